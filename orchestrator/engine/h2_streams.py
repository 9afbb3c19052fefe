"""gRPC calls over our own HTTP/2 connection on trio (framing: engine/http2.py): Generate streams and the
unary control calls (Health, GetLoad, ServerInfo, ModelInfo, Abort).

Why: grpc.aio hands every streamed message from grpc's event-engine thread to its poller thread, to the
asyncio loop thread and then to trio; each message costs about 30 µs of CPU in grpcio alone
(benchmarks/cpu_cost.py prints the floor), and an idle health poll wakes four threads. Here the bytes
arrive on trio's own thread: engine/http2.py parses the frames, we cut the gRPC length-prefixed messages
and decode them.

One H2Channel per worker keeps one connection, opened on first use and again after it failed; every
stream of that worker is multiplexed on it. What is kept from gRPC over HTTP/2:
- the request: HEADERS (`:path /package.Service/Method`, `content-type: application/grpc`,
  `te: trailers`), one length-prefixed uncompressed message, END_STREAM; sent within the peer's flow
  control windows (a 20 MB request with images waits for WINDOW_UPDATEs);
- the response: messages cut from DATA frames whatever their split, flow-control credit returned as
  they are read, `grpc-status` / `grpc-message` from the trailers (or a trailers-only response)
  mapped by errors.from_grpc_status, exactly as for grpcio;
- leaving a stream early (a cancelled scope, a client that went away) sends RST_STREAM(CANCEL), which
  the server sees as a cancelled RPC; a stream whose caller read its terminal event (`let_end`) is left
  to end with its trailers instead (engine/client.py says why), and reset only if it lingers past a
  keepalive period;
- a lost connection fails every open stream as WorkerUnavailable (retryable); GOAWAY fails the streams
  the server will not process and sends new streams to a new connection;
- the peer's SETTINGS_MAX_CONCURRENT_STREAMS: a new stream waits for a free slot;
- a unary call's timeout as `grpc-timeout`, and DEADLINE_EXCEEDED (retryable) when it passes.
Plaintext (h2c, TensorRT-LLM's default) or TLS with ALPN h2 (workers_tls).
"""

from __future__ import annotations

import collections
import logging
import os
import ssl
import urllib.parse
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import grpc
import trio

from orchestrator.eager_receive import EagerReceiver
from orchestrator.eager_send import EagerSender
from orchestrator.engine import http2
from orchestrator.engine.errors import EngineError, from_grpc_status, grpc_status_from_number
from orchestrator.engine.inbox import TrioInbox

log = logging.getLogger("orchestrator.engine")

_WINDOW = 16 * 1024 * 1024  # our receive window, per stream and for the connection: no stall on long streams
_READ_SIZE = 256 * 1024
# While streams are open, a PING every KEEPALIVE_S that must be answered within KEEPALIVE_TIMEOUT_S: a worker
# host that vanished (no FIN, no RST) fails its streams in seconds, as grpcio's keepalive does with our options.
KEEPALIVE_S = 30.0
KEEPALIVE_TIMEOUT_S = 10.0
_HEADER = 5  # gRPC message prefix: 1 byte compressed flag, 4 bytes big-endian length


class H2Stream(TrioInbox):
    """The messages of one call as they arrive, decoded; read with get_batch()."""

    __slots__ = ("id", "rpc", "decode", "let_end", "_buffer", "_status", "_message", "_outbound")

    def __init__(self, rpc: str, decode: Callable[[bytes], Any], request: bytes):
        super().__init__()
        self.id = 0
        self.rpc = rpc
        self.decode = decode
        self.let_end = False  # the caller is done and the call is over but for its status: do not reset it
        self._buffer = bytearray()
        self._status: int | None = None
        self._message = ""
        self._outbound = _prefix(request) + request

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


def _prefix(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big")


class H2Channel:
    """The HTTP/2 connection to one worker for its streaming calls; lives in `nursery`."""

    def __init__(self, address: str, *, worker: str, nursery: trio.Nursery, ssl_context: ssl.SSLContext | None = None,
                 server_name: str | None = None):
        host, _, port = address.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.authority = address
        self.worker = worker
        self._nursery = nursery
        self._ssl_context = ssl_context
        self._server_name = server_name or self.host
        self._connection: _Connection | None = None
        self._connecting = trio.Lock()
        self._closed = False
        self._header_blocks: dict[tuple[str, str], bytes] = {}

    def header_block(self, path: str, scheme: str) -> bytes:
        """The request headers of a call to `path`, HPACK-encoded once (they never change)."""
        block = self._header_blocks.get((path, scheme))
        if block is None:
            block = self._header_blocks[path, scheme] = http2.encode_headers([
                (b":method", b"POST"), (b":scheme", scheme.encode()), (b":path", path.encode()),
                (b":authority", self.authority.encode()), (b"content-type", b"application/grpc"),
                (b"te", b"trailers"), (b"user-agent", b"orchestrator-h2")])
        return block

    async def _current(self, rpc: str) -> "_Connection":
        connection = self._connection
        if connection is not None and connection.usable and not self._closed:
            return connection  # the usual case, without the lock's checkpoint (a pass through the scheduler)
        async with self._connecting:
            if self._closed:
                raise EngineError("engine client closed", worker=self.worker, rpc=rpc)
            if self._connection is None or not self._connection.usable:
                self._connection = await self._connect(rpc)
            return self._connection

    async def _connect(self, rpc: str) -> "_Connection":
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
        connection = _Connection(transport, self, "https" if self._ssl_context else "http")
        await self._nursery.start(connection.run)
        return connection

    @asynccontextmanager
    async def stream(self, path: str, request: bytes, decode: Callable[[bytes], Any], *,
                     timeout: float | None = None) -> AsyncIterator[H2Stream]:
        """Start the call `path` with one request message; leaving early cancels it (RST_STREAM).
        `decode` turns each response message into what get_batch() hands out; a message it turns into None
        is dropped. `timeout` is sent as `grpc-timeout` (the server's deadline); the caller enforces its own."""
        rpc = path.rsplit("/", 1)[-1]
        connection = await self._current(rpc)
        stream = H2Stream(rpc, decode, request)
        await connection.start(stream, path, b"" if timeout is None else _grpc_timeout(timeout))
        try:
            yield stream
        finally:
            connection.finish(stream)

    async def unary(self, path: str, request: bytes, decode: Callable[[bytes], Any], *,
                    timeout: float | None) -> Any:
        """A unary call: its one response message, or the EngineError grpcio would give (DEADLINE_EXCEEDED
        after `timeout`)."""
        rpc = path.rsplit("/", 1)[-1]
        messages: list = []
        with trio.move_on_after(timeout if timeout is not None else float("inf")) as deadline:
            async with self.stream(path, request, decode, timeout=timeout) as stream:
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


class _Connection:
    """One HTTP/2 connection (engine/http2.py does the framing): a reader, a writer and a keepalive task."""

    def __init__(self, transport: trio.abc.Stream, channel: H2Channel, scheme: str):
        self.transport = transport
        self.sender = EagerSender(transport)
        self.receiver = EagerReceiver(transport)
        self.channel = channel
        self.scheme = scheme
        self.wire = http2.ClientConnection(self, receive_window=_WINDOW)
        self.streams: dict[int, H2Stream] = {}
        self.usable = True  # false after GOAWAY or a failure: new streams go to a new connection
        self._dirty = trio.Event()  # set when the wire has bytes to send
        self._slot_freed = trio.Event()
        self._ping_answered = trio.Event()
        self._failure: BaseException | None = None  # why the connection ended, for the streams it fails
        self._lingering: list[H2Stream] = []  # left to end by themselves and still open at the last keepalive
        self._arrived: list[H2Stream] = []  # streams given messages by the read being processed
        self._scope = trio.CancelScope()
        self.last_arrival = 0.0  # when bytes last came from the worker, or run() began (H2Channel.fail_if_silent)

    # ---- the three tasks: reader, writer, keepalive ----------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read, write and keep alive until the connection fails or is closed; then fail what is open."""
        self.last_arrival = trio.current_time()
        self.wire.initiate()
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
                await self.transport.send_all(self.wire.data_to_send())
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
                self.wire.receive(data)
            finally:
                self._hand_over()
                self._kick()  # acknowledgements, WINDOW_UPDATEs, more request body; a GOAWAY on an error

    async def _keepalive(self) -> None:
        while True:
            await trio.sleep(KEEPALIVE_S)
            self._reset_lingering()
            if not self.streams:
                continue
            self._ping_answered = trio.Event()
            self.wire.ping(os.urandom(8))
            self._kick()
            with trio.move_on_after(KEEPALIVE_TIMEOUT_S):
                await self._ping_answered.wait()
                continue
            raise trio.BrokenResourceError(f"no answer to a keepalive ping within {KEEPALIVE_TIMEOUT_S:g} s")

    def _kick(self) -> None:
        if self.wire.wants_to_send:
            self._dirty.set()

    def _flush(self) -> None:
        """Send what the wire has from the calling task when the socket takes it at once (no pass through the
        writer task); the rest, if any, goes back first in line for the writer."""
        if not self.wire.wants_to_send or self.sender.busy or self._dirty.is_set():
            self._kick()
            return
        try:
            rest = self.sender.send_nowait(self.wire.data_to_send())
        except trio.BrokenResourceError as exc:
            self._fail(exc)
            return
        if rest:
            self.wire.put_back(rest)
            self._dirty.set()

    async def _write(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            data = self.wire.data_to_send()
            if data:
                await self.sender.send_all(data)

    # ---- streams ---------------------------------------------------------------------------------
    async def start(self, stream: H2Stream, path: str, extra_headers: bytes = b"") -> None:
        while self.usable and not self.wire.can_open:
            await self._slot_freed.wait()
        if not self.usable or self.wire.going_away:
            self.usable = False
            raise self._unavailable(stream.rpc, "the connection closed before the call started")
        stream.id = self.wire.open_stream(stream, self.channel.header_block(path, self.scheme) + extra_headers,
                                          stream._outbound)
        self.streams[stream.id] = stream
        if self.wire.going_away:  # stream ids ran out: this one is the last on this connection
            self.usable = False
        self._flush()

    def finish(self, stream: H2Stream) -> None:
        """The caller is done with `stream`: a call still running is cancelled, unless it is only its status
        that is still to come (`let_end`): then its trailers end it, and what else arrives is dropped."""
        if not stream.closed:
            if stream.let_end and self.usable:
                stream._items = collections.deque(maxlen=0)
                return
            self._cancel(stream)
        stream._close(stream._error)
        self._forget(stream)

    def _reset_lingering(self) -> None:
        """A stream left to end by itself that is still open a keepalive period later is reset: a worker that
        never sends its trailers cannot hold a stream slot forever."""
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
            self.wire.reset(stream.id, http2.CANCEL)
            self._flush()

    def close(self) -> None:
        self.usable = False
        self._scope.cancel()

    def _forget(self, stream: H2Stream) -> None:
        if self.streams.pop(stream.id, None) is not None:
            self._on_capacity()

    # ---- what the worker sent (engine/http2.py calls these) --------------------------------------
    def _on_capacity(self) -> None:
        self._slot_freed.set()
        self._slot_freed = trio.Event()

    def _on_reset(self, stream: H2Stream, code: int) -> None:
        stream._close(self._reset_error(stream, code))
        self._forget(stream)

    def _on_goaway(self, code: int, refused: list[H2Stream]) -> None:
        self.usable = False
        for stream in refused:
            stream._close(self._unavailable(stream.rpc, "the worker is going away (GOAWAY) and did not start "
                                                        "this call"))
            self._forget(stream)
        self._on_capacity()  # callers waiting for a slot here go to a new connection

    def _on_ping_ack(self) -> None:
        self._ping_answered.set()

    def _on_data(self, stream: H2Stream, data: bytes) -> None:
        buffer = stream._buffer
        if not buffer and len(data) >= _HEADER and data[0] == 0 and int.from_bytes(data[1:5], "big") == len(data) - 5:
            self._deliver(stream, data[5:])  # the usual case: one whole message in one frame
            return
        buffer += data
        while len(buffer) >= _HEADER:
            if buffer[0] != 0:
                stream._close(EngineError("the worker sent a compressed message (none was negotiated)",
                                          worker=self.channel.worker, rpc=stream.rpc))
                return
            length = int.from_bytes(buffer[1:5], "big")
            if len(buffer) < _HEADER + length:
                break
            payload = bytes(buffer[_HEADER:_HEADER + length])
            del buffer[:_HEADER + length]
            if not self._deliver(stream, payload):
                return

    def _deliver(self, stream: H2Stream, payload: bytes) -> bool:
        try:
            item = stream.decode(payload)
        except Exception as exc:  # protobuf's DecodeError, or anything a decoder raises on bad bytes
            error = EngineError(f"the worker sent a message that does not decode: {exc}", worker=self.channel.worker,
                                rpc=stream.rpc)
            self._abandon(stream, error)
            return False
        if item is not None:  # None: a message that says nothing the reader needs (decode's choice)
            if not stream._items:
                self._arrived.append(stream)
            stream._items.append(item)
        return True

    def _hand_over(self) -> None:
        """Each stream's messages of one read go to its reader together (one wake-up, or one direct delivery:
        engine/inbox.py)."""
        arrived, self._arrived = self._arrived, []
        for stream in arrived:
            try:
                stream.hand_over()
            except Exception as exc:  # a bug in a reader's direct handler fails its own call, not the connection
                log.exception("handing over the messages of %s stream %d from %s failed", stream.rpc, stream.id,
                              self.channel.authority)
                self._abandon(stream, exc)

    def _on_headers(self, stream: H2Stream, headers: list[tuple[bytes, bytes]]) -> None:
        for name, value in headers:
            if name == b":status" and value != b"200":
                stream._status = _HTTP_TO_GRPC.get(value, grpc.StatusCode.UNKNOWN).value[0]
                stream._message = f"HTTP status {value.decode(errors='replace')} from the worker"
            elif name == b"grpc-status":
                stream._status = int(value)
            elif name == b"grpc-message":
                stream._message = urllib.parse.unquote(value.decode(errors="replace"))

    def _on_end(self, stream: H2Stream) -> None:
        if stream._buffer:
            error = EngineError("the stream ended inside a message", worker=self.channel.worker, rpc=stream.rpc)
        elif stream._status is None:
            error = EngineError("the stream ended without a grpc-status", worker=self.channel.worker, rpc=stream.rpc)
        elif stream._status == 0:
            error = None
        else:
            error = from_grpc_status(grpc_status_from_number(stream._status), stream._message,
                                     worker=self.channel.worker, rpc=stream.rpc)
        stream._close(error)
        self._forget(stream)

    def _reset_error(self, stream: H2Stream, code: int) -> EngineError:
        # gRPC's mapping of HTTP/2 error codes: REFUSED_STREAM is safe to retry; CANCEL is a cancelled call.
        if code == http2.REFUSED_STREAM:
            return self._unavailable(stream.rpc, "the worker refused the stream (REFUSED_STREAM)")
        status = grpc.StatusCode.CANCELLED if code == http2.CANCEL else grpc.StatusCode.INTERNAL
        return from_grpc_status(status, f"the worker reset the stream ({http2.error_name(code)})",
                                worker=self.channel.worker, rpc=stream.rpc)

    def _unavailable(self, rpc: str, why: str) -> EngineError:
        return unavailable(f"{why} ({self.channel.authority})", worker=self.channel.worker, rpc=rpc)

    def _fail_all(self, cause: BaseException | None) -> None:
        why = f"the connection to the worker was lost: {cause}" if cause else "the connection to the worker closed"
        for stream in list(self.streams.values()):
            error = self._unavailable(stream.rpc, why)
            error.__cause__ = cause
            stream._close(error)
            self._forget(stream)


def unavailable(why: str, *, worker: str, rpc: str) -> EngineError:
    """What grpcio reports for a worker it cannot reach (WorkerUnavailable, retryable)."""
    return from_grpc_status(grpc.StatusCode.UNAVAILABLE, why, worker=worker, rpc=rpc)


# gRPC's mapping of HTTP statuses from a server that is not a gRPC server (or a proxy in front of one).
_HTTP_TO_GRPC = {b"400": grpc.StatusCode.INTERNAL, b"401": grpc.StatusCode.UNAUTHENTICATED,
                 b"403": grpc.StatusCode.PERMISSION_DENIED, b"404": grpc.StatusCode.UNIMPLEMENTED,
                 b"429": grpc.StatusCode.UNAVAILABLE, b"502": grpc.StatusCode.UNAVAILABLE,
                 b"503": grpc.StatusCode.UNAVAILABLE, b"504": grpc.StatusCode.UNAVAILABLE}
