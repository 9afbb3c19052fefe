"""A trio-facing client for one OpenEngine v1 worker (real TRT-LLM or simulated).

    async with LoopThread.open() as loop_thread:
        async with EngineClient.open("127.0.0.1:50051", loop_thread) as worker:
            info = await worker.wait_until_ready()
            async with worker.generate(request) as stream:
                async for event in stream:
                    ...

Leaving the `generate` block before the stream's terminal event (by error, by cancellation of the
enclosing trio scope, or by choice) cancels the RPC, so the worker sees the cancellation. Once the
terminal event (finished, prefill_ready, error) was read, the call is left to end by itself: its status
follows at once, and a cancel landing before it would abort the engine request (see GenerateStream). A
status that has not come 30 s later is not waited for: the call is cancelled then.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import attrs
import grpc
import trio

from orchestrator.engine import events as ev
from orchestrator.engine.capabilities import SingleFlightCache, WorkerCapabilities
from orchestrator.engine.errors import (
    ClientClosed,
    EngineError,
    ErrorCode,
    IncompatibleWorker,
    WorkerNotReady,
    from_rpc_error,
)
from orchestrator.transport import h2_grpc as h2_streams
from orchestrator.transport.h2_grpc import H2Channel
from orchestrator.transport.keepalive import KeepalivePolicy
from orchestrator.transport.loop_thread import LoopThread, StreamInbox
from orchestrator.log import RateLimitedLog, cause_chain
from orchestrator.openengine.v1 import (
    generation_pb2,
    kv_pb2,
    lifecycle_pb2,
    model_pb2,
    openengine_pb2_grpc,
    server_pb2,
)

log = logging.getLogger(__name__)

# The schema revision this client accepts as a worker's minimum_client_revision: openengine v0.1.0 (what
# TensorRT-LLM ships, revision 1) plus the later-branch fields in docs/openengine-additions.md, which the
# sibling server (revision 3 at its pinned commit) serves. Capabilities are gated on the presence of each
# field, never on this number.
CLIENT_SCHEMA_REVISION = 3
HealthState = lifecycle_pb2.HealthState

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # One TCP connection per worker; do not let grpc share subchannels across our clients.
    ("grpc.use_local_subchannel_pool", 1),
]


def _keepalive_options(interval_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """grpcio's keepalive, as our h2 transport's (engine/keepalive.py). grpc-core's client pings only after the
    interval without data read, and sends at most grpc.http2.max_pings_without_data (2 by default) pings while
    it sends no data: left at that default, a silent call never collects the 2 strikes after which a stock
    server closes the connection with GOAWAY too_many_pings (unlimited, 0, did: at 4 intervals)."""
    return [("grpc.keepalive_time_ms", max(1, round(interval_s * 1000))),
            ("grpc.keepalive_timeout_ms", max(1, round(timeout_s * 1000)))]


def check_revision(info: server_pb2.ServerInfo, *, worker: str) -> None:
    """Refuse a worker whose schema revision we cannot speak (explicit, never an assert)."""
    if info.schema_revision == 0:
        raise IncompatibleWorker(
            f"worker reports schema_revision 0 (unset or pre-release); this client speaks revision "
            f"{CLIENT_SCHEMA_REVISION}", worker=worker, rpc="GetServerInfo",
            code=ErrorCode.ERROR_CODE_UNSUPPORTED_FEATURE)
    if info.minimum_client_revision > CLIENT_SCHEMA_REVISION:
        raise IncompatibleWorker(
            f"worker schema_revision {info.schema_revision} requires client revision >= "
            f"{info.minimum_client_revision}; this client speaks revision {CLIENT_SCHEMA_REVISION}",
            worker=worker, rpc="GetServerInfo", code=ErrorCode.ERROR_CODE_UNSUPPORTED_FEATURE)


@attrs.frozen
class ChannelTls:
    """TLS to a worker: the CA that signed its certificate, and ours for mTLS (PEM bytes)."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """The same trust and identity for our own HTTP/2 streams (ALPN h2)."""
        context = ssl.create_default_context(
            cadata=self.root_certificates.decode() if self.root_certificates else None)
        if self.certificate_chain and self.private_key:
            # ssl loads a certificate and key from files only: a private temporary directory, removed at once
            with tempfile.TemporaryDirectory(prefix="orch-tls-") as directory:
                cert, key = Path(directory, "cert.pem"), Path(directory, "key.pem")
                cert.write_bytes(self.certificate_chain)
                key.touch(mode=0o600)
                key.write_bytes(self.private_key)
                context.load_cert_chain(cert, key)
        context.set_alpn_protocols(["h2"])
        return context


STREAM_TRANSPORTS = ("grpcio", "h2")
# The Control service's unary calls and their answers (what the grpcio stubs deserialize), for h2.
_CONTROL_RESPONSES = {"Health": lifecycle_pb2.HealthResponse, "GetServerInfo": server_pb2.ServerInfo,
                      "GetModelInfo": model_pb2.ModelInfo, "GetLoad": server_pb2.LoadInfo,
                      "Abort": lifecycle_pb2.AbortResponse, "GetKvEventSources": kv_pb2.GetKvEventSourcesResponse}
_GENERATE_PATH = "/openengine.v1.Inference/Generate"
_SUBSCRIBE_KV_EVENTS_PATH = "/openengine.v1.Control/SubscribeKvEvents"


_TERMINAL_EVENTS = (ev.Finished, ev.PrefillReady, ev.Failed)
# How long a call whose terminal event was read may take to send its status before it is cancelled:
# h2_streams.STATUS_GRACE_S, one figure for both transports.


class GenerateStream:
    """The events of one Generate call. Iterate it, or read `next_batch()` to coalesce tokens.

    `ended` turns true once a terminal event (finished, prefill_ready, error) was handed out: the worker
    is done, and only the call's status is still on its way. Leaving the `generate` block then does not
    cancel the call. TensorRT-LLM's servicer (tensorrt_llm/grpc/openengine/servicer.py) marks a request
    terminal only when its generator resumes after yielding the last response, and its `finally` aborts
    the engine request when the stream closed before that: a cancel racing the status would abort a request
    that already finished, for a context-only leg the one whose KV the decode leg is about to pull.
    """

    def __init__(self, inbox, worker: str, *, decoded: bool = False):
        self._inbox = inbox  # StreamInbox (grpcio: GenerateResponse messages) or H2Stream (events, `decoded`)
        self._worker = worker
        self._decoded = decoded
        self._pending: list[ev.Event] = []
        self.ended = False

    async def next_batch(self) -> list[ev.Event]:
        """Every event that has arrived (at least one); [] when the stream ended."""
        if self._pending:
            batch, self._pending = self._pending, []
            return batch
        worker = self._worker
        while True:
            raw = await self._inbox.get_batch()
            if not raw:
                return []
            if self._decoded:  # h2 streams queue only events
                decoded = raw
            else:
                decoded = [e for e in (ev.decode(m, worker=worker) for m in raw) if e is not None]
            if decoded:
                if isinstance(decoded[-1], _TERMINAL_EVENTS):  # a terminal event is always the last one
                    self.ended = True
                return decoded

    def deliver_directly(self, handler: Callable[[list[ev.Event]], list | None] | None) -> bool:
        """While `next_batch()` waits, give the events of each read to `handler` in the connection's reader
        task instead of waking this stream's reader (engine/inbox.py: the handler returns None once it has
        dealt with them, or what next_batch() must return instead); None ends that. Only the h2 transport
        can (False if not). The handler must leave terminal events to next_batch(), which marks `ended`."""
        if not self._decoded:
            return False
        self._inbox.direct = handler
        return True

    def __aiter__(self) -> "GenerateStream":
        return self

    async def __anext__(self) -> ev.Event:
        if not self._pending:
            self._pending = await self.next_batch()
            if not self._pending:
                raise StopAsyncIteration
        return self._pending.pop(0)


class EngineClient:
    """One worker's OpenEngine client. With `stream_transport="h2"` (the default) every call goes over our own
    HTTP/2 connection on trio (engine/h2_streams.py); with "grpcio", over grpc.aio on the loop thread."""

    def __init__(self, address: str, loop_thread: LoopThread, nursery: trio.Nursery, *,
                 discovery_timeout: float, name: str | None = None, tls: ChannelTls | None = None):
        self.address = address
        self.name = name or address
        self._loop_thread = loop_thread
        self._channel: grpc.aio.Channel | None = None
        self._inference: openengine_pb2_grpc.InferenceStub | None = None
        self._control: openengine_pb2_grpc.ControlStub | None = None
        self._closed = False
        self._tls = tls
        self._h2: H2Channel | None = None
        self._capabilities = SingleFlightCache(
            self._discover, nursery=nursery, timeout=discovery_timeout, worker=self.name)

    @classmethod
    @asynccontextmanager
    async def open(cls, address: str, loop_thread: LoopThread, *, discovery_timeout: float = 10.0,
                   name: str | None = None, tls: ChannelTls | None = None, stream_transport: str = "h2",
                   keepalive_interval_s: float = 30.0,
                   keepalive_timeout_s: float = 10.0) -> AsyncIterator["EngineClient"]:
        """`keepalive_*`: a PING after that long without hearing from the worker while calls are open, to be
        answered within the timeout (engine/keepalive.py says how servers' ping policies are respected)."""
        if stream_transport not in STREAM_TRANSPORTS:
            raise ValueError(f"stream_transport: expected one of {STREAM_TRANSPORTS}, got {stream_transport!r}")
        address = address.removeprefix("grpc://")
        async with trio.open_nursery() as nursery:
            client = cls(address, loop_thread, nursery, discovery_timeout=discovery_timeout, name=name, tls=tls)
            if stream_transport == "h2":
                client._h2 = H2Channel(address, worker=client.name, nursery=nursery,
                                       ssl_context=None if tls is None else tls.ssl_context(),
                                       server_name=None if tls is None else tls.server_name,
                                       keepalive=KeepalivePolicy(keepalive_interval_s, keepalive_timeout_s))
            options = [*_CHANNEL_OPTIONS, *_keepalive_options(keepalive_interval_s, keepalive_timeout_s)]

            async def connect() -> None:  # grpc.aio objects belong to the loop they are made on
                if tls is None:
                    client._channel = grpc.aio.insecure_channel(address, options=options)
                else:
                    client._channel = grpc.aio.secure_channel(address, tls.credentials(), options=[
                        *options, *tls.options()])
                client._inference = openengine_pb2_grpc.InferenceStub(client._channel)
                client._control = openengine_pb2_grpc.ControlStub(client._channel)

            if client._h2 is None:  # with h2 every call goes over our own connection: no grpcio channel at all
                await loop_thread.run(connect)
            try:
                yield client
            finally:
                client._closed = True
                client._capabilities.close()
                if client._h2 is not None:
                    client._h2.close()
                nursery.cancel_scope.cancel()
                if client._channel is not None:
                    with trio.CancelScope(shield=True):
                        channel = client._channel
                        await loop_thread.run(lambda: channel.close(grace=None))

    # ---- inference ---------------------------------------------------------------------------
    @asynccontextmanager
    async def generate(self, request: generation_pb2.GenerateRequest,
                       metadata: tuple[tuple[str, str], ...] = ()) -> AsyncIterator[GenerateStream]:
        """`metadata`: gRPC request metadata, e.g. the leg's `traceparent` (orchestrator/tracing.py)."""
        self._check_open("Generate")
        if self._h2 is not None:  # messages become events as they are cut from the frames, in one step
            async with self._h2.stream(_GENERATE_PATH, request.SerializeToString(), self._decode_event,
                                       metadata=metadata) as inbox:
                stream = GenerateStream(inbox, self.name, decoded=True)
                try:
                    yield stream
                finally:
                    inbox.let_end = stream.ended  # the call ends by itself: no RST_STREAM
            return
        inbox = self._loop_thread.new_inbox()
        holder: dict[str, grpc.aio.UnaryStreamCall] = {}
        worker = self.name
        stub = self._inference

        def start() -> None:  # on the loop thread; no round trip back to trio needed
            call = stub.Generate(request, metadata=metadata or None)
            holder["call"] = call
            # asyncio keeps only weak references to tasks: `holder` keeps the pump alive with the stream
            holder["pump"] = asyncio.get_running_loop().create_task(_pump(call, inbox, worker))

        self._loop_thread.call_soon(start)
        stream = GenerateStream(inbox, worker)
        try:
            yield stream
        finally:
            def cancel() -> None:
                call = holder.get("call")
                if call is not None and not call.done():
                    call.cancel()

            def cancel_if_no_status() -> None:  # the pump reads the call to its status, if that comes in time
                pump = holder.get("pump")
                if pump is not None and not pump.done():
                    timer = asyncio.get_running_loop().call_later(h2_streams.STATUS_GRACE_S, cancel)
                    pump.add_done_callback(lambda _: timer.cancel())

            self._loop_thread.call_soon(cancel_if_no_status if stream.ended else cancel)

    def fail_calls_if_silent(self, quiet_s: float, why: str) -> int:
        """Fail every open call (WorkerUnavailable) when nothing arrived from the worker for `quiet_s` seconds:
        see H2Channel.fail_if_silent; how many calls. With grpcio, its keepalive (30 s + 10 s) does it: 0."""
        return self._h2.fail_if_silent(quiet_s, why) if self._h2 is not None else 0

    def _decode_event(self, payload: bytes) -> ev.Event | None:
        return ev.decode_bytes(payload, worker=self.name)

    # ---- control -----------------------------------------------------------------------------
    async def _unary(self, rpc: str, request, timeout: float | None, metadata: tuple[tuple[str, str], ...] = ()):
        self._check_open(rpc)
        if self._h2 is not None:
            return await self._h2.unary(f"/openengine.v1.Control/{rpc}", request.SerializeToString(),
                                        _CONTROL_RESPONSES[rpc].FromString, timeout=timeout, metadata=metadata)
        method = getattr(self._control, rpc)
        try:
            return await self._loop_thread.run(lambda: method(request, timeout=timeout, metadata=metadata or None))
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, worker=self.name, rpc=rpc) from None

    async def health(self, *, timeout: float | None = 5.0, probe: bool = False) -> int:
        response = await self._unary("Health", lifecycle_pb2.HealthRequest(include_inference_probe=probe), timeout)
        return response.state

    async def server_info(self, *, timeout: float | None = 10.0) -> server_pb2.ServerInfo:
        return await self._unary("GetServerInfo", server_pb2.GetServerInfoRequest(), timeout)

    async def model_info(self, model: str = "", *, timeout: float | None = 10.0) -> model_pb2.ModelInfo:
        return await self._unary("GetModelInfo", model_pb2.GetModelInfoRequest(model=model), timeout)

    async def load(self, *, timeout: float | None = 5.0) -> server_pb2.LoadInfo:
        return await self._unary("GetLoad", server_pb2.GetLoadRequest(), timeout)

    async def health_and_load(self, *, timeout: float | None = 5.0) -> tuple[int, server_pb2.LoadInfo | EngineError]:
        """Health and GetLoad side by side in one hop to the loop thread and back: an idle pool's poll
        wakes each thread once instead of twice. Raises what health() raises; a failed GetLoad is
        returned in place of the load."""
        self._check_open("Health")
        if self._h2 is not None:
            return await self._health_and_load_h2(timeout)
        control = self._control

        async def both():
            return await asyncio.gather(
                control.Health(lifecycle_pb2.HealthRequest(), timeout=timeout),
                control.GetLoad(server_pb2.GetLoadRequest(), timeout=timeout), return_exceptions=True)

        health, load = await self._loop_thread.run(both)
        if isinstance(health, grpc.aio.AioRpcError):
            raise from_rpc_error(health, worker=self.name, rpc="Health") from None
        if isinstance(health, BaseException):
            raise health
        if isinstance(load, grpc.aio.AioRpcError):
            load = from_rpc_error(load, worker=self.name, rpc="GetLoad")
        elif isinstance(load, BaseException):
            raise load
        return health.state, load

    async def _health_and_load_h2(self, timeout: float | None) -> tuple[int, server_pb2.LoadInfo | EngineError]:
        results: dict[str, Any] = {}

        async def call(rpc: str, request) -> None:
            try:
                results[rpc] = await self._unary(rpc, request, timeout)
            except EngineError as exc:
                results[rpc] = exc

        async with trio.open_nursery() as nursery:  # side by side: one round trip
            nursery.start_soon(call, "Health", lifecycle_pb2.HealthRequest())
            nursery.start_soon(call, "GetLoad", server_pb2.GetLoadRequest())
        if isinstance(results["Health"], EngineError):
            raise results["Health"]
        return results["Health"].state, results["GetLoad"]

    async def abort(self, *, request_id: str | None = None, kv_session: kv_pb2.KvSessionRef | None = None,
                    timeout: float | None = 5.0,
                    metadata: tuple[tuple[str, str], ...] = ()) -> lifecycle_pb2.AbortResponse:
        if (request_id is None) == (kv_session is None):
            raise ValueError("abort takes exactly one of request_id or kv_session")
        request = (lifecycle_pb2.AbortRequest(request_id=request_id) if request_id is not None
                   else lifecycle_pb2.AbortRequest(kv_session=kv_session))
        return await self._unary("Abort", request, timeout, metadata)

    # ---- KV events (orchestrator/workers/kv_events.py) --------------------------------------------
    async def kv_event_sources(self, ranks: tuple[int, ...] = (), *,
                               timeout: float | None = 10.0) -> list[kv_pb2.KvEventSource]:
        """Control.GetKvEventSources: where each attention-DP rank publishes its KV events (all ranks: ())."""
        response = await self._unary("GetKvEventSources",
                                     kv_pb2.GetKvEventSourcesRequest(data_parallel_ranks=list(ranks)), timeout)
        return list(response.sources)

    @asynccontextmanager
    async def subscribe_kv_events(self, ranks: tuple[int, ...] = ()) -> AsyncIterator[Any]:
        """Control.SubscribeKvEvents, a server stream: read SubscribeKvEventsResponse messages with
        `get_batch()` ([] once the stream ended; a failed call raises EngineError). Leaving the block cancels
        it. Only our h2 transport streams it (the KV event feed is its only user)."""
        self._check_open("SubscribeKvEvents")
        if self._h2 is None:
            raise EngineError("SubscribeKvEvents needs the h2 stream transport", worker=self.name,
                              rpc="SubscribeKvEvents", code=ErrorCode.ERROR_CODE_UNSUPPORTED_FEATURE)
        request = kv_pb2.SubscribeKvEventsRequest(data_parallel_ranks=list(ranks))
        async with self._h2.stream(_SUBSCRIBE_KV_EVENTS_PATH, request.SerializeToString(),
                                   kv_pb2.SubscribeKvEventsResponse.FromString) as stream:
            yield stream

    # ---- capabilities and readiness ------------------------------------------------------------
    async def _discover(self) -> WorkerCapabilities:
        server = await self.server_info()
        check_revision(server, worker=self.name)
        model = await self.model_info()
        return WorkerCapabilities.from_protos(server, model)

    async def capabilities(self) -> WorkerCapabilities:
        """ServerInfo + ModelInfo, discovered once and cached; see SingleFlightCache."""
        return await self._capabilities.get()

    def forget_capabilities(self) -> None:
        """The worker may have restarted (new instance, new build): discover again on next use."""
        self._capabilities.invalidate()

    @property
    def cached_capabilities(self) -> WorkerCapabilities | None:
        return self._capabilities.cached

    @property
    def discovery_attempts(self) -> int:
        return self._capabilities.attempts

    async def wait_until_ready(self, *, deadline: float = 300.0, attempt_timeout: float = 5.0,
                               retry_interval: float = 0.5) -> WorkerCapabilities:
        """Connect until the worker is READY (or DEGRADED), then check its revision.

        A worker still STARTING is waited for; one that is unreachable or NOT_READY at the deadline
        is a WorkerNotReady naming the last cause. Every failed attempt is logged with its full cause
        chain, rate-limited, from the first attempt on.
        """
        retry_log = RateLimitedLog(log, interval=5.0)
        give_up_at = trio.current_time() + deadline
        attempt = 0
        last: str = "no attempt made"
        last_error: BaseException | None = None
        while True:
            attempt += 1
            try:
                state = await self.health(timeout=attempt_timeout)
            except EngineError as exc:
                last, last_error = cause_chain(exc), exc
                retry_log("waiting for worker %s (attempt %d): %s", self.name, attempt, last)
            else:
                if state in (HealthState.HEALTH_STATE_READY, HealthState.HEALTH_STATE_DEGRADED):
                    check_revision(await self.server_info(), worker=self.name)
                    self._capabilities.invalidate()
                    caps = await self.capabilities()
                    log.info("worker %s ready: %s role=%s model=%s", self.name, caps.engine, caps.role,
                             caps.model_id)
                    return caps
                last, last_error = f"health state {HealthState.Name(state)}", None
                retry_log("waiting for worker %s (attempt %d): %s", self.name, attempt, last)
            if trio.current_time() + retry_interval > give_up_at:
                raise WorkerNotReady(
                    f"not ready after {deadline:g} s and {attempt} attempts; last: {last}",
                    worker=self.name, rpc="Health", retryable=False) from last_error
            await trio.sleep(retry_interval)

    def _check_open(self, rpc: str) -> None:
        if self._closed:
            raise ClientClosed("engine client closed", worker=self.name, rpc=rpc)


async def _pump(call: grpc.aio.UnaryStreamCall, inbox: StreamInbox, worker: str) -> None:
    """Loop-thread side of a Generate stream: move messages into the trio-side inbox."""
    try:
        async for message in call:
            inbox.put(message)
    except grpc.aio.AioRpcError as exc:
        inbox.close(from_rpc_error(exc, worker=worker, rpc="Generate"))
    except asyncio.CancelledError:
        inbox.close(EngineError("stream cancelled", worker=worker, rpc="Generate",
                                code=ErrorCode.ERROR_CODE_CANCELLED))
    except BaseException as exc:  # keep the trio side from waiting forever
        inbox.close(EngineError(f"stream failed: {exc!r}", worker=worker, rpc="Generate"))
    else:
        inbox.close()
