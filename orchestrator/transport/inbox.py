"""The trio side of a stream's messages: one reader task takes everything that arrived, in batches.

Subclasses fill `_items` and call `_wake_reader()` (StreamInbox from the asyncio loop thread through
its dispatcher), or fill them and call `hand_over()` once the producer has put in everything it has
at that moment (H2Stream: the HTTP/2 connection's reader task, after each socket read), and close
with an error or none. `_taken()` is called each time the reader took a batch: a subclass whose producer
must not run ahead of the reader (H2Stream: HTTP/2 flow control) learns there that it may send more.

Direct delivery: while the reader waits with nothing queued, `hand_over()` gives what arrived to the
reader's `direct` handler, called right there in the producing task, instead of waking the reader.
Waking a task and switching to it costs about as much as everything else a streamed token needs; the
handler (decode/progress.py's StreamProgress.deliver; that module's docstring is the whole contract) writes
the tokens to the client in place. It returns None when it has dealt with the whole batch, or what the reader must
get instead (the batch itself when it declines it): that is queued and the reader woken, as without a
handler. It runs only while the reader is parked in get_batch, so never concurrently with the reader's
own handling of a batch.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import trio


class TrioInbox:
    """A call's responses on their way to the one task that reads them (get_batch)."""

    __slots__ = ("_items", "_reader", "_closed", "_error", "direct")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        # The reader's task while it is parked in get_batch, else None. One reader, woken by rescheduling it
        # directly: a trio ParkingLot does the same with ~14 more Python calls per streamed request
        # (benchmarks/instruction_cost.py, docs/benchmarks.md).
        self._reader: trio.lowlevel.Task | None = None
        self._closed = False
        self._error: BaseException | None = None
        self.direct: Callable[[list], list | None] | None = None  # the reader's direct handler, if any

    @property
    def closed(self) -> bool:
        return self._closed

    def deliver_directly(self, handler: Callable[[list], list | None] | None) -> bool:
        """Give what arrives to `handler` while the reader waits (None: wake the reader again); True."""
        self.direct = handler
        return True

    def hand_over(self) -> None:
        """What is queued goes to the reader: to its `direct` handler while it waits, else by waking it."""
        # Only while the reader is parked: then it is not handling a batch of its own, so the handler never runs
        # concurrently with it, and what the handler declines still reaches it in order.
        if self._reader is not None and self.direct is not None:
            batch = list(self._items)
            self._items.clear()
            rest = self.direct(batch)
            if not rest:
                return
            self._items.extend(rest)
        self._wake_reader()

    def _wake_reader(self) -> None:
        # Forget the reader as it is woken: a second hand_over before it runs only queues.
        reader, self._reader = self._reader, None
        if reader is not None:
            trio.lowlevel.reschedule(reader)

    async def get_batch(self) -> list[Any]:
        """Everything queued so far (at least one item); [] once closed and drained.

        Raises the error the stream was closed with, after its items were read. Either it parks
        until woken (that park is the checkpoint), or it finds items at once and yields to the
        scheduler once, so a fast stream cannot starve other tasks. Cancelled while parked, it is
        forgotten as the reader (`_abort`) and what arrives meanwhile stays queued for the next call.
        """
        items = self._items
        if items or self._closed:
            await trio.lowlevel.checkpoint()
        else:
            while not items and not self._closed:
                self._reader = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._abort)
        batch = list(items)
        items.clear()
        if batch:
            self._taken()
            return batch
        # closed: every item is queued before the close, so nothing can arrive after this point
        if self._error is not None:
            raise self._error
        return []

    def _taken(self) -> None:
        """The reader took what was queued (H2Stream gives the worker its flow-control credit back here)."""

    def _abort(self, _: Any) -> trio.lowlevel.Abort:
        self._reader = None  # cancelled while parked: nobody to wake or to hand batches to directly
        return trio.lowlevel.Abort.SUCCEEDED
