"""Sleeping for the simulated GPU's time, to the microsecond, on an event loop whose timers count milliseconds.

The simulated worker runs on uvloop, and libuv rounds every timer to a whole millisecond: `asyncio.sleep(0.00067)`
lasts 0 or 1 ms and `asyncio.sleep(0.00013)` returns at once (measured in the worker: KV transfers of 0.14 ms took
0.04-0.08 ms, decode steps asked for 0.35-0.48 ms ran back to back and sent their tokens in bursts). At time scale
0.1 those are exactly the times a step or a KV transfer of the demo's profile lasts, and the conversion to GPU time
multiplies every such error by 10. (asyncio's own loop is no better: epoll rounds each wait up to a millisecond.)

So on Linux the worker's GPU time is slept on a timerfd: the kernel wakes the loop at an absolute CLOCK_MONOTONIC
deadline (time.monotonic's clock) with nanosecond resolution, never before it. One timerfd per event loop, armed for
the earliest of the pending deadlines (a heap), serves every sleeper: the step loop and any number of KV transfers.
Elsewhere the loop's own timer is used. Either way each kind of wait asks for its average lateness less, measured on
time.monotonic() (uvloop's loop.time() counts whole milliseconds too).
"""

from __future__ import annotations

import asyncio
import ctypes
import heapq
import itertools
import os
import sys
import time
import weakref

_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK, _TFD_CLOEXEC, _TFD_TIMER_ABSTIME = os.O_NONBLOCK, os.O_CLOEXEC, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):  # a libc without timerfd
        return None


_LIBC = _libc()


class DeadlineTimer:
    """The pending deadlines of one event loop: a timerfd armed for the earliest of them (a heap), or the loop's own
    timer where there is none."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._fd: int | None = None
        self._pending: list[tuple[float, int, asyncio.Future]] = []
        self._order = itertools.count()  # equal deadlines wake in the order they were asked for
        self._armed: float | None = None
        if _LIBC is None:
            return
        fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            return
        try:
            loop.add_reader(fd, self._fire)
        except NotImplementedError:  # a loop that cannot watch an fd
            os.close(fd)
            return
        self._fd = fd
        # The loop holds us (our reader) and we hold no reference to it: the fd closes when the loop is collected.
        weakref.finalize(loop, os.close, fd)

    async def sleep_until(self, deadline: float) -> None:
        """Return at `deadline` (time.monotonic()) or after it; on a timerfd, never before it."""
        now = time.monotonic()
        if self._fd is None or deadline <= now:
            await asyncio.sleep(deadline - now)
            return
        waiter = asyncio.get_running_loop().create_future()
        heapq.heappush(self._pending, (deadline, next(self._order), waiter))
        if self._armed is None or deadline < self._armed:
            self._arm(deadline)
        await waiter  # a cancelled sleeper's entry stays in the heap until its deadline, then is skipped

    def _arm(self, deadline: float) -> None:
        seconds, fraction = divmod(deadline, 1.0)
        spec = _Itimerspec(it_value=_Timespec(int(seconds), max(1, int(fraction * 1e9))))  # 0 would disarm it
        if _LIBC is None or self._fd is None or _LIBC.timerfd_settime(self._fd, _TFD_TIMER_ABSTIME,
                                                                     ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        self._armed = deadline

    def _fire(self) -> None:
        try:
            os.read(self._fd, 8)  # type: ignore[arg-type]  # the expiry count; reading it quiets the fd
        except BlockingIOError:
            pass  # re-armed since it became readable
        self._armed = None
        now = time.monotonic()
        while self._pending and self._pending[0][0] <= now:
            _, _, waiter = heapq.heappop(self._pending)
            if not waiter.done():
                waiter.set_result(None)
        if self._pending:
            self._arm(self._pending[0][0])


_TIMERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, DeadlineTimer] = weakref.WeakKeyDictionary()


def timer() -> DeadlineTimer:
    """The running loop's DeadlineTimer."""
    loop = asyncio.get_running_loop()
    found = _TIMERS.get(loop)
    if found is None:
        found = _TIMERS[loop] = DeadlineTimer(loop)
    return found


class GpuSleep:
    """One kind of GPU wait (the step loop's steps, a worker's KV transfers): each lasts the time asked on average,
    however late this host wakes that kind of wait. A late wake-up (timer slack, a loaded host, the loop busy with
    the previous step's responses) would otherwise add to every wait, and a small time scale multiply it into GPU
    time; so each asks for the average lateness less. Its own average, as a step's lateness (the loop is busy
    sending tokens then) is not a KV transfer's. (Not caught up by shortening the next waits: that would send their
    tokens in bursts.)"""

    def __init__(self) -> None:
        self.late = 0.0  # how late this kind of wait returns (moving average, s)

    async def __call__(self, seconds: float) -> None:
        """Sleep `seconds` of simulated GPU time (already scaled)."""
        deadline = time.monotonic() + max(0.0, seconds - self.late)
        await timer().sleep_until(deadline)
        self.late += 0.1 * ((time.monotonic() - deadline) - self.late)
