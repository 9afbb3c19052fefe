"""gRPC calls to one worker through grpc.aio on the asyncio loop thread (transport/loop_thread.py): the
`stream_transport: grpcio` fallback behind the same WorkerChannel interface as our HTTP/2 client.

Every grpc.aio object belongs to the loop thread: calls start there (`LoopThread.call_soon` / `run`), a
streaming call's messages are decoded there by its pump task and reach the trio reader through a StreamInbox,
woken once per loop iteration for all the messages of that iteration.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc

from orchestrator.tls import TlsMaterial
from orchestrator.transport import calls
from orchestrator.transport.errors import EngineError, ErrorCode, from_rpc_error
from orchestrator.transport.keepalive import KeepalivePolicy
from orchestrator.transport.loop_thread import LoopThread, StreamInbox

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # One TCP connection per worker; do not let grpc share subchannels across our clients.
    ("grpc.use_local_subchannel_pool", 1),
]


def _keepalive_options(keepalive: KeepalivePolicy) -> list[tuple[str, int]]:
    """grpcio's keepalive, as our h2 channel's (transport/keepalive.py). grpc-core's client pings only after the
    interval without data read, and sends at most grpc.http2.max_pings_without_data (2 by default) pings while
    it sends no data: left at that default, a silent call never collects the 2 strikes after which a stock
    server closes the connection with GOAWAY too_many_pings (unlimited, 0, did: at 4 intervals)."""
    return [("grpc.keepalive_time_ms", max(1, round(keepalive.interval_s * 1000))),
            ("grpc.keepalive_timeout_ms", max(1, round(keepalive.timeout_s * 1000)))]


class GrpcioChannel:
    """One worker's grpc.aio channel, used from trio."""

    def __init__(self, grpc_channel: grpc.aio.Channel, loop_thread: LoopThread, *, worker: str,
                 keepalive: KeepalivePolicy):
        self.grpc_channel = grpc_channel
        self.keepalive = keepalive  # given to grpc-core as channel options; kept for the record
        self._loop_thread = loop_thread
        self._worker = worker

    @classmethod
    async def open(cls, address: str, loop_thread: LoopThread, *, worker: str, tls: TlsMaterial | None,
                   keepalive: KeepalivePolicy) -> GrpcioChannel:
        options = [*_CHANNEL_OPTIONS, *_keepalive_options(keepalive)]

        async def connect() -> grpc.aio.Channel:  # on the loop thread: the channel belongs to that loop
            if tls is None:
                return grpc.aio.insecure_channel(address, options=options)
            return grpc.aio.secure_channel(address, tls.grpc_credentials(), options=[*options, *tls.grpc_options()])

        return cls(await loop_thread.run(connect), loop_thread, worker=worker, keepalive=keepalive)

    @asynccontextmanager
    async def stream(self, path: str, request: bytes, decode: Callable[[bytes], Any], *,
                     metadata: calls.Metadata = ()) -> AsyncIterator[StreamInbox]:
        inbox = self._loop_thread.new_inbox()
        rpc = path.rsplit("/", 1)[-1]
        # The call and its pump, once the loop thread started them. asyncio keeps only weak references to
        # tasks: this holds the pump for as long as the stream lasts.
        started: dict[str, Any] = {}

        def start() -> None:  # loop thread; the caller does not wait for it
            method: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = self.grpc_channel.unary_stream(path)
            call = method(request, metadata=metadata or None)
            started["call"] = call
            started["pump"] = asyncio.get_running_loop().create_task(
                _pump(call, inbox, decode, worker=self._worker, rpc=rpc))

        self._loop_thread.call_soon(start)
        try:
            yield inbox
        finally:
            # call_soon runs after start(): `started` is filled by then.
            self._loop_thread.call_soon(_end_when_status_comes if inbox.let_end else _cancel, started)

    async def unary(self, path: str, request: bytes, decode: Callable[[bytes], Any], *, timeout: float | None,
                    metadata: calls.Metadata = ()) -> Any:
        rpc = path.rsplit("/", 1)[-1]

        def call():  # loop thread; cancelling the trio caller cancels it (LoopThread.run)
            method: grpc.aio.UnaryUnaryMultiCallable[bytes, Any] = self.grpc_channel.unary_unary(
                path, response_deserializer=decode)
            return method(request, timeout=timeout, metadata=metadata or None)

        try:
            return await self._loop_thread.run(call)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, worker=self._worker, rpc=rpc) from None

    def fail_if_silent(self, quiet_s: float, why: str) -> int:
        """grpc-core's keepalive finds a silent worker (interval + timeout): nothing to do here."""
        return 0

    async def aclose(self) -> None:
        grpc_channel = self.grpc_channel
        await self._loop_thread.run(lambda: grpc_channel.close(grace=None))


def _cancel(started: dict[str, Any]) -> None:  # loop thread
    call = started.get("call")
    if call is not None and not call.done():
        call.cancel()


def _end_when_status_comes(started: dict[str, Any]) -> None:  # loop thread
    """The reader read the last response: the pump reads the call on to its status, which ends it; a status
    that has not come within the grace cancels it."""
    pump = started.get("pump")
    if pump is not None and not pump.done():
        timer = asyncio.get_running_loop().call_later(calls.STATUS_GRACE_S, _cancel, started)
        pump.add_done_callback(lambda _: timer.cancel())


async def _pump(call: grpc.aio.UnaryStreamCall[bytes, bytes], inbox: StreamInbox, decode: Callable[[bytes], Any], *,
                worker: str, rpc: str) -> None:
    """Loop-thread side of a streaming call: decode its messages into the trio-side inbox, then close it with
    the call's outcome. Whatever happens, the inbox is closed: its trio reader never waits forever."""
    try:
        async for message in call:  # bytes: the call has no deserializer
            try:
                item = decode(message)
            except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or anything a decoder raises
                inbox.close(EngineError(f"the worker sent a message that does not decode: {exc}", worker=worker,
                                        rpc=rpc))
                call.cancel()
                return
            if item is not None:
                inbox.put(item)
    except grpc.aio.AioRpcError as exc:
        inbox.close(from_rpc_error(exc, worker=worker, rpc=rpc))
    except asyncio.CancelledError:
        inbox.close(EngineError("stream cancelled", worker=worker, rpc=rpc, code=ErrorCode.ERROR_CODE_CANCELLED))
    except BaseException as exc:  # noqa: BLE001 - the trio side must not wait forever
        inbox.close(EngineError(f"stream failed: {exc!r}", worker=worker, rpc=rpc))
    else:
        inbox.close()
