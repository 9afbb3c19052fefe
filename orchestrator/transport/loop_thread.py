"""A dedicated asyncio loop thread for grpc.aio, with a batched, thread-safe handoff to trio.

Why a thread and not trio-asyncio on the main thread: measured on a 2-core machine
(benchmarks/engine_client.py), grpc.aio read server streams at about a third of its uvloop rate
when driven through trio-asyncio. Here grpc.aio runs on uvloop in its own thread; messages are
queued on a deque and trio is woken once per batch, not once per message.

Thread-safety rules, kept small on purpose:
- only the loop thread touches grpc objects (`submit`, `run` and `call_soon` get code there);
- a `StreamInbox` is filled by the loop thread and drained by the trio thread; the deque operations
  are atomic under the GIL, and a wake-up flag makes at most one pending trio callback per inbox.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

from orchestrator.transport.inbox import TrioInbox

T = TypeVar("T")

try:  # uvloop is the fast path; plain asyncio works everywhere
    import uvloop

    _new_loop: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    _new_loop = asyncio.new_event_loop


class LoopThread:
    """Owns one asyncio loop on a daemon thread for as long as its `open()` scope lasts."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread, token: trio.lowlevel.TrioToken):
        self.loop = loop
        self._thread = thread
        self.trio_token = token
        self._dispatcher = _WakeDispatcher(loop, token)

    def new_inbox(self) -> StreamInbox:
        return StreamInbox(self._dispatcher)

    @classmethod
    @asynccontextmanager
    async def open(cls, name: str = "grpc-asyncio") -> AsyncIterator[LoopThread]:
        loop = _new_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            loop.run_forever()
            # drain what cancellation left behind, then close
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        await trio.to_thread.run_sync(started.wait)
        self = cls(loop, thread, trio.lowlevel.current_trio_token())
        try:
            yield self
        finally:
            with trio.CancelScope(shield=True):
                loop.call_soon_threadsafe(loop.stop)
                await trio.to_thread.run_sync(thread.join)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run a plain callable on the loop thread, without waiting."""
        self.loop.call_soon_threadsafe(fn, *args)

    async def run(self, make_coro: Callable[[], Awaitable[T]]) -> T:
        """Run `make_coro()` on the loop thread and wait for its result from trio.

        Cancelling the trio caller cancels the asyncio task (and so the gRPC call) and then waits until
        that task has really finished, its own cleanup included: an asyncio task never outlives the
        trio scope that started it.
        """
        box: concurrent.futures.Future = concurrent.futures.Future()
        state: dict = {}

        def start() -> None:
            if state.get("cancelled"):
                box.cancel()
                return
            task = state["task"] = self.loop.create_task(_call(make_coro))

            def finished(task: asyncio.Task) -> None:
                if task.cancelled():
                    box.cancel()
                elif (exc := task.exception()) is not None:
                    box.set_exception(exc)
                else:
                    box.set_result(task.result())

            task.add_done_callback(finished)

        def request_cancel() -> None:  # on the loop thread
            task = state.get("task")
            if task is None:
                state["cancelled"] = True  # start() has not run yet: it will not start the task
            else:
                task.cancel()

        self.loop.call_soon_threadsafe(start)
        return await self._wait(box, box.add_done_callback,
                                lambda: self.loop.call_soon_threadsafe(request_cancel))

    async def _wait(self, future: concurrent.futures.Future, add_done_callback, cancel) -> Any:
        task = trio.lowlevel.current_task()
        token = self.trio_token

        def wake(_: Any) -> None:
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task)
            except trio.RunFinishedError:
                pass

        def abort(_: Any) -> trio.lowlevel.Abort:
            # Ask the asyncio side to stop and keep waiting: the wake-up comes once it has finished.
            cancel()
            return trio.lowlevel.Abort.FAILED

        add_done_callback(wake)
        await trio.lowlevel.wait_task_rescheduled(abort)
        if future.cancelled():
            await trio.lowlevel.checkpoint()  # raises trio.Cancelled when this caller was cancelled
            raise RuntimeError("the asyncio side of the call was cancelled (the loop thread is shutting down)")
        return future.result()


async def _call(make_coro: Callable[[], Awaitable[T]]) -> T:
    return await make_coro()


class _WakeDispatcher:
    """Coalesces wake-ups of trio readers: at most one trio callback per asyncio loop iteration.

    An inbox that receives data marks itself dirty; the first dirty inbox of an iteration schedules
    `flush` with `call_soon`, which runs after every message of that iteration was delivered and
    wakes trio once for all of them (measured: per-message wake-ups halved stream throughput).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, token: trio.lowlevel.TrioToken):
        self._loop = loop
        self._token = token
        self._dirty: list[StreamInbox] = []
        self._flush_pending = False

    def mark(self, inbox: StreamInbox) -> None:  # loop thread
        self._dirty.append(inbox)
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:  # loop thread
        self._flush_pending = False
        dirty, self._dirty = self._dirty, []
        try:
            self._token.run_sync_soon(_wake_all, dirty)
        except trio.RunFinishedError:
            pass


def _wake_all(inboxes: list[StreamInbox]) -> None:  # trio thread
    for inbox in inboxes:
        inbox._wake()


class StreamInbox(TrioInbox):
    """Messages from one asyncio-side stream, handed to one trio-side reader in batches."""

    __slots__ = ("_dispatcher", "_wake_pending", "let_end")

    def __init__(self, dispatcher: _WakeDispatcher):
        super().__init__()
        self._dispatcher = dispatcher
        self._wake_pending = False
        self.let_end = False  # as a call's stream (transport/channel.py CallStream): set by its reader

    def deliver_directly(self, handler: Callable[[list], list | None] | None) -> bool:
        """Never: the producer is the loop thread, where the reader's handler must not run."""
        return False

    # ---- loop thread side -------------------------------------------------------------------
    def put(self, item: Any) -> None:
        self._items.append(item)
        if not self._wake_pending:
            self._wake_pending = True
            self._dispatcher.mark(self)

    def close(self, error: BaseException | None = None) -> None:
        self._error = error
        self._closed = True
        if not self._wake_pending:
            self._wake_pending = True
            self._dispatcher.mark(self)

    # ---- trio side -----------------------------------------------------------------------------
    def _wake(self) -> None:
        self._wake_pending = False
        self._wake_reader()
