"""Several frontend processes behind one port (`http.processes`): how frontend 0 keeps its children,
and the whole thing as real processes: connections spread, metrics summed, crashes restarted, stops."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio

from orchestrator.frontend.multiprocess import FrontendChildren, ParentWatch
from serve_helpers import Deployment, chat_body

# ---- FrontendChildren against stand-in children (tiny Python scripts) -------------------------------

READY_THEN_WAIT = "import sys, time; print('ready fake', flush=True); time.sleep(600)"
IGNORES_SIGTERM = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('ready fake', flush=True); time.sleep(600)")
DIES_AT_ONCE = "import sys; sys.exit(3)"


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def script_children(scripts: dict[int, str], **kwargs) -> tuple[FrontendChildren, list[int]]:
    exited: list[int] = []
    children = FrontendChildren(len(scripts) + 1, lambda index: [sys.executable, "-c", scripts[index]],
                                ready_timeout=kwargs.pop("ready_timeout", 20),
                                stop_timeout=kwargs.pop("stop_timeout", 5),
                                on_exit=exited.append)
    return children, exited


async def test_children_are_started_ready_then_stopped_on_shutdown():
    children, exited = script_children({1: READY_THEN_WAIT, 2: READY_THEN_WAIT})
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(children.run, shutdown)  # returns once both printed `ready`
        pids = [child.process.pid for child in children.current.values()]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        assert all(child.ready_url == "fake" for child in children.current.values())
        shutdown.set()
        await children.stopped.wait()
    assert sorted(exited) == sorted(pids) and not any(alive(pid) for pid in pids)
    assert children.restarts == 0


async def test_a_child_that_exits_is_restarted_after_a_pause():
    children, exited = script_children({1: DIES_AT_ONCE}, ready_timeout=0.5)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(children.run, shutdown)  # never ready: started after the ready timeout
        with trio.fail_after(10):
            while children.restarts < 2:  # 1 s pause, then 2 s
                await trio.sleep(0.05)
        shutdown.set()
    assert len(set(exited)) >= 2  # every run was a new process, and each one's exit was reported


async def test_a_cancelled_scope_stops_the_children_too():
    children, _exited = script_children({1: READY_THEN_WAIT})
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(children.run, trio.Event())
            pid = children.current[1].process.pid
            scope.cancel()
    assert not alive(pid) and children.stopped.is_set()


async def test_a_child_that_ignores_sigterm_is_killed_after_the_stop_timeout():
    children, _ = script_children({1: IGNORES_SIGTERM}, stop_timeout=0.5)
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(children.run, shutdown)
        pid = children.current[1].process.pid
        shutdown.set()
        with trio.fail_after(5):
            await children.stopped.wait()
    assert children.current[1].returncode == -signal.SIGKILL and not alive(pid)


async def test_parent_watch_fires_only_when_the_parent_changes(monkeypatch):
    gone = trio.Event()
    watch = ParentWatch(os.getppid(), gone.set, interval=0.01)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await trio.sleep(0.05)
        assert not gone.is_set()
        monkeypatch.setattr(os, "getppid", lambda: 1)  # what an orphan sees
        with trio.fail_after(2):
            await gone.wait()


async def test_parent_watch_fires_when_the_parent_was_gone_before_it_started():
    gone = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ParentWatch(os.getppid() + 1, gone.set, interval=0.01).run)
        with trio.fail_after(2):
            await gone.wait()


# ---- real `orchestrator serve` with http.processes: 2 ---------------------------------------------

FAST = ("--time-scale", "0.02")


def frontend_pids(deployment: Deployment, connections: int = 40) -> set[int]:
    """The frontend pids that answered `connections` fresh connections (the kernel spreads them)."""
    pids = set()
    for _ in range(connections):
        with deployment.http() as client:
            pids.add(client.get("/health").json()["frontend"]["pid"])
    return pids


def metric(deployment: Deployment, line_start: str) -> float:
    text = httpx.get(deployment.url + "/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    if len(values) != 1:
        raise LookupError(f"{len(values)} samples start with {line_start!r}")
    return values[0]


@pytest.fixture(scope="module")
def two_frontends(tmp_path_factory):
    deployment = Deployment(tmp_path_factory.mktemp("two-frontends"), "disaggregated",
                            {"prefill": [FAST], "decode": [FAST]}, http={"processes": 2},
                            limits={"shutdown_grace_s": 2})
    yield deployment
    deployment.close()


def test_fresh_connections_reach_both_processes_and_metrics_count_across_them(two_frontends):
    first = two_frontends.server.process.process.pid
    pids = frontend_pids(two_frontends)
    assert first in pids and len(pids) == 2
    (child,) = pids - {first}
    assert parent_of(child) == first
    requests = 12
    for i in range(requests):  # each on a fresh connection, so both processes serve some
        stream = two_frontends.openai().chat.completions.create(
            **chat_body(f"question {i}"), max_tokens=5, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 5
    ok = 'orchestrator_requests_total{mode="disaggregated",model="tiny-chat",outcome="ok",route="chat"}'
    assert metric(two_frontends, ok) == requests  # whichever process answers /metrics
    assert metric(two_frontends,
                  'orchestrator_output_tokens_total{mode="disaggregated",model="tiny-chat"}') == 5 * requests
    assert metric(two_frontends, "orchestrator_frontend_processes") == 2
    assert metric(two_frontends, "orchestrator_requests_in_flight") == 0
    assert metric(two_frontends, "process_cpu_seconds_total") > 0


def test_a_killed_frontend_process_is_replaced_and_stops_counting_as_live(two_frontends):
    first = two_frontends.server.process.process.pid
    (child,) = frontend_pids(two_frontends) - {first}
    assert parent_of(child) == first  # ours: started by the server this test started
    os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        replacements = frontend_pids(two_frontends, 10) - {first, child}
        if replacements:
            break
        time.sleep(0.2)
    else:
        pytest.fail("no new frontend process answered within 20 s")
    (replacement,) = replacements
    assert parent_of(replacement) == first
    assert metric(two_frontends, "orchestrator_frontend_processes") == 2
    reply = two_frontends.openai().chat.completions.create(**chat_body(), max_tokens=3)
    assert reply.usage.completion_tokens == 3


def test_sigterm_to_frontend_0_stops_every_frontend_process(tmp_path):
    deployment = Deployment(tmp_path, "aggregated", {"aggregated": [FAST]}, http={"processes": 2},
                            limits={"shutdown_grace_s": 2})
    try:
        first = deployment.server.process.process.pid
        pids = frontend_pids(deployment)
        assert len(pids) == 2
        deployment.server.process.stop()
        assert deployment.server.process.process.returncode == 0
        assert not any(alive(pid) for pid in pids)
        assert first in pids
    finally:
        deployment.close()


def test_a_child_whose_frontend_0_was_killed_drains_exits_and_removes_the_metrics_directory(tmp_path):
    scratch = tmp_path / "tmp"  # the temporary directory of the serve processes: their metrics directory goes here
    scratch.mkdir()
    deployment = Deployment(tmp_path, "aggregated", {"aggregated": [FAST]}, http={"processes": 2},
                            limits={"shutdown_grace_s": 1}, server_env={"TMPDIR": str(scratch)})
    try:
        first = deployment.server.process.process.pid
        (child,) = frontend_pids(deployment) - {first}
        assert [p.name[:13] for p in scratch.iterdir()] == ["orch-metrics-"]
        deployment.server.process.process.kill()  # our own child; its child is left an orphan
        deployment.server.process.process.wait(10)
        deadline = time.monotonic() + 15
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child)
        assert list(scratch.iterdir()) == []  # frontend 0 could not remove it: its last child did
    finally:
        deployment.close()
