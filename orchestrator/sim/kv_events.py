"""The simulated worker's KV events, on the wire exactly as TensorRT-LLM publishes them.

The prefix cache (prefix_cache.py) says what it stored and evicted each step; this module publishes it
the way the persona's engine does. Events are off unless enabled (`--kv-events`), as upstream
(`kv_cache_config.kv_events_config.enable_kv_cache_events`).

Revision 1, `tensorrt_llm/grpc/openengine/` (control.py @06cb2191b0be): Control.GetKvEventSources
advertises one ZMQ publisher per attention-DP rank (node.py @2361706f3283 `_source`: transport "zmq",
endpoint_addr {host, port, protocol "tcp"}, the topic, replay_endpoint "tcp://host:port" or "", the rank,
encoding "msgpack", schema_version 1, buffer_steps/hwm/max_queue_size of KVEventsConfig); SubscribeKvEvents
is UNIMPLEMENTED. The publisher is `tensorrt_llm/_torch/pyexecutor/kv_cache_events.py` @13599e98c71c
ZmqEventPublisher: a PUB socket on base_port + rank; each message is three frames (topic, 8-byte
big-endian sequence number, msgpack payload); the sequence number is taken when a batch is published,
so a batch that is dropped leaves a gap; an optional ROUTER replay socket answers (identity, b"",
start_seq) with (identity, b"", topic, seq, payload) for every retained batch from start_seq on, then
(identity, b"", b"", END_SEQ = -1 as 8 signed bytes, b""). The payload is the positional array
[timestamp, events, data_parallel_rank], one per scheduler iteration; each event a map with a "type" key,
laid out as the streaming sink serializes it (streamingEventSink.cpp @1454f28a18fa: BlockStored with
block_hashes, parent_block_hash, token_ids, block_size, lora_id nil, medium "GPU", lora_name nil, and
mm_keys when the worker takes images, as kv_cache_events.py's BlockStored; BlockRemoved with
block_hashes and medium "GPU").

Revision 3, `tensorrt_llm/openengine/servicer.py` @3a8b4f203346 with `tensorrt_llm/serve/
kv_event_fanout.py` @48f2db0bbf03: GetKvEventSources names the gRPC server itself (transport "grpc",
protocol "grpc", encoding "protobuf", schema_version 1, max_queue_size the fanout's 1024), and
SubscribeKvEvents streams one KvEventBatch per engine event, numbered per rank from 1 by the fanout;
include_snapshot or start_sequence_number is UNIMPLEMENTED, unknown ranks INVALID_ARGUMENT, events off
FAILED_PRECONDITION. Hashes go out as KvBlockHash(value=decimal text of the signed int64,
encoding="decimal_int64"); a stored block whose tokens are not all integers (an image's digest) cannot be
represented and "fails closed": the batch carries AllBlocksCleared instead (`_kv_batch`). A subscriber
that falls behind loses events, and the numbering shows it.

The fault `--drop-kv-events N` spends the sequence number of every Nth batch and sends nothing, as a full
queue does upstream, so a consumer's gap handling can be tested.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import cast

import attrs
import msgpack
import zmq
import zmq.asyncio

from orchestrator.openengine.v1 import kv_pb2
from orchestrator.sim.prefix_cache import AllBlocksCleared, BlockRemoved, BlockStored, Event

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", ""})
FANOUT_BUFFER = 1024  # KvEventFanout's default buffer_size: what a gRPC subscriber may fall behind by


@attrs.frozen
class KvEventsConfig:
    """What upstream's KVEventsConfig says, for the simulated publisher (defaults are upstream's, except
    the port: 0 takes a free port per rank, for tests and several workers on one host)."""

    enabled: bool = False
    port: int = attrs.field(default=0, validator=attrs.validators.and_(attrs.validators.ge(0),
                                                                       attrs.validators.le(65535)))
    replay_port: int | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.and_(attrs.validators.ge(0), attrs.validators.le(65535))))
    topic: str = ""
    buffer_steps: int = attrs.field(default=10_000, validator=attrs.validators.ge(1))
    hwm: int = attrs.field(default=100_000, validator=attrs.validators.ge(1))
    max_queue_size: int = attrs.field(default=100_000, validator=attrs.validators.ge(1))
    drop_every: int = attrs.field(default=0, validator=attrs.validators.ge(0))  # fault: drop every Nth batch
    advertise_port: int | None = None  # fault: GetKvEventSources names this port (+ rank) instead of ours


class DropSchedule:
    """Which batches the drop fault loses: every Nth, counted per publisher."""

    def __init__(self, every: int):
        self.every, self.count = every, 0

    def drop_next(self) -> bool:
        self.count += 1
        return self.every > 0 and self.count % self.every == 0


# ---- revision 1: msgpack over ZMQ -------------------------------------------------------------------------

def _token(token) -> int | str:
    return token.hex() if isinstance(token, bytes) else token  # an image digest goes out as hex text


def wire_event(event: Event, *, mm_keys: bool) -> dict:
    """One event as the streaming sink serializes it (key order included)."""
    if isinstance(event, BlockStored):
        body: dict[str, object] = {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": [_token(t) for t in event.token_ids],
                "block_size": event.block_size, "lora_id": event.lora[0] if event.lora else None, "medium": "GPU",
                "lora_name": event.lora[1] if event.lora else None}
        if mm_keys:
            body["mm_keys"] = [[{"type": "mm_key", "hash": key.hash, "start_offset": key.start_offset}
                                for key in block] for block in event.mm_keys]
        return body
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": "GPU"}
    return {"type": "AllBlocksCleared"}


def wire_batch(events: Sequence[Event], rank: int, *, timestamp: float, mm_keys: bool) -> bytes:
    return msgpack.packb([timestamp, [wire_event(e, mm_keys=mm_keys) for e in events], rank])


def advertised_host(host: str) -> str:
    """A connectable name for a bind address (node.py: a wildcard is replaced by the FQDN)."""
    return socket.getfqdn() if host.strip("[]").lower() in WILDCARD_HOSTS else host


class ZmqPublisher:
    """One rank's PUB socket (and ROUTER replay socket, when configured)."""

    def __init__(self, rank: int, host: str, config: KvEventsConfig, *, mm_keys: bool):
        self.rank, self.config, self.mm_keys = rank, config, mm_keys
        bind_host = "*" if host.strip("[]").lower() in WILDCARD_HOSTS else host
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.port = self._bind(self._pub, bind_host, config.port)
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_port: int | None = None
        if config.replay_port is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self.replay_port = self._bind(self._replay, bind_host, config.replay_port)
        self.host = advertised_host(host)
        self._topic = config.topic.encode()
        self._sequence = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._drops = DropSchedule(config.drop_every)
        self.published = self.dropped = 0
        self._replay_task: asyncio.Task | None = None

    def _bind(self, sock: zmq.Socket, host: str, base_port: int) -> int:
        if base_port == 0:
            return sock.bind_to_random_port(f"tcp://{host}")
        port = base_port + self.rank  # ZmqEventPublisher.offset_endpoint_port
        sock.bind(f"tcp://{host}:{port}")
        return port

    def start(self) -> None:
        if self._replay is not None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay(self._replay))

    def publish(self, events: Sequence[Event]) -> None:
        sequence = self._sequence  # reserved first: a lost batch leaves a gap
        self._sequence += 1
        if self._drops.drop_next():
            self.dropped += 1
            return
        payload = wire_batch(events, self.rank, timestamp=time.time(), mm_keys=self.mm_keys)
        try:
            self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.dropped += 1
            log.warning("KV event batch %d of rank %d not sent: %s", sequence, self.rank, exc)
            return
        self._buffer.append((sequence, payload))
        self.published += 1

    async def _serve_replay(self, replay: zmq.asyncio.Socket) -> None:
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV event replay request of %d frames", len(frames))
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for sequence, payload in list(self._buffer):
                if sequence >= start_seq:
                    await replay.send_multipart((identity, b"", self._topic, sequence.to_bytes(8, "big"), payload))
            await replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    def source(self) -> kv_pb2.KvEventSource:
        c = self.config
        return kv_pb2.KvEventSource(
            transport="zmq", endpoint_addr=kv_pb2.KvEndpoint(
                host=self.host, port=self.port if c.advertise_port is None else c.advertise_port + self.rank,
                protocol="tcp"),
            topic=c.topic, replay_endpoint=f"tcp://{self.host}:{self.replay_port}" if self.replay_port else "",
            data_parallel_rank=self.rank, encoding="msgpack", schema_version=1, buffer_steps=c.buffer_steps,
            hwm=c.hwm, max_queue_size=c.max_queue_size)

    def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()


# ---- revision 3: protobuf over gRPC ----------------------------------------------------------------------

def block_hash(value: int) -> kv_pb2.KvBlockHash:
    return kv_pb2.KvBlockHash(value=str(value).encode("ascii"), encoding="decimal_int64")


def proto_event(event: Event) -> kv_pb2.KvEvent:
    """One cache event as tensorrt_llm/openengine's `_kv_batch` bridges it."""
    if isinstance(event, BlockStored):
        if not all(isinstance(t, int) for t in event.token_ids):
            return kv_pb2.KvEvent(all_blocks_cleared=kv_pb2.AllBlocksCleared())  # fail closed
        stored = kv_pb2.BlockStored(block_hashes=[block_hash(h) for h in event.block_hashes],
                                    token_ids=cast("list[int]", list(event.token_ids)),  # ints: checked above
                                    block_size=event.block_size, lora_id=event.lora[0] if event.lora else 0,
                                    lora_name=event.lora[1] if event.lora else "",
                                    medium=kv_pb2.STORAGE_MEDIUM_GPU, group_idx=0)
        if event.parent_block_hash is not None:
            stored.parent_block_hash.CopyFrom(block_hash(event.parent_block_hash))
        return kv_pb2.KvEvent(block_stored=stored)
    if isinstance(event, BlockRemoved):
        return kv_pb2.KvEvent(block_removed=kv_pb2.BlockRemoved(
            block_hashes=[block_hash(h) for h in event.block_hashes], medium=kv_pb2.STORAGE_MEDIUM_GPU,
            group_idx=0))
    assert isinstance(event, AllBlocksCleared)
    return kv_pb2.KvEvent(all_blocks_cleared=kv_pb2.AllBlocksCleared())


class GrpcFanout:
    """The revision-3 engine's KvEventFanout: per-rank numbering, a bounded queue per subscriber."""

    def __init__(self, ranks: int, config: KvEventsConfig):
        self.ranks = ranks
        self._sequence = [0] * ranks
        self._drops = [DropSchedule(config.drop_every) for _ in range(ranks)]
        self._subscribers: dict[asyncio.Queue, frozenset[int]] = {}
        self.published = self.dropped = 0

    def publish(self, rank: int, events: Sequence[Event]) -> None:
        for event in events:  # the engine's event stream has one event per item
            self._sequence[rank] += 1
            sequence = self._sequence[rank]
            if self._drops[rank].drop_next():
                self.dropped += 1
                continue
            self.published += 1
            batch = kv_pb2.KvEventBatch(sequence_number=sequence, timestamp_unix_nanos=time.time_ns(),
                                        data_parallel_rank=rank, events=[proto_event(event)])
            for queue, selected in tuple(self._subscribers.items()):
                if selected and rank not in selected:
                    continue
                try:
                    queue.put_nowait(batch)
                except asyncio.QueueFull:
                    log.warning("dropping a KV event batch for a slow subscriber")

    async def subscribe(self, ranks: Sequence[int]) -> AsyncIterator[kv_pb2.KvEventBatch]:
        queue: asyncio.Queue = asyncio.Queue(maxsize=FANOUT_BUFFER)
        self._subscribers[queue] = frozenset(ranks)
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.pop(queue, None)
