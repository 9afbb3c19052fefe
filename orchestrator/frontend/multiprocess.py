"""Several frontend processes behind one port (`http.processes: N`), so that every core serves.

The process the operator started is frontend 0. It binds the port with SO_REUSEPORT (resolving port
0 to a real port), then starts N-1 copies of itself (`orchestrator serve ... --frontend-index I`)
that bind the same port the same way; the kernel spreads new connections across the N listening
sockets. Each process has its own trio loop, HTTP server, coordinator and pool, and each polls the
workers itself: least-loaded routing scores workers by what they report (GetLoad) plus what this
process sent since, so the processes share the workers' own view of their load.

Frontend 0 owns its children (a nursery task per child, each child an orchestrator.processes.ManagedProcess
whose output goes to frontend 0's stderr after its name):
- it prints its `ready` line once every child has printed its own;
- a child that exits while we are not stopping is restarted after a pause (1 s, doubling up to 30 s
  while it keeps dying within a minute of its start);
- SIGTERM/SIGINT (or a cancelled scope) sends SIGTERM to every child, which drains like frontend 0
  does, and waits for them (SIGKILL after the stop timeout);
- a child whose parent is gone (frontend 0 was killed) drains and exits by itself (ParentWatch).
Metrics are summed across the processes (orchestrator/metrics.py, prometheus multiprocess mode).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from collections.abc import Callable

import attrs
import trio

from orchestrator.processes import ManagedProcess, ProcessFailed

log = logging.getLogger("orchestrator.frontend")

_RESTART_PAUSE_S = (1.0, 30.0)  # first pause, longest pause
_HEALTHY_AFTER_S = 60.0  # a child up this long resets the pause


@attrs.frozen
class FrontendProcess:
    """Which frontend this process is: `index` of `count` (0 is the one that starts the others)."""

    index: int = 0
    count: int = 1
    parent_pid: int | None = None  # a child: the pid of frontend 0, which started it

    @property
    def is_first(self) -> bool:
        return self.index == 0

    def describe(self) -> dict:
        return {"index": self.index, "processes": self.count, "pid": os.getpid()}


class FrontendChildren:
    """Frontends 1..count-1, started, kept running and stopped by frontend 0."""

    def __init__(self, count: int, argv_for: Callable[[int], list[str]], *, ready_timeout: float,
                 stop_timeout: float, on_exit: Callable[[int], None]):
        self.count = count
        self.argv_for = argv_for
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.on_exit = on_exit  # called with the pid of every child that exited (its metrics are dead)
        self.current: dict[int, ManagedProcess] = {}
        self.restarts = 0
        self.stopped = trio.Event()  # set once every child has stopped after shutdown
        self._stopping = False

    async def run(self, shutdown: trio.Event, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Start every child; started once each has printed `ready` (or the ready timeout passed);
        returns after `shutdown` (or a cancellation) once every child has stopped."""
        first_ready = {index: trio.Event() for index in range(1, self.count)}
        try:
            async with trio.open_nursery() as nursery:
                for index, ready in first_ready.items():
                    nursery.start_soon(self._keep, index, ready)
                with trio.move_on_after(self.ready_timeout):
                    for ready in first_ready.values():
                        await ready.wait()
                late = [index for index, ready in first_ready.items() if not ready.is_set()]
                if late:
                    log.error("frontend processes %s not ready after %.0f s; serving without them until they are",
                              late, self.ready_timeout)
                task_status.started()
                await shutdown.wait()
                self._stopping = True
                nursery.cancel_scope.cancel()  # each _keep stops its child, all at the same time
        finally:
            self._stopping = True
            self.stopped.set()

    async def _keep(self, index: int, first_ready: trio.Event) -> None:
        pause = _RESTART_PAUSE_S[0]
        while not self._stopping:
            child = ManagedProcess(f"frontend-{index}", self.argv_for(index))
            self.current[index] = child
            started_at = trio.current_time()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_set_when_ready, child, first_ready)
                    await child.wait_async()
                    nursery.cancel_scope.cancel()
            finally:
                # Cancelled (shutdown, or our caller's scope): the child drains on SIGTERM, is killed after the
                # stop timeout, and its exit is reported all the same.
                with trio.CancelScope(shield=True):
                    await child.stop_async(self.stop_timeout)
                self.on_exit(child.pid)
            if self._stopping:
                return
            if trio.current_time() - started_at >= _HEALTHY_AFTER_S:
                pause = _RESTART_PAUSE_S[0]
            log.error("frontend process %d (pid %d) exited; restarting it in %.0f s\n%s", index, child.pid, pause,
                      child.describe_failure())
            await trio.sleep(pause)
            pause = min(pause * 2, _RESTART_PAUSE_S[1])
            self.restarts += 1


async def _set_when_ready(child: ManagedProcess, event: trio.Event) -> None:
    try:
        await child.wait_ready_async()
    except ProcessFailed:
        return  # it exited first; _keep restarts it
    event.set()


def leave_metrics_dir(directory: str) -> None:
    """A child frontend whose frontend 0 is gone (killed, so it could not remove the metrics directory it made),
    on its way out: the last frontend process out removes the directory.

    Under an exclusive lock on the directory, each child removes its own live files (mark_process_dead), then
    looks for another frontend process that still has them and runs; none: it is the last, and removes the lot.
    A process killed before it could remove its files has them still, but does not run: it does not count."""
    from prometheus_client.multiprocess import mark_process_dead

    from orchestrator.metrics import FrontendProcesses

    try:
        handle = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        mark_process_dead(os.getpid(), directory)
        if not [pid for pid in FrontendProcesses(directory).live_pids() if _running(pid)]:
            shutil.rmtree(directory, ignore_errors=True)
            log.info("removed the metrics directory %s: the last frontend process is leaving", directory)
    finally:
        os.close(handle)


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ParentWatch:
    """In a child frontend: calls `on_gone` once `parent` (frontend 0) is no longer our parent, also when
    it was gone before we looked (the pid comes from the command line, not from getppid at start-up)."""

    def __init__(self, parent: int, on_gone: Callable[[], None], interval: float = 1.0):
        self.parent = parent
        self.on_gone = on_gone
        self.interval = interval

    async def run(self) -> None:
        while os.getppid() == self.parent:
            await trio.sleep(self.interval)
        log.warning("frontend 0 (pid %d) is gone: draining", self.parent)
        self.on_gone()
