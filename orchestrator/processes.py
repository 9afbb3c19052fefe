"""Child processes we start and stop: the one supervisor of the launcher, of frontend 0's other frontend
processes, of the testkit and of `bench compare`.

`ManagedProcess` starts a command in a session of its own, logs every line it writes (to a file, or to our
stderr after its name), notices the line `ready URL` its stdout announces readiness with, and stops it with
SIGTERM, then SIGKILL after a timeout. Signals go only to the process itself, which we started and have
not reaped (so its pid cannot have been reused): never to a process group, never by name.

It is used from plain threads (tests, `bench compare`) and from trio (the launcher, frontend 0), so every
wait comes in both kinds: `wait_ready` / `wait` / `stop`, and `wait_ready_async` / `wait_async` /
`stop_async`, which never block the trio loop. Reader threads pump the output in both cases.

A child started `tied=True` (the launcher's) dies with us however we die: the kernel sends it SIGTERM when
our thread that started it ends (PR_SET_PDEATHSIG, set in the child before exec), and our own `orchestrator`
children also hold a lifeline, the read end of a pipe whose write end only we hold: its EOF (we are gone,
even by SIGKILL) gives them `LIFELINE_GRACE_S` to finish the drain that SIGTERM began before they exit
regardless (watch_lifeline, called first thing by every `orchestrator` command).

Also here: the one builder of `orchestrator ...` commands, `free_port()` and the etcd command line.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import trio

log = logging.getLogger("orchestrator.processes")

_TAIL_LINES = 1000  # without a log file: kept in memory for failure messages and tail()
_OUTPUT_DRAIN_S = 2.0  # after the exit, how long to wait for the last lines (a grandchild may hold the pipe)
_ECHO_LOCK = threading.Lock()  # lines of several children on our stderr stay whole


LIFELINE_ENV = "ORCHESTRATOR_LIFELINE_FD"  # the inherited read end of the launcher's lifeline pipe
LIFELINE_GRACE_S = 5.0  # after the lifeline breaks: time to drain (the PDEATHSIG SIGTERM's), then a hard exit
# The launcher's supervision state (JSON, rewritten whole); `orchestrator serve` shows it in /health.
SUPERVISOR_STATUS_ENV = "ORCHESTRATOR_SUPERVISOR_STATUS"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def orchestrator_command(*args: str) -> list[str]:
    """`orchestrator ARGS...` with this interpreter: what every component starts another with."""
    return [sys.executable, "-m", "orchestrator", *args]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (check-then-bind: whoever binds it later may find it taken meanwhile)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ProcessFailed(RuntimeError):
    pass


class _Lifeline:
    """The pipe our tied children watch. Created once per process; the write end is never inherited (O_CLOEXEC,
    Python's default) and never closed, so it closes exactly when this process ends."""

    _read_fd: int | None = None
    _prctl = None  # libc's prctl, looked up before any fork (nothing may allocate between fork and exec)

    @classmethod
    def read_fd(cls) -> int:
        if cls._read_fd is None:
            cls._read_fd, _write_fd = os.pipe()  # _write_fd stays open until we exit, on purpose
        return cls._read_fd

    @classmethod
    def prctl(cls):
        if cls._prctl is None and sys.platform.startswith("linux"):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            cls._prctl = libc.prctl
        return cls._prctl


def _die_with_parent(prctl, parent: int):
    """The preexec hook of a tied child: SIGTERM when the parent goes, and none of that race where it went
    between our fork and the prctl (we would be adopted by init already)."""

    def hook() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def watch_lifeline() -> None:
    """In an `orchestrator` child started tied: exit once the lifeline breaks (the launcher is gone), after
    LIFELINE_GRACE_S for the drain the kernel's SIGTERM began. A thread, so it works in every command, trio or not."""
    fd_text = os.environ.pop(LIFELINE_ENV, None)  # our own children must not take the number for theirs
    if fd_text is None:
        return
    try:
        fd = int(fd_text)
        os.fstat(fd)
    except (ValueError, OSError):
        log.warning("%s=%r names no open descriptor; not watching the launcher", LIFELINE_ENV, fd_text)
        return

    def watch() -> None:
        try:
            while os.read(fd, 1):  # nobody writes: this returns b"" at EOF, when the launcher is gone
                pass
        except OSError:
            pass
        log.warning("the launcher is gone; exiting within %.0f s", LIFELINE_GRACE_S)
        time.sleep(LIFELINE_GRACE_S)
        os._exit(70)  # the drain did not finish: leave nothing behind rather than serve without a supervisor

    threading.Thread(target=watch, daemon=True, name="lifeline").start()


class ManagedProcess:
    """One child process, started at once. `log_dir`: its output goes to `log_dir/NAME.log` (its stderr
    straight from the child, so it never waits for us to read it, and keeps logging if we die); None: each
    line goes to our stderr as `[NAME] line` (the launcher, frontend 0: the operator reads one stream).
    `cwd`: its working directory. `tied`: it dies with us (module docstring); start it from the thread that
    lives as long as it should (the kernel watches that thread, not the process)."""

    def __init__(self, name: str, argv: list[str], *, env: dict[str, str] | None = None,
                 log_dir: Path | None = None, cwd: Path | None = None, tied: bool = False):
        self.name = name
        self.argv = argv
        self.log_path = None if log_dir is None else Path(log_dir) / f"{name}.log"
        self._log: IO[bytes] | None = None if self.log_path is None else open(self.log_path, "ab")
        self._lines: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)  # without a log file
        self._output_lock = threading.Lock()
        self.ready_url: str | None = None
        self._ready = threading.Event()  # set by the `ready URL` line, or when stdout ends without one
        self._sent_sigterm = False
        child_env = {**os.environ, **env} if env else None
        pass_fds: tuple[int, ...] = ()
        preexec = None
        if tied:
            lifeline = _Lifeline.read_fd()
            pass_fds = (lifeline,)
            child_env = {**(child_env or os.environ), LIFELINE_ENV: str(lifeline)}
            preexec = _die_with_parent(_Lifeline.prctl(), os.getpid())
        try:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE if self._log is None else self._log,
                                            start_new_session=True, env=child_env, cwd=cwd, pass_fds=pass_fds,
                                            preexec_fn=preexec)
        except OSError as exc:  # e.g. a launch.workers command that is not installed
            self._close_log()
            raise ProcessFailed(f"{name} could not start: {argv[0]}: {exc.strerror or exc}") from exc
        log.info("started %s (pid %d): %s", name, self.process.pid, " ".join(argv))
        streams = [(self.process.stdout, True)] + ([(self.process.stderr, False)] if self._log is None else [])
        self._readers = [threading.Thread(target=self._read, args=(stream, is_stdout), daemon=True,
                                          name=f"{name}-{'stdout' if is_stdout else 'stderr'}")
                         for stream, is_stdout in streams]
        for reader in self._readers:
            reader.start()

    # ---- output ----------------------------------------------------------------------------------

    def _read(self, stream: IO[bytes], is_stdout: bool) -> None:
        try:
            for raw in stream:
                line = raw.decode(errors="replace").rstrip("\r\n")
                self._record(line)
                if is_stdout and self.ready_url is None and line.startswith("ready "):
                    self.ready_url = line.split(" ", 1)[1].strip()
                    self._ready.set()
        finally:
            stream.close()
            if is_stdout:
                self._ready.set()  # no ready line will come

    def _record(self, line: str) -> None:
        with self._output_lock:
            try:
                if self._log is not None:
                    if not self._log.closed:
                        # Whole lines, appended (O_APPEND), next to what the child writes to its stderr.
                        self._log.write(line.encode() + b"\n")
                        self._log.flush()  # a test or an operator may read the file while the child runs
                else:
                    self._lines.append(line)
                    with _ECHO_LOCK:
                        print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
            except (OSError, ValueError):
                pass  # a full disk or a closed stderr: the reader keeps draining, or the child would block

    def _join_readers(self) -> None:
        """After the exit: let the readers take the last lines (bounded: a grandchild may keep a pipe open)."""
        deadline = time.monotonic() + _OUTPUT_DRAIN_S
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))

    def tail(self, lines: int = 40) -> str:
        with self._output_lock:
            if self.log_path is not None:
                last = self.log_path.read_text(errors="replace").splitlines()[-lines:]
            else:
                last = list(self._lines)[-lines:]
        return "\n".join(f"  [{self.name}] {line}" for line in last)

    def describe_failure(self) -> str:
        code = self.process.poll()
        state = f"exited with code {code}" if code is not None else "did not become ready"
        return f"{self.name} {state}; last lines of its log:\n{self.tail() or '  (no output)'}"

    # ---- state -----------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """None while it runs (this reaps it once it has exited)."""
        return self.process.poll()

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():  # Popen.send_signal also checks, so a reaped pid is never signalled
            self.process.send_signal(sig)

    def _terminate(self) -> None:
        """SIGTERM once: our children drain on the first and die of a second (its default action)."""
        if not self._sent_sigterm:
            self._sent_sigterm = True
            self.signal(signal.SIGTERM)

    # ---- waiting from a plain thread -------------------------------------------------------------

    def wait_ready(self, timeout: float = 60.0) -> str:
        """The URL of the `ready URL` line; ProcessFailed (with the log's tail) if it exits or times out first."""
        self._ready.wait(timeout)
        if self.ready_url is None:
            if self._ready.is_set():  # stdout ended: the exit follows
                try:
                    self.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            raise ProcessFailed(self.describe_failure())
        return self.ready_url

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, once it has exited and its last lines are read; TimeoutExpired after `timeout`."""
        code = self.process.wait(timeout)
        self._join_readers()
        return code

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after `timeout`; the exit code."""
        if self.alive():
            self._terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", self.name, timeout)
                self.process.kill()
                self.process.wait(5)
        self._join_readers()
        self._close_log()
        return self.process.returncode

    def _close_log(self) -> None:
        with self._output_lock:
            if self._log is not None:
                self._log.close()

    # ---- waiting in trio -------------------------------------------------------------------------

    async def wait_ready_async(self, timeout: float = math.inf) -> str:
        """wait_ready() in trio."""
        with trio.move_on_after(timeout):
            # The thread ends when the event is set: at the ready line or when stdout ends, even after we
            # stopped waiting for it.
            await _in_thread(self._ready.wait, abandon_on_cancel=True)
        if self.ready_url is None:
            if self._ready.is_set():
                with trio.move_on_after(5):
                    await self.wait_async()
            raise ProcessFailed(self.describe_failure())
        return self.ready_url

    async def wait_async(self) -> int:
        """wait() in trio: on a pidfd, as trio's own processes do, so no thread waits in waitpid()."""
        if self.process.poll() is None:
            # No checkpoint between the poll and the open, and in trio only this thread reaps the child: the
            # pid is still ours.
            try:
                pidfd = os.pidfd_open(self.process.pid)
            except ProcessLookupError:  # reaped meanwhile after all (a plain thread waited too)
                return await self._exit_code_async()
            try:
                await trio.lowlevel.wait_readable(pidfd)
            finally:
                trio.lowlevel.notify_closing(pidfd)
                os.close(pidfd)
        return await self._exit_code_async()

    async def _exit_code_async(self) -> int:
        code = self.process.wait()  # it has exited: no wait
        await _in_thread(self._join_readers)
        return code

    async def stop_async(self, timeout: float = 20.0) -> int:
        """stop() in trio."""
        if self.alive():
            self._terminate()
            with trio.move_on_after(timeout):
                await self.wait_async()
            if self.alive():
                log.warning("%s did not stop within %.0f s; killing it", self.name, timeout)
                self.process.kill()
                with trio.move_on_after(5):
                    await self.wait_async()
        await _in_thread(self._join_readers)
        self._close_log()
        return self.process.returncode


async def _in_thread(fn, *, abandon_on_cancel: bool = False):
    # A limiter of its own: a wait that lasts minutes must not hold a token of trio's default limiter, which
    # the request path's threads share (tokenizing a long prompt, decoding a big body).
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=abandon_on_cancel, limiter=trio.CapacityLimiter(1))


def etcd_command(binary: str, name: str, data_dir: str, client_port: int, peer_port: int,
                 tls: tuple[str, str, str] | None = None) -> list[str]:
    """A single-member etcd on loopback ports (`orchestrator launch` and the testkit start it the same way).

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
