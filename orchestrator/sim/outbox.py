"""One Generate call's responses, between the scheduler that fills them and the handler that streams them.

Its own module because the worker's declared state (worker_state.py) and the parts that fill and drain it
(responses.py, admission.py) all name it.
"""

from __future__ import annotations

import asyncio
import collections

from orchestrator.openengine.v1 import generation_pb2


class Outbox:
    """Responses for one Generate call, filled by the scheduler, drained by the handler."""

    __slots__ = ("items", "waiter", "closed")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.closed = False

    def put(self, item: generation_pb2.GenerateResponse, last: bool = False) -> None:
        self.items.append(item)
        self.closed = self.closed or last
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> list:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        batch = list(self.items)
        self.items.clear()
        return batch
