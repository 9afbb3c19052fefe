"""The KV event feed (orchestrator/workers/kv_events.py) against real simulated workers of both personas,
and its source validation and decoding, pure.

Upstream facts (see tests/e2e/test_trtllm_conformance.py UPSTREAM "kv-events-*" for file and commit): revision 1
publishes over ZMQ per rank with an optional replay ROUTER, revision 3 streams SubscribeKvEvents and fails
closed on image blocks; sources are validated as Dynamo's TensorRT-LLM sidecar validates them.
"""

from __future__ import annotations

import grpc
import pytest
import trio

from grpc_servers import grpc_aio_server
from orchestrator.discovery.snapshots import Snapshot, WorkerSpec
from orchestrator.engine import LoopThread
from orchestrator.metrics import Metrics
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import kv_pb2, lifecycle_pb2, model_pb2, openengine_pb2_grpc, server_pb2
from orchestrator.processes import free_port
from orchestrator.workers.kv_events import KvEventFeed
from orchestrator.workers.kv_index import KvIndex, PromptImage, image_identity, prompt_block_keys
from orchestrator.workers.kv_routing import KvRouting
from sim_helpers import IMAGE_TOKEN_ID, collect, data_uri, full_request, png_bytes

FAST = ("--time-scale", "0")
BLOCK = 32  # the default profile's kv_block_size
IMAGE_TOKENS = 576  # the default profile's tokens per image
REVISION_1 = ("--kv-events",)
REVISION_3 = ("--kv-events", "--schema-revision", "3")


def prompt(seed: int, length: int = 100) -> tuple[int, ...]:
    return tuple(range(seed * 1000, seed * 1000 + length))


async def wait_for(predicate, timeout: float = 10.0, what: str = "") -> None:
    """Poll until `predicate()`; `what` names it in the failure."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.02)


class Fed:
    """A KvEventFeed following one worker through a real EngineClient."""

    def __init__(self, index: KvIndex, feed: KvEventFeed, address: str):
        self.index, self.feed, self.address = index, feed, address

    def held(self, ids, images=()) -> dict:
        return self.index.overlap(prompt_block_keys(ids, BLOCK, images), trio.current_time())

    def blocks(self, ids, images=()) -> int:
        return max(self.held(ids, images).values(), default=0)


async def follow(nursery, engine_client, address: str, *, client_options: dict | None = None,
                 **options) -> tuple[Fed, object]:
    """`options` for the feed, `client_options` for the EngineClient (stream_transport=...)."""
    index = KvIndex()
    feed = KvEventFeed(index, retry_s=0.1, identity_check_s=0.2, **options)
    client = await nursery.start(_open_client, engine_client, address, client_options)
    nursery.start_soon(feed.follow, address, client)
    return Fed(index, feed, address), client


async def _open_client(engine_client, address, options=None, *, task_status=trio.TASK_STATUS_IGNORED):
    async with engine_client(address, **(options or {})) as client:
        await client.wait_until_ready(deadline=20)
        task_status.started(client)
        await trio.sleep_forever()


async def run(client, ids, rid, max_tokens=2, media=()):
    return await collect(client, full_request(rid, ids=ids, max_tokens=max_tokens, media=media))


# ---- both personas, real processes ---------------------------------------------------------------------------

@pytest.mark.parametrize("revision", [REVISION_1, REVISION_3], ids=["zmq", "grpc"])
async def test_events_from_each_persona_reach_the_index_per_rank(sim_workers, engine_client, revision):
    worker = sim_workers.start("aggregated", *FAST, *revision, "--attention-dp-size", "2")
    async with trio.open_nursery() as nursery:
        fed, client = await follow(nursery, engine_client, worker.address)
        await wait_for(lambda: fed.index.mode(worker.address) == "events")
        await run(client, prompt(1), "a")
        await wait_for(lambda: fed.blocks(prompt(1)) == 3)  # 100 tokens: 3 full blocks
        held = fed.held(prompt(1))
        assert list(held.values()) == [3] and next(iter(held))[0] == worker.address
        assert next(iter(held))[1] in (0, 1)
        assert fed.blocks(prompt(2)) == 0  # a prompt nobody ran
        assert fed.index.image_keys(worker.address) is (revision is REVISION_1)
        nursery.cancel_scope.cancel()


async def test_the_grpcio_transport_follows_the_revision_3_event_stream(sim_workers, engine_client):
    """SubscribeKvEvents streams over grpcio as over h2 (one WorkerChannel interface): events reach the index."""
    worker = sim_workers.start("aggregated", *FAST, *REVISION_3, "--attention-dp-size", "2")
    async with trio.open_nursery() as nursery:
        fed, client = await follow(nursery, engine_client, worker.address,
                                   client_options={"stream_transport": "grpcio"})
        await wait_for(lambda: fed.index.mode(worker.address) == "events")
        await run(client, prompt(1), "a")
        await wait_for(lambda: fed.blocks(prompt(1)) == 3)  # 100 tokens: 3 full blocks
        held = fed.held(prompt(1))
        assert list(held.values()) == [3] and next(iter(held))[0] == worker.address
        assert fed.blocks(prompt(2)) == 0  # a prompt nobody ran
        assert not fed.index.image_keys(worker.address)  # revision 3's stream carries no image keys
        assert fed.feed.stats.batches >= 1 and "cannot be followed" not in fed.feed.detail.get(worker.address, "")
        nursery.cancel_scope.cancel()


async def settle(fed: Fed, client) -> tuple[int, ...]:
    """Probe requests (one event batch each) until one reaches the index: the subscription has taken (a ZMQ
    subscriber misses what was published before it joined). Returns the probe that arrived."""
    for attempt in range(50):
        probe = prompt(100 + attempt, 40)
        await run(client, probe, f"probe{attempt}")
        with trio.move_on_after(0.5):
            await wait_for(lambda probe=probe: fed.blocks(probe) == 1)
            return probe
    raise AssertionError("no probe reached the index")


@pytest.mark.parametrize("revision", [REVISION_1, REVISION_3], ids=["zmq", "grpc"])
async def test_a_sequence_gap_clears_the_worker_until_rebuilt(sim_workers, engine_client, revision):
    # every 2nd batch (zmq) or event (grpc, one event per batch) is lost. A probe that arrived was a kept one,
    # so the next request's store is lost and the one after it arrives after the gap, which must clear what
    # was known before (the probe).
    worker = sim_workers.start("aggregated", *FAST, *revision, "--drop-kv-events", "2")
    async with trio.open_nursery() as nursery:
        fed, client = await follow(nursery, engine_client, worker.address)
        await wait_for(lambda: fed.index.mode(worker.address) == "events")
        probe = await settle(fed, client)
        lost, after = prompt(1, 40), prompt(2, 40)  # one full block each: one event per request
        await run(client, lost, "lost")
        await run(client, after, "after")
        await wait_for(lambda: fed.blocks(after) == 1)
        assert fed.blocks(probe) == 0, "the gap must clear what was known before it"
        assert fed.blocks(lost) == 0
        assert fed.feed.stats.gaps >= 1 and fed.feed.stats.clears >= 1
        nursery.cancel_scope.cancel()


async def test_a_gap_the_replay_socket_still_holds_is_filled_without_clearing(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, *REVISION_1, "--kv-events-replay-port", "0",
                               "--kv-events-topic", "kv")
    async with trio.open_nursery() as nursery:
        fed, client = await follow(nursery, engine_client, worker.address)
        await wait_for(lambda: fed.index.mode(worker.address) == "events")
        # batches the publisher sent before the subscription took come from the replay buffer
        await run(client, prompt(1, 40), "r1")
        await wait_for(lambda: fed.blocks(prompt(1, 40)) == 1)
        await run(client, prompt(2, 40), "r2")
        await wait_for(lambda: fed.blocks(prompt(2, 40)) == 1)
        assert fed.blocks(prompt(1, 40)) == 1 and fed.feed.stats.clears == 0
        nursery.cancel_scope.cancel()


async def test_the_replay_fills_in_what_was_published_before_the_subscription(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, *REVISION_1, "--kv-events-replay-port", "0")
    async with engine_client(worker.address) as early:
        await run(early, prompt(5), "before")
    async with trio.open_nursery() as nursery:
        fed, _ = await follow(nursery, engine_client, worker.address)
        await wait_for(lambda: fed.blocks(prompt(5)) == 3)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("revision", [REVISION_1, REVISION_3], ids=["zmq", "grpc"])
async def test_a_worker_restart_clears_its_entries_and_the_new_instance_is_followed(sim_workers, engine_client,
                                                                                  revision):
    port = free_port()
    first = sim_workers.start("aggregated", *FAST, *revision, "--port", str(port), "--instance-id", "one")
    async with trio.open_nursery() as nursery:
        fed, client = await follow(nursery, engine_client, first.address)
        await wait_for(lambda: fed.index.mode(first.address) == "events")
        await run(client, prompt(1), "before")
        await wait_for(lambda: fed.blocks(prompt(1)) == 3)
        first.process.stop()
        second = sim_workers.start("aggregated", *FAST, *revision, "--port", str(port), "--instance-id", "two")
        assert second.address == first.address
        await wait_for(lambda: fed.blocks(prompt(1)) == 0, what="the restart clears the index")
        await wait_for(lambda: fed.index.mode(first.address) == "events")
        async with engine_client(second.address) as fresh:
            await run(fresh, prompt(2), "after")
        await wait_for(lambda: fed.blocks(prompt(2)) == 3)
        assert fed.blocks(prompt(1)) == 0
        nursery.cancel_scope.cancel()


async def test_a_follow_that_ends_leaves_the_worker_approximate_with_no_event_entries(sim_workers, engine_client):
    """Nobody keeps the entries of a worker whose events are no longer followed (its follow task ended while it
    stays known): they are dropped and its mode is approximate, not "events" forever with what it held then."""
    worker = sim_workers.start("aggregated", *FAST, *REVISION_1)
    index = KvIndex()
    feed = KvEventFeed(index, retry_s=0.1, identity_check_s=0.2)
    async with trio.open_nursery() as nursery:
        client = await nursery.start(_open_client, engine_client, worker.address)
        following = trio.CancelScope()

        async def follow_until_cancelled():
            with following:
                await feed.follow(worker.address, client)
        nursery.start_soon(follow_until_cancelled)
        await wait_for(lambda: index.mode(worker.address) == "events")
        await run(client, prompt(1), "p")
        await wait_for(lambda: index.blocks(worker.address) == 3)
        following.cancel()
        await wait_for(lambda: index.mode(worker.address) == "approximate", timeout=2)
        assert index.blocks(worker.address) == 0
        nursery.cancel_scope.cancel()


async def test_an_invalid_source_sends_the_worker_to_approximate_mode_with_its_cause_logged(
        sim_workers, engine_client, caplog):
    worker = sim_workers.start("aggregated", *FAST, *REVISION_1)

    class WildcardSources:
        """The real worker, but its source says "0.0.0.0", which no subscriber can connect to."""

        def __init__(self, client):
            self._client = client

        def __getattr__(self, name):
            return getattr(self._client, name)

        async def kv_event_sources(self, ranks=(), *, timeout=10.0):
            sources = await self._client.kv_event_sources(ranks, timeout=timeout)
            for source in sources:
                source.endpoint_addr.host = "0.0.0.0"
            return sources

    index = KvIndex()
    feed = KvEventFeed(index, retry_s=0.1, identity_check_s=0.2)
    async with trio.open_nursery() as nursery:
        client = await nursery.start(_open_client, engine_client, worker.address)
        nursery.start_soon(feed.follow, worker.address, WildcardSources(client))
        await wait_for(lambda: feed.stats.invalid_sources == 1)
        assert index.mode(worker.address) == "approximate"
        assert "routable" in feed.detail[worker.address]
        # approximate mode answers from what we routed there
        keys = prompt_block_keys(prompt(1), BLOCK)
        index.routed((worker.address, 0), keys, trio.current_time())
        assert index.overlap(keys, trio.current_time()) == {(worker.address, 0): 3}
        nursery.cancel_scope.cancel()
    assert any("invalid KV event sources" in r.getMessage() and "0.0.0.0" in r.getMessage()
               for r in caplog.records)


async def test_a_worker_without_events_is_approximate(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST)  # events off: no sources
    async with trio.open_nursery() as nursery:
        fed, _ = await follow(nursery, engine_client, worker.address)
        await wait_for(lambda: "no KV events" in fed.feed.detail.get(worker.address, ""))
        assert fed.index.mode(worker.address) == "approximate"
        nursery.cancel_scope.cancel()


class RefusesKvEventStream(openengine_pb2_grpc.ControlServicer):
    """A revision-3 worker (stock grpc.aio) that advertises a grpc KV event source but does not serve
    SubscribeKvEvents: a stream nobody can follow until the worker changes (restarts)."""

    def __init__(self) -> None:
        self.instance_id = "refusing-1"
        self.subscriptions = 0

    async def Health(self, request, context):
        return lifecycle_pb2.HealthResponse(state=lifecycle_pb2.HEALTH_STATE_READY)

    async def GetServerInfo(self, request, context):
        return server_pb2.ServerInfo(
            engine_name="refusing", instance_id=self.instance_id, supported_models=["tiny-chat"], schema_revision=3,
            parallelism=server_pb2.ParallelismInfo(data_parallel_size=1),
            capacity=server_pb2.DeploymentCapacity(kv_block_size=BLOCK))

    async def GetModelInfo(self, request, context):
        return model_pb2.ModelInfo(model_id="tiny-chat", served_model_name="tiny-chat")

    async def GetKvEventSources(self, request, context):
        return kv_pb2.GetKvEventSourcesResponse(sources=[kv_pb2.KvEventSource(
            transport="grpc", data_parallel_rank=0, encoding="protobuf", schema_version=1)])

    async def SubscribeKvEvents(self, request, context):
        self.subscriptions += 1
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "SubscribeKvEvents is not served here")


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_a_stream_this_client_cannot_follow_leaves_the_worker_approximate_until_it_restarts(
        engine_client, transport):
    servicer = RefusesKvEventStream()
    index = KvIndex()
    feed = KvEventFeed(index, retry_s=0.05, identity_check_s=0.2)
    with grpc_aio_server(control=servicer) as worker:
        async with engine_client(worker.address, stream_transport=transport) as client, \
                trio.open_nursery() as nursery:
            await client.wait_until_ready(deadline=20)
            nursery.start_soon(feed.follow, worker.address, client)
            await wait_for(lambda: "cannot be followed" in feed.detail.get(worker.address, ""))
            clears = feed.stats.clears
            await trio.sleep(0.5)  # not tried again every retry_s: only a restart can change it
            assert index.mode(worker.address) == "approximate" and feed.stats.clears == clears
            assert servicer.subscriptions == 1
            servicer.instance_id = "refusing-2"  # restarted: its stream is tried again (and refused again)
            await wait_for(lambda: servicer.subscriptions == 2)
            assert index.mode(worker.address) == "approximate"
            nursery.cancel_scope.cancel()


async def test_image_blocks_from_zmq_events_match_the_keys_of_the_same_prompt(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, *REVISION_1, "--multimodal", "--kv-events-replay-port", "0")
    image = png_bytes(3, 3)
    # text ids stay below tiny-chat's vocabulary: the engine reads ids above it as an image's synthetic ids
    text = (*range(100, 150), IMAGE_TOKEN_ID, *range(200, 260))
    # the engine's sequence: the image's positions follow its placeholder
    engine_ids = (*text[:51], *([0] * IMAGE_TOKENS), *text[51:])
    by_bytes = [PromptImage(image_identity(data=image), 51, IMAGE_TOKENS)]
    other = [PromptImage(image_identity(data=png_bytes(4, 4)), 51, IMAGE_TOKENS)]
    media = [g.MediaItem(modality=g.MODALITY_IMAGE, data_uri=data_uri(image))]
    async with trio.open_nursery() as nursery:
        fed, client = await follow(nursery, engine_client, worker.address)
        await wait_for(lambda: fed.index.mode(worker.address) == "events")
        await run(client, text, "img", media=media)
        full = len(engine_ids) // BLOCK
        await wait_for(lambda: fed.blocks(engine_ids, by_bytes) == full)
        assert fed.blocks(engine_ids, other) == 51 // BLOCK  # another image: only the text before it
        assert fed.index.image_keys(worker.address)
        # how many positions the engine gave the image, learned from its events: what a prompt's layout needs
        assert fed.index.image_length(image_identity(data=image)) == IMAGE_TOKENS
        nursery.cancel_scope.cancel()


async def test_two_replicas_following_the_same_worker_agree(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, *REVISION_1, "--kv-events-replay-port", "0",
                               "--attention-dp-size", "2")
    async with trio.open_nursery() as nursery:
        one, client = await follow(nursery, engine_client, worker.address)
        two, _ = await follow(nursery, engine_client, worker.address)
        prompts = [prompt(i, 70 + 30 * i) for i in range(1, 5)]
        for i, ids_ in enumerate(prompts):
            await run(client, ids_, f"r{i}")
        await wait_for(lambda: all(one.blocks(p) == len(p) // BLOCK == two.blocks(p) for p in prompts))
        assert [one.held(p) for p in prompts] == [two.held(p) for p in prompts]
        nursery.cancel_scope.cancel()


# ---- the pool's hook ---------------------------------------------------------------------------------------

class StaticRegistry:
    """Snapshots pushed by the test."""

    def __init__(self, specs):
        self.send, self._receive = trio.open_memory_channel(10)
        self.first = Snapshot(frozenset(specs), True, "")

    async def run(self, publish):
        publish(self.first)
        async for snapshot in self._receive:
            publish(snapshot)


async def test_a_worker_that_leaves_the_pool_leaves_the_index_at_once(sim_workers, engine_client):
    from orchestrator.config import RoutingConfig
    from orchestrator.workers.pool import WorkerPool

    worker = sim_workers.start("aggregated", *FAST, *REVISION_1)
    spec = WorkerSpec(address=worker.address, role="aggregated")
    index = KvIndex()
    feed = KvEventFeed(index, retry_s=0.1, identity_check_s=0.2)
    registry = StaticRegistry([spec])
    async with LoopThread.open() as loop_thread, trio.open_nursery() as nursery:
        pool = WorkerPool(loop_thread=loop_thread, metrics=Metrics(), routing=RoutingConfig(), model="",
                          health_interval=0.1, removal_grace=30.0,
                          kv=KvRouting(index, feed, roles=(), follow_roles=("aggregated",)))
        await nursery.start(pool.run, registry)
        await wait_for(lambda: index.mode(worker.address) == "events")
        async with engine_client(worker.address) as client:
            await run(client, prompt(1), "p")
        keys = prompt_block_keys(prompt(1), BLOCK)
        await wait_for(lambda: index.overlap(keys, trio.current_time()))
        # a request still in flight keeps the worker retiring, but the index forgets it now
        with pool.lease(pool.workers[spec]):
            await registry.send.send(Snapshot(frozenset(), True, ""))
            await wait_for(lambda: not pool.workers)
            assert pool.retiring
            assert index.overlap(keys, trio.current_time()) == {}
            assert index.mode(worker.address) == "approximate" and index.blocks() == 0
            await trio.sleep(0.3)  # its follow task, still running until the worker retires, applies nothing
            assert index.blocks() == 0 and index.workers() == {}
        nursery.cancel_scope.cancel()


async def test_a_worker_that_leaves_the_pool_leaves_the_metrics(sim_workers):
    """Its per-worker KV series (the index's blocks and mode, the routed and cached prompt blocks) go with it:
    a fleet that churns does not grow /metrics without bound, nor show workers that are gone."""
    from orchestrator.config import RoutingConfig
    from orchestrator.workers.pool import WorkerPool

    worker = sim_workers.start("aggregated", *FAST, *REVISION_1)
    spec = WorkerSpec(address=worker.address, role="aggregated")
    metrics = Metrics()
    index = KvIndex()
    registry = StaticRegistry([spec])
    async with LoopThread.open() as loop_thread, trio.open_nursery() as nursery:
        feed = KvEventFeed(index, retry_s=0.1, identity_check_s=0.2)
        pool = WorkerPool(loop_thread=loop_thread, metrics=metrics, routing=RoutingConfig(aggregated="kv_aware"),
                          model="", health_interval=0.05, removal_grace=30.0,
                          kv=KvRouting(index, feed, roles=("aggregated",), follow_roles=("aggregated",)))
        await nursery.start(pool.run, registry)
        await wait_for(lambda: index.mode(worker.address) == "events" and pool.ready_count("aggregated"))
        pool.route("aggregated", prompt=prompt_block_keys(prompt(1), BLOCK))

        def series() -> list[str]:
            return [line for line in metrics.render().decode().splitlines()
                    if not line.startswith("#") and "_created" not in line and f'worker="{worker.address}"' in line]
        await wait_for(lambda: len(series()) == 5, what=str(series()))  # blocks, mode x 2, prompt and cached blocks
        await registry.send.send(Snapshot(frozenset(), True, ""))
        await wait_for(lambda: not pool.workers)
        assert series() == []
        await trio.sleep(0.2)  # its monitor, until it retires, does not bring them back
        assert series() == []
        nursery.cancel_scope.cancel()


class CountsServerInfo(RefusesKvEventStream):
    """Counts the ServerInfo reads it answers."""

    def __init__(self) -> None:
        super().__init__()
        self.server_infos = 0

    async def GetServerInfo(self, request, context):
        self.server_infos += 1
        return await super().GetServerInfo(request, context)


async def test_the_pool_is_the_one_reader_of_a_workers_identity_and_tells_the_feed_of_a_restart():
    """One ServerInfo poller per worker, the pool's identity check (every identity_interval): the feed of a worker
    waiting for its restart (a stream it cannot follow) learns of the restart from the pool, not by polling too."""
    from orchestrator.config import RoutingConfig
    from orchestrator.workers.pool import WorkerPool

    servicer = CountsServerInfo()
    index = KvIndex()
    feed = KvEventFeed(index, retry_s=0.05, identity_check_s=0.1)
    with grpc_aio_server(control=servicer) as server:
        address = f"grpc://{server.address}"
        async with LoopThread.open() as loop_thread, trio.open_nursery() as nursery:
            pool = WorkerPool(loop_thread=loop_thread, metrics=Metrics(), routing=RoutingConfig(), model="",
                              health_interval=0.05, kv=KvRouting(index, feed, roles=(), follow_roles=("aggregated",)))
            pool.monitor.identity_interval = 0.5
            await nursery.start(pool.run, StaticRegistry([WorkerSpec(address=address, role="aggregated")]))
            await wait_for(lambda: "cannot be followed" in feed.detail.get(address, ""))
            before = servicer.server_infos
            await trio.sleep(2.0)
            assert servicer.server_infos - before <= 5  # the pool's, one per 0.5 s; none of the feed's own
            assert servicer.subscriptions == 1
            servicer.instance_id = "refusing-2"  # restarted: the pool sees it and the feed subscribes again
            await wait_for(lambda: servicer.subscriptions == 2)
            nursery.cancel_scope.cancel()


class SendsAHugeKvEventMessage(RefusesKvEventStream):
    """A revision-3 worker whose SubscribeKvEvents sends one batch of ~5 MiB (200,000 stored blocks)."""

    async def SubscribeKvEvents(self, request, context):
        self.subscriptions += 1
        hashes = [kv_pb2.KvBlockHash(value=str(n).encode(), encoding="decimal_int64") for n in range(200_000)]
        yield kv_pb2.SubscribeKvEventsResponse(batch=kv_pb2.KvEventBatch(
            data_parallel_rank=0, sequence_number=1,
            events=[kv_pb2.KvEvent(block_stored=kv_pb2.BlockStored(block_hashes=hashes, token_ids=[7] * 400_000,
                                                                    block_size=2))]))
        await _asyncio_sleep(30)  # (the servicer runs on asyncio) the stream stays open


async def _asyncio_sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


@pytest.mark.parametrize("transport", ["h2", "grpcio"])
async def test_an_oversize_subscribe_kv_events_message_is_refused_unparsed(engine_client, transport):
    """Issue 43: the same flood through SubscribeKvEvents grew RSS from 73 to 658 MB. A message above the feed's
    limit (kv_event_codec.MAX_MESSAGE_BYTES) is not parsed: the worker's events are refused, /health says why."""
    metrics = Metrics()
    servicer = SendsAHugeKvEventMessage()
    index = KvIndex()
    feed = KvEventFeed(index, retry_s=5, identity_check_s=0.2, metrics=metrics)
    with grpc_aio_server(control=servicer) as worker:
        async with engine_client(worker.address, stream_transport=transport) as client, \
                trio.open_nursery() as nursery:
            await client.wait_until_ready(deadline=20)
            nursery.start_soon(feed.follow, worker.address, client)
            await wait_for(lambda: feed.stats.refused == 1)
            assert feed.detail[worker.address].startswith("KV events refused (oversize)")
            assert index.blocks(worker.address) == 0
            nursery.cancel_scope.cancel()
    assert metrics.kv_events_refused.labels(worker.address, "oversize")._value.get() == 1
