"""The single-flight capability cache: shared attempts, bounded, shared failure, recovery, cancel, close."""

from typing import Any

import pytest
import trio
import trio.testing

from orchestrator.engine.capabilities import SingleFlightCache
from orchestrator.engine.errors import ClientClosed, DiscoveryFailed, EngineError, IncompatibleWorker


class FakeWorker:
    def __init__(self):
        self.calls = 0
        self.release = trio.Event()
        self.fail_with: EngineError | None = None
        self.hang = False

    async def fetch(self):
        self.calls += 1
        await self.release.wait()
        if self.hang:
            await trio.sleep_forever()
        if self.fail_with is not None:
            raise self.fail_with
        return f"capabilities#{self.calls}"


async def _gather(cache, n, nursery, results):
    async def one(i):
        try:
            results[i] = await cache.get()
        except EngineError as exc:
            results[i] = exc

    for i in range(n):
        nursery.start_soon(one, i)


async def test_concurrent_callers_share_one_discovery_and_then_the_cache(nursery):
    worker = FakeWorker()
    cache = SingleFlightCache(worker.fetch, nursery=nursery, timeout=5, worker="w")
    results: dict[int, Any] = {}  # capabilities, or the error a caller got instead
    async with trio.open_nursery() as callers:
        await _gather(cache, 20, callers, results)
        await trio.testing.wait_all_tasks_blocked()
        worker.release.set()
    assert worker.calls == 1 == cache.attempts
    assert set(results.values()) == {"capabilities#1"}
    assert await cache.get() == "capabilities#1"
    assert worker.calls == 1


async def test_a_failure_is_shared_by_every_waiter_of_that_attempt(nursery):
    worker = FakeWorker()
    worker.fail_with = EngineError("boom", worker="w", rpc="GetServerInfo")
    cache = SingleFlightCache(worker.fetch, nursery=nursery, timeout=5, worker="w")
    results: dict[int, Any] = {}  # capabilities, or the error a caller got instead
    async with trio.open_nursery() as callers:
        await _gather(cache, 10, callers, results)
        await trio.testing.wait_all_tasks_blocked()
        worker.release.set()
    assert worker.calls == 1
    assert all(isinstance(r, DiscoveryFailed) for r in results.values())
    assert {str(r) for r in results.values()} == {str(results[0])}
    assert all(r.__cause__ is worker.fail_with for r in results.values())
    assert "boom" in str(results[0])


async def test_discovery_is_bounded_by_its_timeout(nursery, autojump_clock):
    worker = FakeWorker()
    worker.hang = True
    worker.release.set()
    cache = SingleFlightCache(worker.fetch, nursery=nursery, timeout=3, worker="w")
    start = trio.current_time()
    with pytest.raises(DiscoveryFailed, match="no answer within 3 s"):
        await cache.get()
    assert trio.current_time() - start == pytest.approx(3)


async def test_the_next_call_after_a_failure_tries_again(nursery):
    worker = FakeWorker()
    worker.release.set()
    worker.fail_with = EngineError("down", worker="w", rpc="GetServerInfo")
    cache = SingleFlightCache(worker.fetch, nursery=nursery, timeout=5, worker="w")
    with pytest.raises(DiscoveryFailed):
        await cache.get()
    worker.fail_with = None
    assert await cache.get() == "capabilities#2"
    assert worker.calls == 2


async def test_a_cancelled_waiter_does_not_cancel_the_discovery_for_others(nursery):
    worker = FakeWorker()
    cache = SingleFlightCache(worker.fetch, nursery=nursery, timeout=5, worker="w")
    results: dict[str, str] = {}
    impatient = trio.CancelScope()

    async def impatient_caller():
        with impatient:
            await cache.get()
        results["impatient"] = "cancelled"

    async with trio.open_nursery() as callers:
        callers.start_soon(_await_into, cache, results, "patient")
        callers.start_soon(impatient_caller)
        await trio.testing.wait_all_tasks_blocked()
        impatient.cancel()
        await trio.testing.wait_all_tasks_blocked()
        worker.release.set()
    assert results == {"impatient": "cancelled", "patient": "capabilities#1"}
    assert worker.calls == 1


async def _await_into(cache, results, key):
    results[key] = await cache.get()


async def test_close_wakes_every_waiter_with_client_closed(nursery):
    worker = FakeWorker()
    cache = SingleFlightCache(worker.fetch, nursery=nursery, timeout=5, worker="w")
    results: dict[int, Any] = {}  # capabilities, or the error a caller got instead
    async with trio.open_nursery() as callers:
        await _gather(cache, 5, callers, results)
        await trio.testing.wait_all_tasks_blocked()
        cache.close()
    assert all(isinstance(r, ClientClosed) for r in results.values()) and len(results) == 5
    with pytest.raises(ClientClosed, match="closed"):
        await cache.get()


async def test_a_failed_re_read_keeps_the_last_known_capabilities(nursery):
    """UPSTREAM server-info-unavailable: TensorRT-LLM answers GetServerInfo UNAVAILABLE while its node discovery
    is pending. A worker re-read after a health blip stays routable on what it last reported."""
    worker = FakeWorker()
    worker.release.set()
    cache = SingleFlightCache(worker.fetch, nursery=nursery, timeout=5, worker="w")
    assert await cache.get() == "capabilities#1"
    cache.invalidate()
    worker.fail_with = EngineError("OpenEngine node discovery is unavailable", worker="w", rpc="GetServerInfo")
    assert await cache.get() == "capabilities#1" and worker.calls == 2
    assert cache.cached == "capabilities#1"  # kept: not asked again on every request
    cache.invalidate()
    worker.fail_with = None
    assert await cache.get() == "capabilities#3"  # and replaced once a read works


async def test_a_re_read_that_times_out_keeps_them_but_an_incompatible_worker_does_not(nursery, autojump_clock):
    worker = FakeWorker()
    worker.release.set()
    cache = SingleFlightCache(worker.fetch, nursery=nursery, timeout=5, worker="w")
    assert await cache.get() == "capabilities#1"
    cache.invalidate()
    worker.hang = True
    assert await cache.get() == "capabilities#1"  # after the 5 s timeout
    worker.hang = False
    cache.invalidate()
    worker.fail_with = IncompatibleWorker("requires client revision >= 9", worker="w", rpc="GetServerInfo")
    with pytest.raises(DiscoveryFailed, match="requires client revision"):
        await cache.get()


async def test_without_last_known_capabilities_a_failure_stands(nursery):
    worker = FakeWorker()
    worker.release.set()
    worker.fail_with = EngineError("OpenEngine node discovery is unavailable", worker="w", rpc="GetServerInfo")
    cache = SingleFlightCache(worker.fetch, nursery=nursery, timeout=5, worker="w")
    cache.invalidate()
    with pytest.raises(DiscoveryFailed, match="node discovery"):
        await cache.get()
