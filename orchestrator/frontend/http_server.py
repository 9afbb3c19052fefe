"""The native HTTP/1.1 server: trio sockets, httptools' C parser, the ASGI application on top.

Why our own server rather than an ASGI server such as hypercorn (which this project ran until it was
removed): hypercorn's per-event machinery cost about 0.3 ms per response write and most of a millisecond
per request on this project's benchmarks. This server does only what the OpenAI API needs from HTTP/1.1:

- keep-alive, with `http.keep_alive_s` as the idle limit and as the deadline for a whole request head
  (checked every min(1 s, a quarter of it): a connection goes within that much after the limit);
  pipelined requests are answered in order; `Expect: 100-continue` is honoured.
- a request head of at most `http.max_header_bytes` (else 431); a malformed request gets 400, also when
  only its chunked body is malformed (the `bad_body` extension tells the application why its body ended).
  A chunked body's trailer fields are read and dropped, never merged into the request's headers (a proxy
  vets headers, not trailers: RFC 9110 6.5.2), and the bytes between two pieces of body (chunk framing,
  extensions, the trailer section) are bounded by `http.max_header_bytes` too (else 431).
- a connection closed while the client may still be sending (a refused head, a body left unread) is
  half-closed first and what still arrives is read and dropped for up to `_LINGER_S` (RFC 9112 9.6):
  closing with unread bytes makes the kernel reset the connection, and a client still writing its request
  then fails on the write and never reads the answer.
- at most `max_connections` client connections: one more closes the connection idle the longest, or is
  refused with a 503 when none is idle. Out of file descriptors, accepting pauses and says so in one log
  line per interval (trio's own loop logged a traceback for every attempt).
- a response head goes out with the first body bytes, in one write; a body without content-length is
  chunked, its last chunk and terminator in one write.
- disconnect detection: one reader task per connection; when the client closes, the application's
  `receive()` returns `http.disconnect`, and the callback the application gave `on_disconnect` is called.
- beyond ASGI, every scope carries a `ServerExtensions` (frontend/server_extensions.py, the whole contract
  with the application): `body_arrived`, `on_disconnect`, `bad_body` and, on plain sockets, `send_now`.
- graceful drain: on shutdown, stop accepting, close idle connections, let in-flight requests finish
  for `grace_s`, then cancel them.
- TLS (trio.SSLStream), TCP_NODELAY (trio's default for TCP streams), a listen backlog, SO_REUSEPORT
  for several frontend processes on one port.

The application sees ASGI 3 `http` scopes.
"""

from __future__ import annotations

import errno
import logging
import socket as stdlib_socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, cast

import attrs
import httptools
import trio

from orchestrator.frontend import http_wire as wire
from orchestrator.frontend.server_extensions import ServerExtensions
from orchestrator.log import RateLimitedLog
from orchestrator.net.eager_receive import EagerReceiver
from orchestrator.net.eager_send import EagerSender

log = logging.getLogger(__name__)
Application = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]

_READ_SIZE = 64 * 1024
_BODY_BUFFER = 1 << 20  # request body bytes read ahead of the application before reading pauses
_PIPELINE_DEPTH = 8  # requests parsed ahead of the one being answered before reading pauses
_LINGER_S = 2.0  # how long a closing connection reads and drops what the client still sends
# accept() failing for want of descriptors or memory (trio's serve_listeners has the same list): pause, retry
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_ACCEPT_PAUSE_S = 0.1


@attrs.frozen
class ServerLimits:
    keep_alive_s: float = 15.0
    max_header_bytes: int = 16 * 1024
    grace_s: float = 10.0
    max_connections: int | None = None  # open client connections (None: no cap of our own)


async def open_listener(host: str, port: int, *, backlog: int, reuse_port: bool = False) -> trio.SocketListener:
    """A listening TCP socket on host:port (port 0: a free port). SO_REUSEPORT lets several processes
    listen on the same port, the kernel spreading connections across them."""
    family = stdlib_socket.AF_INET6 if ":" in host else stdlib_socket.AF_INET
    sock = trio.socket.socket(family, stdlib_socket.SOCK_STREAM)
    try:
        sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_REUSEPORT, 1)
        await sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


async def serve_http(app: Application, listener: trio.SocketListener, *, limits: ServerLimits,
                     shutdown: trio.Event, ssl_context: ssl.SSLContext | None = None,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on `listener` until `shutdown` is set, then drain (see the module docstring)."""
    server = _Server(app, limits, ssl_context)
    host, port = listener.socket.getsockname()[:2]
    scheme = "https" if ssl_context else "http"
    url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
    accepting = trio.CancelScope()

    async def accept(connections: trio.Nursery) -> None:
        with accepting:
            await server.accept(listener, connections)

    async with trio.open_nursery() as connections:
        connections.start_soon(accept, connections)
        connections.start_soon(server.close_idle_connections)
        task_status.started(url)
        await shutdown.wait()
        accepting.cancel()
        await listener.aclose()
        server.drain()
        with trio.move_on_after(limits.grace_s):
            await server.idle.wait()
        connections.cancel_scope.cancel()


class _Server:
    def __init__(self, app: Application, limits: ServerLimits, ssl_context: ssl.SSLContext | None):
        self.app, self.limits, self.ssl_context = app, limits, ssl_context
        self.scheme = "https" if ssl_context else "http"
        self.draining = False
        self.open: set[_Connection] = set()
        self.idle = trio.Event()  # set once draining and no connection is left
        self.out_of_resources_log = RateLimitedLog(log, interval=10.0, level=logging.ERROR)

    def drain(self) -> None:
        self.draining = True
        for connection in list(self.open):
            connection.notify()
        self._check_idle()

    def _check_idle(self) -> None:
        if self.draining and not self.open:
            self.idle.set()

    async def close_idle_connections(self) -> None:
        """End the connections that waited keep_alive_s for a whole request head. One sweep for all of them,
        instead of a timer per request (a cancel scope's deadline set and reset cost ~2% of a short request)."""
        limit = self.limits.keep_alive_s
        while True:
            await trio.sleep(min(1.0, limit / 4))
            waited_since = trio.current_time() - limit
            for connection in list(self.open):
                if connection.waiting_since is not None and connection.waiting_since <= waited_since:
                    connection.reading.cancel()  # its reader stops: the connection ends as if the client went

    async def accept(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        """Accept connections into `connections` until cancelled, within `limits.max_connections`."""
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                # Out of descriptors (or memory): the connection waits in the listen queue. A pause instead of
                # spinning, and one line per interval: a traceback per attempt would bury the log.
                self.out_of_resources_log("cannot accept connections: %s; %d client connections open; pausing "
                                          "accept() %.1f s at a time", exc.strerror or exc, len(self.open),
                                          _ACCEPT_PAUSE_S)
                await trio.sleep(_ACCEPT_PAUSE_S)
                continue
            cap = self.limits.max_connections
            if cap is not None and len(self.open) >= cap and not self._close_longest_idle():
                connections.start_soon(_refuse, stream)
                continue
            connections.start_soon(self.connection, stream)

    def _close_longest_idle(self) -> bool:
        """End the connection that has waited longest for a request (keep-alive or an unfinished head);
        False when every connection has a request being answered."""
        waiting = [c for c in self.open if c.waiting_since is not None]
        if not waiting:
            return False
        longest = min(waiting, key=lambda connection: connection.waiting_since or 0.0)  # all set: see above
        longest.waiting_since = None  # it is going: not a candidate again
        longest.reading.cancel()
        return True

    async def connection(self, stream: trio.SocketStream) -> None:
        try:
            peer = stream.socket.getpeername()[:2]
            local = stream.socket.getsockname()[:2]
        except OSError:  # reset before we looked
            await trio.aclose_forcefully(stream)
            return
        transport: trio.abc.Stream = stream
        if self.ssl_context is not None:
            transport = trio.SSLStream(stream, self.ssl_context, server_side=True, https_compatible=True)
        connection = _Connection(self, transport, peer, local)
        self.open.add(connection)
        try:
            if isinstance(transport, trio.SSLStream):
                with trio.move_on_after(self.limits.keep_alive_s) as handshake:
                    await transport.do_handshake()
                if handshake.cancelled_caught:
                    connection.broken = True
                    return
            await connection.serve()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
            pass  # the client went away (or never finished its TLS handshake)
        except Exception:
            log.exception("HTTP connection from %s:%s failed", *peer)
        finally:
            self.open.discard(connection)
            self._check_idle()
            try:
                if connection.may_have_unread_input:
                    await connection.linger()  # not shielded: a drain's final cancel cuts it short
            finally:
                connection.release()
                await _close(transport, forcefully=connection.broken)


async def _refuse(stream: trio.SocketStream) -> None:
    """A connection beyond max_connections while none is idle: a 503, then closed."""
    with trio.move_on_after(1):
        try:
            await stream.send_all(wire.error_response(503, "the server has too many open connections; retry shortly",
                                                      "too_many_connections", retry_after=1))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    await _close(stream, forcefully=False)


async def _close(stream: trio.abc.Stream, *, forcefully: bool) -> None:
    """Close a connection; a TLS one sends its close_notify unless it is broken (at most 1 s)."""
    with trio.CancelScope(shield=True):
        if forcefully:
            await trio.aclose_forcefully(stream)
            return
        with trio.move_on_after(1) as closing:
            try:
                await stream.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
                pass
        if closing.cancelled_caught:
            await trio.aclose_forcefully(stream)


class _Request:
    """One parsed request: its head, its body as it arrives, whether all of it has arrived."""

    __slots__ = ("method", "target", "headers", "http_version", "keep_alive", "expect_continue", "body",
                 "complete")

    def __init__(self, method: str, target: bytes, headers: list, http_version: str, keep_alive: bool):
        self.method, self.target, self.headers = method, target, headers
        self.http_version, self.keep_alive = http_version, keep_alive
        self.expect_continue = any(n == b"expect" and v.lower() == b"100-continue" for n, v in headers)
        self.body: list[bytes] = []
        self.complete = False


class _Connection:
    """One client connection: a reader task feeding the parser, requests answered one at a time."""

    def __init__(self, server: _Server, stream: trio.abc.Stream, peer, local):
        self.server, self.stream, self.peer, self.local = server, stream, peer, local
        self.sender = EagerSender(stream)
        self.receiver = EagerReceiver(stream)
        self.parser = httptools.HttpRequestParser(self)
        self.parsed: deque[_Request] = deque()  # heads complete, not yet answered (the first is being answered)
        self.incoming: _Request | None = None  # the request the parser is filling
        self.head_bytes = 0  # bytes of the request head being read
        self.in_head = False
        self.buffered = 0  # body bytes parsed and not yet taken by the application
        self.eof = False  # the client closed its side (or the connection broke, or reading stopped)
        self.client_closed = False  # the client's FIN was read: nothing more will arrive
        self.broken = False  # a write failed: close without ceremony
        self.backlog = b""  # response bytes write_now() could not send yet; the next write() sends them first
        self.bad_request: tuple[int, str, str] | None = None  # a request that cannot be answered normally
        self.upgrade_ignored = False  # no request can follow on this connection
        self._changed = trio.Event()
        # The reader runs in this scope; the server cancels it when the connection waited keep_alive_s for a
        # request (since `waiting_since`; None while one is answered).
        self.reading = trio.CancelScope()
        self.waiting_since: float | None = None
        self.answering: _Exchange | None = None  # the request being answered (its disconnect callback)
        self._header_parts: list[tuple[bytes, bytes]] = []
        self._target = b""
        self._head_size = 0
        # bytes read in a body since its last piece (chunk framing, extensions, trailers): bounded like a head,
        # as httptools accumulates a trailer field or a chunk extension whole, however long it is
        self.framing_bytes = 0

    # ---- the reader side --------------------------------------------------------------------------
    def notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def changed(self) -> None:
        await self._changed.wait()

    async def read(self) -> None:
        try:
            with self.reading:  # cancelled: idle too long, which ends the connection like the client going
                await self._read()
        finally:
            self._gone()

    async def _read(self) -> None:
        try:
            while self.bad_request is None:
                while self.buffered > _BODY_BUFFER or len(self.parsed) > _PIPELINE_DEPTH:
                    await self.changed()  # the application has not caught up: stop reading (backpressure)
                data = await self.receiver.receive_some(_READ_SIZE)
                if not data:
                    self.client_closed = True
                    break
                if self.in_head or self.incoming is None:
                    self.head_bytes += len(data)
                else:  # counted before feeding: a piece of body in this read resets it (on_body)
                    self.framing_bytes += len(data)
                try:
                    self.parser.feed_data(data)
                except httptools.HttpParserUpgrade:
                    # An Upgrade request (h2c, websocket) is answered as plain HTTP/1.1, and the connection
                    # closes after it: what follows is not HTTP/1.1. Reading goes on only to see the client go.
                    self.upgrade_ignored = True
                    self.notify()
                    while await self.receiver.receive_some(_READ_SIZE):
                        pass
                    self.client_closed = True
                    break
                except httptools.HttpParserError as exc:
                    self.bad_request = (400, f"the request is not valid HTTP/1.1: {exc}", "bad_request")
                if self.in_head and self.head_bytes > self.server.limits.max_header_bytes:
                    self._refuse_head()  # still arriving and already too large: read no more of it
                elif self.incoming is not None and self.framing_bytes > self.server.limits.max_header_bytes:
                    self._refuse_framing()  # trailers or chunk framing without end: read no more of them
                self.notify()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
            self.client_closed = True  # broken: nothing more can be read

    @property
    def may_have_unread_input(self) -> bool:
        """Whether closing now may leave bytes the client sent (or is sending) unread: a refused or unfinished
        head, a body the application did not read whole, a request pipelined behind the last answered one."""
        if self.client_closed or self.broken:
            return False
        return self.bad_request is not None or self.in_head or self.incoming is not None or len(self.parsed) > 1

    async def linger(self) -> None:
        """Half-close, then read and drop what the client still sends until it closes or _LINGER_S passes.
        Closing with unread bytes would reset the connection: a client still writing its request (a big body
        refused with 413, a head refused with 431) fails on its write and never reads the answer."""
        with trio.move_on_after(_LINGER_S):
            try:
                if isinstance(self.stream, trio.SocketStream):
                    await self.stream.send_eof()  # the answer is whole: a client reading to the end sees it end
                while await self.receiver.receive_some(_READ_SIZE):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
                pass

    def release(self) -> None:
        """Drop the request bodies this connection still holds, at once. The parser and the connection refer
        to each other (its callbacks), so without this a 1 MB read-ahead of a refused body would wait for a
        full garbage collection."""
        for request in (*self.parsed, self.incoming):
            if request is not None:
                request.body.clear()
        self.parsed.clear()
        self.incoming = None
        self.parser = None  # type: ignore[assignment]  # unreachable from here on: drop it with its references

    def _gone(self) -> None:
        """The client closed its side or the connection broke: wake receive() and call the callback."""
        self.eof = True
        self.notify()
        exchange, self.answering = self.answering, None
        if exchange is not None and exchange.on_gone is not None:
            exchange.on_gone()

    # httptools callbacks
    def _refuse_head(self) -> None:
        self.bad_request = (431, f"the request head is larger than {self.server.limits.max_header_bytes} bytes",
                            "request_header_fields_too_large")

    def _refuse_framing(self) -> None:
        self.bad_request = (431, "the request body's chunk framing or trailer section is larger than "
                                 f"{self.server.limits.max_header_bytes} bytes", "request_header_fields_too_large")

    def on_message_begin(self) -> None:
        self.in_head = True
        self._target = b""
        self._header_parts = []
        self._head_size = 0
        self.framing_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._target += url
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_head:
            return  # a trailer field (after a chunked body): never a request header, so dropped
        self._header_parts.append((name.lower(), value))
        self._head_size += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        parser = self.parser
        request = _Request(parser.get_method().decode("ascii", "replace"), self._target, self._header_parts,
                           parser.get_http_version(), parser.should_keep_alive())
        self.in_head = False
        self.head_bytes = 0
        self.incoming = request  # the parser may go on into its body; that is what a refused one takes too
        if self._head_size > self.server.limits.max_header_bytes:  # arrived whole in one read, too large
            self._refuse_head()
            return
        self.parsed.append(request)

    def on_body(self, body: bytes) -> None:
        cast(_Request, self.incoming).body.append(body)  # a body follows a head: incoming is set
        self.buffered += len(body)
        self.framing_bytes = 0

    def on_message_complete(self) -> None:
        cast(_Request, self.incoming).complete = True
        self.incoming = None

    # ---- the answering side -----------------------------------------------------------------------
    async def serve(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.read)
            try:
                while (request := await self._next_request()) is not None:
                    if not await self._answer(request):
                        break
                    self.parsed.popleft()
                    self.notify()  # reading may resume
            finally:
                nursery.cancel_scope.cancel()

    async def _next_request(self) -> _Request | None:
        """The next request whose head is complete; None when the connection should close: the client went,
        the server drains, or no whole head came within keep_alive_s (the reader stops then: eof)."""
        if not self.parsed:
            self.waiting_since = trio.current_time()
        while True:
            if self.parsed:
                self.waiting_since = None  # answering: however long it takes, the reader watches for the client
                return self.parsed[0]
            if self.bad_request is not None:
                await self.write(wire.error_response(*self.bad_request))
                return None
            if self.eof or (self.server.draining and not self.in_head):
                return None
            await self.changed()

    async def _answer(self, request: _Request) -> bool:
        """Run the application for one request; whether the connection can take another."""
        path, raw_path, query = wire.split_target(request.target)
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": request.http_version, "method": request.method, "scheme": self.server.scheme,
                 "path": path, "raw_path": raw_path, "query_string": query, "root_path": "",
                 "headers": request.headers, "client": self.peer, "server": self.local}
        exchange = _Exchange(self, request)
        ServerExtensions(body_arrived=request.complete, on_disconnect=exchange.call_on_disconnect,
                         bad_body=exchange.body_error,
                         send_now=exchange.send_now if self.sender.eager else None).put_in(scope)
        self.answering = exchange
        try:
            await self.server.app(scope, exchange.receive, exchange.send)
        except Exception:
            log.exception("the application failed on %s %s", request.method, path)
            if not exchange.head_sent:
                await exchange.send_error(500, "internal error", "internal_error")
            return False
        finally:
            self.answering = None  # that request is over: a later disconnect is not its business
        if not exchange.finished:
            if exchange.head_sent:  # a response cut short cannot be completed: the client sees it end
                return False
            if exchange.body_error() is not None and self.bad_request is not None:  # its body was malformed:
                await exchange.send_error(*self.bad_request)  # the client's error, not ours
                return False
            await exchange.send_error(500, "the application sent no response", "internal_error")
            return False
        return exchange.keep_alive

    async def write(self, data: bytes) -> None:
        if self.backlog:
            data, self.backlog = self.backlog + data, b""
        if self.broken:
            return
        try:
            await self.sender.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError):
            self._broke()

    def write_now(self, data: bytes) -> bool:
        """Write what the socket takes now; False when the rest waits in `backlog` for the next write()."""
        if self.broken:
            return True
        if self.backlog:  # behind bytes still waiting: keep the order
            self.backlog += data
            return False
        try:
            rest = self.sender.send_nowait(data)
        except trio.BrokenResourceError:
            self._broke()
            return True
        if rest:
            self.backlog = bytes(rest)
            return False
        return True

    def _broke(self) -> None:
        self.broken = True  # the client is gone; receive() reports the disconnect
        self._gone()


class _Exchange:
    """The ASGI receive/send pair of one request."""

    __slots__ = ("connection", "request", "started", "head_sent", "finished", "status", "headers", "chunked",
                 "close", "bodyless", "body_done", "continue_sent", "on_gone")

    def __init__(self, connection: _Connection, request: _Request):
        self.connection, self.request = connection, request
        self.started = self.head_sent = self.finished = self.body_done = self.continue_sent = False
        self.status = 200
        self.headers: list = []
        self.chunked = self.close = self.bodyless = False
        self.on_gone: Callable[[], None] | None = None

    def body_error(self) -> str | None:
        """`bad_body`: why this request's body ended before it was whole (its framing is malformed: a bad chunk
        size, say), or None. receive() reports such an end as a disconnect, as ASGI has no other word for it."""
        bad = self.connection.bad_request  # the parser reads in order: an unfinished body is the last thing parsed
        return None if bad is None or self.request.complete else bad[1]

    def call_on_disconnect(self, callback: Callable[[], None]) -> None:
        """`callback()` once, when the client goes while this request is answered (at once if it has gone).
        A request that is over is not called back, even if its application registers late."""
        if self.connection.eof:
            callback()
        else:
            self.on_gone = callback

    @property
    def keep_alive(self) -> bool:
        return not self.close and not self.connection.eof and not self.connection.upgrade_ignored

    async def receive(self) -> dict[str, Any]:
        request, connection = self.request, self.connection
        while True:
            if request.body:
                body = b"".join(request.body) if len(request.body) > 1 else request.body[0]
                request.body.clear()
                connection.buffered -= len(body)
                connection.notify()
                self.body_done = request.complete
                return {"type": "http.request", "body": body, "more_body": not request.complete}
            if request.complete and not self.body_done:
                self.body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            if connection.eof or self.finished:
                return {"type": "http.disconnect"}
            if request.expect_continue and not self.continue_sent and not self.started:
                self.continue_sent = True  # the client waits for this before it sends the body
                await connection.write(wire.CONTINUE)
                continue
            await connection.changed()

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started:
            raise RuntimeError("http.response.body sent before http.response.start")
        if self.finished:
            return
        more = message.get("more_body", False)
        data = self._frame(message.get("body", b""), more)
        if not more:
            self.finished = True
        await self.connection.write(data)

    def send_now(self, body: bytes) -> bool:
        """`send_now`: `http.response.body` with more to come, written at once by the calling task; False when
        part of it waits for the next `send` (which the application then awaits)."""
        if not self.started or self.finished:
            raise RuntimeError("send_now is for the body of a response that is started and not finished")
        return self.connection.write_now(self._frame(body, True))

    def _frame(self, body: bytes, more: bool) -> bytes:
        data = b""
        if not self.head_sent:  # the head goes out with the first body bytes
            data = self._head()
            self.head_sent = True
        if self.bodyless:  # the head is the whole response: a body here would be read as the next response
            return data
        if self.chunked:
            return data + wire.frame_chunk(body) + (b"" if more else wire.LAST_CHUNK)
        return data + body

    def _head(self) -> bytes:
        request, connection = self.request, self.connection
        has_length = wire.has_content_length(self.headers)
        # 1xx, 204 and 304 never have a body, nor framing for one (RFC 9110 §15.3.5, §15.4.5, RFC 9112 §6.1); a
        # HEAD's head says what a GET would get (its content-length, or chunked) and its body is never sent
        no_body_status = self.status < 200 or self.status in (204, 304)
        self.bodyless = no_body_status or request.method == "HEAD"
        self.chunked = not has_length and not no_body_status and request.http_version == "1.1"
        # close after this response: the client asked to, an unread body is left on the connection, a
        # HTTP/1.0 body without length ends with the connection, or the server is draining
        self.close = (not request.keep_alive or not request.complete
                      or (not has_length and not self.chunked and not self.bodyless) or connection.server.draining)
        return wire.render_head(self.status, self.headers, chunked=self.chunked, close=self.close)

    async def send_error(self, status: int, message: str, code: str) -> None:
        self.started = self.head_sent = self.finished = True
        self.close = True
        await self.connection.write(wire.error_response(status, message, code,
                                                        with_body=self.request.method != "HEAD"))
