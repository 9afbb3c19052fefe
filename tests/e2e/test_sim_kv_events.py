"""The simulated worker's prefix cache and KV events, as real processes: what requests report, and the
events read back by a plain pyzmq subscriber (revision 1) and a plain gRPC subscriber (revision 3).

Upstream facts (NVIDIA/TensorRT-LLM, path @ commit), one per case that relies on it:
- R1-SOURCES: tensorrt_llm/grpc/openengine/control.py @06cb2191b0be and node.py @2361706f3283 `_source`:
  one ZMQ source per DP rank, transport "zmq", protocol "tcp", encoding "msgpack", schema_version 1,
  replay_endpoint "tcp://host:port"; ServerInfo.extra.trtllm_kv_event_hash_algo = "v2_sha256_64" only while
  events are on; SubscribeKvEvents UNIMPLEMENTED; no sources while events are off.
- R1-WIRE: tensorrt_llm/_torch/pyexecutor/kv_cache_events.py @13599e98c71c ZmqEventPublisher: frames
  (topic, 8-byte big-endian seq, msgpack [ts, events, rank]); seq reserved per published batch, so a lost
  batch is a gap; replay ROUTER answers (id, b"", start_seq) and ends with END_SEQ -1; events are maps with
  "type" (cpp/.../kv_cache_manager_v2/streamingEventSink.cpp @1454f28a18fa serializeBatch).
- HASH: tensorrt_llm/runtime/kv_cache_manager_v2/_block_radix_tree.py @065ff9e93780 (sha256 block keys),
  streamingEventSink.cpp wireHash (first 8 bytes, big-endian, signed).
- R3-SUBSCRIBE: tensorrt_llm/openengine/servicer.py @3a8b4f203346 GetKvEventSources / SubscribeKvEvents /
  _kv_batch and tensorrt_llm/serve/kv_event_fanout.py @48f2db0bbf03: transport "grpc", one event per batch,
  sequence per rank from 1, KvBlockHash(decimal text, "decimal_int64"), snapshot/replay UNIMPLEMENTED,
  events off FAILED_PRECONDITION.
"""

from __future__ import annotations

import grpc
import msgpack
import pytest
import trio
import zmq

from orchestrator.openengine.v1 import kv_pb2, openengine_pb2_grpc, server_pb2
from orchestrator.prefill import context_only_leg
from orchestrator.sim.kv_events import proto_event, wire_batch, wire_event
from orchestrator.sim.prefix_cache import ROOT_KEY, BlockRemoved, BlockStored, MmKey, block_key, wire_hash
from sim_helpers import PrefillReady, collect, full_request, terminal, token_ids

FAST = ("--time-scale", "0")
BLOCK = 32  # the default profile's kv_block_size
SYSTEM = tuple(range(1000, 1100))  # 100 shared tokens: 3 full blocks


def attr(load, name):
    return load.attributes.fields[name].number_value


def control(worker):
    channel = grpc.insecure_channel(worker.target)
    return channel, openengine_pb2_grpc.ControlStub(channel)


def expected_hashes(sequence) -> list[int]:
    """The wire hashes of every full block of `sequence`, recomputed from the upstream key rule."""
    key, hashes = ROOT_KEY, []
    for start in range(0, len(sequence) - len(sequence) % BLOCK, BLOCK):
        key = block_key(key, sequence[start:start + BLOCK])
        hashes.append(wire_hash(key))
    return hashes


def cached_sequence(prompt, events) -> tuple[int, ...]:
    """What a finished request leaves cached: its prompt and every output token but the last."""
    return (*prompt, *token_ids(events)[:-1])


def zmq_messages(endpoint: str, count: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    """A plain synchronous pyzmq SUB: the first `count` messages (run in a thread)."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sub.connect(endpoint)
    try:
        return [sub.recv_multipart() for _ in range(count)]
    finally:
        sub.close(linger=0)
        context.term()


def zmq_replay(endpoint: str, start: int) -> list[list[bytes]]:
    """Ask a replay ROUTER for every batch from `start`: frames until the END_SEQ marker."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                return replies
    finally:
        dealer.close(linger=0)
        context.term()


def live_hashes(batches) -> set[int]:
    """Replay the events of decoded msgpack batches into the set of blocks a subscriber believes cached."""
    live: set[int] = set()
    for _, events, _ in batches:
        for event in events:
            if event["type"] == "BlockStored":
                live.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                live.difference_update(event["block_hashes"])
    return live


def zmq_source(worker) -> kv_pb2.KvEventSource:
    channel, stub = control(worker)
    with channel:
        (source,) = stub.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest()).sources
    return source


async def start_subscriber(nursery, read, *args) -> list:
    """Run the blocking subscriber `read(*args)` in a thread; the list its messages land in, once connected."""
    received: list = []

    async def subscribe():
        received.extend(await trio.to_thread.run_sync(read, *args))

    nursery.start_soon(subscribe)
    await trio.sleep(0.5)  # PUB/SUB and a fresh stream: what is published before the subscription lands is not seen
    return received


# ---- the encoders, pure -----------------------------------------------------------------------------------

def test_an_image_block_goes_out_with_its_digest_as_hex_and_its_segments_on_zmq_but_fails_closed_on_grpc():
    digest = bytes(range(32))
    stored = BlockStored((-5,), 7, (1, digest, 1001, 1002), 4, ((MmKey(digest.hex(), 0),),))
    assert wire_event(stored, mm_keys=True) == {
        "type": "BlockStored", "block_hashes": [-5], "parent_block_hash": 7, "token_ids": [1, digest.hex(), 1001, 1002],
        "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
        "mm_keys": [[{"type": "mm_key", "hash": digest.hex(), "start_offset": 0}]]}
    assert "mm_keys" not in wire_event(stored, mm_keys=False)
    # _kv_batch: a block whose tokens are not all integers cannot be represented; the index is cleared instead
    assert proto_event(stored).WhichOneof("event") == "all_blocks_cleared"
    text = proto_event(BlockStored((-5,), None, (1, 2, 3, 4), 4))
    assert text.block_stored.block_hashes[0] == kv_pb2.KvBlockHash(value=b"-5", encoding="decimal_int64")
    assert msgpack.unpackb(wire_batch([BlockRemoved((3,))], 1, timestamp=2.5, mm_keys=False)) == [
        2.5, [{"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}], 1]


# ---- the prefix cache as requests see it ------------------------------------------------------------------

async def test_a_second_request_sharing_a_prefix_reports_cached_tokens_and_costs_less_prefill(sim_workers,
                                                                                             engine_client):
    worker = sim_workers.start("aggregated", *FAST)
    async with engine_client(worker.address) as client:
        first = terminal(await collect(client, full_request("t1", ids=SYSTEM + (1, 2, 3))))
        after_first = await client.load()
        second = terminal(await collect(client, full_request("t2", ids=SYSTEM + (7, 8, 9, 10))))
        after_second = await client.load()
    assert first.usage.cached_prompt_tokens == 0 and second.usage.cached_prompt_tokens == 96
    assert second.usage.prompt_tokens == 104
    first_ms = attr(after_first, "prefill_ms_total")
    second_ms = attr(after_second, "prefill_ms_total") - first_ms
    assert attr(after_second, "prefill_tokens_computed") - attr(after_first, "prefill_tokens_computed") == 8
    assert 0 < second_ms < first_ms  # the cost model priced 8 tokens, not 104
    assert attr(after_second, "cached_prompt_tokens_total") == 96


async def test_the_prefill_reports_cached_tokens_in_prefill_ready_and_no_prefix_cache_turns_it_off(
        sim_workers, engine_client):
    cached = sim_workers.start("prefill", *FAST)
    uncached = sim_workers.start("prefill", *FAST, "--no-prefix-cache")
    async with engine_client(cached.address) as on, engine_client(uncached.address) as off:
        for client in (on, off):
            await collect(client, context_only_leg(full_request("a", ids=SYSTEM + (1,))))
        ready_on = terminal(await collect(on, context_only_leg(full_request("b", ids=SYSTEM + (2,)))))
        ready_off = terminal(await collect(off, context_only_leg(full_request("b", ids=SYSTEM + (2,)))))
    assert isinstance(ready_on, PrefillReady) and ready_on.usage is not None
    assert ready_on.usage.cached_prompt_tokens == 96
    assert isinstance(ready_off, PrefillReady) and ready_off.usage is not None
    assert ready_off.usage.cached_prompt_tokens == 0


# ---- revision 1: ZMQ ------------------------------------------------------------------------------------------

async def test_revision_1_advertises_one_zmq_source_per_rank_only_while_events_are_on(sim_workers):
    off = sim_workers.start("aggregated", *FAST)
    on = sim_workers.start("aggregated", *FAST, "--kv-events", "--kv-events-replay-port", "0",
                           "--kv-events-topic", "kv", "--attention-dp-size", "2")
    channel, stub = control(off)
    with channel:
        assert list(stub.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest()).sources) == []
        assert "trtllm_kv_event_hash_algo" not in stub.GetServerInfo(server_pb2.GetServerInfoRequest()).extra.fields
    channel, stub = control(on)
    with channel:
        sources = list(stub.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest()).sources)
        info = stub.GetServerInfo(server_pb2.GetServerInfoRequest())
        only_one = stub.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest(data_parallel_ranks=[1, 1])).sources
        with pytest.raises(grpc.RpcError) as unknown:
            stub.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest(data_parallel_ranks=[2]))
        with pytest.raises(grpc.RpcError) as subscribe:
            next(iter(stub.SubscribeKvEvents(kv_pb2.SubscribeKvEventsRequest())))
    assert info.extra.fields["trtllm_kv_event_hash_algo"].string_value == "v2_sha256_64"
    assert info.parallelism.data_parallel_size == 2
    assert [s.data_parallel_rank for s in sources] == [0, 1] and [s.data_parallel_rank for s in only_one] == [1]
    for source in sources:
        assert (source.transport, source.encoding, source.schema_version, source.topic) == ("zmq", "msgpack", 1, "kv")
        assert source.endpoint_addr.host == "127.0.0.1" and source.endpoint_addr.protocol == "tcp"
        assert source.replay_endpoint.startswith("tcp://127.0.0.1:")
        assert (source.buffer_steps, source.hwm, source.max_queue_size) == (10_000, 100_000, 100_000)
    assert len({s.endpoint_addr.port for s in sources}) == 2
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert subscribe.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_revision_1_events_read_by_a_plain_zmq_subscriber_match_the_cache(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--kv-events", "--kv-events-replay-port", "0",
                               "--kv-events-topic", "kv", "--total-kv-blocks", "10")
    source = zmq_source(worker)
    endpoint = f"tcp://{source.endpoint_addr.host}:{source.endpoint_addr.port}"
    async with engine_client(worker.address) as client, trio.open_nursery() as nursery:
        received = await start_subscriber(nursery, zmq_messages, endpoint, 3)
        # batch 0: the first prompt's 3 blocks; batch 1: the block its answer filled; batch 2: the second
        # request needs 7 of the 6 free blocks, so that answer block is evicted, then its own 6 are stored
        prompts = [SYSTEM + (1,), tuple(range(3000, 3200))]
        answers = [await collect(client, full_request("z0", ids=prompts[0], max_tokens=40)),
                   await collect(client, full_request("z1", ids=prompts[1], max_tokens=8))]
        load = await client.load()
    assert [frames[0] for frames in received] == [b"kv"] * 3
    assert [int.from_bytes(frames[1], "big") for frames in received] == [0, 1, 2]
    batches = [msgpack.unpackb(frames[2]) for frames in received]
    timestamp, events, rank = batches[0]
    assert isinstance(timestamp, float) and rank == 0
    assert events == [{"type": "BlockStored", "block_hashes": expected_hashes(prompts[0]),
                       "parent_block_hash": None, "token_ids": list(prompts[0][:96]), "block_size": BLOCK,
                       "lora_id": None, "medium": "GPU", "lora_name": None}]
    answer_block = expected_hashes(cached_sequence(prompts[0], answers[0]))[3]
    assert batches[1][1] == [{"type": "BlockStored", "block_hashes": [answer_block],
                              "parent_block_hash": expected_hashes(prompts[0])[-1],
                              "token_ids": list(cached_sequence(prompts[0], answers[0])[96:128]),
                              "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None}]
    assert batches[2][1][0] == {"type": "BlockRemoved", "block_hashes": [answer_block], "medium": "GPU"}
    # what a subscriber believes cached is what the worker holds
    holds = set(expected_hashes(prompts[0])) | set(expected_hashes(cached_sequence(prompts[1], answers[1])))
    assert live_hashes(batches) == holds and len(holds) == attr(load, "cached_blocks") == 9
    # the replay socket hands back the same batches, then END_SEQ (a DEALER sees b"", topic, seq, payload)
    replayed = zmq_replay(source.replay_endpoint, 1)
    assert [f[1] for f in replayed[:-1]] == [b"kv", b"kv"]
    assert [int.from_bytes(f[2], "big") for f in replayed[:-1]] == [1, 2]
    assert [f[3] for f in replayed[:-1]] == [frames[2] for frames in received[1:]]
    assert replayed[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


async def test_the_drop_fault_shows_as_a_sequence_gap_on_zmq(sim_workers, engine_client):
    worker = sim_workers.start("aggregated", *FAST, "--kv-events", "--drop-kv-events", "2")
    source = zmq_source(worker)
    endpoint = f"tcp://{source.endpoint_addr.host}:{source.endpoint_addr.port}"
    async with engine_client(worker.address) as client, trio.open_nursery() as nursery:
        received = await start_subscriber(nursery, zmq_messages, endpoint, 2)
        for i in range(4):  # one stored batch each
            await collect(client, full_request(f"g{i}", ids=tuple(range(i * 100, i * 100 + 40)), max_tokens=2))
        load = await client.load()
    assert [int.from_bytes(frames[1], "big") for frames in received] == [0, 2]  # 1 and 3 were lost
    assert attr(load, "kv_event_batches_dropped") == 2 and attr(load, "kv_event_batches_published") == 2


# ---- revision 3: gRPC --------------------------------------------------------------------------------------

def grpc_batches(target: str, count: int) -> list:
    """A plain grpcio subscriber: the first `count` batches of SubscribeKvEvents (run in a thread)."""
    with grpc.insecure_channel(target) as channel:
        stream = openengine_pb2_grpc.ControlStub(channel).SubscribeKvEvents(kv_pb2.SubscribeKvEventsRequest(),
                                                                            timeout=20)
        batches = []
        for response in stream:
            batches.append(response.batch)
            if len(batches) == count:
                stream.cancel()
                return batches
    return batches


def decimal_hashes(hashes) -> list[int]:
    assert all(h.encoding == "decimal_int64" for h in hashes)
    return [int(h.value.decode("ascii")) for h in hashes]


async def test_revision_3_serves_events_over_grpc_numbered_from_1_and_matching_the_cache(sim_workers,
                                                                                         engine_client):
    revision_3 = ("--schema-revision", "3", "--kv-events", "--total-kv-blocks", "10")
    worker = sim_workers.start("aggregated", *FAST, *revision_3)
    channel, stub = control(worker)
    with channel:
        (source,) = stub.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest()).sources
        with pytest.raises(grpc.RpcError) as snapshot:
            next(iter(stub.SubscribeKvEvents(kv_pb2.SubscribeKvEventsRequest(include_snapshot=True))))
        with pytest.raises(grpc.RpcError) as unknown:
            next(iter(stub.SubscribeKvEvents(kv_pb2.SubscribeKvEventsRequest(data_parallel_ranks=[3]))))
        assert "trtllm_kv_event_hash_algo" not in stub.GetServerInfo(server_pb2.GetServerInfoRequest()).extra.fields
    assert (source.transport, source.encoding, source.endpoint_addr.protocol) == ("grpc", "protobuf", "grpc")
    assert source.endpoint_addr.port == int(worker.target.rsplit(":", 1)[1]) and source.max_queue_size == 1024
    assert snapshot.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    prompts = [SYSTEM + (1,), tuple(range(3000, 3200))]
    async with engine_client(worker.address) as client, trio.open_nursery() as nursery:
        received = await start_subscriber(nursery, grpc_batches, worker.target, 4)
        answers = [await collect(client, full_request("r0", ids=prompts[0], max_tokens=40)),
                   await collect(client, full_request("r1", ids=prompts[1], max_tokens=8))]
        load = await client.load()
    assert [b.sequence_number for b in received] == [1, 2, 3, 4] and all(len(b.events) == 1 for b in received)
    events = [b.events[0] for b in received]
    assert [e.WhichOneof("event") for e in events] == ["block_stored", "block_stored", "block_removed",
                                                      "block_stored"]
    first = events[0].block_stored
    assert decimal_hashes(first.block_hashes) == expected_hashes(prompts[0])
    assert list(first.token_ids) == list(prompts[0][:96]) and first.block_size == BLOCK
    assert not first.HasField("parent_block_hash") and first.medium == kv_pb2.STORAGE_MEDIUM_GPU
    answer_block = expected_hashes(cached_sequence(prompts[0], answers[0]))[3]
    assert decimal_hashes(events[1].block_stored.block_hashes) == [answer_block]
    assert decimal_hashes([events[1].block_stored.parent_block_hash]) == expected_hashes(prompts[0])[-1:]
    assert decimal_hashes(events[2].block_removed.block_hashes) == [answer_block]
    live = {h for e in (events[0], events[1], events[3]) for h in decimal_hashes(e.block_stored.block_hashes)}
    live.discard(answer_block)
    holds = set(expected_hashes(prompts[0])) | set(expected_hashes(cached_sequence(prompts[1], answers[1])))
    assert live == holds and len(holds) == attr(load, "cached_blocks") == 9


async def test_revision_3_refuses_a_subscription_while_events_are_off_and_drops_show_as_gaps(sim_workers,
                                                                                            engine_client):
    off = sim_workers.start("aggregated", *FAST, "--schema-revision", "3")
    channel, stub = control(off)
    with channel:
        assert list(stub.GetKvEventSources(kv_pb2.GetKvEventSourcesRequest()).sources) == []
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(stub.SubscribeKvEvents(kv_pb2.SubscribeKvEventsRequest())))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    lossy = sim_workers.start("aggregated", *FAST, "--schema-revision", "3", "--kv-events", "--drop-kv-events", "3")
    async with engine_client(lossy.address) as client, trio.open_nursery() as nursery:
        received = await start_subscriber(nursery, grpc_batches, lossy.target, 3)
        for i in range(4):
            await collect(client, full_request(f"g{i}", ids=tuple(range(i * 100, i * 100 + 40)), max_tokens=2))
    assert [b.sequence_number for b in received] == [1, 2, 4]
