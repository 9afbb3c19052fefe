"""A worker's ZMQ KV event publisher that floods, lies about its rank or sends what no engine sends: the feed bounds
what it holds, refuses it, says so in /health (feed.detail) and the metric, and keeps following (issue 43, 1-3).

The worker here is a scripted ZMQ publisher behind a scripted client (ServerInfo, GetKvEventSources), so the test
sends exactly the hostile bytes it means to."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import msgpack
import trio
import zmq

from orchestrator.metrics import Metrics
from orchestrator.openengine.v1 import kv_pb2
from orchestrator.processes import free_port
from orchestrator.workers.instance_watch import InstanceWatch
from orchestrator.workers.kv_events import KvEventFeed
from orchestrator.workers.kv_index import KvIndex

WORKER = "grpc://127.0.0.1:9"
TOTAL_KV_BLOCKS = 12_000  # as the worker reported
BOUND = 2 * TOTAL_KV_BLOCKS + 1024  # kv_event_codec.rank_bound(12_000, 1)


class _Caps:
    instance_id = "i1"
    data_parallel_size = 1
    kv_block_size = 2
    total_kv_blocks = TOTAL_KV_BLOCKS


class ScriptedWorker:
    """What the feed asks of a worker's client: its capabilities and one ZMQ source per rank."""

    def __init__(self, ports: list[int], data_parallel_size: int = 1):
        self.ports = ports
        self.caps = _Caps()
        self.caps.data_parallel_size = data_parallel_size
        self.subscriptions: list[float] = []  # when the feed asked for its sources (each subscription), trio time

    async def capabilities(self):
        return self.caps

    async def kv_event_sources(self, ranks=(), *, timeout=10.0):
        self.subscriptions.append(trio.current_time())
        return [kv_pb2.KvEventSource(transport="zmq", endpoint_addr=kv_pb2.KvEndpoint(
                    host="127.0.0.1", port=port, protocol="tcp"), topic="kv", data_parallel_rank=rank,
                    encoding="msgpack", schema_version=1, hwm=10_000_000)
                for rank, port in enumerate(self.ports)]


def stored(first: int, blocks: int) -> dict:
    return {"type": "BlockStored", "block_hashes": list(range(first, first + blocks)), "parent_block_hash": None,
            "token_ids": [7] * (2 * blocks), "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}


class Publisher:
    def __init__(self, context: zmq.Context, port: int):
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.sequence = 0

    def send(self, events: list, rank=0) -> None:
        self.sequence += 1
        self.socket.send_multipart([b"kv", self.sequence.to_bytes(8, "big"), msgpack.packb([1.0, events, rank])])


async def until(predicate, timeout: float = 15.0) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


@contextlib.contextmanager
def feed_and_publisher(**feed_options) -> Iterator[tuple[KvEventFeed, Publisher, int]]:
    """A feed and the worker's publisher on a free port, on one ZMQ context, closed in the order ZMQ needs (a
    socket still open without linger 0 makes the context's term() hang)."""
    context, port = zmq.Context(), free_port()
    feed = KvEventFeed(KvIndex(), zmq_context=context, **feed_options)
    publisher = Publisher(context, port)
    try:
        yield feed, publisher, port
    finally:
        publisher.socket.close(linger=0)
        feed.close()
        context.term()


async def subscribed(feed: KvEventFeed) -> None:
    """The feed follows the worker's events, and its subscription has taken (ZMQ's late joiner)."""
    await until(lambda: feed.index.mode(WORKER) == "events")
    await trio.sleep(0.3)


async def test_a_flooding_worker_never_holds_more_than_twice_what_it_says_it_holds():
    """20 s of BlockStored grew the issue's index to 24,338,316 blocks (the worker reports 12,000)."""
    metrics = Metrics()
    peak = 0
    with feed_and_publisher(retry_s=0.05, metrics=metrics) as (feed, publisher, port):
        index = feed.index
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed.follow, WORKER, ScriptedWorker([port]), InstanceWatch())
            await subscribed(feed)
            for n in range(150):  # 150 batches of 1,000 blocks: 150,000 blocks, 6x the bound
                publisher.send([stored(1 + n * 1000, 1000)])
                await trio.sleep(0.005)
                peak = max(peak, index.blocks(WORKER))
            await until(lambda: feed.stats.refused > 0)
            peak = max(peak, index.blocks(WORKER))
            nursery.cancel_scope.cancel()
    assert 0 < peak <= BOUND
    assert "KV events refused (over_bound)" in feed.detail.get(WORKER, "")
    refused = metrics.kv_events_refused.labels(WORKER, "over_bound")._value.get()
    assert refused >= 1


async def test_a_batch_naming_another_rank_is_refused_and_said_in_health():
    """A batch's own DP-rank field (99) used to be ignored and applied to the socket's rank."""
    metrics = Metrics()
    with feed_and_publisher(retry_s=5, metrics=metrics) as (feed, publisher, port):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed.follow, WORKER, ScriptedWorker([port]), InstanceWatch())
            await subscribed(feed)
            publisher.send([stored(1, 3)], rank=99)
            await until(lambda: feed.stats.refused == 1)
            assert feed.index.blocks(WORKER) == 0 and feed.index.mode(WORKER) == "approximate"
            assert feed.detail[WORKER].startswith("KV events refused (bad_rank)")
            nursery.cancel_scope.cancel()
    assert metrics.kv_events_refused.labels(WORKER, "bad_rank")._value.get() == 1


async def test_a_worker_advertising_thousands_of_ranks_gets_no_socket_and_health_says_why():
    """12,000 advertised DP-rank sources exhausted our file descriptors."""
    feed = KvEventFeed(KvIndex(), retry_s=5)
    worker = ScriptedWorker([free_port()] * 12_000, data_parallel_size=12_000)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed.follow, WORKER, worker, InstanceWatch())
            await until(lambda: feed.stats.invalid_sources == 1)
            assert "at most 32" in feed.detail[WORKER] and len(feed.detail[WORKER]) < 400
            nursery.cancel_scope.cancel()
    finally:
        feed.close()


async def test_a_huge_malformed_payload_becomes_a_bounded_health_detail_and_log_line(caplog):
    """One 20 MB malformed payload became a 73 MB /health body and a 60 MB log line (the decoder's exception repr
    carried the bytes). Here 3 MB of a string where a block hash belongs (under the message limit)."""
    import logging

    from orchestrator.log import MAX_CAUSE_CHARS, BoundedFormatter

    with feed_and_publisher(retry_s=5) as (feed, publisher, port):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed.follow, WORKER, ScriptedWorker([port]), InstanceWatch())
            await subscribed(feed)
            publisher.send([{**stored(1, 1), "block_hashes": ["x" * 3_000_000]}])
            await until(lambda: feed.stats.refused == 1)
            nursery.cancel_scope.cancel()
    assert len(feed.detail[WORKER]) <= MAX_CAUSE_CHARS + 100
    lines = [BoundedFormatter("%(message)s").format(r) for r in caplog.records if "refused" in r.getMessage()]
    assert lines and all(len(line) <= 4 * MAX_CAUSE_CHARS for line in lines)
    assert all(len(r.getMessage()) < 10_000 for r in caplog.records if r.levelno >= logging.WARNING)


async def test_a_refused_worker_is_followed_again_only_after_a_long_growing_wait_or_when_it_restarts():
    """Each new subscription to a flooding worker costs a burst (its rank filled to the bound, then cleared); it was
    tried again after 1, 2, 4 ... 30 s. Now after refused_backoff_s (60 s in serve), doubling, and at once when the
    worker restarts (a new engine). /health says when."""
    instance = InstanceWatch()
    instance.saw("i1")
    refused_at: list[float] = []
    with feed_and_publisher(retry_s=0.05, refused_backoff_s=0.4) as (feed, publisher, port):
        worker = ScriptedWorker([port])

        async def refuse_subscription(n: int) -> None:
            await until(lambda: len(worker.subscriptions) == n)
            await subscribed(feed)
            publisher.send([stored(1, 3)], rank=99)
            await until(lambda: feed.stats.refused == n)
            refused_at.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(feed.follow, WORKER, worker, instance)
            await refuse_subscription(1)
            assert feed.detail[WORKER].endswith("followed again in 0.4 s")
            await refuse_subscription(2)
            assert feed.detail[WORKER].endswith("followed again in 0.8 s")
            await refuse_subscription(3)
            assert feed.detail[WORKER].endswith("followed again in 1.6 s")
            restarted = trio.current_time()
            worker.caps.instance_id = "i2"
            instance.saw("i2")  # a new engine: followed at once, its backoff starts afresh
            await until(lambda: len(worker.subscriptions) == 4)
            assert worker.subscriptions[3] - restarted < 1.0
            await refuse_subscription(4)
            assert feed.detail[WORKER].endswith("followed again in 0.4 s")
            nursery.cancel_scope.cancel()
    # never sooner than its backoff (retry_s is 0.05 s): 0.4 s, then 0.8 s (refused_at is read by polling, up to
    # 0.01 s after the refusal)
    assert worker.subscriptions[1] - refused_at[0] >= 0.4 - 0.02
    assert worker.subscriptions[2] - refused_at[1] >= 0.8 - 0.02
