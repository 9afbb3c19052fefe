"""The asyncio loop thread and its trio-side contract."""

import asyncio

import pytest
import trio

from orchestrator.engine import LoopThread


async def test_results_and_exceptions_cross_back_to_trio():
    async def add(a, b):
        await asyncio.sleep(0)
        return a + b

    async def fail():
        raise KeyError("from asyncio")

    async with LoopThread.open() as loop_thread:
        assert await loop_thread.run(lambda: add(2, 3)) == 5
        with pytest.raises(KeyError, match="from asyncio"):
            await loop_thread.run(fail)


async def test_cancelling_the_trio_caller_waits_for_the_asyncio_cleanup():
    log = []

    async def work():
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.2)  # e.g. revoking a lease
            log.append("cleaned up")

    async with LoopThread.open() as loop_thread:
        with trio.move_on_after(0.1) as scope:
            await loop_thread.run(work)
        assert scope.cancelled_caught
        assert log == ["cleaned up"]  # done before the caller went on, not after


async def test_many_streams_get_their_items_in_order_through_inboxes():
    async with LoopThread.open() as loop_thread:
        inboxes = [loop_thread.new_inbox() for _ in range(20)]

        async def produce():
            for i in range(200):
                for inbox in inboxes:
                    inbox.put(i)
                if i % 17 == 0:
                    await asyncio.sleep(0)
            for inbox in inboxes:
                inbox.close()

        received: dict[int, list[int]] = {n: [] for n in range(len(inboxes))}

        async def consume(n):
            while batch := await inboxes[n].get_batch():
                received[n].extend(batch)

        async with trio.open_nursery() as nursery:
            for n in range(len(inboxes)):
                nursery.start_soon(consume, n)
            await loop_thread.run(produce)
    assert all(items == list(range(200)) for items in received.values())


async def test_an_inbox_closed_with_an_error_raises_it_after_its_items():
    async with LoopThread.open() as loop_thread:
        inbox = loop_thread.new_inbox()
        loop_thread.call_soon(inbox.put, "a")
        loop_thread.call_soon(inbox.close, ValueError("stream broke"))
        assert await inbox.get_batch() == ["a"]
        with pytest.raises(ValueError, match="stream broke"):
            await inbox.get_batch()
