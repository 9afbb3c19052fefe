"""H2Channel: a worker's gRPC calls over our own HTTP/2 connection on trio (framing: transport/http2.py), the
default WorkerChannel (transport/calls.py): Generate streams and the unary control calls (Health, GetLoad,
ServerInfo, ModelInfo, Abort).

Why: grpc.aio hands every streamed message from grpc's event-engine thread to its poller thread, to the
asyncio loop thread and then to trio; each message costs about 30 µs of CPU in grpcio alone
(benchmarks/cpu_cost.py prints the floor), and an idle health poll wakes four threads. Here the bytes
arrive on trio's own thread: transport/http2.py parses the frames into events, transport/grpc_framing.py cuts
the gRPC length-prefixed messages and reads the status (both pure), and we act on them: decode the messages,
hand them to the call's reader, end or fail the call.

One H2Channel per worker keeps one connection, opened on first use and again after it failed; every
stream of that worker is multiplexed on it. What of gRPC over HTTP/2 (PROTOCOL-HTTP2.md) it implements
(tests/unit/test_transport_conformance.py holds it to it, against h2's server side and a stock grpc.aio server):
- the request: HEADERS (`:method POST`, `:scheme`, `:path /package.Service/Method`, `:authority`,
  `content-type: application/grpc`, `te: trailers`, `grpc-accept-encoding: identity`, `user-agent`, and a
  unary call's timeout as `grpc-timeout`), one length-prefixed uncompressed message, END_STREAM; sent within
  the peer's flow control windows (a 20 MB request with images waits for WINDOW_UPDATEs);
- the response: messages cut from DATA frames whatever their split, at most MAX_MESSAGE_BYTES (64 MiB, as
  grpcio): a larger length prefix fails the call RESOURCE_EXHAUSTED at once, nothing of it buffered; a
  stream's flow-control credit goes back as its reader takes the messages (STREAM_RECEIVE_WINDOW bytes wait
  at most: a slow reader holds up its worker, not our memory); a message flagged compressed is inflated when
  the response's `grpc-encoding` is gzip or deflate (a grpc-core server with a default compression algorithm
  compresses whatever the client accepts), to at most 64 MiB, and fails the call INTERNAL otherwise;
- the status: `grpc-status` / `grpc-message` from the trailers or a trailers-only response, mapped by
  errors.from_grpc_status exactly as for grpcio; without a grpc-status, a `:status` other than 200 maps as
  gRPC maps HTTP statuses (a proxy, or no gRPC server); a `content-type` other than application/grpc*, a
  grpc-status that is not a number, and every HTTP/2 stream error (transport/http2.py) fail that call INTERNAL
  and only it; a call failed while its stream is open resets it (RST_STREAM CANCEL), so the worker stops
  and the stream slot is free;
- leaving a stream early (a cancelled scope, a client that went away) sends RST_STREAM(CANCEL), which
  the server sees as a cancelled RPC; a stream whose caller read its terminal event (`let_end`) is left
  to end with its trailers instead (engine/client.py says why), and reset only if it lingers past
  calls.STATUS_GRACE_S;
- a lost connection fails every open stream as WorkerUnavailable (retryable); GOAWAY fails the streams the
  server will not process, naming its code and debug data, and new streams, and those waiting for a slot on
  that connection, go to a new one;
- the peer's SETTINGS_MAX_CONCURRENT_STREAMS: a new stream waits for a free slot;
- keepalive PINGs that respect the server's ping policy (transport/keepalive.py), their ACKs matched to them;
- a unary call's DEADLINE_EXCEEDED (retryable) when its timeout passes.
Plaintext (h2c with prior knowledge, TensorRT-LLM's default) or TLS with ALPN h2 (workers_tls).
What it deliberately does not do: compress requests, or ask for compressed responses (inflating costs CPU
on every token); client or bidirectional streaming (every call sends one message); request metadata other
than what a call is given (a leg's trace context), and response metadata other than the status (initial
metadata is read for its status only;
`grpc-status-details-bin` is ignored); retries, hedging and transparent retries of streams a GOAWAY or
REFUSED_STREAM turned away (they fail retryable: the orchestrator retries at its own level); name
resolution and load balancing (one address per worker); sizing windows by BDP probes (fixed windows).
"""

from __future__ import annotations

import collections
import logging
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import trio

from orchestrator.net.eager_receive import EagerReceiver
from orchestrator.net.eager_send import EagerSender
from orchestrator.transport import calls, http2
from orchestrator.transport.errors import EngineError, from_grpc_status
from orchestrator.transport.grpc_framing import CallFailure, ResponseFraming, prefix
from orchestrator.transport.http2 import (
    CAPACITY_FREED,
    DATA_RECEIVED,
    GOAWAY_RECEIVED,
    HEADERS_RECEIVED,
    PING_ACKED,
    STREAM_BROKEN,
    STREAM_ENDED,
    STREAM_RESET,
)
from orchestrator.transport.inbox import TrioInbox
from orchestrator.transport.keepalive import KeepalivePolicy

log = logging.getLogger("orchestrator.engine")  # the engine client's logger: one name for a worker's troubles

# Receive flow control: each stream may have STREAM_RECEIVE_WINDOW bytes on their way or waiting for its reader,
# credited back as the reader takes them (a reader that does not read stops its worker there); the connection's
# window is credited as bytes arrive, so that one slow reader never stalls the other streams.
STREAM_RECEIVE_WINDOW = 1024 * 1024
CONNECTION_RECEIVE_WINDOW = 16 * 1024 * 1024
_FRESH_CONNECTION_TRIES = 3  # a call that never started on a connection that went away tries a new one
_READ_SIZE = 256 * 1024


class H2Stream(TrioInbox):
    """The messages of one call as they arrive, decoded; read with get_batch()."""

    __slots__ = ("id", "rpc", "decode", "let_end", "unread", "response", "_connection", "_outbound")

    def __init__(self, rpc: str, decode: Callable[[bytes], Any], request: bytes):
        super().__init__()
        self.id = 0
        self.rpc = rpc
        self.decode = decode
        self.let_end = False  # the caller is done and the call is over but for its status: do not reset it
        self.unread = 0  # DATA bytes behind messages still queued for the reader: their credit waits for it
        self.response = ResponseFraming()  # its messages cut and its status read (transport/grpc_framing.py)
        self._connection: WorkerConnection | None = None
        self._outbound = prefix(request) + request

    def _taken(self) -> None:
        if self.unread and self._connection is not None:  # the reader took them: the worker may send that much more
            self._connection._credit(self, flush=True)

    def _close(self, error: BaseException | None) -> None:
        if not self._closed:
            self._closed, self._error = True, error
            self._wake_reader()


def _why_not_connected(exc: BaseException) -> str:
    """trio reports 'all attempts to connect failed' with the reasons in a group behind it: name them."""
    group = exc.__cause__
    if isinstance(group, BaseExceptionGroup):
        reasons = [str(leaf) for leaf in _leaves(group)]
        return "; ".join(dict.fromkeys(reasons)) or str(exc)
    return str(exc)


def _leaves(group: BaseExceptionGroup):
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            yield from _leaves(error)
        else:
            yield error


def _grpc_timeout(seconds: float) -> bytes:
    """A `grpc-timeout` field (at most 8 digits and a unit), HPACK-encoded to follow a cached header block."""
    millis = max(1, int(seconds * 1000))
    value = f"{millis}m" if millis < 10**8 else f"{min(max(1, int(seconds)), 10**8 - 1)}S"
    return http2.encode_headers([(b"grpc-timeout", value.encode())])


class H2Channel:
    """The HTTP/2 connection to one worker for its streaming calls; lives in `nursery`."""

    def __init__(self, address: str, *, worker: str, nursery: trio.Nursery, ssl_context: ssl.SSLContext | None = None,
                 server_name: str | None = None, keepalive: KeepalivePolicy | None = None):
        host, _, port = address.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.authority = address
        self.worker = worker
        self._nursery = nursery
        self._ssl_context = ssl_context
        self._server_name = server_name or self.host
        self._connection: WorkerConnection | None = None
        self._connecting = trio.Lock()
        self._closed = False
        self._header_blocks: dict[tuple[str, str], bytes] = {}
        self.keepalive = keepalive or KeepalivePolicy()  # this worker's, across its connections

    def header_block(self, path: str, scheme: str) -> bytes:
        """The request headers of a call to `path`, HPACK-encoded once (they never change)."""
        block = self._header_blocks.get((path, scheme))
        if block is None:
            block = self._header_blocks[path, scheme] = http2.encode_headers([
                (b":method", b"POST"), (b":scheme", scheme.encode()), (b":path", path.encode()),
                (b":authority", self.authority.encode()), (b"content-type", b"application/grpc"),
                (b"te", b"trailers"), (b"grpc-accept-encoding", b"identity"), (b"user-agent", b"orchestrator-h2")])
        return block

    async def _current(self, rpc: str) -> WorkerConnection:
        connection = self._connection
        if connection is not None and connection.usable and not self._closed:
            return connection  # the usual case, without the lock's checkpoint (a pass through the scheduler)
        async with self._connecting:
            if self._closed:
                raise EngineError("engine client closed", worker=self.worker, rpc=rpc)
            if self._connection is None or not self._connection.usable:
                self._connection = await self._connect(rpc)
            return self._connection

    async def _connect(self, rpc: str) -> WorkerConnection:
        try:
            transport: trio.abc.Stream = await trio.open_tcp_stream(self.host, self.port)
            if self._ssl_context is not None:
                transport = trio.SSLStream(transport, self._ssl_context, server_hostname=self._server_name)
                await transport.do_handshake()
                if transport.selected_alpn_protocol() != "h2":
                    await trio.aclose_forcefully(transport)
                    raise unavailable(f"the TLS handshake with {self.authority} did not select h2 (ALPN)",
                                      worker=self.worker, rpc=rpc)
        except (OSError, trio.BrokenResourceError, ssl.SSLError) as exc:
            raise unavailable(f"cannot connect to {self.authority}: {_why_not_connected(exc)}", worker=self.worker,
                              rpc=rpc) from exc
        connection = WorkerConnection(transport, self, "https" if self._ssl_context else "http")
        await self._nursery.start(connection.run)
        return connection

    @asynccontextmanager
    async def stream(self, path: str, request: bytes, decode: Callable[[bytes], Any], *,
                     timeout: float | None = None,
                     metadata: tuple[tuple[str, str], ...] = ()) -> AsyncIterator[H2Stream]:
        """Start the call `path` with one request message; leaving early cancels it (RST_STREAM).
        `decode` turns each response message into what get_batch() hands out; a message it turns into None
        is dropped. `timeout` is sent as `grpc-timeout` (the server's deadline); the caller enforces its own.
        `metadata` (lower-case ASCII keys) goes out as request headers, as grpcio sends call metadata."""
        rpc = path.rsplit("/", 1)[-1]
        stream = H2Stream(rpc, decode, request)
        extra_headers = b"" if timeout is None else _grpc_timeout(timeout)
        if metadata:
            extra_headers += http2.encode_headers([(key.encode(), value.encode()) for key, value in metadata])
        for _ in range(_FRESH_CONNECTION_TRIES):
            connection = await self._current(rpc)
            if await connection.start(stream, path, extra_headers):
                break
            # The connection went away (GOAWAY, or lost) while the call waited for a stream slot there: it never
            # started, so a fresh connection takes it instead of failing it (and burning one of its retries).
        else:
            raise unavailable(f"{self.authority} went away {_FRESH_CONNECTION_TRIES} times before the call could "
                              f"start", worker=self.worker, rpc=rpc)
        try:
            yield stream
        finally:
            # Synchronous on purpose: a cancelled caller cannot await here, and its RST_STREAM must still go out
            # (finish queues it and sends what the socket takes at once; the writer task sends the rest).
            connection.finish(stream)

    async def unary(self, path: str, request: bytes, decode: Callable[[bytes], Any], *,
                    timeout: float | None, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
        """A unary call: its one response message, or the EngineError grpcio would give (DEADLINE_EXCEEDED
        after `timeout`)."""
        rpc = path.rsplit("/", 1)[-1]
        messages: list = []
        with trio.move_on_after(timeout if timeout is not None else float("inf")) as deadline:
            async with self.stream(path, request, decode, timeout=timeout, metadata=metadata) as stream:
                while batch := await stream.get_batch():
                    messages.extend(batch)
        if deadline.cancelled_caught:
            raise from_grpc_status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", worker=self.worker,
                                   rpc=rpc)
        if len(messages) != 1:
            raise EngineError(f"a unary call answered with {len(messages)} messages", worker=self.worker, rpc=rpc)
        return messages[0]

    def close(self) -> None:
        self._closed = True
        if self._connection is not None:
            self._connection.close()

    async def aclose(self) -> None:
        """WorkerChannel's close: nothing to wait for (the connection's tasks end in their nursery)."""
        self.close()

    def fail_if_silent(self, quiet_s: float, why: str) -> int:
        """Drop the connection and fail its calls as WorkerUnavailable (retryable: they retry or migrate
        elsewhere) when it has calls open and nothing arrived on it for `quiet_s` seconds; how many calls.
        For the pool, whose health check found the worker unresponsive: a frozen process (SIGSTOP, a hung
        host) keeps its connection open, and the keepalive would take KEEPALIVE_S + KEEPALIVE_TIMEOUT_S to
        notice. A worker that is only slow to answer its health check still sends its tokens: it is left be."""
        connection = self._connection
        if connection is None or not connection.usable or not connection.streams:
            return 0
        if trio.current_time() - connection.last_arrival < quiet_s:
            return 0
        calls = len(connection.streams)
        connection.usable = False  # new calls go to a new connection at once
        connection._fail(trio.BrokenResourceError(why))  # the connection's task fails every open stream with it
        return calls


class WorkerConnection:
    """One HTTP/2 connection (transport/http2.py does the framing): a reader, a writer and a keepalive task."""

    def __init__(self, transport: trio.abc.Stream, channel: H2Channel, scheme: str):
        self.transport = transport
        self.sender = EagerSender(transport)
        self.receiver = EagerReceiver(transport)
        self.channel = channel
        self.scheme = scheme
        self.framing = http2.ClientConnection(receive_window=STREAM_RECEIVE_WINDOW,
                                              connection_window=CONNECTION_RECEIVE_WINDOW)
        self.streams: dict[int, H2Stream] = {}
        self.usable = True  # false after GOAWAY or a failure: new streams go to a new connection
        self.goaway = ""  # the worker's GOAWAY, named for the errors of the calls it ends ("GOAWAY CODE: debug")
        self.pings_sent = 0
        self._dirty = trio.Event()  # set when the framing has bytes to send
        self._slot_freed = trio.Event()
        self._failure: BaseException | None = None  # why the connection ended, for the streams it fails
        self._lingering: list[H2Stream] = []  # left to end by themselves and still open at the last sweep
        self._arrived: list[H2Stream] = []  # streams given messages by the read being processed
        self._scope = trio.CancelScope()
        # When bytes last came from the worker, or run() began: the keepalive pings only after this much quiet
        # (transport/keepalive.py), and H2Channel.fail_if_silent fails the calls of a worker silent for long.
        self.last_arrival = 0.0
        self._last_ping = 0.0  # the PING awaiting its ACK, and how many went since the last HEADERS or DATA
        self._pings_since_data = 0
        self._ping_payload = b""
        self._ping_answered = trio.Event()

    # ---- the three tasks: reader, writer, keepalive ----------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read, write and keep alive until the connection fails or is closed; then fail what is open."""
        self.last_arrival = trio.current_time()
        self.framing.initiate()
        self._dirty.set()
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._until_failure, self._write)
                    nursery.start_soon(self._until_failure, self._keepalive)
                    task_status.started()
                    await self._until_failure(self._read)
        finally:
            self.usable = False
            self._fail_all(self._failure)
            with trio.CancelScope(shield=True):
                if isinstance(self._failure, http2.ProtocolError):
                    await self._tell_goaway()
                await trio.aclose_forcefully(self.transport)

    async def _tell_goaway(self) -> None:
        """Best effort: the GOAWAY naming the worker's protocol error, before we hang up."""
        with trio.move_on_after(0.2):
            try:
                await self.transport.send_all(self.framing.data_to_send())
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError,
                    ssl.SSLError):
                pass

    async def _until_failure(self, part: Callable[[], Any]) -> None:
        """Run one of the connection's tasks; the first to fail records why and ends the others."""
        try:
            await part()
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError,
                http2.ProtocolError) as exc:
            self._fail(exc)
        except Exception as exc:  # a bug here must fail this worker's streams, not the whole client
            log.exception("HTTP/2 connection to %s failed", self.channel.authority)
            self._fail(exc)
        else:
            self._fail(None)

    def _fail(self, cause: BaseException | None) -> None:
        """End the connection; the first cause recorded is what its open streams are failed with."""
        self._failure = self._failure or cause
        self._scope.cancel()

    async def _read(self) -> None:
        while True:
            data = await self.receiver.receive_some(_READ_SIZE)
            if not data:
                raise trio.BrokenResourceError("the worker closed the connection")
            self.last_arrival = trio.current_time()
            try:
                try:
                    events = self.framing.receive(data)
                except http2.ProtocolError as exc:
                    self._act(exc.events)  # what came before the broken frame (the connection fails after it)
                    raise
                self._act(events)
            finally:
                self._kick()  # acknowledgements, WINDOW_UPDATEs, more request body; a GOAWAY on an error

    async def _keepalive(self) -> None:
        """PINGs by the keepalive policy while streams are open, and the sweep of streams left lingering."""
        policy = self.channel.keepalive
        next_sweep = trio.current_time() + calls.STATUS_GRACE_S
        while True:
            ping_at = self._ping_due() if self.streams else trio.current_time() + policy.interval_s
            await trio.sleep_until(min(ping_at, next_sweep))
            now = trio.current_time()
            if now >= next_sweep:
                self._reset_lingering()
                next_sweep = now + calls.STATUS_GRACE_S
            if self.streams and now >= self._ping_due():  # (anything heard meanwhile moved it later)
                await self._ping(policy.timeout_s)

    def _ping_due(self) -> float:
        return self.channel.keepalive.ping_due(quiet_since=self.last_arrival, last_ping=self._last_ping,
                                               pings_since_data=self._pings_since_data)

    async def _ping(self, timeout: float) -> None:
        """One PING, answered by an ACK with its own payload within `timeout`, or the connection has failed."""
        self.pings_sent += 1
        self._pings_since_data += 1
        self._last_ping = trio.current_time()
        self._ping_payload = self.pings_sent.to_bytes(8, "big")
        self._ping_answered = trio.Event()
        self.framing.ping(self._ping_payload)
        self._kick()
        with trio.move_on_after(timeout):
            await self._ping_answered.wait()
            return
        raise trio.BrokenResourceError(f"no answer to a keepalive ping within {timeout:g} s")

    def _kick(self) -> None:
        if self.framing.wants_to_send:
            self._dirty.set()

    def _flush(self) -> None:
        """Send what the framing has from the calling task when the socket takes it at once (no pass through the
        writer task); the rest, if any, goes back first in line for the writer."""
        # While the writer is in a send (busy) or due to run (dirty), bytes sent from here would cut into or
        # overtake what it took: frames must leave in the order the framing queued them.
        if not self.framing.wants_to_send or self.sender.busy or self._dirty.is_set():
            self._kick()
            return
        try:
            rest = self.sender.send_nowait(self.framing.data_to_send())
        except trio.BrokenResourceError as exc:
            self._fail(exc)
            return
        if rest:
            self.framing.put_back(rest)
            self._dirty.set()

    async def _write(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            data = self.framing.data_to_send()
            if data:
                await self.sender.send_all(data)

    # ---- streams ---------------------------------------------------------------------------------
    async def start(self, stream: H2Stream, path: str, extra_headers: bytes = b"") -> bool:
        """Open `stream` once a slot is free; False when the connection went away first (the call never started
        here: the channel takes it to a fresh connection)."""
        while self.usable and not self.framing.can_open:
            await self._slot_freed.wait()
        if not self.usable or self.framing.going_away:
            self.usable = False
            return False
        if not self.streams:  # an idle connection: its silence so far says nothing about this call
            self.last_arrival = trio.current_time()
        stream._connection = self
        stream.id = self.framing.open_stream(stream, self.channel.header_block(path, self.scheme) + extra_headers,
                                          stream._outbound)
        self.streams[stream.id] = stream
        if self.framing.going_away:  # stream ids ran out: this one is the last on this connection
            self.usable = False
        self._flush()
        return True

    def finish(self, stream: H2Stream) -> None:
        """The caller is done with `stream`: a call still running is cancelled, unless it is only its status
        that is still to come (`let_end`): then its trailers end it, and what else arrives is dropped."""
        if not stream.closed:
            if stream.let_end and self.usable:
                stream._items = collections.deque(maxlen=0)
                if stream.unread:  # nobody will read what was queued: its credit goes back now
                    self._credit(stream, flush=True)
                return
            self._cancel(stream)
        stream._close(stream._error)
        self._forget(stream)

    def _credit(self, stream: H2Stream, *, flush: bool = False) -> None:
        """What `stream` received is read (or will never be): its flow-control credit goes back to the worker.
        From the reader's task the WINDOW_UPDATE is sent at once (`flush`); the connection's reader sends its
        own after each read."""
        count, stream.unread = stream.unread, 0
        if stream.id in self.streams:
            self.framing.consumed(stream.id, count)
            if flush:
                self._flush()

    def _reset_lingering(self) -> None:
        """A stream left to end by itself that is still open a sweep (STATUS_GRACE_S) later is reset: a worker
        that never sends its trailers cannot hold a stream slot forever."""
        for stream in self._lingering:
            if stream.id in self.streams:
                self._abandon(stream, None)
        self._lingering = [stream for stream in self.streams.values() if stream.let_end]

    def _abandon(self, stream: H2Stream, error: BaseException | None) -> None:
        """Give up on a call: reset it on the worker, end it for its reader with `error`, free its slot."""
        self._cancel(stream)
        stream._close(error)
        self._forget(stream)

    def _cancel(self, stream: H2Stream) -> None:
        if stream.id in self.streams and self.usable:
            self.framing.reset(stream.id, http2.CANCEL)
            self._flush()

    def close(self) -> None:
        self.usable = False
        self._scope.cancel()

    def _forget(self, stream: H2Stream) -> None:
        if self.streams.pop(stream.id, None) is not None:
            self._on_capacity()

    # ---- what the worker sent (transport/http2.py's events) -------------------------------------------
    def _act(self, events: list[http2.Event]) -> None:
        """Act on what one read meant, in order, then hand each stream's new messages to its reader together (one
        wake-up, or one direct delivery: transport/inbox.py). A stream failed by an earlier event of the same read
        (a message that does not decode, a bad status) is closed: what the read held for it after that is dropped,
        as the framing drops what comes for a stream once we reset it."""
        for kind, stream, detail in events:
            if kind == DATA_RECEIVED:  # most events, a token each: handled here, without a call
                if stream._closed:
                    continue
                self._pings_since_data = 0  # the worker sent DATA: its ping strikes are forgiven (keepalive.py)
                size = len(detail)
                stream.unread += size
                # ResponseFraming.data's usual case, one whole message in one frame, without the call (a call costs
                # about as much as the rest of a token's work here); anything else goes through it.
                if size >= 5 and detail[0] == 0 and int.from_bytes(detail[1:5], "big") == size - 5 \
                        and not stream.response.pending:
                    if not self._deliver(stream, detail[5:]):
                        continue
                elif not self._on_messages(stream, stream.response.data(detail)):
                    continue
                if not stream._items and stream.unread:  # nothing waits for the reader (a message in part, dropped)
                    self._credit(stream)
            elif kind == CAPACITY_FREED:
                self._on_capacity()
            elif kind == HEADERS_RECEIVED:
                if not stream._closed:
                    self._on_headers(stream, detail)
            elif kind == STREAM_ENDED:
                if not stream._closed:
                    self._on_end(stream)
            elif kind == STREAM_RESET:
                if not stream._closed:
                    self._on_reset(stream, detail)
            elif kind == STREAM_BROKEN:
                if not stream._closed:
                    self._on_stream_error(stream, *detail)
            elif kind == GOAWAY_RECEIVED:
                self._on_goaway(*detail)
            elif kind == PING_ACKED:
                self._on_ping_ack(detail)
        # (here, not in a method of its own: a call less per read)
        arrived, self._arrived = self._arrived, []
        for stream in arrived:
            try:
                stream.hand_over()
            except Exception as exc:  # a bug in a reader's direct handler fails its own call, not the connection
                log.exception("handing over the messages of %s stream %d from %s failed", stream.rpc, stream.id,
                              self.channel.authority)
                self._abandon(stream, exc)
                continue
            if not stream._items and stream.unread:  # the direct handler took them all
                self._credit(stream)

    def _on_messages(self, stream: H2Stream, messages: list[bytes]) -> bool:
        """The messages ResponseFraming.data cut, to the reader; False when the call failed on one of them (or on
        what followed them: the framing's `failure`)."""
        for message in messages:
            if not self._deliver(stream, message):
                return False
        if stream.response.failure is not None:
            self._abandon(stream, self._failed(stream, stream.response.failure))
            return False
        return True

    def _on_capacity(self) -> None:
        self._slot_freed.set()
        self._slot_freed = trio.Event()

    def _on_reset(self, stream: H2Stream, code: int) -> None:
        stream._close(self._reset_error(stream, code))
        self._forget(stream)

    def _on_stream_error(self, stream: H2Stream, code: int, why: str) -> None:
        """The framing reset a stream whose frames broke HTTP/2: that call fails, the others go on."""
        stream._close(self._error(grpc.StatusCode.INTERNAL, stream, f"the worker broke HTTP/2 on this stream: {why}"))
        self._forget(stream)

    def _on_goaway(self, code: int, debug: bytes, refused: list[H2Stream]) -> None:
        self.usable = False
        detail = debug.decode("utf-8", "replace")[:200].strip()
        self.goaway = f"GOAWAY {http2.error_name(code)}" + (f": {detail}" if detail else "")
        if code == http2.ENHANCE_YOUR_CALM and debug == b"too_many_pings":
            keepalive = self.channel.keepalive
            if keepalive.too_many_pings():
                log.warning("worker %s closed a connection with GOAWAY too_many_pings: its ping policy is stricter "
                            "than our keepalive; pinging it at most every %g s from now on (doubled again at each "
                            "further one, not logged)", self.channel.authority, keepalive.interval_s)
        for stream in refused:
            stream._close(self._unavailable(stream.rpc, f"the worker is going away ({self.goaway}) and did not "
                                                        f"start this call"))
            self._forget(stream)
        self._on_capacity()  # callers waiting for a slot here go to a new connection

    def _on_ping_ack(self, payload: bytes) -> None:
        if payload == self._ping_payload:  # an ACK of some other PING answers nothing we asked
            self._ping_answered.set()

    def _deliver(self, stream: H2Stream, payload: bytes) -> bool:
        try:
            item = stream.decode(payload)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or anything a decoder raises on bad bytes
            error = EngineError(f"the worker sent a message that does not decode: {exc}", worker=self.channel.worker,
                                rpc=stream.rpc)
            self._abandon(stream, error)
            return False
        if item is not None:  # None: a message that says nothing the reader needs (decode's choice)
            if not stream._items:
                self._arrived.append(stream)
            stream._items.append(item)
        return True

    def _on_headers(self, stream: H2Stream, headers: list[tuple[bytes, bytes]]) -> None:
        self._pings_since_data = 0  # the worker sent HEADERS: its ping strikes are forgiven
        failure = stream.response.headers(headers)
        if failure is not None:
            self._abandon(stream, self._failed(stream, failure))

    def _on_end(self, stream: H2Stream) -> None:
        failure = stream.response.end()
        stream._close(None if failure is None else self._failed(stream, failure))
        self._forget(stream)

    def _failed(self, stream: H2Stream, failure: CallFailure) -> EngineError:
        """What a call fails with for what its response said (no status: a response that broke off)."""
        if failure.status is None:
            return EngineError(failure.why, worker=self.channel.worker, rpc=stream.rpc)
        return self._error(failure.status, stream, failure.why)

    def _reset_error(self, stream: H2Stream, code: int) -> EngineError:
        # gRPC's mapping of HTTP/2 error codes: REFUSED_STREAM is safe to retry; CANCEL is a cancelled call.
        if code == http2.REFUSED_STREAM:
            return self._unavailable(stream.rpc, "the worker refused the stream (REFUSED_STREAM)")
        status = grpc.StatusCode.CANCELLED if code == http2.CANCEL else grpc.StatusCode.INTERNAL
        return self._error(status, stream, f"the worker reset the stream ({http2.error_name(code)})")

    def _error(self, status: grpc.StatusCode, stream: H2Stream, why: str) -> EngineError:
        return from_grpc_status(status, why, worker=self.channel.worker, rpc=stream.rpc)

    def _unavailable(self, rpc: str, why: str) -> EngineError:
        return unavailable(f"{why} ({self.channel.authority})", worker=self.channel.worker, rpc=rpc)

    def _fail_all(self, cause: BaseException | None) -> None:
        why = f"the connection to the worker was lost: {cause}" if cause else "the connection to the worker closed"
        if self.goaway:
            why += f", after {self.goaway}"
        for stream in list(self.streams.values()):
            error = self._unavailable(stream.rpc, why)
            error.__cause__ = cause
            stream._close(error)
            self._forget(stream)


def unavailable(why: str, *, worker: str, rpc: str) -> EngineError:
    """What grpcio reports for a worker it cannot reach (WorkerUnavailable, retryable)."""
    return from_grpc_status(grpc.StatusCode.UNAVAILABLE, why, worker=worker, rpc=rpc)
