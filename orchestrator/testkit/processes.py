"""Groups of real processes on loopback for tests and benchmarks, each started by the one supervisor
(orchestrator.processes.ManagedProcess) and stopped together.

- SimWorkers: simulated workers (`orchestrator sim-worker`), each a SimWorkerProcess with its address.
- OrchestratorServers: `orchestrator serve` processes, each an OrchestratorServer with its URL.
- EtcdServer: a real etcd (Debian's etcd-server) on free ports with a temporary data dir.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from pathlib import Path

from orchestrator.processes import ManagedProcess, ProcessFailed, etcd_command, free_port, orchestrator_command


class SimWorkerProcess:
    """A simulated worker's process (the worker itself, the gRPC servicer, is orchestrator.sim.server.SimWorker)."""

    def __init__(self, role: str, process: ManagedProcess, address: str):
        self.role = role
        self.process = process
        self.address = address  # grpc://127.0.0.1:PORT, once ready

    @property
    def target(self) -> str:
        return self.address.removeprefix("grpc://")


class SimWorkers:
    """Starts simulated workers as processes; stops all of them on `close()`."""

    def __init__(self, log_dir: Path):
        self._log_dir = log_dir
        self.started: list[SimWorkerProcess] = []

    def spawn(self, role: str, *flags: str) -> SimWorkerProcess:
        """Start without waiting for readiness (`.process.wait_ready()` later)."""
        name = f"sim-{role}-{len(self.started)}"
        process = ManagedProcess(name, orchestrator_command("sim-worker", "--role", role, *flags),
                                 log_dir=self._log_dir)
        worker = SimWorkerProcess(role, process, "")
        self.started.append(worker)
        return worker

    def start(self, role: str, *flags: str, timeout: float = 60.0) -> SimWorkerProcess:
        worker = self.spawn(role, *flags)
        worker.address = worker.process.wait_ready(timeout)
        return worker

    def close(self) -> None:
        for worker in reversed(self.started):
            worker.process.stop()


class OrchestratorServer:
    def __init__(self, process: ManagedProcess, url: str):
        self.process = process
        self.url = url


class OrchestratorServers:
    """Starts `orchestrator serve -c CONFIG --port 0` processes; stops all of them on `close()`."""

    def __init__(self, log_dir: Path):
        self._log_dir = log_dir
        self.started: list[OrchestratorServer] = []

    def start(self, config: str | Path, *flags: str, timeout: float = 60.0,
              env: dict[str, str] | None = None) -> OrchestratorServer:
        name = f"orchestrator-{len(self.started)}"
        process = ManagedProcess(name, orchestrator_command("serve", "-c", str(config), "--port", "0", *flags),
                                 log_dir=self._log_dir, env=env)
        server = OrchestratorServer(process, "")
        self.started.append(server)
        server.url = process.wait_ready(timeout)
        return server

    def close(self) -> None:
        for server in reversed(self.started):
            server.process.stop()


class EtcdServer:
    """A single-member etcd; `stop()` and `start()` again keep its ports and data (a restart)."""

    def __init__(self, log_dir: Path, tls: tuple[str, str, str] | None = None):
        self.tls = tls  # (cert, key, client CA): TLS with client certificates required
        binary = shutil.which("etcd")
        if binary is None:
            raise ProcessFailed("etcd is not on PATH: install Debian's etcd-server (see .ci/run)")
        self._binary = binary
        self._log_dir = log_dir
        self.process: ManagedProcess | None = None
        # free_port() is check-then-bind: another process may take the port before etcd binds it. A start
        # whose etcd exited at once is tried again on fresh ports (a restart keeps the ports it has).
        for attempt in range(5):
            self.data_dir = tempfile.mkdtemp(prefix="orch-etcd-")
            self.client_port, self.peer_port = free_port(), free_port()
            self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.client_port}"
            try:
                self.start()
                return
            except ProcessFailed:
                exited = self.process is not None and not self.process.alive()
                self.close()
                if not exited or attempt == 4:
                    raise

    def start(self) -> None:
        """Start etcd and wait until its client port answers."""
        self.process = ManagedProcess(
            f"etcd-{self.client_port}",
            etcd_command(self._binary, "orch-test", self.data_dir, self.client_port, self.peer_port, self.tls),
            log_dir=self._log_dir)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.process.alive():
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise ProcessFailed(f"etcd did not start on {self.url}:\n{self.process.tail()}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


class RedisServer:
    """A real Redis (Debian's redis-server) on a free port, in memory only (no snapshots, no append-only file)."""

    def __init__(self, log_dir: Path):
        binary = shutil.which("redis-server")
        if binary is None:
            raise ProcessFailed("redis-server is not on PATH: install Debian's redis-server (scripts/setup.sh does)")
        for attempt in range(5):  # check-then-bind, as for etcd: a port taken meanwhile is tried again
            self.port = free_port()
            self.url = f"redis://127.0.0.1:{self.port}/0"
            self.process = ManagedProcess(f"redis-{self.port}", [
                binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--protected-mode", "yes"], log_dir=log_dir)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.process.alive():
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                        return
                except OSError:
                    time.sleep(0.05)
            exited = not self.process.alive()
            self.process.stop(5)
            if not exited or attempt == 4:
                raise ProcessFailed(f"redis-server did not start on {self.url}:\n{self.process.tail()}")

    def close(self) -> None:
        self.process.stop(5)
