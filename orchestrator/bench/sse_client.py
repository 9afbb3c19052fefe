"""A small HTTP/1.1 client for streaming OpenAI responses, on trio.

Why not httpx here: a load generator shares the machine with what it measures, and per-chunk
client cost shows up as server latency. This client does one thing: POST JSON on a keep-alive
connection (TCP_NODELAY, so no Nagle / delayed-ACK stalls) and hand back each SSE `data:` payload
with its arrival time. Every complete chunk of a read is taken in one pass over the buffer, and the
socket is read without trio's per-call wrapping (EagerReceiver): at 64 concurrent streams on two
cores, its CPU is CPU the server and the workers do not get.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import trio

from orchestrator.net.eager_receive import EagerReceiver


class HttpError(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status
        self.body = body


class Connection:
    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only http://HOST:PORT URLs are supported, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.base_path = parts.path.rstrip("/")
        self._stream: trio.SocketStream | None = None
        self._receiver: EagerReceiver | None = None
        self._buffer = b""

    async def _connect(self) -> trio.SocketStream:
        if self._stream is None:
            self._stream = await trio.open_tcp_stream(self.host, self.port)
            self._stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._receiver = EagerReceiver(self._stream)
            self._buffer = b""
        return self._stream

    async def aclose(self) -> None:
        if self._stream is not None:
            await self._stream.aclose()
            self._stream = self._receiver = None

    async def _fill(self) -> None:
        if self._receiver is None:
            raise ConnectionError("not connected")
        data = await self._receiver.receive_some(65536)
        if not data:
            raise ConnectionError("connection closed by the server")
        self._buffer += data

    async def _read_until(self, marker: bytes) -> bytes:
        while (index := self._buffer.find(marker)) < 0:
            await self._fill()
        head, self._buffer = self._buffer[:index], self._buffer[index + len(marker):]
        return head

    async def _read_exact(self, n: int) -> bytes:
        while len(self._buffer) < n:
            await self._fill()
        head, self._buffer = self._buffer[:n], self._buffer[n:]
        return head

    def _take_chunks(self) -> tuple[list[bytes], bool]:
        """The data of every complete chunk at the front of the buffer, and whether the last (empty) chunk
        was among them; what they took leaves the buffer."""
        buffer, at = self._buffer, 0
        chunks: list[bytes] = []
        while (line_end := buffer.find(b"\r\n", at)) >= 0:
            size = int(buffer[at:line_end].split(b";")[0], 16)
            end = line_end + 2 + size + 2  # the size line, the data, its CRLF
            if end > len(buffer):
                break
            at = end
            if size == 0:
                self._buffer = buffer[at:]
                return chunks, True
            chunks.append(buffer[line_end + 2:end - 2])
        self._buffer = buffer[at:]
        return chunks, False

    async def post_stream(self, path: str, body: dict, on_data: Callable[[bytes, float], None],
                          headers: dict[str, str] | None = None) -> int:
        """POST `body`; calls on_data(payload, perf_counter time) per SSE `data:` line (or once with the
        whole body for a non-streamed response). Returns the status; raises HttpError on >= 400."""
        try:
            return await self._post_stream(path, body, on_data, headers or {})
        except BaseException:
            await self.aclose()  # a half-read response poisons the connection
            raise

    async def _post_stream(self, path, body, on_data, headers) -> int:
        stream = await self._connect()
        payload = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = (f"POST {self.base_path}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{extra}\r\n").encode()
        await stream.send_all(request + payload)
        head = (await self._read_until(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        chunked = fields.get("transfer-encoding", "").lower() == "chunked"
        if not chunked:
            data = await self._read_exact(int(fields.get("content-length", "0")))
            if status >= 400:
                raise HttpError(status, data)
            on_data(data, time.perf_counter())
        else:
            pending = b""  # SSE bytes after the last complete event
            while True:
                chunks, last = self._take_chunks()
                if chunks:
                    now = time.perf_counter()
                    pending += b"".join(chunks)
                    if status < 400:
                        *events, pending = pending.split(b"\n\n")
                        for event in events:
                            if event.startswith(b"data: "):
                                on_data(event[6:], now)
                if last:
                    break
                await self._fill()
            if status >= 400:
                raise HttpError(status, pending)
        if fields.get("connection", "").lower() == "close":
            await self.aclose()
        return status
