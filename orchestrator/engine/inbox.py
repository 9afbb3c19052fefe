"""The trio side of a stream's messages: one reader task takes everything that arrived, in batches.

Subclasses fill `_items` and call `_wake_reader()` (StreamInbox from the asyncio loop thread through
its dispatcher, H2Stream from the HTTP/2 connection's reader task), and close with an error or none.
"""

from __future__ import annotations

import collections
from typing import Any

import trio


class TrioInbox:
    __slots__ = ("_items", "_reader", "_closed", "_error")

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self._reader: trio.lowlevel.Task | None = None
        self._closed = False
        self._error: BaseException | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def _wake_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            trio.lowlevel.reschedule(reader)

    async def get_batch(self) -> list[Any]:
        """Everything queued so far (at least one item); [] once closed and drained.

        Raises the error the stream was closed with, after its items were read. Either it parks
        until woken (that park is the checkpoint), or it finds items at once and yields to the
        scheduler once, so a fast stream cannot starve other tasks.
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
            return batch
        # closed: every item is queued before the close, so nothing can arrive after this point
        if self._error is not None:
            raise self._error
        return []

    def _abort(self, _: Any) -> trio.lowlevel.Abort:
        self._reader = None
        return trio.lowlevel.Abort.SUCCEEDED
