"""An HTTP/2 server on h2's server side (an independent implementation of RFC 9113), on 127.0.0.1 and a free
port in the test's own trio loop, whose answer to each call is the test's script: well-formed responses
through h2, and frames h2 would never send (a broken worker) written raw.

    async def answer(call):
        await call.respond()
        await call.message(b"...")
        await call.trailers(0)

    async with scripted_server(answer) as server:
        ... server.address, server.connections, server.calls ...
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import trio

from orchestrator.transport import http2

GRPC_HEADERS = [(b":status", b"200"), (b"content-type", b"application/grpc")]


def grpc_message(payload: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + len(payload).to_bytes(4, "big") + payload


class ServerCall:
    """One request the server received whole, and the means to answer it."""

    def __init__(self, connection: ServerConnection, stream_id: int, headers: list[tuple[bytes, bytes]]):
        self.connection, self.stream_id, self.headers = connection, stream_id, headers
        self.body = b""
        self.reset_code: int | None = None  # the client's RST_STREAM
        self.reset = trio.Event()
        self.sent = 0  # DATA bytes sent on this stream
        self.done = False  # the server ended its side

    @property
    def path(self) -> bytes:
        return dict(self.headers)[b":path"]

    async def respond(self, headers=GRPC_HEADERS, end_stream: bool = False) -> None:
        self.connection.h2.send_headers(self.stream_id, headers, end_stream=end_stream)
        self.done = end_stream
        await self.connection.flush()

    async def data(self, data: bytes, end_stream: bool = False) -> None:
        """DATA within the client's flow-control windows: waits for its WINDOW_UPDATEs."""
        connection = self.connection
        while data:
            room = min(connection.h2.local_flow_control_window(self.stream_id), connection.h2.max_outbound_frame_size,
                       len(data))
            if room <= 0:
                connection.blocked.set()
                await connection.window_opened.wait()
                continue
            connection.h2.send_data(self.stream_id, data[:room])
            data = data[room:]
            self.sent += room
            await connection.flush()
        if end_stream:
            connection.h2.end_stream(self.stream_id)
            self.done = True
            await connection.flush()

    async def message(self, payload: bytes, flag: int = 0) -> None:
        await self.data(grpc_message(payload, flag))

    async def trailers(self, status: int | bytes = 0, message: bytes | None = None) -> None:
        fields = [(b"grpc-status", status if isinstance(status, bytes) else str(status).encode())]
        if message is not None:
            fields.append((b"grpc-message", message))
        self.connection.h2.send_headers(self.stream_id, fields, end_stream=True)
        self.done = True
        await self.connection.flush()

    async def raw(self, *frames: bytes) -> None:
        """Frames written as they are, behind h2's back (header blocks: literals only, so HPACK stays in step)."""
        await self.connection.send_raw(b"".join(frames))


class ServerConnection:
    def __init__(self, server: ScriptedServer, stream: trio.SocketStream):
        self.server, self.stream = server, stream
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.calls: dict[int, ServerCall] = {}
        self.pings: list[bytes] = []
        self.pinged = trio.Event()  # set at the first PING
        self.window_opened = trio.Event()
        self.blocked = trio.Event()  # set when a send waited for the client's flow-control credit
        self._lock = trio.Lock()

    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            await self.send_raw(data)

    async def send_raw(self, data: bytes) -> None:
        async with self._lock:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def goaway(self, code: int = http2.NO_ERROR, debug: bytes = b"", last_stream_id: int | None = None) -> None:
        """GOAWAY, written raw: h2 takes no frame after its own, where a server draining gracefully (grpc-core's
        max_connection_age) still answers the streams up to `last_stream_id`."""
        last = max(self.calls, default=0) if last_stream_id is None else last_stream_id
        await self.send_raw(http2.frame(http2.GOAWAY, 0, 0, last.to_bytes(4, "big") + code.to_bytes(4, "big") + debug))

    async def close(self) -> None:
        await self.stream.aclose()

    async def serve(self, nursery: trio.Nursery) -> None:
        await trio.sleep(self.server.settings_delay)  # a server slow to start: the client's first frames wait
        self.h2.initiate_connection()
        if self.server.settings:
            self.h2.update_settings(self.server.settings)
        await self.flush()
        while True:
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError:
                await self.flush()
                return
            for event in events:
                self._on_event(event, nursery)
            await self.flush()

    def _on_event(self, event, nursery: trio.Nursery) -> None:
        if isinstance(event, h2.events.RequestReceived):
            call = ServerCall(self, event.stream_id, event.headers)
            self.calls[event.stream_id] = call
            self.server.calls.append(call)
            open_calls = [c for c in self.calls.values() if c.reset_code is None and not c.done]
            if self.server.refuse_above is not None and len(open_calls) > self.server.refuse_above:
                self.h2.reset_stream(event.stream_id, http2.REFUSED_STREAM)
                call.reset_code = http2.REFUSED_STREAM
                self.server.refused += 1
        elif isinstance(event, h2.events.DataReceived):
            self.calls[event.stream_id].body += event.data
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            call = self.calls[event.stream_id]
            if call.reset_code is None:
                nursery.start_soon(self._answer, call)
        elif isinstance(event, h2.events.StreamReset):
            reset_call = self.calls.get(event.stream_id)
            if reset_call is not None:
                reset_call.reset_code = event.error_code
                reset_call.reset.set()
            self.window_opened.set()
            self.window_opened = trio.Event()
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self.window_opened.set()
            self.window_opened = trio.Event()
        elif isinstance(event, h2.events.PingReceived):
            self.pings.append(event.ping_data)
            self.pinged.set()

    async def _answer(self, call: ServerCall) -> None:
        try:
            await self.server.answer(call)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            pass  # the client reset the stream, or went away: what a test checks is elsewhere


class ScriptedServer:
    def __init__(self, answer: Callable[[ServerCall], Awaitable[None]], settings: dict | None,
                 refuse_above: int | None, settings_delay: float):
        self.answer, self.settings, self.refuse_above = answer, settings, refuse_above
        self.settings_delay = settings_delay
        self.connections: list[ServerConnection] = []
        self.calls: list[ServerCall] = []
        self.refused = 0
        self.address = ""

    async def _handle(self, stream: trio.SocketStream) -> None:
        connection = ServerConnection(self, stream)
        self.connections.append(connection)
        async with trio.open_nursery() as calls:
            await connection.serve(calls)
            calls.cancel_scope.cancel()
        await stream.aclose()


@asynccontextmanager
async def scripted_server(answer: Callable[[ServerCall], Awaitable[None]], *, settings: dict | None = None,
                          refuse_above: int | None = None, settings_delay: float = 0.0):
    """`settings`: the server's SETTINGS (h2.settings.SettingCodes keys); `refuse_above`: a server that refuses
    (RST_STREAM REFUSED_STREAM) any stream above that many open ones, whatever it advertised;
    `settings_delay`: how long a new connection waits before the server sends its SETTINGS and reads."""
    server = ScriptedServer(answer, settings, refuse_above, settings_delay)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, server._handle, 0, host="127.0.0.1"))
        server.address = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()


SettingCodes = h2.settings.SettingCodes
