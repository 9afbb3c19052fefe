"""`orchestrator launch CONFIG`: bring a whole topology up in order, and down in reverse.

Order: etcd (if `launch.etcd.enabled`), workers (simulated or real commands), register sidecars,
then `orchestrator serve`. Each child's output is prefixed with its name on our stderr; our stdout
gets one line, `ready http://HOST:PORT`, once the orchestrator reports every role ready. Ctrl-C or
SIGTERM stops everything in reverse order and exits 0. A child that dies during start-up tears the
rest down, prints the tail of its log and makes the launcher exit non-zero.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shutil
import signal
import socket
import tempfile
from functools import partial
from pathlib import Path

import trio

from orchestrator import config as config_module
from orchestrator.config import Config, ConfigError
from orchestrator.processes import ManagedProcess, ProcessFailed, etcd_command, free_port, orchestrator_command

log = logging.getLogger("orchestrator.launch")


class LaunchFailed(Exception):
    pass


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("launch", help="start every component a config names, in order; stop them on Ctrl-C",
                              description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("--http-port", type=int, default=None, help="the orchestrator's port (default: http.port; 0: free)")
    p.add_argument("--host", default=None)
    p.set_defaults(run=run)


class Launcher:
    def __init__(self, config: Config, config_path: Path, *, http_port: int | None, host: str | None):
        self.config = config
        self.config_path = config_path
        self.http_port = config.http.port if http_port is None else http_port
        self.host = host or config.http.host
        self.children: list[ManagedProcess] = []
        self.etcd_url: str | None = None
        self._tmp: str | None = None  # etcd's data, when launch.etcd is enabled

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        """Start a child (its output goes to our stderr after its name); down() stops it."""
        try:
            child = ManagedProcess(name, argv, env=env)
        except ProcessFailed as exc:
            raise LaunchFailed(str(exc)) from exc
        self.children.append(child)
        return child

    async def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None, *,
                     ready_timeout: float) -> str:
        """Start a child and wait for its `ready URL` line; the URL."""
        child = self._spawn(name, argv, env)
        try:
            return await child.wait_ready_async(ready_timeout)
        except ProcessFailed as exc:
            raise LaunchFailed(str(exc)) from exc

    async def up(self) -> str:
        launch = self.config.launch
        timeout = launch.ready_timeout_s
        self._check_port()  # before any worker: real ones take minutes to load
        if launch.etcd.enabled:
            await self._start_etcd(timeout)
        overrides: list[str] = []
        etcd_flags: list[str] = []
        ttl_flags: list[str] = []
        lease_ttl = ""
        if self.config.discovery.etcd is not None:
            etcd = self.config.discovery.etcd
            url = self.etcd_url or etcd.endpoints[0]
            etcd_flags = ["--etcd", url, "--etcd-namespace", etcd.namespace]
            lease_ttl = str(etcd.lease_ttl_s)
            ttl_flags = ["--etcd-ttl", lease_ttl]
        for spec in launch.workers:
            for i in range(spec.count):
                name = f"{spec.role}-{i}" if spec.sim is None else f"sim-{spec.role}-{i}"
                if spec.sim is not None:
                    argv = orchestrator_command("sim-worker", "--role", spec.role, "--port", "0",
                                                "--model", self.config.model.name, "--profile", spec.sim.profile,
                                                "--time-scale", repr(spec.sim.time_scale),
                                                "--schema-revision", str(spec.sim.schema_revision),
                                                *sim_model_flags(spec.sim), *etcd_flags,
                                                *(ttl_flags if etcd_flags else ()), *spec.sim.args)
                    address = await self._start(name, argv, spec.env, ready_timeout=timeout)
                else:
                    port = free_port()
                    argv = [part.replace("{port}", str(port)) for part in spec.command]
                    self._spawn(name, argv, spec.env)
                    address = f"grpc://127.0.0.1:{port}"
                    if spec.register and etcd_flags:
                        await self._start(f"register-{name}", orchestrator_command(
                            "register", "--worker", address, "--role", spec.role, *etcd_flags,
                            "--ttl", lease_ttl,
                            "--model", self.config.model.name), ready_timeout=timeout)
                overrides += ["--worker", f"{spec.role}={address}"]
        return await self._start("orchestrator", self.serve_argv(overrides), ready_timeout=timeout)

    def serve_argv(self, worker_overrides: list[str]) -> list[str]:
        """`orchestrator serve` for this config, with the launched workers (`--worker ROLE=ADDRESS` pairs)."""
        argv = orchestrator_command("serve", "-c", str(self.config_path), "--host", self.host,
                                    "--port", str(self.http_port), "--port-flag=--http-port")
        if self.config.discovery.static is not None:
            argv += worker_overrides
        elif self.etcd_url:
            argv += ["--etcd-endpoint", self.etcd_url]
        return argv

    def _check_port(self) -> None:
        """The orchestrator's port is free now (serve says the same if it is taken later)."""
        from orchestrator.serve import busy_port_message

        if self.http_port == 0:
            return
        with socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.host, self.http_port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise LaunchFailed(busy_port_message(self.host, self.http_port, exc, "--http-port",
                                                         self.config_path)) from exc

    async def _start_etcd(self, timeout: float) -> None:
        binary = shutil.which(self.config.launch.etcd.binary)
        if binary is None:
            raise LaunchFailed(f"{self.config_path}: launch.etcd.binary: {self.config.launch.etcd.binary!r} is not on "
                               "PATH (Debian: apt-get install etcd-server)")
        self._tmp = tempfile.mkdtemp(prefix="orch-launch-")
        # free_port() is check-then-bind: an etcd that exits at once (its port was taken meanwhile) is started
        # again on fresh ports.
        for attempt in range(5):
            client, peer = free_port(), free_port()
            self.etcd_url = f"http://127.0.0.1:{client}"
            argv = etcd_command(binary, "orch-launch", os.path.join(self._tmp, f"etcd-{attempt}"), client, peer)
            child = self._spawn("etcd", argv)
            with trio.move_on_after(timeout):
                while child.returncode is None:
                    try:
                        stream = await trio.open_tcp_stream("127.0.0.1", client)
                        await stream.aclose()
                        return
                    except OSError:
                        await trio.sleep(0.05)
            if child.returncode is None:
                break  # it runs but does not answer: no port clash, a real failure
            self.children.remove(child)
            await child.stop_async()  # it has exited: this reads its last lines
        raise LaunchFailed(child.describe_failure())

    async def down(self) -> None:
        with trio.CancelScope(shield=True):
            for child in reversed(self.children):
                await child.stop_async()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def died(self) -> ManagedProcess | None:
        return next((c for c in self.children if not c.alive()), None)


async def launch(config: Config, config_path: Path, *, http_port: int | None, host: str | None) -> int:
    launcher = Launcher(config, config_path, http_port=http_port, host=host)
    outcome: dict[str, object] = {}
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as control:
                control.start_soon(_first_signal, signals, control.cancel_scope, outcome)
                control.start_soon(_first_death, launcher, control.cancel_scope, outcome)
                try:
                    url = await launcher.up()
                except LaunchFailed as exc:
                    outcome.setdefault("error", str(exc))
                    control.cancel_scope.cancel()
                else:
                    print(f"ready {url}", flush=True)
                    log.info("all components ready; Ctrl-C to stop")
                    await trio.sleep_forever()
    finally:
        await launcher.down()
    if "error" in outcome and "signal" not in outcome:
        log.error("launch failed: %s", outcome["error"])
        return 1
    return 0


async def _first_signal(signals, scope: trio.CancelScope, outcome: dict) -> None:
    async for signum in signals:
        log.info("%s: stopping everything in reverse order", signal.Signals(signum).name)
        outcome["signal"] = signum
        scope.cancel()
        return


async def _first_death(launcher: Launcher, scope: trio.CancelScope, outcome: dict) -> None:
    while (dead := launcher.died()) is None:
        await trio.sleep(0.1)
    await dead.wait_async()  # it has exited: this reads its last lines, for the message
    outcome.setdefault("error", dead.describe_failure())
    scope.cancel()


def check_sim_workers(config: Config, file: str) -> None:
    """What only the launcher can check: the simulated workers' profiles, grammar backends and parsers exist."""
    from orchestrator.sim.persona import GUIDED_BACKENDS
    from orchestrator.sim.profiles import PROFILES
    from orchestrator.sim.tool_formats import REASONING_PARSERS, TOOL_CALL_PARSERS

    for i, worker in enumerate(config.launch.workers):
        if worker.sim is None:
            continue
        for key, value, known in (("profile", worker.sim.profile, sorted(PROFILES)),
                                  ("guided_backend", worker.sim.guided_backend, GUIDED_BACKENDS),
                                  ("tool_call_parser", worker.sim.tool_call_parser, ("", *TOOL_CALL_PARSERS)),
                                  ("reasoning_parser", worker.sim.reasoning_parser, ("", *REASONING_PARSERS))):
            if value not in known:
                raise ConfigError(file, f"launch.workers[{i}].sim.{key}", " or ".join(k or "''" for k in known), value)


def sim_model_flags(sim) -> tuple[str, ...]:
    """The sim-worker flags for what a simulated engine was started with (only those the config sets)."""
    flags: tuple[str, ...] = ()
    if sim.guided_backend != "none":
        flags += ("--guided-backend", sim.guided_backend)
    if sim.tool_call_parser:
        flags += ("--tool-call-parser", sim.tool_call_parser)
    if sim.reasoning_parser:
        flags += ("--reasoning-parser", sim.reasoning_parser)
    if sim.natural_eos:
        flags += ("--natural-eos",)
    return flags


def run(args: argparse.Namespace) -> int:
    try:
        config = config_module.load(args.config)
        check_sim_workers(config, str(args.config))
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    return trio.run(partial(launch, config, args.config, http_port=args.http_port, host=args.host))
