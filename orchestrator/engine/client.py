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

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
from google.protobuf.message import Message

from orchestrator.engine import events as ev
from orchestrator.engine.capabilities import SingleFlightCache, WorkerCapabilities
from orchestrator.engine.errors import (
    ClientClosed,
    EngineError,
    ErrorCode,
    IncompatibleWorker,
    NoLoraSurface,
    WorkerNotReady,
)
from orchestrator.engine.numbering import Health, Numbering, error_code_of, health_of, health_text, numbering_of
from orchestrator.log import RateLimitedLog, cause_chain
from orchestrator.openengine.v1 import generation_pb2, kv_pb2, lifecycle_pb2, lora_pb2, model_pb2, server_pb2
from orchestrator.tls import TlsMaterial
from orchestrator.transport.calls import STREAM_TRANSPORTS, CallStream, WorkerChannel
from orchestrator.transport.errors import ERROR_CODE_DRAINING
from orchestrator.transport.grpcio_channel import GrpcioChannel
from orchestrator.transport.h2_channel import H2Channel
from orchestrator.transport.keepalive import KeepalivePolicy
from orchestrator.transport.loop_thread import LoopThread

__all__ = ["CLIENT_SCHEMA_REVISION", "STREAM_TRANSPORTS", "EngineClient", "GenerateStream",
           "check_revision"]

log = logging.getLogger(__name__)

# The schema revision this client accepts as a worker's minimum_client_revision: openengine v0.1.0 (what
# TensorRT-LLM ships, revision 1) plus the later-branch fields in docs/openengine-additions.md, which the
# sibling server (revision 3 at its pinned commit) serves. Capabilities are gated on the presence of each
# field, never on this number.
CLIENT_SCHEMA_REVISION = 3
HealthState = lifecycle_pb2.HealthState
_FIRST_DIFFERING_HEALTH = 4  # v0.1.0's NOT_READY, the drain numbering's DRAINING (engine/numbering.py)

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


# The Control service's unary calls and the messages they answer with.
_CONTROL_RESPONSES: dict[str, type[Message]] = {
    "Health": lifecycle_pb2.HealthResponse, "GetServerInfo": server_pb2.ServerInfo, "GetModelInfo": model_pb2.ModelInfo,
    "GetLoad": server_pb2.LoadInfo, "Abort": lifecycle_pb2.AbortResponse,
    "GetKvEventSources": kv_pb2.GetKvEventSourcesResponse, "ListLoras": lora_pb2.ListLorasResponse,
    "LoadLora": lora_pb2.LoadLoraResponse, "UnloadLora": lora_pb2.UnloadLoraResponse}
# How a worker without the LoRA surface answers its RPCs: revision 1 UNIMPLEMENTED (control.py), the sibling server
# FAILED_PRECONDITION "TensorRT-LLM was not configured with LoRA support" (servicer.py _supports_lora)
_NO_LORA_STATUSES = ("UNIMPLEMENTED", "FAILED_PRECONDITION")
# Both servers spell it so: revision 1 as an extra key (request_mapping.py), the sibling as a metadata key
CONVERSATION_ID = "conversation_id"
_GENERATE_PATH = "/openengine.v1.Inference/Generate"
_SUBSCRIBE_KV_EVENTS_PATH = "/openengine.v1.Control/SubscribeKvEvents"


_TERMINAL_EVENTS = (ev.Finished, ev.PrefillReady, ev.Failed)


class GenerateStream:
    """The events of one Generate call. Iterate it, or read `next_batch()` to coalesce tokens.

    `ended` turns true once a terminal event (finished, prefill_ready, error) was handed out: the worker
    is done, and only the call's status is still on its way. Leaving the `generate` block then does not
    cancel the call. TensorRT-LLM's servicer (tensorrt_llm/grpc/openengine/servicer.py) marks a request
    terminal only when its generator resumes after yielding the last response, and its `finally` aborts
    the engine request when the stream closed before that: a cancel racing the status would abort a request
    that already finished, for a context-only leg the one whose KV the decode leg is about to pull.
    """

    def __init__(self, call: CallStream):
        self._call = call
        self._pending: list[ev.Event] = []
        self.ended = False

    async def next_batch(self) -> list[ev.Event]:
        """Every event that has arrived (at least one); [] when the stream ended."""
        if self._pending:
            batch, self._pending = self._pending, []
            return batch
        batch = await self._call.get_batch()
        if batch and isinstance(batch[-1], _TERMINAL_EVENTS):  # a terminal event is always the last one
            self.ended = True
        return batch

    def deliver_directly(self, handler: Callable[[list[ev.Event]], list | None] | None) -> bool:
        """While `next_batch()` waits, give the events of each read to `handler` in the connection's reader
        task instead of waking this stream's reader (decode/progress.py has the contract: the handler returns None
        once it has dealt with them, or what next_batch() must return instead); None ends that. Only the h2 transport
        can (False if not). The handler must leave terminal events to next_batch(), which marks `ended`."""
        return self._call.deliver_directly(handler)

    def __aiter__(self) -> GenerateStream:
        return self

    async def __anext__(self) -> ev.Event:
        if not self._pending:
            self._pending = await self.next_batch()
            if not self._pending:
                raise StopAsyncIteration
        return self._pending.pop(0)


@attrs.frozen
class OversizeMessage:
    """A stream message not parsed because it was bigger than the caller's limit."""

    size: int


class EngineClient:
    """One worker's OpenEngine client. Its calls go through one WorkerChannel (transport/calls.py): our own
    HTTP/2 client on trio (`stream_transport="h2"`, the default) or grpc.aio on the loop thread ("grpcio")."""

    def __init__(self, address: str, channel: WorkerChannel, nursery: trio.Nursery, *, discovery_timeout: float,
                 name: str | None = None):
        self.address = address
        self.name = name or address
        self._channel = channel
        self._closed = False
        self._capabilities = SingleFlightCache(
            self._discover, nursery=nursery, timeout=discovery_timeout, worker=self.name)
        # How this worker numbers its enums (engine/numbering.py), from its ServerInfo; v0.1.0 until read.
        self.numbering = Numbering.V0_1_0
        self._numbering_read = False
        # When the last Generate message arrived from this worker (time.monotonic(), from any thread): a worker
        # that streams tokens is alive, whatever its health check says under load (workers/pool.py).
        self.heard_at = float("-inf")
        self.last_health_value = 0  # the number the last health answer carried

    @classmethod
    @asynccontextmanager
    async def open(cls, address: str, loop_thread: LoopThread, *, discovery_timeout: float = 10.0,
                   name: str | None = None, tls: TlsMaterial | None = None, stream_transport: str = "h2",
                   keepalive_interval_s: float = 30.0,
                   keepalive_timeout_s: float = 10.0) -> AsyncIterator[EngineClient]:
        """`keepalive_*`: a PING after that long without hearing from the worker while calls are open, to be
        answered within the timeout (transport/keepalive.py says how servers' ping policies are respected).
        `loop_thread` runs grpc.aio for the grpcio transport (and is not used with h2)."""
        if stream_transport not in STREAM_TRANSPORTS:
            raise ValueError(f"stream_transport: expected one of {STREAM_TRANSPORTS}, got {stream_transport!r}")
        address = address.removeprefix("grpc://")
        name = name or address
        keepalive = KeepalivePolicy(keepalive_interval_s, keepalive_timeout_s)
        async with trio.open_nursery() as nursery:
            channel: WorkerChannel
            if stream_transport == "h2":
                channel = H2Channel(address, worker=name, nursery=nursery, keepalive=keepalive,
                                    ssl_context=None if tls is None else tls.client_context(["h2"]),
                                    server_name=None if tls is None else tls.server_name)
            else:
                channel = await GrpcioChannel.open(address, loop_thread, worker=name, tls=tls, keepalive=keepalive)
            client = cls(address, channel, nursery, discovery_timeout=discovery_timeout, name=name)
            try:
                yield client
            finally:
                client._closed = True
                client._capabilities.close()
                with trio.CancelScope(shield=True):  # closes even when we are cancelled: the worker sees its calls end
                    await channel.aclose()
                nursery.cancel_scope.cancel()

    # ---- inference ---------------------------------------------------------------------------
    @asynccontextmanager
    async def generate(self, request: generation_pb2.GenerateRequest,
                       metadata: tuple[tuple[str, str], ...] = ()) -> AsyncIterator[GenerateStream]:
        """`metadata`: gRPC request metadata, e.g. the leg's `traceparent` (orchestrator/tracing.py). A request's
        `extra.conversation_id` also goes as metadata `conversation_id`: revision 1 reads the extra, the sibling
        server only the metadata (on its prefill role)."""
        self._check_open("Generate")
        conversation = request.extra.fields.get(CONVERSATION_ID) if request.HasField("extra") else None
        if conversation is not None:
            metadata = (*metadata, (CONVERSATION_ID, conversation.string_value))
        async with self._channel.stream(_GENERATE_PATH, request.SerializeToString(), self._decode_event,
                                        metadata=metadata) as call:
            stream = GenerateStream(call)
            try:
                yield stream
            finally:
                call.let_end = stream.ended  # the call ends by itself: not cancelled (see GenerateStream)

    def fail_calls_if_silent(self, quiet_s: float, why: str) -> int:
        """Fail every open call (WorkerUnavailable) when nothing arrived from the worker for `quiet_s` seconds:
        see H2Channel.fail_if_silent; how many calls. With grpcio, its keepalive (30 s + 10 s) does it: 0."""
        return self._channel.fail_if_silent(quiet_s, why)

    def heard_within(self, seconds: float) -> bool:
        """Whether a Generate message arrived from the worker in the last `seconds`."""
        return time.monotonic() - self.heard_at < seconds

    def _decode_event(self, payload: bytes) -> ev.Event | None:
        self.heard_at = time.monotonic()
        event = ev.decode_bytes(payload, worker=self.name)
        if isinstance(event, ev.Failed) and self.numbering is not Numbering.V0_1_0:
            event.error.code = error_code_of(self.numbering, event.error.code)
            if event.error.code == ERROR_CODE_DRAINING:
                event.error.retryable = True  # it stopped taking requests: another worker may
        return event

    # ---- control -----------------------------------------------------------------------------
    async def _unary(self, rpc: str, request, timeout: float | None, metadata: tuple[tuple[str, str], ...] = ()):
        self._check_open(rpc)
        return await self._channel.unary(f"/openengine.v1.Control/{rpc}", request.SerializeToString(),
                                         _CONTROL_RESPONSES[rpc].FromString, timeout=timeout, metadata=metadata)

    async def health(self, *, timeout: float | None = 5.0, probe: bool = False) -> Health:
        """The worker's health state, read by its numbering (Health.UNKNOWN for a number it does not define)."""
        response = await self._unary("Health", lifecycle_pb2.HealthRequest(include_inference_probe=probe), timeout)
        return await self._health_of(response.state, timeout)

    async def server_info(self, *, timeout: float | None = 10.0) -> server_pb2.ServerInfo:
        info = await self._unary("GetServerInfo", server_pb2.GetServerInfoRequest(), timeout)
        self.numbering, self._numbering_read = numbering_of(info), True
        return info

    async def model_info(self, model: str = "", *, timeout: float | None = 10.0) -> model_pb2.ModelInfo:
        return await self._unary("GetModelInfo", model_pb2.GetModelInfoRequest(model=model), timeout)

    async def load(self, *, timeout: float | None = 5.0) -> server_pb2.LoadInfo:
        return await self._unary("GetLoad", server_pb2.GetLoadRequest(), timeout)

    async def health_and_load(self, *, timeout: float | None = 5.0
                              ) -> tuple[Health, server_pb2.LoadInfo | EngineError]:
        """Health and GetLoad side by side (one round trip). Raises what health() raises; a failed GetLoad is
        returned in place of the load."""
        self._check_open("Health")
        results: dict[str, Any] = {}

        async def call(rpc: str, request) -> None:
            try:
                results[rpc] = await self._unary(rpc, request, timeout)
            except EngineError as exc:
                results[rpc] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "Health", lifecycle_pb2.HealthRequest())
            nursery.start_soon(call, "GetLoad", server_pb2.GetLoadRequest())
        if isinstance(results["Health"], EngineError):
            raise results["Health"]
        return await self._health_of(results["Health"].state, timeout), results["GetLoad"]

    async def _health_of(self, value: int, timeout: float | None) -> Health:
        """A health answer by the worker's numbering. Where the numberings differ (4 and up) and this worker's is
        not known yet (health comes before discovery), its ServerInfo says which it is."""
        self.last_health_value = value
        if value >= _FIRST_DIFFERING_HEALTH and not self._numbering_read:
            try:
                await self.server_info(timeout=timeout)
            except EngineError:
                pass  # read by v0.1.0's: not ready either way
        return health_of(self.numbering, value)

    async def abort(self, *, request_id: str | None = None, kv_session: kv_pb2.KvSessionRef | None = None,
                    all_requests: bool = False, timeout: float | None = 5.0,
                    metadata: tuple[tuple[str, str], ...] = ()) -> lifecycle_pb2.AbortResponse:
        """Abort one request, one KV session or (an operator's act, and tests') every request of the worker."""
        if (request_id is not None) + (kv_session is not None) + all_requests != 1:
            raise ValueError("abort takes exactly one of request_id, kv_session or all_requests")
        request = (lifecycle_pb2.AbortRequest(request_id=request_id) if request_id is not None
                   else lifecycle_pb2.AbortRequest(kv_session=kv_session) if kv_session is not None
                   else lifecycle_pb2.AbortRequest(all_requests=lifecycle_pb2.AllRequests()))
        return await self._unary("Abort", request, timeout, metadata)

    # ---- LoRA adapters (orchestrator/workers/adapters.py) --------------------------------------------
    async def list_loras(self, *, timeout: float | None = 5.0) -> list[lora_pb2.LoraAdapter]:
        """Control.ListLoras: the adapters the worker holds. NoLoraSurface: it serves no LoRA RPCs."""
        return list((await self._lora("ListLoras", lora_pb2.ListLorasRequest(), timeout)).adapters)

    async def load_lora(self, name: str, source_path: str, lora_id: int, *,
                        timeout: float | None = 60.0) -> lora_pb2.LoadLoraResponse:
        """Control.LoadLora. The sibling server binds a name to its id and path for the life of its process (a
        second load with other attributes is INVALID_ARGUMENT) and answers already_loaded for the same ones."""
        adapter = lora_pb2.LoraAdapter(lora_id=lora_id, lora_name=name, source_path=source_path)
        return await self._lora("LoadLora", lora_pb2.LoadLoraRequest(adapter=adapter), timeout)

    async def unload_lora(self, name: str, *, timeout: float | None = 10.0) -> lora_pb2.UnloadLoraResponse:
        """Control.UnloadLora (an unknown name: NOT_FOUND)."""
        return await self._lora("UnloadLora", lora_pb2.UnloadLoraRequest(lora_name=name), timeout)

    async def _lora(self, rpc: str, request, timeout: float | None):
        try:
            return await self._unary(rpc, request, timeout)
        except EngineError as exc:
            if exc.grpc_status is not None and exc.grpc_status.name in _NO_LORA_STATUSES:
                raise NoLoraSurface(f"no LoRA surface: {exc.message}", worker=self.name, rpc=rpc, code=exc.code,
                                    retryable=False, grpc_status=exc.grpc_status) from exc
            raise

    # ---- KV events (orchestrator/workers/kv_events.py) --------------------------------------------
    async def kv_event_sources(self, ranks: tuple[int, ...] = (), *,
                               timeout: float | None = 10.0) -> list[kv_pb2.KvEventSource]:
        """Control.GetKvEventSources: where each attention-DP rank publishes its KV events (all ranks: ())."""
        response = await self._unary("GetKvEventSources",
                                     kv_pb2.GetKvEventSourcesRequest(data_parallel_ranks=list(ranks)), timeout)
        return list(response.sources)

    @asynccontextmanager
    async def subscribe_kv_events(self, ranks: tuple[int, ...] = (), *, max_message_bytes: int | None = None
                                  ) -> AsyncIterator[Any]:
        """Control.SubscribeKvEvents, a server stream: read SubscribeKvEventsResponse messages with
        `get_batch()` ([] once the stream ended; a failed call raises EngineError). Leaving the block cancels
        it. Either transport streams it (transport/calls.py). A message above `max_message_bytes` is not parsed:
        the stream hands out an OversizeMessage in its place."""
        self._check_open("SubscribeKvEvents")
        request = kv_pb2.SubscribeKvEventsRequest(data_parallel_ranks=list(ranks))

        def decode(payload: bytes) -> Any:
            if max_message_bytes is not None and len(payload) > max_message_bytes:
                return OversizeMessage(len(payload))
            return kv_pb2.SubscribeKvEventsResponse.FromString(payload)

        async with self._channel.stream(_SUBSCRIBE_KV_EVENTS_PATH, request.SerializeToString(), decode) as stream:
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
        self._numbering_read = False

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
                if state.serving:
                    check_revision(await self.server_info(), worker=self.name)
                    self._capabilities.invalidate()
                    caps = await self.capabilities()
                    log.info("worker %s ready: %s role=%s model=%s", self.name, caps.engine, caps.role,
                             caps.model_id)
                    return caps
                last, last_error = health_text(self.numbering, self.last_health_value), None
                retry_log("waiting for worker %s (attempt %d): %s", self.name, attempt, last)
            if trio.current_time() + retry_interval > give_up_at:
                raise WorkerNotReady(
                    f"not ready after {deadline:g} s and {attempt} attempts; last: {last}",
                    worker=self.name, rpc="Health", retryable=False) from last_error
            await trio.sleep(retry_interval)

    def _check_open(self, rpc: str) -> None:
        if self._closed:
            raise ClientClosed("engine client closed", worker=self.name, rpc=rpc)

