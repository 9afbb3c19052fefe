"""The KV event feed: follows each worker's KV events (ZMQ per rank, or Control.SubscribeKvEvents) into the KV
index. The thin I/O part: what the events say, which sources are valid and what a rank may hold are
kv_event_codec.py's (pure, tested without sockets).

Consistency: a sequence gap, a reconnect, a restart (new ServerInfo.instance_id, or a sequence number that
went back) clears that worker's (rank's) event entries, which the events that follow rebuild; where a
replay socket is advertised, a gap is first asked of it, and only a replay that no longer holds the
missing batch clears. A worker that leaves the pool leaves the index at once (`forget`). What we refuse (an
oversize message, a batch of another rank, one that takes a rank above its bound, a malformed one) ends the
subscription: the worker's entries are cleared, /health says why (`detail`), the metric
orchestrator_kv_events_refused counts it by reason, and the worker is followed anew after retry_s.

Bounded memory: ZMQ_MAXMSGSIZE refuses a bigger message (ZMQ drops the connection: the batches lost show as a gap),
and our own receive high-water mark (not the worker's hwm) bounds what waits in ZMQ; the index holds at most
a rank's bound; a big batch is applied in slices with a checkpoint between them, so requests are not stalled.

pyzmq runs on trio without a thread: each socket is non-blocking, and a task waits for its ZMQ_FD with
`trio.lowlevel.wait_readable` whenever ZMQ_EVENTS says nothing is ready (the FD is edge-triggered: it
only says "look at ZMQ_EVENTS again").

Who runs it: the pool starts `follow(worker, client, instance)` in that worker's own nursery (pool.py), so a
feed task never outlives its worker, and hands it the worker's InstanceWatch (instance_watch.py): the pool
is the one reader of the worker's identity, and the feed starts over when the watch reports a restart.
serve.py owns the KvEventFeed next to the pool and closes it after:

    kv = kv_routing(config, metrics)       # index, feed and the roles it follows (kv_routing.py)
    pool = WorkerPool(..., kv=kv)          # follows every worker it runs, forgets every worker it drops
    ... pool.run(...) ...
    kv.feed.close()                        # after the pool's nursery exited

`index.mode(worker)` says "events" or "approximate"; `feed.detail[worker]` says why a worker is approximate
("" when fed by events), and `feed.stats` counts batches, gaps, replays, clears, invalid sources and refusals.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import grpc
import trio
import zmq

from orchestrator.engine import EngineError
from orchestrator.engine.client import OversizeMessage
from orchestrator.engine.errors import ErrorCode
from orchestrator.log import RateLimitedLog, cause_chain
from orchestrator.workers import kv_event_codec as codec
from orchestrator.workers.instance_watch import InstanceWatch
from orchestrator.workers.kv_event_codec import (
    END_SEQ,
    Batch,
    GrpcSource,
    InvalidKvSource,
    KvStreamBroken,
    ZmqSource,
    decode_proto_batch,
    decode_wire_batch,
    validate_sources,
)
from orchestrator.workers.kv_index import KvIndex

log = logging.getLogger(__name__)

# After we refuse what a worker sent, it is not followed again for REFUSED_BACKOFF_S, then twice as long after each
# refusal that follows, up to MAX_REFUSED_BACKOFF_S, until it restarts. What we refuse (a message above 4 MiB, more
# blocks than twice its cache, a batch of another rank, what no engine sends) is a lie or a bug that a second
# does not fix; each new subscription to a flooding worker costs a burst (the rank filled to its bound, then
# cleared), and a retry every 1-30 s made that burst every few seconds. Meanwhile the worker is routed
# approximately, as one without events is.
REFUSED_BACKOFF_S = 60.0
MAX_REFUSED_BACKOFF_S = 3600.0

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


# ---- the feed ------------------------------------------------------------------------------------------------

@attrs.define
class FeedStats:
    batches: int = 0
    gaps: int = 0  # sequence gaps seen
    replays: int = 0  # gaps a replay filled
    clears: int = 0  # times a worker's or rank's entries were cleared (gap, reconnect, restart)
    invalid_sources: int = 0
    refused: int = 0  # messages or batches refused (kv_event_codec.REFUSALS)


@attrs.define(eq=False)
class _Follower:
    worker: str
    log: RateLimitedLog
    active: bool = True
    image_keys: bool = True  # its events key image blocks (revision 1 with mm_keys)
    bound: int = codec.DEFAULT_RANK_BOUND  # blocks one of its ranks may hold (kv_event_codec.rank_bound)
    # After a refusal the worker is followed anew later each time (REFUSED_BACKOFF_S, doubling, up to
    # MAX_REFUSED_BACKOFF_S; back to 0 when it restarts): a worker that floods us is not read as fast as it sends.
    refused_backoff: float = 0.0
    instance_id: str = ""  # the instance its last subscription followed


class KvEventFeed:
    """Follows the KV events of every worker the pool runs `follow` for, into `index`.

    `retry_s`: wait before trying a failed worker again; `refused_backoff_s`: wait after the first refusal (then
    doubling, up to `max_refused_backoff_s`); `identity_check_s`: how often a feed followed without the pool's
    InstanceWatch reads ServerInfo itself to notice a restart (a ZMQ subscriber cannot: it reconnects silently);
    `replay_timeout_s`: how long a replay request may take."""

    def __init__(self, index: KvIndex, *, retry_s: float = 1.0, refused_backoff_s: float = REFUSED_BACKOFF_S,
                 max_refused_backoff_s: float = MAX_REFUSED_BACKOFF_S, identity_check_s: float = 2.0,
                 replay_timeout_s: float = 2.0, zmq_context: zmq.Context | None = None, metrics=None):
        self.index = index
        self.metrics = metrics  # orchestrator.metrics.Metrics: kv_events_refused (None: not counted)
        self.retry_s = retry_s
        self.refused_backoff_s = refused_backoff_s
        self.max_refused_backoff_s = max_refused_backoff_s
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
                    follower.refused_backoff = 0.0
                elif follower.refused_backoff > self.retry_s:
                    await self._refused_wait(follower, instance)
                else:
                    await trio.sleep(self.retry_s)
        finally:
            if self._followers.get(worker) is follower:  # (not forgotten, nor followed anew since)
                # Nobody keeps its event entries from now on: they go, and what we route there counts instead.
                self._followers.pop(worker)
                self.index.cleared(worker)
                self.index.set_mode(worker, "approximate")

    async def _refused_wait(self, follower: _Follower, instance: InstanceWatch) -> None:
        """The refusal backoff: over when it has passed, or sooner when the worker restarts (a new engine, which
        starts with a fresh backoff)."""
        with trio.move_on_after(follower.refused_backoff):
            await instance.changed_from(follower.instance_id)
            log.info("worker %s restarted: its KV events are followed again before their refusal backoff ended",
                     follower.worker)
            follower.refused_backoff = 0.0
            self.index.cleared_routed(follower.worker)  # what we routed there is gone from its cache

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
        follower.instance_id = info.instance_id
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
        follower.bound = codec.rank_bound(info.total_kv_blocks, len(valid))
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
        await self._clear_in_slices(follower)
        if not follower.active:
            return None
        if failures:
            failure = failures[0]
            if isinstance(failure, KvStreamBroken) and failure.reason:
                self._refused(follower, failure)
            elif _permanent(failure):  # this client or worker cannot stream them: nothing changes until a restart
                self.detail[worker] = f"KV events cannot be followed: {cause_chain(failure)}"
                follower.log("worker %s: KV events cannot be followed, routing it approximately: %s", worker,
                             cause_chain(failure))
                return info.instance_id
            else:
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

    def _refused(self, follower: _Follower, refusal: KvStreamBroken) -> None:
        """We refused what the worker sent: its entries are cleared (by the caller), and /health, the log and the
        metric say so; it is followed anew after its refusal backoff (REFUSED_BACKOFF_S, doubling)."""
        worker = follower.worker
        self.stats.refused += 1
        follower.refused_backoff = min(self.max_refused_backoff_s,
                                       max(self.retry_s, self.refused_backoff_s, 2 * follower.refused_backoff))
        if self.metrics is not None:
            self.metrics.kv_events_refused.labels(worker, refusal.reason).inc()
        self.detail[worker] = (f"KV events refused ({refusal.reason}): {refusal}; routed approximately, its events "
                               f"followed again in {follower.refused_backoff:g} s")
        follower.log("worker %s: KV events refused (%s), its index is cleared and its events followed again in %g s "
                     "(or when it restarts): %s", worker, refusal.reason, follower.refused_backoff, refusal)

    async def _clear_in_slices(self, follower: _Follower) -> None:
        self.stats.clears += 1
        for _ in codec.clear_slices(self.index, follower.worker):
            await trio.lowlevel.checkpoint()
            if not follower.active:
                return

    def _clear(self, worker: str, rank: int | None = None) -> None:
        self.stats.clears += 1
        self.index.cleared(worker, rank)

    # ---- revision 3: gRPC stream ---------------------------------------------------------------------
    async def _follow_grpc(self, follower: _Follower, client, ranks: list[int]) -> None:
        worker = follower.worker
        expected: dict[int, int] = {}
        async with client.subscribe_kv_events(max_message_bytes=codec.MAX_MESSAGE_BYTES) as stream:
            # Image blocks fail closed in this stream (AllBlocksCleared): they are never keyed from it.
            self._events_mode(follower, image_keys=False)
            while True:
                messages = await stream.get_batch()
                if not messages:
                    raise KvStreamBroken("SubscribeKvEvents ended")
                if not follower.active:
                    return
                for message in messages:
                    if isinstance(message, OversizeMessage):
                        raise KvStreamBroken(f"a SubscribeKvEvents message of {message.size} bytes, above our limit "
                                             f"of {codec.MAX_MESSAGE_BYTES}", "oversize")
                    if message.HasField("error"):
                        raise KvStreamBroken(f"SubscribeKvEvents error: {message.error}")
                    batch = message.batch
                    decoded = decode_proto_batch(batch, ranks)
                    rank = batch.data_parallel_rank
                    want = expected.get(rank)
                    if want is not None and batch.sequence_number != want:
                        self.stats.gaps += 1
                        follower.log("worker %s rank %d: KV event sequence %d after %d: its entries are cleared "
                                     "until rebuilt", worker, rank, batch.sequence_number, want - 1)
                        self._clear(worker, rank)
                    expected[rank] = batch.sequence_number + 1
                    await self._apply(follower, (worker, rank), decoded)
                    if not follower.active:
                        return

    # ---- revision 1: ZMQ per rank --------------------------------------------------------------------
    async def _follow_zmq(self, follower: _Follower, source: ZmqSource) -> None:
        where = (follower.worker, source.rank)
        # A bounded receive queue of our own (not the hwm the worker advertises) and a bounded message: a feed that
        # falls behind loses messages, and ZMQ drops a peer that sends a bigger one; both show as a gap (cleared),
        # rather than holding an unbounded backlog in memory.
        with _zmq_socket(self._context, zmq.SUB, source.endpoint, SUBSCRIBE=source.topic, RCVHWM=codec.RECEIVE_HWM,
                         MAXMSGSIZE=codec.MAX_MESSAGE_BYTES) as sub:
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
                await self._apply_zmq(follower, where, frames[2])
                if not follower.active:
                    return
                applied = sequence

    async def _apply_zmq(self, follower: _Follower, where: tuple[str, int], payload: bytes) -> None:
        batch = decode_wire_batch(payload, where[1])
        await self._apply(follower, where, batch)
        if not batch.image_keys and follower.image_keys and follower.active:
            follower.image_keys = False
            self._events_mode(follower, image_keys=False)

    async def _apply(self, follower: _Follower, where: tuple[str, int], batch: Batch) -> None:
        """One batch into the index, a slice at a time: the event loop runs between slices (a 1M-block batch
        stalled every request for 3.5 s). Stops where it is if the worker is forgotten meanwhile."""
        for _ in codec.apply(self.index, where, batch, follower.bound):
            await trio.lowlevel.checkpoint()
            if not follower.active:
                return
        self.stats.batches += 1

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
            with _zmq_socket(self._context, zmq.DEALER, source.replay_endpoint, RCVHWM=codec.RECEIVE_HWM,
                             MAXMSGSIZE=codec.MAX_MESSAGE_BYTES) as replay:
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
                await self._apply_zmq(follower, where, payload)
                if not follower.active:
                    return applied
                applied = sequence
        return applied

