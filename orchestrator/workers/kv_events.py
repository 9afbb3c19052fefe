"""The engines' own KV events, per worker and attention-DP rank, fed into the KV index (kv_index.py).

Where they come from, as each TensorRT-LLM server offers them (orchestrator/sim/kv_events.py has the wire
details and the upstream commits):
- revision 1 (tensorrt_llm/grpc/openengine, merged): Control.GetKvEventSources names one ZMQ publisher per
  rank (transport "zmq", encoding "msgpack", schema_version 1); each message is three frames (topic, 8-byte
  big-endian sequence number, msgpack [timestamp, events, rank]); a ROUTER replay socket, when advertised,
  answers a start sequence number with the batches it still holds, then END_SEQ (-1). SubscribeKvEvents is
  UNIMPLEMENTED there.
- revision 3 (tensorrt_llm/openengine, open PR #16336; its KV events open PR #19440): GetKvEventSources
  names the gRPC server itself (transport "grpc", encoding "protobuf"), and Control.SubscribeKvEvents
  streams KvEventBatch messages numbered per rank from 1. A stored block holding an image position cannot
  be carried there: the engine sends AllBlocksCleared instead, so such workers carry no image keys and
  their image blocks are answered from approximate entries (kv_index.py).

Sources are validated as Dynamo's TensorRT-LLM sidecar does (ai-dynamo/dynamo lib/sidecar/trtllm/src/
engine.rs @ e419430b8943, open PRs #14349/#15087: validate_kv_sources / validate_kv_source): transport zmq
with encoding msgpack, schema_version 1, a rank inside the engine's data-parallel size, one source per
rank and no duplicates, a tcp endpoint with a routable host (not empty, "*", "0.0.0.0" or "::") and a
port. A worker whose sources fail is logged (rate-limited, with the cause) and left in approximate mode.

Consistency: a sequence gap, a reconnect, a restart (new ServerInfo.instance_id, or a sequence number that
went back) clears that worker's (rank's) event entries, which the events that follow rebuild; where a
replay socket is advertised, a gap is first asked of it, and only a replay that no longer holds the
missing batch clears. A worker that leaves the pool leaves the index at once (`forget`).

pyzmq runs on trio without a thread: each socket is non-blocking, and a task waits for its ZMQ_FD with
`trio.lowlevel.wait_readable` whenever ZMQ_EVENTS says nothing is ready (the FD is edge-triggered: it
only says "look at ZMQ_EVENTS again").

Who runs it: the pool starts `follow(worker, client, instance)` in that worker's own nursery (pool.py), so a
feed task never outlives its worker, and hands it the worker's InstanceWatch (instance_watch.py): the pool
is the one reader of the worker's identity, and the feed starts over when the watch reports a restart.
serve.py owns the KvEventFeed next to the pool and closes it after:

    kv = kv_routing(config)                # index, feed and the roles it follows (kv_routing.py)
    pool = WorkerPool(..., kv=kv)          # follows every worker it runs, forgets every worker it drops
    ... pool.run(...) ...
    kv.feed.close()                        # after the pool's nursery exited

`index.mode(worker)` says "events" or "approximate"; `feed.detail[worker]` says why a worker is approximate
("" when fed by events), and `feed.stats` counts batches, gaps, replays, clears and invalid sources.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import grpc
import msgpack
import trio
import zmq

from orchestrator.engine import EngineError
from orchestrator.engine.errors import ErrorCode
from orchestrator.log import RateLimitedLog, cause_chain
from orchestrator.workers.instance_watch import InstanceWatch
from orchestrator.workers.kv_index import EventBlockError, KvIndex, MmSegment

log = logging.getLogger(__name__)

END_SEQ = -1
NOT_ROUTABLE_HOSTS = frozenset({"", "*", "0.0.0.0", "::"})
SCHEMA_VERSION = 1


class InvalidKvSource(ValueError):
    """GetKvEventSources named something we cannot (or must not) subscribe to."""


class KvStreamBroken(Exception):
    """The event stream lost continuity (the caller clears and starts again)."""


@attrs.frozen
class ZmqSource:
    rank: int
    endpoint: str  # tcp://host:port
    topic: bytes
    replay_endpoint: str  # "" when not advertised
    hwm: int = 100_000  # the publisher's high-water mark (KVEventsConfig.hwm), ours for receiving


@attrs.frozen
class GrpcSource:
    rank: int


# ---- validation -------------------------------------------------------------------------------------------

def validate_sources(sources: Sequence[Any], data_parallel_size: int, kv_block_size: int | None
                     ) -> list[ZmqSource] | list[GrpcSource]:
    """The sources of one worker, checked as Dynamo's sidecar checks them; raises InvalidKvSource."""
    if not sources:
        return []
    if not kv_block_size or kv_block_size < 1:
        raise InvalidKvSource("KV events need a positive ServerInfo.capacity.kv_block_size")
    transports = {source.transport for source in sources}
    if len(transports) != 1:
        raise InvalidKvSource(f"sources mix transports {sorted(transports)}")
    ranks: set[int] = set()
    result: list = []
    for source in sources:
        rank = _checked_rank(source, data_parallel_size)
        if rank in ranks:
            raise InvalidKvSource(f"GetKvEventSources returned duplicate rank {rank}")
        ranks.add(rank)
        if source.transport == "grpc":
            if source.encoding != "protobuf" or source.schema_version != SCHEMA_VERSION:
                raise InvalidKvSource(f"a grpc source needs encoding protobuf and schema_version 1, not "
                                      f"{source.encoding!r} and {source.schema_version}")
            result.append(GrpcSource(rank))
        elif source.transport == "zmq":
            result.append(_zmq_source(source, rank))
        else:
            raise InvalidKvSource(f"unsupported transport {source.transport!r} (zmq or grpc)")
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
        raise InvalidKvSource(f"a zmq source needs encoding msgpack, not {source.encoding!r}")
    if source.schema_version != SCHEMA_VERSION:
        raise InvalidKvSource(f"unsupported schema_version {source.schema_version} (1)")
    if not source.HasField("endpoint_addr"):
        raise InvalidKvSource("GetKvEventSources omitted endpoint_addr")
    endpoint = source.endpoint_addr
    host = endpoint.host.strip()
    if endpoint.protocol != "tcp" or host.strip("[]") in NOT_ROUTABLE_HOSTS or not 0 < endpoint.port < 65536:
        raise InvalidKvSource(f"not a routable tcp endpoint: protocol {endpoint.protocol!r}, host {endpoint.host!r}, "
                              f"port {endpoint.port}")
    replay = source.replay_endpoint.strip()
    if replay and not _routable_tcp(replay):
        raise InvalidKvSource(f"not a routable replay endpoint: {replay!r}")
    return ZmqSource(rank, f"tcp://{_bracketed(host)}:{endpoint.port}", source.topic.encode(), replay,
                     source.hwm if source.HasField("hwm") and source.hwm > 0 else 100_000)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _routable_tcp(endpoint: str) -> bool:
    if not endpoint.startswith("tcp://"):
        return False
    host, _, port = endpoint[6:].rpartition(":")
    return host.strip("[]") not in NOT_ROUTABLE_HOSTS and port.isdigit() and 0 < int(port) < 65536


# ---- applying events ---------------------------------------------------------------------------------------

def apply_wire_events(index: KvIndex, where: tuple[str, int], events: Sequence[Any]) -> bool:
    """One revision-1 batch's events (msgpack maps tagged by "type"). Returns False when a stored block had
    image positions without mm_keys (the worker's image blocks are then not keyed from its events)."""
    try:
        return _apply_wire_events(index, where, events)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a map without the fields of its type
        raise KvStreamBroken(f"a malformed KV event: {exc!r}") from exc


def _apply_wire_events(index: KvIndex, where: tuple[str, int], events: Sequence[Any]) -> bool:
    image_keys = True
    for event in events:
        if not isinstance(event, dict):
            raise KvStreamBroken(f"an event is a {type(event).__name__}, not a map")
        kind = event.get("type")
        if event.get("medium") not in (None, "GPU"):
            continue  # another tier's copy: the hashes are the same blocks, and routing counts the GPU's
        if kind == "BlockStored":
            mm = event.get("mm_keys")
            if mm is None and any(type(t) is not int for t in event["token_ids"]):
                image_keys = False
            segments = None if mm is None else [[MmSegment(key["hash"], key["start_offset"]) for key in block]
                                                for block in mm]
            try:
                index.stored_engine(where, event["block_hashes"], event.get("parent_block_hash"), event["token_ids"],
                                    event["block_size"], segments)
            except EventBlockError as exc:  # a ValueError: named here, before the generic catch above
                raise KvStreamBroken(f"a BlockStored event cannot be keyed: {exc}") from exc
        elif kind == "BlockRemoved":
            index.removed_engine(where, event["block_hashes"])
        elif kind == "AllBlocksCleared":
            index.cleared(*where)
        else:
            raise KvStreamBroken(f"unknown KV event type {kind!r}")
    return image_keys


def _proto_hash(value: Any) -> int:
    if value.encoding != "decimal_int64":
        raise KvStreamBroken(f"unknown block hash encoding {value.encoding!r}")
    return int(value.value.decode("ascii"))


def apply_proto_events(index: KvIndex, where: tuple[str, int], events: Sequence[Any]) -> None:
    """One revision-3 KvEventBatch's events."""
    try:
        _apply_proto_events(index, where, events)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # e.g. a hash that is not decimal text
        raise KvStreamBroken(f"a malformed KV event: {exc!r}") from exc


def _apply_proto_events(index: KvIndex, where: tuple[str, int], events: Sequence[Any]) -> None:
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            stored = event.block_stored
            parent = _proto_hash(stored.parent_block_hash) if stored.HasField("parent_block_hash") else None
            try:
                index.stored_engine(where, [_proto_hash(h) for h in stored.block_hashes], parent,
                                    list(stored.token_ids), stored.block_size)
            except EventBlockError as exc:
                raise KvStreamBroken(f"a BlockStored event cannot be keyed: {exc}") from exc
        elif kind == "block_removed":
            index.removed_engine(where, [_proto_hash(h) for h in event.block_removed.block_hashes])
        elif kind == "all_blocks_cleared":
            index.cleared(*where)


def _permanent(exc: BaseException) -> bool:
    """A failure that trying again cannot fix: the call is not served (UNIMPLEMENTED, events off), or our
    transport cannot stream it."""
    if not isinstance(exc, EngineError):
        return False
    return exc.code == ErrorCode.ERROR_CODE_UNSUPPORTED_FEATURE or exc.grpc_status in (
        grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)


# ---- pyzmq on trio -------------------------------------------------------------------------------------------

class TrioZmqSocket:
    """A non-blocking zmq socket whose waits are trio waits on its ZMQ_FD."""

    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self._fd = socket.fileno()  # ZMQ_FD

    async def recv_multipart(self) -> list[bytes]:
        await trio.lowlevel.checkpoint()  # a busy publisher must not starve the other tasks
        while True:
            if self._events() & zmq.POLLIN:
                try:
                    return self.socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    pass
            await trio.lowlevel.wait_readable(self._fd)

    async def send_multipart(self, frames: Sequence[bytes]) -> None:
        while True:
            if self._events() & zmq.POLLOUT:
                try:
                    self.socket.send_multipart(frames, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass
            await trio.lowlevel.wait_readable(self._fd)  # the FD signals every event change, writability too

    def _events(self) -> int:
        events = self.socket.getsockopt(zmq.EVENTS)
        if not isinstance(events, int):  # an int option; pyzmq types every option's value int | bytes
            raise TypeError(f"ZMQ_EVENTS read as {events!r}")
        return events

    def close(self) -> None:
        trio.lowlevel.notify_closing(self._fd)
        self.socket.close(linger=0)


@contextmanager
def _zmq_socket(context: zmq.Context, kind: int, endpoint: str, **options: Any) -> Iterator[TrioZmqSocket]:
    socket = context.socket(kind)
    try:
        for name, value in options.items():
            socket.setsockopt(getattr(zmq, name), value)
        socket.connect(endpoint)
    except BaseException:
        socket.close(linger=0)
        raise
    wrapped = TrioZmqSocket(socket)
    try:
        yield wrapped
    finally:
        wrapped.close()


def decode_batch(payload: bytes) -> list[Any]:
    """A revision-1 payload's events: msgpack [timestamp, events, data_parallel_rank]."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise KvStreamBroken(f"a KV event payload is not msgpack: {exc!r}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise KvStreamBroken("a KV event payload is not [timestamp, events, rank]")
    return batch[1]


# ---- the feed ------------------------------------------------------------------------------------------------

@attrs.define
class FeedStats:
    batches: int = 0
    gaps: int = 0  # sequence gaps seen
    replays: int = 0  # gaps a replay filled
    clears: int = 0  # times a worker's or rank's entries were cleared (gap, reconnect, restart)
    invalid_sources: int = 0


@attrs.define(eq=False)
class _Follower:
    worker: str
    log: RateLimitedLog
    active: bool = True
    image_keys: bool = True  # its events key image blocks (revision 1 with mm_keys)


class KvEventFeed:
    """Follows the KV events of every worker the pool runs `follow` for, into `index`.

    `retry_s`: wait before trying a failed worker again; `identity_check_s`: how often a feed followed without
    the pool's InstanceWatch reads ServerInfo itself to notice a restart (a ZMQ subscriber cannot: it
    reconnects silently); `replay_timeout_s`: how long a replay request may take."""

    def __init__(self, index: KvIndex, *, retry_s: float = 1.0, identity_check_s: float = 2.0,
                 replay_timeout_s: float = 2.0, zmq_context: zmq.Context | None = None):
        self.index = index
        self.retry_s = retry_s
        self.identity_check_s = identity_check_s
        self.replay_timeout_s = replay_timeout_s
        self._context = zmq_context or zmq.Context()
        self._own_context = zmq_context is None
        self._followers: dict[str, _Follower] = {}
        self.stats = FeedStats()
        self.detail: dict[str, str] = {}  # worker -> why it is approximate ("" when fed by events)

    def close(self) -> None:
        if self._own_context:
            self._context.term()

    def forget(self, worker: str) -> None:
        """The worker left the pool: its entries leave the index now, and its follow task stops applying."""
        follower = self._followers.pop(worker, None)
        if follower is not None:
            follower.active = False
        self.detail.pop(worker, None)
        self.index.forget(worker)

    # ---- one worker --------------------------------------------------------------------------------
    async def follow(self, worker: str, client, instance: InstanceWatch | None = None) -> None:
        """Feed `worker`'s events until cancelled (or forgotten); approximate mode whenever that fails.
        `instance` tells when the worker restarted (the pool's watch of it); without one, the feed reads the
        worker's ServerInfo itself every identity_check_s."""
        if instance is not None:
            await self._follow(worker, client, instance)
            return
        instance = InstanceWatch()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(instance.poll, client, self.identity_check_s)
            await self._follow(worker, client, instance)
            nursery.cancel_scope.cancel()

    async def _follow(self, worker: str, client, instance: InstanceWatch) -> None:
        follower = _Follower(worker, RateLimitedLog(log, interval=30.0))
        previous = self._followers.get(worker)
        if previous is not None:
            previous.active = False
        self._followers[worker] = follower
        try:
            while follower.active:
                wait_for_restart = await self._follow_once(follower, client, instance)
                if not follower.active:
                    return
                self._approximate(follower, self.detail.get(worker) or "no KV events")
                if wait_for_restart is not None:
                    await instance.changed_from(wait_for_restart)
                    self.index.cleared_routed(worker)  # restarted: what we routed there is gone from its cache
                else:
                    await trio.sleep(self.retry_s)
        finally:
            if self._followers.get(worker) is follower:  # (not forgotten, nor followed anew since)
                # Nobody keeps its event entries from now on: they go, and what we route there counts instead.
                self._followers.pop(worker)
                self.index.cleared(worker)
                self.index.set_mode(worker, "approximate")

    async def _follow_once(self, follower: _Follower, client, instance: InstanceWatch) -> str | None:
        """One subscription. Returns the worker's instance id when only a restart may change things (no
        sources, invalid sources), else None (try again after retry_s)."""
        worker = follower.worker
        try:
            # the instance the pool knows (its capabilities, shared through the client): a restart is one
            # the watch reports after that
            info = await client.capabilities()
            sources = await client.kv_event_sources()
        except EngineError as exc:
            if follower.active:  # (forgotten while it asked: its /health entry is gone and stays gone)
                self.detail[worker] = f"KV event sources unavailable: {cause_chain(exc)}"
            return None
        if not follower.active:
            return None
        try:
            valid = validate_sources(sources, max(1, info.data_parallel_size), info.kv_block_size)
        except InvalidKvSource as exc:
            self.stats.invalid_sources += 1
            self.detail[worker] = f"invalid KV event source: {exc}"
            follower.log("worker %s: invalid KV event sources, routing it approximately: %s (sources: %s)", worker,
                         exc, "; ".join(str(s).replace("\n", " ") for s in sources))
            return info.instance_id
        if not valid:
            self.detail[worker] = "the worker publishes no KV events"
            return info.instance_id
        failures: list[BaseException] = []

        async def guarded(subscribe, *args) -> None:
            # A stream's failure ends the whole subscription: recorded here, not raised into the nursery
            # (which would wrap it in an ExceptionGroup).
            try:
                await subscribe(follower, *args)
            except (EngineError, KvStreamBroken, zmq.ZMQError) as exc:
                failures.append(exc)
            finally:
                subscription.cancel()  # also when it returned (forgotten): the identity watch goes with it

        async with trio.open_nursery() as nursery:
            subscription = nursery.cancel_scope
            nursery.start_soon(self._until_restarted, worker, instance, info.instance_id, subscription)
            if isinstance(valid[0], GrpcSource):
                nursery.start_soon(guarded, self._follow_grpc, client, [s.rank for s in valid])
            else:
                for source in valid:
                    nursery.start_soon(guarded, self._follow_zmq, source)
        if not follower.active:
            return None
        self._clear(worker)
        if failures:
            failure = failures[0]
            if _permanent(failure):  # this client or worker cannot stream them: nothing changes until a restart
                self.detail[worker] = f"KV events cannot be followed: {cause_chain(failure)}"
                follower.log("worker %s: KV events cannot be followed, routing it approximately: %s", worker,
                             cause_chain(failure))
                return info.instance_id
            self.detail[worker] = f"KV event stream lost: {cause_chain(failure)}"
            follower.log("worker %s: KV event stream lost, its index is cleared until rebuilt: %s", worker,
                         cause_chain(failure))
        else:  # the identity watch ended it: the worker restarted, its cache is empty
            self.detail[worker] = "the worker restarted"
            self.index.cleared_routed(worker)
        return None

    @staticmethod
    async def _until_restarted(worker: str, instance: InstanceWatch, instance_id: str,
                               subscription: trio.CancelScope) -> None:
        await instance.changed_from(instance_id)
        log.info("worker %s restarted (instance %s -> %s): its KV events are followed anew", worker, instance_id,
                 instance.instance_id)
        subscription.cancel()

    def _events_mode(self, follower: _Follower, *, image_keys: bool) -> None:
        if not follower.active:
            return
        if self.index.mode(follower.worker) != "events" or self.index.image_keys(follower.worker) != image_keys:
            log.info("worker %s: routing on its KV events%s", follower.worker,
                     "" if image_keys else " (image blocks approximately: its events carry no image keys)")
            self.index.set_mode(follower.worker, "events", image_keys=image_keys)
        self.detail[follower.worker] = ""

    def _approximate(self, follower: _Follower, why: str) -> None:
        if follower.active and self.index.mode(follower.worker) != "approximate":
            log.info("worker %s: routing approximately (%s)", follower.worker, why)
            self.index.set_mode(follower.worker, "approximate")

    def _clear(self, worker: str, rank: int | None = None) -> None:
        self.stats.clears += 1
        self.index.cleared(worker, rank)

    # ---- revision 3: gRPC stream ---------------------------------------------------------------------
    async def _follow_grpc(self, follower: _Follower, client, ranks: list[int]) -> None:
        worker = follower.worker
        expected: dict[int, int] = {}
        async with client.subscribe_kv_events() as stream:
            # Image blocks fail closed in this stream (AllBlocksCleared): they are never keyed from it.
            self._events_mode(follower, image_keys=False)
            while True:
                messages = await stream.get_batch()
                if not messages:
                    raise KvStreamBroken("SubscribeKvEvents ended")
                if not follower.active:
                    return
                for message in messages:
                    if message.HasField("error"):
                        raise KvStreamBroken(f"SubscribeKvEvents error: {message.error}")
                    batch = message.batch
                    rank = batch.data_parallel_rank
                    if rank not in ranks:
                        raise KvStreamBroken(f"a batch of rank {rank}, not one of {ranks}")
                    want = expected.get(rank)
                    if want is not None and batch.sequence_number != want:
                        self.stats.gaps += 1
                        follower.log("worker %s rank %d: KV event sequence %d after %d: its entries are cleared "
                                     "until rebuilt", worker, rank, batch.sequence_number, want - 1)
                        self._clear(worker, rank)
                    expected[rank] = batch.sequence_number + 1
                    apply_proto_events(self.index, (worker, rank), batch.events)
                    self.stats.batches += 1

    # ---- revision 1: ZMQ per rank --------------------------------------------------------------------
    async def _follow_zmq(self, follower: _Follower, source: ZmqSource) -> None:
        where = (follower.worker, source.rank)
        # A bounded receive queue: a feed that falls behind loses messages, which shows as a gap (cleared), rather
        # than holding an unbounded backlog in memory.
        with _zmq_socket(self._context, zmq.SUB, source.endpoint, SUBSCRIBE=source.topic, RCVHWM=source.hwm) as sub:
            applied = -1  # the last sequence number applied
            floor = 0  # the first sequence number this subscription applied (or asked a replay for)
            if source.replay_endpoint:
                # What the publisher sent before this subscription took: its replay buffer from the start.
                applied = await self._replay(follower, source, 0, applied)
            # Fed by events from here on (a batch published before the subscription took is lost unseen when
            # the worker offers no replay: ZMQ's late joiner; the blocks it stored stay unknown here).
            self._events_mode(follower, image_keys=follower.image_keys)
            while True:
                frames = await sub.recv_multipart()
                if not follower.active:
                    return
                if len(frames) != 3 or len(frames[1]) != 8:
                    raise KvStreamBroken(f"a KV event message of {len(frames)} frames")
                sequence = int.from_bytes(frames[1], "big")
                if applied >= 0 and sequence <= applied:
                    if sequence >= floor:
                        continue  # already applied from a replay
                    # The numbering went back: a new publisher (the engine restarted on the same port).
                    follower.log("worker %s rank %d: KV event sequence went back to %d: cleared", *where, sequence)
                    self._clear(*where)
                    applied = -1
                if applied < 0:
                    floor = sequence
                elif sequence != applied + 1:
                    self.stats.gaps += 1
                    floor = applied + 1
                    applied = await self._gap(follower, source, applied, sequence)
                    if sequence <= applied:
                        continue
                self._apply_zmq(follower, where, frames[2])
                applied = sequence

    def _apply_zmq(self, follower: _Follower, where: tuple[str, int], payload: bytes) -> None:
        image_keys = apply_wire_events(self.index, where, decode_batch(payload))
        self.stats.batches += 1
        if not image_keys and follower.image_keys:
            follower.image_keys = False
            self._events_mode(follower, image_keys=False)

    async def _gap(self, follower: _Follower, source: ZmqSource, applied: int, sequence: int) -> int:
        """Batches applied+1 .. sequence-1 were lost: replay them when the publisher still holds them, else
        clear the rank (the events that follow rebuild it). Returns the last sequence number applied."""
        where = (follower.worker, source.rank)
        if source.replay_endpoint:
            return await self._replay(follower, source, applied + 1, applied)
        follower.log("worker %s rank %d: KV event batches %d..%d lost: its entries are cleared until rebuilt",
                     *where, applied + 1, sequence - 1)
        self._clear(*where)
        return sequence - 1

    async def _replay(self, follower: _Follower, source: ZmqSource, start: int, applied: int) -> int:
        """Ask the replay socket for every batch from `start` on and apply them; clears the rank first when
        the publisher no longer holds batch `start` (while we had applied up to start-1). Returns the last
        sequence number applied."""
        where = (follower.worker, source.rank)
        batches: list[tuple[int, bytes]] = []
        with trio.move_on_after(self.replay_timeout_s) as deadline:
            with _zmq_socket(self._context, zmq.DEALER, source.replay_endpoint) as replay:
                await replay.send_multipart((b"", start.to_bytes(8, "big")))
                while True:
                    frames = await replay.recv_multipart()
                    if len(frames) != 4 or len(frames[2]) != 8:
                        raise KvStreamBroken(f"a replay answer of {len(frames)} frames")
                    sequence = int.from_bytes(frames[2], "big", signed=True)
                    if sequence == END_SEQ:
                        break
                    batches.append((sequence, frames[3]))
        if deadline.cancelled_caught:
            raise KvStreamBroken(f"the replay socket {source.replay_endpoint} did not answer in "
                                 f"{self.replay_timeout_s:g} s")
        if not follower.active:  # forgotten while the replay was on its way: nothing may enter the index again
            return applied
        if applied >= 0 and (not batches or batches[0][0] != start):
            follower.log("worker %s rank %d: the replay no longer holds KV event batch %d: its entries are cleared "
                         "until rebuilt", *where, start)
            self._clear(*where)
        elif applied >= 0:
            self.stats.replays += 1
        for sequence, payload in batches:
            if sequence > applied:
                self._apply_zmq(follower, where, payload)
                applied = sequence
        return applied

