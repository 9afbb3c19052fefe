"""`orchestrator launch CONFIG`: bring a whole topology up in order, supervise it, and bring it down in reverse.

Order: etcd (if `launch.etcd.enabled`), workers (simulated or real commands, the latter run in the config
file's directory), register sidecars, then `orchestrator serve`. Each child's output is prefixed with its name
on our stderr; our stdout gets one line, `ready http://HOST:PORT`, once the orchestrator reports every role
ready. Ctrl-C, SIGTERM or SIGHUP (the terminal closed) stops everything in reverse order and exits 0.

A child that dies during start-up tears the rest down, prints the tail of its log and makes the launcher exit
non-zero. After start-up a worker that exits is restarted on the same address as its `restart` policy says,
with a crash-loop backoff, while the rest keeps serving (the orchestrator's pool sees it gone and back, as it
would a remote worker); each exit and restart is logged with its cause and written to a status file that
`orchestrator serve` shows in /health (`supervisor`). etcd, a register sidecar or the orchestrator dying
after start-up still stops the deployment: without them nothing is served.

Every child is tied to us (orchestrator/processes.py): it dies with the launcher however the launcher dies.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from functools import partial
from pathlib import Path

import attrs
import trio

from orchestrator import config as config_module
from orchestrator.config import Config, ConfigError, SimSpec
from orchestrator.processes import (
    SUPERVISOR_STATUS_ENV,
    ManagedProcess,
    ProcessFailed,
    etcd_command,
    free_port,
    orchestrator_command,
)

log = logging.getLogger("orchestrator.launch")


class LaunchFailed(Exception):
    pass


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("launch", help="start every component a config names, in order; stop them on Ctrl-C",
                              description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path)
    p.add_argument("--http-port", type=int, default=None, help="the orchestrator's port (default: http.port; 0: free)")
    p.add_argument("--host", default=None, help="the address the orchestrator listens on (default: http.host)")
    p.set_defaults(run=run)


class RestartBackoff:
    """The crash-loop backoff of one worker: `first` s before the first restart, twice as long before each
    restart of a worker that ran less than `cap` s since its last start, at most `cap`; a worker that ran at
    least `cap` s is restarted after `first` again."""

    def __init__(self, first: float, cap: float):
        self.first, self.cap = first, cap
        self._next = first

    def delay(self, uptime: float) -> float:
        """How long to wait before restarting a worker that exited after `uptime` s."""
        if uptime >= self.cap:
            self._next = self.first
        delay = self._next
        self._next = min(self.cap, self._next * 2)
        return delay


def should_restart(policy: str, code: int) -> bool:
    """`restart: always | on-failure | never` for an exit code (negative: killed by that signal)."""
    return policy == "always" or (policy == "on-failure" and code != 0)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@attrs.define
class Worker:
    """One launched worker under supervision; `start(port)` is its argv for a port (0: any, the first time)."""

    name: str
    role: str
    policy: str
    start: Callable[[int], list[str]]
    env: dict[str, str]
    cwd: Path | None
    announces_ready: bool  # a simulated worker prints `ready URL`; a real one is ready when the pool says so
    backoff: RestartBackoff
    child: ManagedProcess
    address: str = ""
    port: int = 0
    started_at: float = attrs.field(factory=time.monotonic)
    restarts: int = 0
    state: str = "running"  # running, restarting, or stopped (its policy said not to restart it)
    last_exit: str | None = None

    def status(self) -> dict[str, object]:
        return {"name": self.name, "role": self.role, "address": self.address, "state": self.state,
                "pid": self.child.pid if self.state == "running" else None, "restart": self.policy,
                "restarts": self.restarts, "last_exit": self.last_exit}


def _sim_argv(model: str, role: str, sim: SimSpec, etcd_flags: list[str], port: int) -> list[str]:
    return orchestrator_command("sim-worker", "--role", role, "--port", str(port), "--model", model,
                                "--profile", sim.profile, "--time-scale", repr(sim.time_scale),
                                "--schema-revision", str(sim.schema_revision), *sim_model_flags(sim), *etcd_flags,
                                *sim.args)


def _command_argv(command: tuple[str, ...], port: int) -> list[str]:
    return [part.replace("{port}", str(port)) for part in command]


class Launcher:
    def __init__(self, config: Config, config_path: Path, *, http_port: int | None, host: str | None):
        self.config = config
        self.config_path = config_path
        self.http_port = config.http.port if http_port is None else http_port
        self.host = host or config.http.host
        self.children: list[ManagedProcess] = []
        self.workers: list[Worker] = []
        self.supervising = False  # after start-up: a worker's exit is its supervisor's, not the end of launch
        self.etcd_url: str | None = None
        self._tmp = ""  # made by up(): etcd's data and the supervisor's status

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, *,
               cwd: Path | None = None) -> ManagedProcess:
        """Start a child (its output goes to our stderr after its name); down() stops it. From trio's thread,
        which lives as long as the launcher: the children's PR_SET_PDEATHSIG watches the thread that forked."""
        try:
            child = ManagedProcess(name, argv, env=env, cwd=cwd, tied=True)
        except ProcessFailed as exc:
            raise LaunchFailed(str(exc)) from exc
        self.children.append(child)
        return child

    async def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None, *,
                     ready_timeout: float, cwd: Path | None = None) -> str:
        """Start a child and wait for its `ready URL` line; the URL."""
        child = self._spawn(name, argv, env, cwd=cwd)
        try:
            return await child.wait_ready_async(ready_timeout)
        except ProcessFailed as exc:
            raise LaunchFailed(str(exc)) from exc

    async def up(self) -> str:
        launch = self.config.launch
        timeout = launch.ready_timeout_s
        self._check_port()  # before any worker: real ones take minutes to load
        self._tmp = tempfile.mkdtemp(prefix="orch-launch-")
        if launch.etcd.enabled:
            await self._start_etcd(timeout)
        overrides: list[str] = []
        several = len(self.config.models) > 1
        # Worker commands run where the config file is: their relative paths mean what model.dir's do.
        config_dir = self.config_path.resolve().parent
        for spec in launch.workers:
            view = config_module.launched_model(self.config, spec)  # the model it serves: its discovery
            model = view.model.name
            etcd_flags: list[str] = []
            ttl_flags: list[str] = []
            lease_ttl = ""
            if view.discovery.etcd is not None:
                etcd = view.discovery.etcd
                url = self.etcd_url or etcd.endpoints[0]
                etcd_flags = ["--etcd", url, "--etcd-namespace", etcd.namespace]
                lease_ttl = str(etcd.lease_ttl_s)
                ttl_flags = ["--etcd-ttl", lease_ttl]
            for i in range(spec.count):
                role_name = f"{model}-{spec.role}" if several else spec.role  # names stay apart across models
                name = f"{role_name}-{i}" if spec.sim is None else f"sim-{role_name}-{i}"
                start: Callable[[int], list[str]]
                if spec.sim is not None:
                    start = partial(_sim_argv, model, spec.role, spec.sim,
                                    [*etcd_flags, *(ttl_flags if etcd_flags else ())])
                    address = await self._start(name, start(0), spec.env, ready_timeout=timeout, cwd=config_dir)
                    port = urllib.parse.urlsplit(address).port or 0  # a restart takes the same address
                    child = self.children[-1]
                else:
                    port = free_port()
                    start = partial(_command_argv, spec.command)
                    child = self._spawn(name, start(port), spec.env, cwd=config_dir)
                    address = f"grpc://127.0.0.1:{port}"
                    if spec.register and etcd_flags:
                        await self._start(f"register-{name}", orchestrator_command(
                            "register", "--worker", address, "--role", spec.role, *etcd_flags,
                            "--ttl", lease_ttl,
                            "--model", model), ready_timeout=timeout)
                launch_knobs = self.config.launch
                self.workers.append(Worker(
                    name=name, role=spec.role, policy=spec.restart, start=start, env=spec.env, cwd=config_dir,
                    announces_ready=spec.sim is not None, child=child, address=address, port=port,
                    backoff=RestartBackoff(launch_knobs.restart_backoff_s, launch_knobs.restart_backoff_max_s)))
                if view.discovery.static is not None:  # (etcd: the worker registers itself)
                    overrides += ["--worker", f"{model}:{spec.role}={address}" if several else f"{spec.role}={address}"]
        self.write_status()
        return await self._start("orchestrator", self.serve_argv(overrides),
                                 {SUPERVISOR_STATUS_ENV: str(self.status_path)}, ready_timeout=timeout)

    # ---- supervision -----------------------------------------------------------------------------

    def supervise(self, nursery: trio.Nursery) -> None:
        """From now on a worker's exit is handled by its own supervisor task."""
        self.supervising = True
        for worker in self.workers:
            nursery.start_soon(self._supervise, worker)

    @property
    def status_path(self) -> Path:
        return Path(self._tmp) / "supervisor.json"

    def write_status(self) -> None:
        """The supervision state as `orchestrator serve` shows it in /health: rewritten whole (rename), so a
        reader never sees half of it."""
        body = {"launcher_pid": os.getpid(), "workers": [w.status() for w in self.workers]}
        partial_path = self.status_path.with_suffix(".tmp")
        try:
            partial_path.write_text(json.dumps(body))
            os.replace(partial_path, self.status_path)
        except OSError as exc:
            log.warning("cannot write the supervisor status %s: %s", self.status_path, exc)

    async def _supervise(self, worker: Worker) -> None:
        while True:
            code = await worker.child.wait_async()
            uptime = time.monotonic() - worker.started_at
            worker.last_exit = f"{describe_exit(code)} after {uptime:.1f} s"
            await worker.child.stop_async()  # it has exited: this reads its last lines and closes its log
            if not should_restart(worker.policy, code):
                worker.state = "stopped"
                self.write_status()
                log.error("%s %s; restart: %s, so the deployment serves on without it", worker.name,
                          worker.last_exit, worker.policy)
                return
            worker.state = "restarting"
            self.write_status()
            cause = f"{worker.last_exit}; its last lines:\n{worker.child.tail(5) or '  (no output)'}"
            while not await self._restart(worker, worker.backoff.delay(uptime), cause):
                uptime, cause = 0.0, worker.last_exit  # it could not even start: back off further

    async def _restart(self, worker: Worker, delay: float, cause: str) -> bool:
        """After `delay`, start `worker` again on its address. False if it could not start; else its child runs,
        or has exited (the next round of _supervise sees that and backs off)."""
        log.warning("%s %s; restarting it on %s in %.1f s (restart %d, restart: %s)", worker.name, cause,
                    worker.address, delay, worker.restarts + 1, worker.policy)
        await trio.sleep(delay)
        worker.restarts += 1
        worker.started_at = time.monotonic()
        try:
            child = ManagedProcess(worker.name, worker.start(worker.port), env=worker.env, cwd=worker.cwd, tied=True)
        except ProcessFailed as exc:  # e.g. its command was uninstalled meanwhile: a failed start like any other
            worker.last_exit = str(exc)
            self.write_status()
            return False
        self.children[self.children.index(worker.child)] = child
        worker.child = child
        if worker.announces_ready:
            try:
                await child.wait_ready_async(self.config.launch.ready_timeout_s)
            except ProcessFailed:
                if child.alive():  # not ready in time: stopped, it counts as a failed start
                    log.error("%s did not become ready within %.0f s of its restart; stopping it", worker.name,
                              self.config.launch.ready_timeout_s)
                    await child.stop_async()
                return True
        worker.state = "running"
        self.write_status()
        log.info("%s restarted (pid %d) on %s; restarts so far: %d", worker.name, child.pid, worker.address,
                 worker.restarts)
        return True

    def serve_argv(self, worker_overrides: list[str]) -> list[str]:
        """`orchestrator serve` for this config, with the launched workers of the models with static discovery
        (`--worker [MODEL:]ROLE=ADDRESS` pairs) and the launched etcd for those with etcd discovery."""
        argv = orchestrator_command("serve", "-c", str(self.config_path), "--host", self.host,
                                    "--port", str(self.http_port), "--port-flag=--http-port")
        argv += worker_overrides
        if self.etcd_url and any(view.discovery.etcd is not None for view in self.config.models):
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
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def died(self) -> ManagedProcess | None:
        """A child whose exit ends the launch: any during start-up, then any but a supervised worker."""
        supervised = {id(w.child) for w in self.workers} if self.supervising else set()
        return next((c for c in self.children if id(c) not in supervised and not c.alive()), None)


async def launch(config: Config, config_path: Path, *, http_port: int | None, host: str | None) -> int:
    launcher = Launcher(config, config_path, http_port=http_port, host=host)
    outcome: dict[str, object] = {}
    try:
        # SIGHUP: the terminal the launcher ran in closed. The children are in sessions of their own, so only we
        # hear it, and stop them in order.
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async with trio.open_nursery() as control:
                control.start_soon(_first_signal, signals, control.cancel_scope, outcome)
                control.start_soon(_first_death, launcher, control.cancel_scope, outcome)
                try:
                    url = await launcher.up()
                except LaunchFailed as exc:
                    outcome.setdefault("error", str(exc))
                    control.cancel_scope.cancel()
                else:
                    launcher.supervise(control)
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
