"""One interface for the two ways of calling a worker; `stream_transport` chooses one per client
(engine/client.py's EngineClient.open).

A WorkerChannel makes the gRPC calls of one worker with serialized requests: server-streaming ones
(`stream`: Generate) and unary ones (`unary`: the Control service). Its implementations:
- "h2" (the default): H2Channel (transport/h2_channel.py), our own HTTP/2 client on trio's thread;
- "grpcio": GrpcioChannel (transport/grpcio_channel.py), grpc.aio on the asyncio loop thread, kept as the
  operator's fallback should our HTTP/2 client ever disagree with a worker.
Both report failures as the same EngineErrors (transport/errors.py), and the engine client's tests run on both.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from orchestrator.transport.keepalive import KeepalivePolicy

STREAM_TRANSPORTS = ("grpcio", "h2")
# A call whose reader read its last response is left to end with its status (`let_end`); one whose status has
# not come this long after is cancelled, so a worker that never ends its calls cannot pile them up. Read at
# use (calls.STATUS_GRACE_S), so that tests can shorten it.
STATUS_GRACE_S = 30.0
Metadata = tuple[tuple[str, str], ...]  # request metadata (lower-case ASCII keys), e.g. a leg's traceparent


class CallStream(Protocol):
    """The responses of one streaming call, each already decoded, for the one task that reads them."""

    # Set by the reader before it leaves the `stream` block: True once it read the call's last response, so
    # the call is left to end with its status instead of being cancelled (engine/client.py says why).
    let_end: bool

    async def get_batch(self) -> list[Any]:
        """Every response that arrived (at least one); [] when the call ended well; raises its error."""
        ...

    def deliver_directly(self, handler: Callable[[list], list | None] | None) -> bool:
        """Hand the responses to `handler` in the producing task while the reader waits (transport/inbox.py);
        False when this channel cannot (its producer is another thread)."""
        ...


class WorkerChannel(Protocol):
    keepalive: KeepalivePolicy

    def stream(self, path: str, request: bytes, decode: Callable[[bytes], Any], *,
               metadata: Metadata = ()) -> AbstractAsyncContextManager[CallStream]:
        """Start the server-streaming call `path` (`/package.Service/Method`); leaving the block early cancels it.
        `decode` turns each response message into what the stream hands out (None: dropped)."""
        ...

    async def unary(self, path: str, request: bytes, decode: Callable[[bytes], Any], *, timeout: float | None,
                    metadata: Metadata = ()) -> Any:
        """The decoded response of a unary call; DEADLINE_EXCEEDED after `timeout`."""
        ...

    def fail_if_silent(self, quiet_s: float, why: str) -> int:
        """Fail the open calls when nothing came from the worker for `quiet_s` s; how many (0 if it cannot)."""
        ...

    async def aclose(self) -> None:
        """Cancel what is open; no call starts after this."""
        ...
