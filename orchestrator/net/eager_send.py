"""Writes to a trio socket stream that skip the scheduler when the kernel takes every byte at once.

trio's SocketStream.send_all is always a checkpoint: the writing task goes to the back of the run
queue even when the socket had room, which costs a pass through the scheduler per write. A streaming
response writes once per token batch, so that pass is paid per token. EagerSender tries one
non-blocking write first and only falls back to send_all (which waits for room, and is the
checkpoint) for what the kernel did not take. Callers that must checkpoint do so elsewhere: a
stream's task waits for its next batch anyway.

Only for plain sockets: TLS streams (trio.SSLStream) always go through send_all.
"""

from __future__ import annotations

import os

import trio


class EagerSender:
    """Sends on one stream; one writer at a time, as with send_all."""

    __slots__ = ("stream", "_socket", "_busy")

    def __init__(self, stream: trio.abc.Stream):
        self.stream = stream
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._busy = False  # a send_all is waiting for room: an eager write now would cut into it

    @property
    def eager(self) -> bool:
        """Whether send_nowait can write at all (a plain socket), rather than always leaving everything."""
        return self._socket is not None

    @property
    def busy(self) -> bool:
        return self._busy

    def send_nowait(self, data: bytes | memoryview) -> bytes | memoryview:
        """What the kernel takes now, without waiting; returns the rest (all of it for a stream that is not a
        plain socket, or while a send_all is waiting). Raises BrokenResourceError if the write failed."""
        # fileno() each time: -1 once the socket is closed, so a number reused by a new socket is never written
        if self._socket is None or self._busy or (fd := self._socket.fileno()) < 0:
            return data
        try:
            sent = os.write(fd, data)
        except BlockingIOError:
            return data
        except OSError as exc:
            raise trio.BrokenResourceError(f"the socket write failed: {exc}") from exc
        return memoryview(data)[sent:] if sent < len(data) else b""

    async def send_all(self, data: bytes | memoryview) -> None:
        data = self.send_nowait(data)
        if not data:
            return
        self._busy = True
        try:
            await self.stream.send_all(data)
        finally:
            self._busy = False
