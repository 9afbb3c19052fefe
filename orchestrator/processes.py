"""Child processes on loopback, for tests, benchmarks and `bench compare`: started, awaited, stopped.

- ManagedProcess: a command whose stdout announces readiness with `ready URL`; log to a file; stop()
  sends SIGTERM, then SIGKILL after a timeout, and only ever to our own child.
- SimWorkers / OrchestratorServers: groups of those, stopped together.
- EtcdServer: a real etcd (Debian's etcd-server) on free ports with a temporary data dir.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, cast


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ProcessFailed(RuntimeError):
    pass


class ManagedProcess:
    """One child process whose stdout announces readiness with a line starting `ready `."""

    def __init__(self, name: str, argv: list[str], *, env: dict | None = None, log_dir: Path | None = None):
        self.name = name
        self.argv = argv
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="orch-")) / f"{name}.log"
        self._log = open(self.log_path, "w+b")
        self.process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )
        self.ready_line: str | None = None
        self.stdout_lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, name=f"{name}-stdout", daemon=True).start()

    def _read_stdout(self) -> None:
        for raw in cast(IO[bytes], self.process.stdout):  # stdout=PIPE above, so never None
            line = raw.decode(errors="replace").rstrip("\n")
            self.stdout_lines.append(line)
            if self.ready_line is None and line.startswith("ready "):
                self.ready_line = line
                self._ready.set()
        self._ready.set()  # EOF: the process ended

    def wait_ready(self, timeout: float = 60.0) -> str:
        """The URL from the `ready URL` line; raises ProcessFailed with the log tail otherwise."""
        if not self._ready.wait(timeout) or self.ready_line is None:
            state = f"exited with {self.process.poll()}" if self.process.poll() is not None else "timed out"
            raise ProcessFailed(f"{self.name} {state} before it was ready:\n{self.tail()}")
        return self.ready_line.split(" ", 1)[1].strip()

    def tail(self, lines: int = 40) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(f"  [{self.name}] {line}" for line in text[-lines:])

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.process.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code. Only ever our own child."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()
        return self.process.returncode


def python_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "orchestrator", *args]


class SimWorker:
    def __init__(self, role: str, process: ManagedProcess, address: str):
        self.role = role
        self.process = process
        self.address = address

    @property
    def target(self) -> str:
        return self.address.removeprefix("grpc://")


class SimWorkers:
    """Starts simulated workers as processes; stops all of them on `close()`."""

    def __init__(self, log_dir: Path):
        self._log_dir = log_dir
        self.started: list[SimWorker] = []

    def spawn(self, role: str, *flags: str) -> SimWorker:
        """Start without waiting for readiness (`.process.wait_ready()` later)."""
        name = f"sim-{role}-{len(self.started)}"
        process = ManagedProcess(name, python_command("sim-worker", "--role", role, *flags), log_dir=self._log_dir)
        worker = SimWorker(role, process, "")
        self.started.append(worker)
        return worker

    def start(self, role: str, *flags: str, timeout: float = 60.0) -> SimWorker:
        worker = self.spawn(role, *flags)
        worker.address = worker.process.wait_ready(timeout)
        return worker

    def close(self) -> None:
        for worker in reversed(self.started):
            worker.process.stop()


def etcd_command(binary: str, name: str, data_dir: str, client_port: int, peer_port: int,
                 tls: tuple[str, str, str] | None = None) -> list[str]:
    """A single-member etcd on loopback ports (tests and `orchestrator launch` start it the same way).

    `tls` (cert, key, client CA files): clients connect over TLS and must present a certificate.
    """
    scheme = "https" if tls else "http"
    client, peer = f"{scheme}://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    command = [binary, "--name", name, "--data-dir", data_dir,
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"{name}={peer}", "--initial-cluster-state", "new",
               "--log-level", "warn", "--logger", "zap"]
    if tls:
        cert, key, client_ca = tls
        command += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", client_ca, "--client-cert-auth"]
    return command


class EtcdServer:
    def __init__(self, log_dir: Path, tls: tuple[str, str, str] | None = None):
        self.tls = tls  # (cert, key, client CA): TLS with client certificates required
        binary = shutil.which("etcd")
        if binary is None:
            raise ProcessFailed("etcd is not on PATH: install Debian's etcd-server (see .ci/run)")
        self._binary = binary
        self._log_dir = log_dir
        self.process: subprocess.Popen | None = None
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
                exited = self.process is not None and self.process.poll() is not None
                self.close()
                if not exited or attempt == 4:
                    raise

    def start(self) -> None:
        self._log = open(Path(self._log_dir) / f"etcd-{self.client_port}.log", "ab")
        self.process = subprocess.Popen(
            etcd_command(self._binary, "orch-test", self.data_dir, self.client_port, self.peer_port, self.tls),
            stdout=self._log, stderr=self._log, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2):
                    return
            except OSError:
                if self.process.poll() is not None:
                    break
                time.sleep(0.05)
        raise ProcessFailed(f"etcd did not start on {self.url}; see {self._log.name}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


class OrchestratorServer:
    def __init__(self, process: ManagedProcess, url: str):
        self.process = process
        self.url = url


class OrchestratorServers:
    def __init__(self, log_dir: Path):
        self._log_dir = log_dir
        self.started: list[OrchestratorServer] = []

    def start(self, config: str | Path, *flags: str, timeout: float = 60.0,
              env: dict | None = None) -> OrchestratorServer:
        name = f"orchestrator-{len(self.started)}"
        process = ManagedProcess(name, python_command("serve", "-c", str(config), "--port", "0", *flags),
                                 log_dir=self._log_dir, env=env)
        server = OrchestratorServer(process, "")
        self.started.append(server)
        server.url = process.wait_ready(timeout)
        return server

    def close(self) -> None:
        for server in reversed(self.started):
            server.process.stop()
