"""The engines' KV events as values, pure: which sources to follow, what a batch says, and how much of it the index
may take. No sockets, no clock: kv_events.py carries the bytes (ZMQ, gRPC) and feeds the index through this.

Where they come from, as each TensorRT-LLM server offers them (orchestrator/sim/kv_events.py has the wire
details and the upstream commits):
- revision 1 (tensorrt_llm/grpc/openengine, merged): Control.GetKvEventSources names one ZMQ publisher per
  rank (transport "zmq", encoding "msgpack", schema_version 1); each message is three frames (topic, 8-byte
  big-endian sequence number, msgpack [timestamp, events, rank]).
- revision 3 (tensorrt_llm/openengine, open PR #16336; its KV events open PR #19440): GetKvEventSources
  names the gRPC server itself (transport "grpc", encoding "protobuf"), and Control.SubscribeKvEvents
  streams KvEventBatch messages numbered per rank from 1.

Sources are validated as Dynamo's TensorRT-LLM sidecar does (ai-dynamo/dynamo lib/sidecar/trtllm/src/
engine.rs @ e419430b8943, open PRs #14349/#15087: validate_kv_sources / validate_kv_source): transport zmq
with encoding msgpack, schema_version 1, a rank inside the engine's data-parallel size, one source per
rank and no duplicates, a tcp endpoint with a routable host (not empty, "*", "0.0.0.0" or "::") and a
port; and at most MAX_SOURCES of them (each is a socket: 12,000 advertised ranks exhausted our descriptors).

Nothing a worker sends is taken on trust (issue 43): a message above MAX_MESSAGE_BYTES is refused (ZMQ refuses it
itself: ZMQ_MAXMSGSIZE), a batch whose own rank field names another rank is refused, and a rank may hold at most
`rank_bound(total_kv_blocks)` blocks in the index, tied to what the worker says it can hold, with a margin. A
refusal is a KvStreamBroken whose `reason` is one of REFUSALS (the metric's label); the feed clears the worker
and follows it anew. Big batches are applied in slices (`apply`), so that the feed yields between them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import msgpack

from orchestrator.log import bounded
from orchestrator.workers.adapters import MAX_ADAPTER_NAME
from orchestrator.workers.kv_index import EventBlockError, KvIndex, MmSegment

END_SEQ = -1
NOT_ROUTABLE_HOSTS = frozenset({"", "*", "0.0.0.0", "::"})
SCHEMA_VERSION = 1
MAX_SOURCES = 32  # per worker: one socket (ZMQ) per attention-DP rank
# One message (a ZMQ payload, a SubscribeKvEventsResponse): an engine publishes a batch per scheduler iteration,
# kilobytes; a 128k-token prompt's BlockStored is well under 1 MiB.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Messages our ZMQ subscriber queues before it drops (which shows as a sequence gap): ours, not the hwm the
# worker advertises. With MAX_MESSAGE_BYTES, what one rank can make us queue.
RECEIVE_HWM = 32
# A rank's event entries: twice what the worker says it holds (total_kv_blocks) plus some, so that a worker
# honest about its cache is never refused; without a capacity, DEFAULT_RANK_BOUND; never above MAX_RANK_BOUND
# (a worker may claim any capacity), nor above MAX_WORKER_BOUND over all of a worker's ranks.
RANK_MARGIN_BLOCKS = 1024
DEFAULT_RANK_BOUND = 200_000
MAX_RANK_BOUND = 1_000_000
MAX_WORKER_BOUND = 2_000_000
SLICE_BLOCKS = 128  # blocks applied between two yields of the event loop (a millisecond or two)
REFUSALS = ("oversize", "over_bound", "bad_rank", "malformed", "lost")


class InvalidKvSource(ValueError):
    """GetKvEventSources named something we cannot (or must not) subscribe to."""


class KvStreamBroken(Exception):
    """The event stream lost continuity, or we refused what it sent (the caller clears and starts again).
    `reason`: one of REFUSALS when we refused it, "" when the stream just broke."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(bounded(message))
        self.reason = reason


@attrs.frozen
class ZmqSource:
    rank: int
    endpoint: str  # tcp://host:port
    topic: bytes
    replay_endpoint: str  # "" when not advertised


@attrs.frozen
class GrpcSource:
    rank: int


# ---- validation -------------------------------------------------------------------------------------------

def validate_sources(sources: Sequence[Any], data_parallel_size: int, kv_block_size: int | None
                     ) -> list[ZmqSource] | list[GrpcSource]:
    """The sources of one worker, checked as Dynamo's sidecar checks them; raises InvalidKvSource."""
    if not sources:
        return []
    if len(sources) > MAX_SOURCES or data_parallel_size > MAX_SOURCES:
        raise InvalidKvSource(f"{len(sources)} sources for {data_parallel_size} data-parallel ranks: we follow at "
                              f"most {MAX_SOURCES} per worker (each is a socket)")
    if not kv_block_size or kv_block_size < 1:
        raise InvalidKvSource("KV events need a positive ServerInfo.capacity.kv_block_size")
    transports = {source.transport for source in sources}
    if len(transports) != 1:
        raise InvalidKvSource(bounded(f"sources mix transports {sorted(transports)}"))
    ranks: set[int] = set()
    result: list = []
    for source in sources:
        rank = _checked_rank(source, data_parallel_size)
        if rank in ranks:
            raise InvalidKvSource(f"GetKvEventSources returned duplicate rank {rank}")
        ranks.add(rank)
        if source.transport == "grpc":
            if source.encoding != "protobuf" or source.schema_version != SCHEMA_VERSION:
                raise InvalidKvSource(bounded(f"a grpc source needs encoding protobuf and schema_version 1, not "
                                              f"{source.encoding!r} and {source.schema_version}"))
            result.append(GrpcSource(rank))
        elif source.transport == "zmq":
            result.append(_zmq_source(source, rank))
        else:
            raise InvalidKvSource(bounded(f"unsupported transport {source.transport!r} (zmq or grpc)"))
    if len(ranks) != data_parallel_size:
        raise InvalidKvSource(f"GetKvEventSources returned {len(ranks)} sources for {data_parallel_size} "
                              f"data-parallel ranks")
    return sorted(result, key=lambda s: s.rank)


def _checked_rank(source: Any, data_parallel_size: int) -> int:
    if not source.HasField("data_parallel_rank"):
        raise InvalidKvSource("GetKvEventSources omitted data_parallel_rank")
    if not 0 <= source.data_parallel_rank < data_parallel_size:
        raise InvalidKvSource(f"rank {source.data_parallel_rank} is outside 0..{data_parallel_size - 1}")
    return source.data_parallel_rank


def _zmq_source(source: Any, rank: int) -> ZmqSource:
    if source.encoding != "msgpack":
        raise InvalidKvSource(bounded(f"a zmq source needs encoding msgpack, not {source.encoding!r}"))
    if source.schema_version != SCHEMA_VERSION:
        raise InvalidKvSource(f"unsupported schema_version {source.schema_version} (1)")
    if not source.HasField("endpoint_addr"):
        raise InvalidKvSource("GetKvEventSources omitted endpoint_addr")
    endpoint = source.endpoint_addr
    host = endpoint.host.strip()
    if endpoint.protocol != "tcp" or host.strip("[]") in NOT_ROUTABLE_HOSTS or not 0 < endpoint.port < 65536:
        raise InvalidKvSource(bounded(f"not a routable tcp endpoint: protocol {endpoint.protocol!r}, host "
                                      f"{endpoint.host!r}, port {endpoint.port}"))
    replay = source.replay_endpoint.strip()
    if replay and not _routable_tcp(replay):
        raise InvalidKvSource(bounded(f"not a routable replay endpoint: {replay!r}"))
    return ZmqSource(rank, f"tcp://{_bracketed(host)}:{endpoint.port}", source.topic.encode(), replay)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _routable_tcp(endpoint: str) -> bool:
    if not endpoint.startswith("tcp://"):
        return False
    host, _, port = endpoint[6:].rpartition(":")
    return host.strip("[]") not in NOT_ROUTABLE_HOSTS and port.isdigit() and 0 < int(port) < 65536


# ---- what one rank may hold ---------------------------------------------------------------------------------

def rank_bound(total_kv_blocks: int | None, ranks: int) -> int:
    """The blocks one rank's events may keep in the index (see the module's docstring)."""
    bound = DEFAULT_RANK_BOUND if not total_kv_blocks else 2 * total_kv_blocks + RANK_MARGIN_BLOCKS
    return min(bound, MAX_RANK_BOUND, max(RANK_MARGIN_BLOCKS, MAX_WORKER_BOUND // max(1, ranks)))


# ---- the events ------------------------------------------------------------------------------------------------

@attrs.frozen
class Stored:
    hashes: Sequence[int]
    parent: int | None
    token_ids: Sequence[int | str]
    block_size: int
    mm_keys: Sequence[Sequence[MmSegment]] | None = None
    # the LoRA adapter the blocks were computed with ("": none; None: one the event does not name, a lora_id without
    # a lora_name, whose blocks cannot be keyed: they are not indexed): kv_index.adapter_root
    adapter: str | None = ""


def event_adapter(lora_id: Any, lora_name: Any) -> str | None:
    """A BlockStored's LoRA scope from its lora_id and lora_name (msgpack: nil when none; protobuf: 0 and "")."""
    if isinstance(lora_name, str) and lora_name:
        return lora_name if len(lora_name) <= MAX_ADAPTER_NAME else None
    return "" if lora_id in (None, 0) else None


@attrs.frozen
class Removed:
    hashes: Sequence[int]


@attrs.frozen
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


@attrs.frozen
class Batch:
    """One batch's events for one rank. `image_keys` False when a stored block had image positions without
    mm_keys (that worker's image blocks are then not keyed from its events)."""

    events: tuple[KvEvent, ...]
    image_keys: bool = True

    @property
    def stored_blocks(self) -> int:
        return sum(len(e.hashes) for e in self.events if isinstance(e, Stored))


def decode_wire_batch(payload: bytes, rank: int) -> Batch:
    """A revision-1 payload, msgpack [timestamp, events, data_parallel_rank], as the batch of the socket's `rank`:
    refused when it is too big, not that shape, or names another rank (99, -1, "zero")."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise KvStreamBroken(f"a KV event payload of {len(payload)} bytes, above our limit of {MAX_MESSAGE_BYTES}",
                             "oversize")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types for bad input
        raise KvStreamBroken(f"a KV event payload is not msgpack: {type(exc).__name__}: {exc}", "malformed") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise KvStreamBroken("a KV event payload is not [timestamp, events, rank]", "malformed")
    if len(batch) > 2 and batch[2] is not None and (type(batch[2]) is not int or batch[2] != rank):
        raise KvStreamBroken(bounded(f"a KV event batch of rank {batch[2]!r} on the socket of rank {rank}", 200),
                             "bad_rank")
    try:
        return _wire_events(batch[1])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a map without the fields of its type
        raise KvStreamBroken(f"a malformed KV event: {type(exc).__name__}: {exc}", "malformed") from None


def _wire_events(events: list) -> Batch:
    image_keys = True
    decoded: list[KvEvent] = []
    for event in events:
        if not isinstance(event, dict):
            raise KvStreamBroken(f"an event is a {type(event).__name__}, not a map", "malformed")
        kind = event.get("type")
        if event.get("medium") not in (None, "GPU"):
            continue  # another tier's copy: the hashes are the same blocks, and routing counts the GPU's
        if kind == "BlockStored":
            token_ids = _list(event["token_ids"], "token_ids")
            mm = event.get("mm_keys")
            if mm is None and any(type(t) is not int for t in token_ids):
                image_keys = False
            segments = None if mm is None else [[MmSegment(_str(key["hash"]), _int(key["start_offset"]))
                                                 for key in _list(block, "mm_keys")] for block in _list(mm, "mm_keys")]
            parent = event.get("parent_block_hash")
            decoded.append(Stored(_ints(event["block_hashes"]), None if parent is None else _int(parent), token_ids,
                                  _int(event["block_size"]), segments,
                                  event_adapter(event.get("lora_id"), event.get("lora_name"))))
        elif kind == "BlockRemoved":
            decoded.append(Removed(_ints(event["block_hashes"])))
        elif kind == "AllBlocksCleared":
            decoded.append(Cleared())
        else:
            raise KvStreamBroken(bounded(f"unknown KV event type {kind!r}", 200), "malformed")
    return Batch(tuple(decoded), image_keys)


def _list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise TypeError(f"{name} is a {type(value).__name__}, not a list")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a {type(value).__name__} where a string belongs")
    return value


def _int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"a {type(value).__name__} where an integer belongs")
    return value


def _ints(value: Any) -> list[int]:
    return [_int(v) for v in _list(value, "block_hashes")]


def decode_proto_batch(batch: Any, ranks: Sequence[int]) -> Batch:
    """One revision-3 KvEventBatch: its rank must be one we subscribed to."""
    if batch.data_parallel_rank not in ranks:
        raise KvStreamBroken(f"a batch of rank {batch.data_parallel_rank}, not one of {list(ranks)[:8]}", "bad_rank")
    try:
        events = (_proto_event(event) for event in batch.events)
        return Batch(tuple(event for event in events if event is not None), image_keys=False)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # e.g. a hash that is not decimal text
        raise KvStreamBroken(f"a malformed KV event: {type(exc).__name__}: {exc}", "malformed") from None


def _proto_event(event: Any) -> KvEvent | None:
    kind = event.WhichOneof("event")
    if kind == "block_stored":
        stored = event.block_stored
        parent = _proto_hash(stored.parent_block_hash) if stored.HasField("parent_block_hash") else None
        return Stored([_proto_hash(h) for h in stored.block_hashes], parent, list(stored.token_ids),
                      stored.block_size, adapter=event_adapter(stored.lora_id, stored.lora_name))
    if kind == "block_removed":
        return Removed([_proto_hash(h) for h in event.block_removed.block_hashes])
    if kind == "all_blocks_cleared":
        return Cleared()
    return None  # a kind a later schema adds (an unknown field to us): not one that changes what is held


def _proto_hash(value: Any) -> int:
    if value.encoding != "decimal_int64":
        raise KvStreamBroken(bounded(f"unknown block hash encoding {value.encoding!r}", 200), "malformed")
    text = value.value
    if len(text) > 20:
        raise ValueError("a decimal_int64 hash of more than 20 characters")
    return int(text.decode("ascii"))


# ---- into the index -------------------------------------------------------------------------------------------

def apply(index: KvIndex, where: tuple[str, int], batch: Batch, bound: int) -> Iterator[None]:
    """Apply `batch` to `where`'s entries, yielding after each SLICE_BLOCKS blocks (the caller lets the event loop
    run there). Refuses (KvStreamBroken "over_bound") a batch that would take the rank above `bound` blocks,
    before applying anything of it."""
    if index.rank_blocks(where) + batch.stored_blocks > bound:
        raise KvStreamBroken(f"rank {where[1]} would hold {index.rank_blocks(where) + batch.stored_blocks} blocks, "
                             f"above its bound of {bound} (twice what the worker says it holds, plus a margin)",
                             "over_bound")
    done = 0
    for event in batch.events:
        if isinstance(event, Stored):
            for start in range(0, max(1, len(event.hashes)), SLICE_BLOCKS):
                _stored(index, where, event, start)
                done += min(SLICE_BLOCKS, len(event.hashes) - start)
                if done >= SLICE_BLOCKS:
                    done = 0
                    yield
        elif isinstance(event, Removed):
            for start in range(0, len(event.hashes), SLICE_BLOCKS):
                index.removed_engine(where, event.hashes[start:start + SLICE_BLOCKS])
                done += min(SLICE_BLOCKS, len(event.hashes) - start)
                if done >= SLICE_BLOCKS:
                    done = 0
                    yield
        else:
            index.cleared(*where)


def _stored(index: KvIndex, where: tuple[str, int], event: Stored, start: int) -> None:
    """One slice of a BlockStored event: blocks start..start+SLICE_BLOCKS, chained on the slice before."""
    if event.adapter is None:
        return  # an adapter's blocks we cannot scope: keyed as the base model's they would be a false prefix
    hashes = event.hashes[start:start + SLICE_BLOCKS]
    size = event.block_size
    parent = event.parent if start == 0 else event.hashes[start - 1]
    tokens = event.token_ids[start * size:(start + len(hashes)) * size] if len(event.hashes) > SLICE_BLOCKS \
        else event.token_ids
    mm = event.mm_keys[start:start + SLICE_BLOCKS] if event.mm_keys is not None else None
    try:
        index.stored_engine(where, hashes, parent, tokens, size, mm, event.adapter)
    except EventBlockError as exc:
        raise KvStreamBroken(f"a BlockStored event cannot be keyed: {exc}", "malformed") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # token ids or image keys of the wrong kind
        raise KvStreamBroken(f"a malformed BlockStored event: {type(exc).__name__}: {exc}", "malformed") from None


def clear_slices(index: KvIndex, worker: str) -> Iterator[None]:
    """Clear `worker`'s event entries, yielding after each SLICE_BLOCKS blocks (a refused flood leaves a rank at its
    bound: tens of thousands of entries, too many to drop in one step of the event loop)."""
    for rank, hashes in index.engine_hashes(worker).items():
        for start in range(0, len(hashes), SLICE_BLOCKS):
            index.removed_engine((worker, rank), hashes[start:start + SLICE_BLOCKS])
            yield
    index.cleared(worker)


def apply_now(index: KvIndex, where: tuple[str, int], batch: Batch, bound: int = MAX_RANK_BOUND) -> None:
    """`apply` without yielding: the whole batch at once (tests, tools)."""
    for _ in apply(index, where, batch, bound):
        pass
