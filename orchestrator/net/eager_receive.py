"""Reads from a trio socket stream without trio's per-call wrapping, with the same checkpoint rule.

trio's SocketStream.receive_some wraps each read in an error-translating context manager, a cancel check,
and a first attempt whose BlockingIOError it catches before it waits for the socket: about 7 us more than
the read itself when nothing has arrived yet, and 4 us when something has (on our 2-core test machine).
A connection to a worker reads once per arrival of frames, and the client connection once per request,
so at low concurrency that is paid several times per request.

EagerReceiver reads the descriptor directly. Each call is still a checkpoint, as trio's is: it either
waits for the socket (when nothing was there) or, when data was already there, yields once to the
scheduler, so a peer that never stops sending cannot starve the other tasks.

Only for plain sockets: TLS streams (trio.SSLStream) always go through their own receive_some.
"""

from __future__ import annotations

import os
from typing import cast

import trio


class EagerReceiver:
    """Receives from one stream; one reader at a time, as with receive_some."""

    __slots__ = ("stream", "_socket")

    def __init__(self, stream: trio.abc.Stream):
        self.stream = stream
        self._socket = stream.socket if isinstance(stream, trio.SocketStream) else None

    async def receive_some(self, max_bytes: int) -> bytes:
        """Up to `max_bytes` (b"" at the end of the stream). Raises ClosedResourceError once the stream was
        closed here, BrokenResourceError if the read failed, as trio's receive_some does."""
        if self._socket is None:
            # trio's socket and TLS streams return bytes (its Stream ABC also allows a bytearray)
            return cast(bytes, await self.stream.receive_some(max_bytes))
        waited = False
        while True:
            # fileno() each time: -1 once the socket is closed, so a number reused by a new socket is never read
            fd = self._socket.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("the stream was closed")
            try:
                data = os.read(fd, max_bytes)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self._socket)  # the checkpoint
                waited = True
                continue
            except OSError as exc:
                raise trio.BrokenResourceError(f"the socket read failed: {exc}") from exc
            if not waited:
                await trio.lowlevel.checkpoint()
            return data
