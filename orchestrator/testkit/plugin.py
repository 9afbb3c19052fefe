"""pytest plugin (entry point `orchestrator`): real processes on free loopback ports, torn down after.

Fixtures
- `sim_workers`: a SimWorkers factory; `sim_workers.start("prefill", "--time-scale", "0.01")` -> a
  SimWorkerProcess with `.address` (grpc://127.0.0.1:PORT), `.target` (HOST:PORT), `.role` and `.process`
  (its ManagedProcess). Every worker is stopped at the end of the test.
- `redis_server` (session): a RedisServer, a real Redis (Debian's redis-server) on a free port; `.url`.
- `etcd_server` (session): an EtcdServer, a real etcd (Debian's etcd-server) on free ports with a temporary
  data dir; `.url`.
- `orchestrator_servers`: an OrchestratorServers factory; `.start(config_path, *flags)` -> an
  OrchestratorServer with `.url` (http://...) and `.process`. Every server is stopped at the end of the test.
- `orchestrator_in_process`: `async with orchestrator_in_process(config_path) as url:` runs the
  orchestrator on the test's own trio loop (no process), cancelled when the block ends.
- `engine_client`: a factory usable from trio tests: `async with engine_client(addr) as client`.

Helpers: `ManagedProcess` (the one supervisor, orchestrator/processes.py: start a command, wait for its
`ready ...` line, stop it, tail its log), `orchestrator_command(...)` (`python -m orchestrator ...`),
`free_port()`, `write_config(...)`, `wait_for_load(...)`; the process groups themselves are in
orchestrator/testkit/processes.py. For unit tests without processes, the scripted `FakeEngineClient`,
`FakePool` and `fake_worker` (orchestrator/testkit/fakes.py), run under pytest-trio's `autojump_clock`.

A five-line test:

    async def test_hello(sim_workers, engine_client):
        worker = sim_workers.start("aggregated", "--time-scale", "0")
        async with engine_client(worker.address) as client:
            caps = await client.wait_until_ready(deadline=10)
        assert caps.serves_role("aggregated")
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from orchestrator.processes import (  # noqa: F401 - re-exported for tests that use the testkit
    ManagedProcess,
    ProcessFailed,
    free_port,
    orchestrator_command,
)
from orchestrator.testkit.fakes import (  # noqa: F401 - re-exported: the scripted fakes of the unit layer
    Fail,
    FakeEngineClient,
    FakePool,
    Hang,
    Send,
    Wait,
    fake_worker,
)
from orchestrator.testkit.processes import (  # noqa: F401 - re-exported for tests that use the testkit
    EtcdServer,
    OrchestratorServer,
    OrchestratorServers,
    RedisServer,
    SimWorkerProcess,
    SimWorkers,
)


def write_config(path: Path, mode: str, workers: dict[str, list[str]] | None = None, *,
                 etcd: dict | None = None, **sections) -> Path:
    """Write an orchestrator YAML for tests: static `workers` by role (or an `etcd` discovery section)."""
    import yaml

    data: dict = {"mode": mode, "model": {"name": "tiny-chat", "dir": "builtin:tiny-chat"},
                  "http": {"host": "127.0.0.1", "port": 0},
                  "limits": {"worker_startup_timeout_s": 30, "health_interval_s": 0.2}}
    data["discovery"] = {"etcd": etcd} if etcd is not None else {"static": workers or {}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def sim_workers(tmp_path) -> Iterator[SimWorkers]:
    workers = SimWorkers(tmp_path)
    yield workers
    workers.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-logs"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd-logs"))
    yield server
    server.close()


@pytest.fixture
def orchestrator_servers(tmp_path) -> Iterator[OrchestratorServers]:
    servers = OrchestratorServers(tmp_path)
    yield servers
    servers.close()


@asynccontextmanager
async def serve_in_process(config) -> AsyncIterator[str]:
    """Run `orchestrator serve` inside the calling trio task's scope; yields its base URL."""
    from functools import partial

    import trio

    from orchestrator import config as config_module
    from orchestrator.serve import serve

    loaded = config if isinstance(config, config_module.Config) else config_module.load(config)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve, loaded, host="127.0.0.1", port=0, ready_line=False,
                                          handle_signals=False))
        try:
            yield url
        finally:
            nursery.cancel_scope.cancel()


@pytest.fixture
def orchestrator_in_process() -> Callable:
    return serve_in_process


@pytest.fixture
def engine_client() -> Callable:
    """`async with engine_client("grpc://...") as client:` inside a trio test."""
    from orchestrator.engine import EngineClient, LoopThread

    @asynccontextmanager
    async def open_client(address: str, **kwargs) -> AsyncIterator[EngineClient]:
        async with LoopThread.open() as loop_thread, EngineClient.open(address, loop_thread, **kwargs) as client:
            yield client

    return open_client


async def wait_for_load(client, predicate: Callable, *, timeout: float = 10.0, interval: float = 0.05):
    """Poll Control.GetLoad until `predicate(load)` holds; returns that LoadInfo."""
    import trio

    with trio.move_on_after(timeout):
        while True:
            load = await client.load()
            if predicate(load):
                return load
            await trio.sleep(interval)
    raise AssertionError(f"worker {client.name} load never matched; last: {load}")
