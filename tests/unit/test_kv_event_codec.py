"""The KV events as values (orchestrator/workers/kv_event_codec.py), without sockets: which sources are followed,
what a batch says, what is refused, and what one worker can make the index hold."""

from __future__ import annotations

import os
from typing import cast

import msgpack
import pytest

from orchestrator.log import MAX_CAUSE_CHARS
from orchestrator.openengine.v1 import kv_pb2
from orchestrator.workers import kv_event_codec as codec
from orchestrator.workers.kv_event_codec import (
    MAX_SOURCES,
    Batch,
    InvalidKvSource,
    KvStreamBroken,
    Stored,
    ZmqSource,
    apply,
    apply_now,
    decode_proto_batch,
    decode_wire_batch,
    rank_bound,
    validate_sources,
)
from orchestrator.workers.kv_index import KvIndex, prompt_block_keys


def apply_wire_events(index: KvIndex, where: tuple[str, int], events: list) -> bool:
    """Apply revision-1 wire events as one batch of rank where[1]; whether its image blocks are keyed."""
    batch = decode_wire_batch(msgpack.packb([1.0, events, where[1]]), where[1])
    apply_now(index, where, batch)
    return batch.image_keys


def zmq_source(**changes) -> kv_pb2.KvEventSource:
    source = kv_pb2.KvEventSource(transport="zmq", endpoint_addr=kv_pb2.KvEndpoint(host="10.0.0.5", port=5557,
                                  protocol="tcp"), topic="kv", replay_endpoint="tcp://10.0.0.5:5560",
                                  data_parallel_rank=0, encoding="msgpack", schema_version=1)
    for name, value in changes.items():
        if name in ("host", "port", "protocol"):
            setattr(source.endpoint_addr, name, value)
        elif value is None:
            source.ClearField(name)
        else:
            setattr(source, name, value)
    return source


def test_a_valid_zmq_source_per_rank_is_accepted_with_its_endpoints():
    sources = [zmq_source(data_parallel_rank=1, port=5558, replay_endpoint=""), zmq_source()]
    assert validate_sources(sources, 2, 32) == [
        ZmqSource(0, "tcp://10.0.0.5:5557", b"kv", "tcp://10.0.0.5:5560"),
        ZmqSource(1, "tcp://10.0.0.5:5558", b"kv", "")]
    assert cast(ZmqSource, validate_sources([zmq_source(host="fd00::1")], 1, 32)[0]).endpoint == "tcp://[fd00::1]:5557"
    assert validate_sources([], 1, None) == []  # events off: nothing to follow, not an error


@pytest.mark.parametrize("changes, cause", [
    ({"transport": "nats"}, "transport"),
    ({"encoding": "json"}, "msgpack"),
    ({"schema_version": 2}, "schema_version"),
    ({"data_parallel_rank": None}, "omitted data_parallel_rank"),
    ({"data_parallel_rank": 1}, "outside"),
    ({"host": "*"}, "routable"),
    ({"host": "0.0.0.0"}, "routable"),
    ({"host": "::"}, "routable"),
    ({"host": ""}, "routable"),
    ({"port": 0}, "routable"),
    ({"protocol": "ipc"}, "routable"),
    ({"replay_endpoint": "tcp://*:5560"}, "replay"),
])
def test_an_invalid_source_is_refused_as_dynamos_sidecar_refuses_it(changes, cause):
    with pytest.raises(InvalidKvSource, match=cause):
        validate_sources([zmq_source(**changes)], 1, 32)


def test_sources_must_cover_every_rank_once_and_need_a_block_size():
    with pytest.raises(InvalidKvSource, match="2 data-parallel ranks"):
        validate_sources([zmq_source()], 2, 32)
    with pytest.raises(InvalidKvSource, match="duplicate rank 0"):
        validate_sources([zmq_source(), zmq_source(port=5558)], 2, 32)
    with pytest.raises(InvalidKvSource, match="kv_block_size"):
        validate_sources([zmq_source()], 1, None)
    grpc = kv_pb2.KvEventSource(transport="grpc", data_parallel_rank=0, encoding="protobuf", schema_version=1)
    with pytest.raises(InvalidKvSource, match="mix"):
        validate_sources([zmq_source(), grpc], 2, 32)
    assert [s.rank for s in validate_sources([grpc], 1, 32)] == [0]


def test_wire_events_are_applied_and_bad_payloads_break_the_stream():
    index = KvIndex()
    tokens = list(range(64))
    events = [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": tokens,
               "block_size": 32, "lora_id": None, "medium": "GPU", "lora_name": None}]
    assert apply_wire_events(index, ("w", 0), events)
    keys = prompt_block_keys(tokens, 32)
    assert index.overlap(keys, 0.0) == {("w", 0): 2}
    # another tier's copy of the same blocks is not the GPU's: neither stored nor removed here
    apply_wire_events(index, ("w", 0), [{"type": "BlockRemoved", "block_hashes": [12], "medium": "CPU"}])
    assert index.overlap(keys, 0.0) == {("w", 0): 2}
    apply_wire_events(index, ("w", 0), [{"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}])
    assert index.overlap(keys, 0.0) == {("w", 0): 1}
    apply_wire_events(index, ("w", 0), [{"type": "AllBlocksCleared"}])
    assert index.overlap(keys, 0.0) == {}
    # an image position without mm_keys: not keyed from events (the worker's images go approximate)
    image = [{"type": "BlockStored", "block_hashes": [13], "parent_block_hash": None, "block_size": 2,
              "token_ids": [1, "ab" * 32], "lora_id": None, "medium": "GPU", "lora_name": None}]
    assert apply_wire_events(index, ("w", 0), image) is False
    for bad in (b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, "events", 0])):
        with pytest.raises(KvStreamBroken):
            decode_wire_batch(bad, 0)
    with pytest.raises(KvStreamBroken, match="unknown KV event type"):
        apply_wire_events(index, ("w", 0), [{"type": "Snapshot"}])
    with pytest.raises(KvStreamBroken, match="cannot be keyed"):
        apply_wire_events(index, ("w", 0), [{**events[0], "token_ids": tokens[:40]}])


def test_a_malformed_revision_3_event_breaks_the_stream_not_the_server():
    """A hash that is not decimal text raised ValueError out of the follow task and through the pool's
    nursery; like a malformed revision-1 event, it is a broken stream (cleared, followed anew)."""
    event = kv_pb2.KvEvent(block_removed=kv_pb2.BlockRemoved(
        block_hashes=[kv_pb2.KvBlockHash(value=b"not-a-number", encoding="decimal_int64")]))
    with pytest.raises(KvStreamBroken, match="malformed"):
        decode_proto_batch(kv_pb2.KvEventBatch(data_parallel_rank=0, events=[event]), [0])


# ---- what a worker sends is not taken on trust (issue 43) --------------------------------------------------------

def stored_event(first_hash: int, blocks: int, block_size: int = 4, parent: int | None = None) -> dict:
    return {"type": "BlockStored", "block_hashes": list(range(first_hash, first_hash + blocks)),
            "parent_block_hash": parent, "token_ids": [7] * (blocks * block_size), "block_size": block_size,
            "lora_id": None, "medium": "GPU", "lora_name": None}


@pytest.mark.parametrize("rank", [99, -1, "zero", 1.0, True, [0]])
def test_a_batch_naming_another_rank_than_its_sockets_is_refused(rank):
    payload = msgpack.packb([1.0, [stored_event(1, 1)], rank])
    with pytest.raises(KvStreamBroken) as refused:
        decode_wire_batch(payload, 0)
    assert refused.value.reason == "bad_rank"


def test_a_batch_of_its_own_rank_or_without_one_is_taken():
    for payload in (msgpack.packb([1.0, [], 3]), msgpack.packb([1.0, [], None]), msgpack.packb([1.0, []])):
        assert decode_wire_batch(payload, 3) == Batch(())


def test_a_revision_3_batch_of_a_rank_we_did_not_subscribe_to_is_refused():
    with pytest.raises(KvStreamBroken) as refused:
        decode_proto_batch(kv_pb2.KvEventBatch(data_parallel_rank=99), [0, 1])
    assert refused.value.reason == "bad_rank"


def test_an_oversize_payload_is_refused_before_it_is_decoded():
    payload = msgpack.packb([1.0, [stored_event(1, 1)], 0]) + b"\0" * codec.MAX_MESSAGE_BYTES
    with pytest.raises(KvStreamBroken) as refused:
        decode_wire_batch(payload, 0)
    assert refused.value.reason == "oversize" and len(str(refused.value)) < 200


def test_a_malformed_payloads_cause_is_bounded_whatever_it_carried():
    """A 20 MB malformed payload became a 73 MB /health body and a 60 MB log line (the decoder's repr)."""
    huge = "x" * 3_000_000
    for payload in (msgpack.packb([1.0, [{"type": huge}], 0]), msgpack.packb([1.0, [{**stored_event(1, 1),
                                                                                     "block_hashes": [huge]}], 0])):
        with pytest.raises(KvStreamBroken) as refused:
            decode_wire_batch(payload, 0)
        assert refused.value.reason == "malformed" and len(str(refused.value)) <= MAX_CAUSE_CHARS


@pytest.mark.parametrize("field, value", [("block_hashes", "12"), ("block_hashes", [1.5]), ("token_ids", 7),
                                          ("block_size", "4"), ("parent_block_hash", "p"), ("mm_keys", [[{"x": 1}]])])
def test_a_field_of_the_wrong_kind_is_malformed_not_a_crash(field, value):
    with pytest.raises(KvStreamBroken) as refused:
        decode_wire_batch(msgpack.packb([1.0, [{**stored_event(1, 1), field: value}], 0]), 0)
    assert refused.value.reason == "malformed"


def test_the_rank_bound_follows_what_the_worker_says_it_holds_with_a_margin():
    assert rank_bound(12_000, 1) == 2 * 12_000 + codec.RANK_MARGIN_BLOCKS
    assert rank_bound(None, 1) == codec.DEFAULT_RANK_BOUND
    assert rank_bound(10**12, 1) == codec.MAX_RANK_BOUND  # a worker may claim any capacity
    assert rank_bound(10**12, MAX_SOURCES) * MAX_SOURCES <= codec.MAX_WORKER_BOUND


def test_a_batch_that_would_take_a_rank_above_its_bound_is_refused_whole():
    index = KvIndex()
    apply_now(index, ("w", 0), decode_wire_batch(msgpack.packb([1.0, [stored_event(1, 90)], 0]), 0), bound=100)
    flood = decode_wire_batch(msgpack.packb([1.0, [stored_event(1000, 20)], 0]), 0)
    with pytest.raises(KvStreamBroken) as refused:
        apply_now(index, ("w", 0), flood, bound=100)
    assert refused.value.reason == "over_bound" and index.rank_blocks(("w", 0)) == 90


def test_a_flood_of_batches_never_holds_more_than_the_bound_nor_grows_memory_by_its_size():
    """Issue 43: BlockStored for 20 s grew one worker's index to 24,338,316 blocks (it reports 12,000) and RSS
    from 73 MB to 5.2 GB. Each refusal clears the rank (the feed does: _follow_once), as here."""
    bound = rank_bound(12_000, 1)
    index = KvIndex()
    before = _rss_kb()
    refusals, next_hash = 0, 1
    for _ in range(400):  # 400 batches of 2,000 blocks: 800,000 blocks offered, 32x the bound
        batch = decode_wire_batch(msgpack.packb([1.0, [stored_event(next_hash, 2000, block_size=2)], 0]), 0)
        next_hash += 2000
        try:
            apply_now(index, ("w", 0), batch, bound=bound)
        except KvStreamBroken:
            refusals += 1
            index.cleared("w", 0)
        assert index.rank_blocks(("w", 0)) <= bound
    grown_kb = _rss_kb() - before
    assert refusals >= 400 // (bound // 2000 + 1) - 1
    # 800,000 entries would take well over 100 MB; bounded, the index never holds more than ~25,000
    assert grown_kb < 60_000, grown_kb


def _rss_kb() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def test_a_big_batch_is_applied_in_slices():
    index = KvIndex()
    batch = decode_wire_batch(msgpack.packb([1.0, [stored_event(1, 3 * codec.SLICE_BLOCKS + 5, block_size=2)], 0]), 0)
    slices = sum(1 for _ in apply(index, ("w", 0), batch, bound=10**6))
    assert slices >= 3 and index.rank_blocks(("w", 0)) == 3 * codec.SLICE_BLOCKS + 5
    # sliced or whole, the same keys: a prompt of those tokens finds every block
    whole = KvIndex()
    apply_now(whole, ("w", 0), Batch((Stored(list(range(1, 11)), None, [7] * 20, 2),)))
    keys = prompt_block_keys([7] * 20, 2)
    assert whole.overlap(keys, 0.0) == index.overlap(keys, 0.0) == {("w", 0): 10}


def test_more_sources_than_we_follow_per_worker_are_refused_saying_why():
    sources = [zmq_source(data_parallel_rank=rank, port=5000 + rank, replay_endpoint="")
               for rank in range(MAX_SOURCES + 1)]
    with pytest.raises(InvalidKvSource, match=f"at most {MAX_SOURCES}"):
        validate_sources(sources, MAX_SOURCES + 1, 32)
    with pytest.raises(InvalidKvSource, match=f"at most {MAX_SOURCES}"):
        validate_sources(sources[:1], 12_000, 32)  # a data-parallel size no worker has
