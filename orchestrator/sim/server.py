"""The simulated TRT-LLM worker: an OpenEngine v1 gRPC server over the scheduler and KV store.

It behaves like TensorRT-LLM's own OpenEngine server (orchestrator.sim.persona says how, revision 1
or 3); the "strict" persona keeps the spec-only behaviour. Either way a real protocol mistake of the
orchestrator (a decode leg whose prompt or media differ from its prefill, a handoff the decode
cannot resolve, image placeholders that do not match the images) is an error here, as it would be
on the engine.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import random
import signal
import time
import uuid as uuidlib
from pathlib import Path
from typing import AsyncIterator

import attrs
import grpc
import httpx
from google.protobuf import json_format, struct_pb2
from tokenizers import Tokenizer

from orchestrator.openengine.v1 import (
    error_pb2,
    generation_pb2,
    kv_pb2,
    lifecycle_pb2,
    model_pb2,
    openengine_pb2_grpc,
    server_pb2,
)
from orchestrator.roles import Role
from orchestrator.sim import handoff, kv_transfer, media, output
from orchestrator.sim.persona import Persona
from orchestrator.sim.profiles import Profile
from orchestrator.sim.scheduler import CONTEXT_ONLY, FULL, GENERATION_ONLY, Faults, Scheduler, SimRequest

log = logging.getLogger("orchestrator.sim")
E = error_pb2.ErrorCode
HS = lifecycle_pb2.HealthState
ENGINE_NAME = "tensorrt_llm-sim"
ENGINE_VERSION = "1.0.0-sim"
# ServerInfo.schema_release: immutable schema identities, as Dynamo's sidecar requires (32 or 40 hex digits).
SCHEMA_RELEASES = {1: "768a93c7b44e40f28c692ad0b471a8f2",  # the BSR commit tensorrt_llm/grpc/openengine pins
                   3: "f1a7189311770f8aa1f0dd787561df809847595d"}  # tensorrt_llm/openengine's OPENENGINE_COMMIT
# How refused requests end under a persona whose errors are gRPC statuses (TensorRT-LLM's servicers).
_STATUS_OF = {E.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
              E.ERROR_CODE_UNSUPPORTED_FEATURE: grpc.StatusCode.UNIMPLEMENTED,
              E.ERROR_CODE_DUPLICATE_REQUEST: grpc.StatusCode.ALREADY_EXISTS,
              E.ERROR_CODE_ROLE_MISMATCH: grpc.StatusCode.INVALID_ARGUMENT,
              E.ERROR_CODE_MODEL_NOT_FOUND: grpc.StatusCode.INVALID_ARGUMENT,
              E.ERROR_CODE_DRAINING: grpc.StatusCode.UNAVAILABLE,
              E.ERROR_CODE_OVERLOADED: grpc.StatusCode.UNAVAILABLE}


@attrs.frozen
class SimConfig:
    role: str
    host: str
    port: int
    model: str
    model_dir: Path
    profile: Profile
    time_scale: float = 1.0
    instance_id: str = ""
    warmup_s: float = 0.0
    persona: Persona = Persona()
    kv_transfer_timeout_s: float | None = None  # None: the persona's (revision-1 TensorRT-LLM: until exit)
    supports_abort_cleanup: bool = False  # force abort-by-session on where the persona has none
    supports_multimodal: bool | None = None  # None: the persona's
    image_paths: str = "both"  # revision 3: where MODALITY_IMAGE is listed (both | aggregate | none)
    max_context_length: int | None = None
    total_kv_blocks: int | None = None
    reported_schema_revision: int | None = None  # fault: claim another ServerInfo.schema_revision
    minimum_client_revision: int = 1
    # faults
    error_rate: float = 0.0
    error_phase: str = "any"  # prefill | decode | aggregated | any
    error_code: str = "ERROR_CODE_INTERNAL"
    error_retryable: bool = False
    crash_after_tokens: int | None = None
    stall_after_tokens: int | None = None
    drop_kv_sessions: bool = False
    not_ready: bool = False
    fail_model_info: bool = False
    eos_probability: float = 0.0
    seed: int = 0
    media_limits: media.MediaLimits = media.MediaLimits()

    @property
    def context_window(self) -> int:
        return self.max_context_length or self.profile.max_context_length

    @property
    def schema_revision(self) -> int:
        return self.persona.schema_revision

    @property
    def multimodal(self) -> bool:
        return self.persona.default_multimodal() if self.supports_multimodal is None else self.supports_multimodal

    @property
    def abort_cleanup(self) -> bool:
        return self.supports_abort_cleanup or (self.persona.trtllm and self.persona.abort_by_session)

    @property
    def session_ttl_s(self) -> float | None:
        if self.kv_transfer_timeout_s is None:
            return self.persona.default_session_ttl_s
        return self.kv_transfer_timeout_s or None  # 0: never expire

    def lists_images(self, disaggregated: bool) -> bool:
        """Revision 3: whether multimodal_capabilities lists MODALITY_IMAGE for a leg of this kind."""
        return self.image_paths == "both" or (self.image_paths == "aggregate" and not disaggregated)

    def images_on(self, disaggregated: bool) -> bool:
        """Whether this worker takes images for a leg of this kind."""
        if self.persona.schema_revision < 3:
            return self.multimodal
        return self.multimodal and self.lists_images(disaggregated)


class EngineFailure(Exception):
    """A refused request. `in_stream`: reported as GenerateResponse.error even where the persona's
    refusals are gRPC statuses (engine-side failures after acceptance: faults, KV transfer)."""

    def __init__(self, code: int, message: str, retryable: bool = False, in_stream: bool = False):
        super().__init__(message)
        self.code, self.message, self.retryable, self.in_stream = code, message, retryable, in_stream


class _Outbox:
    """Responses for one Generate call, filled by the scheduler, drained by the handler."""

    __slots__ = ("items", "waiter", "closed")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.closed = False

    def put(self, item: generation_pb2.GenerateResponse, last: bool = False) -> None:
        self.items.append(item)
        self.closed = self.closed or last
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> list:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        batch = list(self.items)
        self.items.clear()
        return batch


class SimWorker(openengine_pb2_grpc.InferenceServicer, openengine_pb2_grpc.ControlServicer):
    def __init__(self, config: SimConfig):
        self.config = config
        self.instance_id = config.instance_id or f"sim-{config.role}-{uuidlib.uuid4().hex[:8]}"
        self.tokenizer = Tokenizer.from_file(str(config.model_dir / "tokenizer.json"))
        self.vocab = output.Vocabulary.from_model_dir(config.model_dir)
        faults = Faults(crash_after_tokens=config.crash_after_tokens, stall_after_tokens=config.stall_after_tokens,
                        eos_probability=config.eos_probability)
        self.persona = config.persona
        self.scheduler = Scheduler(config.profile, config.role, self.vocab, time_scale=config.time_scale,
                                   faults=faults, total_kv_blocks=config.total_kv_blocks,
                                   context_stops=self.persona.streams_context_token)
        self.sessions = kv_transfer.SessionStore(self.scheduler.release_blocks, config.session_ttl_s)
        self.image_token_id = _image_token_id(config.model_dir, self.tokenizer)
        # TensorRT-LLM's context request ids are integers; KvSessionRef.session_id carries one.
        self.context_ids = itertools.count(random.Random().randrange(1 << 20, 1 << 40))
        self.kv_port = 0
        self.started_at = time.monotonic()
        self.draining = False
        self.active: dict[str, SimRequest] = {}
        self.finished_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.random = random.Random(config.seed)
        self.http: httpx.AsyncClient | None = None
        self.cancelled_by_client = 0
        self.model_info_calls = 0
        self.background: list[asyncio.Future] = []  # e.g. etcd self-registration
        # what recent requests carried, for tests and debugging: {id, kind, media: [...]}
        self.recent: collections.deque[dict] = collections.deque(maxlen=32)

    # ---- Control ---------------------------------------------------------------------------------
    def health_state(self) -> int:
        if self.draining:
            return HS.HEALTH_STATE_DRAINING
        if self.config.not_ready:
            return HS.HEALTH_STATE_NOT_READY
        if time.monotonic() - self.started_at < self.config.warmup_s:
            return HS.HEALTH_STATE_STARTING
        return HS.HEALTH_STATE_READY

    async def Health(self, request, context):
        state = self.health_state()
        return lifecycle_pb2.HealthResponse(state=state, checks=[
            lifecycle_pb2.HealthCheck(name="engine", state=state, message=HS.Name(state))])

    async def GetServerInfo(self, request, context):
        c = self.config
        kv = kv_pb2.KvConnectorInfo(
            enabled=True, transfer_backend=kv_transfer.PROTOCOL,
            local_endpoints=[kv_pb2.KvEndpoint(host=c.host, port=self.kv_port, protocol=kv_transfer.PROTOCOL)],
            supported_protocols=[kv_transfer.PROTOCOL], supports_remote_prefill=True,
            supports_decode_pull=not self.persona.trtllm or self.persona.schema_revision >= 3,
            supports_abort_cleanup=c.abort_cleanup, supports_drain=True, schema_version=c.schema_revision)
        if self.persona.session_profile:
            kv.handoff_profile = handoff.TRTLLM_PROFILE
            kv.supports_client_bootstrap = False
        return server_pb2.ServerInfo(
            engine_name=ENGINE_NAME, engine_version=ENGINE_VERSION,
            # Revision-1 TensorRT-LLM: "the same build serves either phase; the role is per request".
            engine_role=Role(c.role).engine_role if self.persona.declares_role else server_pb2.ENGINE_ROLE_UNSPECIFIED,
            instance_id=self.instance_id, supported_models=[c.model],
            parallelism=server_pb2.ParallelismInfo(tensor_parallel_size=1, pipeline_parallel_size=1,
                                                   data_parallel_size=1, data_parallel_rank=0),
            kv_connector=kv, minimum_client_revision=c.minimum_client_revision,
            schema_revision=c.schema_revision if c.reported_schema_revision is None else c.reported_schema_revision,
            schema_release=SCHEMA_RELEASES[c.schema_revision],
            capacity=server_pb2.DeploymentCapacity(
                kv_block_size=c.profile.kv_block_size, total_kv_blocks=self.scheduler.total_blocks,
                max_running_requests=c.profile.max_batch_size, max_batched_tokens=c.profile.max_num_tokens),
            extra=_struct({"profile": c.profile.name, "time_scale": c.time_scale, "persona": self.persona.name,
                           "handoff_shape": self.persona.handoff_shape}),
        )

    async def GetModelInfo(self, request, context):
        c = self.config
        self.model_info_calls += 1
        if c.fail_model_info:
            await context.abort(grpc.StatusCode.INTERNAL, "fault injection: model info unavailable")
        if request.model and request.model != c.model:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here")
        info = model_pb2.ModelInfo(
            model_id=c.model, served_model_name=c.model, max_context_length=c.context_window,
            tokenizer_modes=["auto"], supports_text_input=True, supports_token_ids_input=True,
            generation=model_pb2.GenerationCapabilities(
                output_logprobs=model_pb2.LogprobCapabilities(
                    supported=True, candidate_selection_modes=[model_pb2.CANDIDATE_TOKEN_SELECTION_MODE_TOP_N],
                    max_top_n=20),
                guided_decoding=model_pb2.GuidedDecodingCapabilities(supported=False),
                max_num_sequences=1, supports_stop_in_output=True),
            supports_lora=False, supports_multimodal=c.multimodal,
        )
        if self.persona.advertises_max_output_tokens:
            info.max_output_tokens = c.profile.max_output_tokens
        if c.schema_revision >= 3:
            image = [generation_pb2.MODALITY_IMAGE]
            info.tokenizer.source = str(c.model_dir)
            info.tokenizer.mode = "auto"
            mm = info.multimodal_capabilities
            mm.aggregate_modalities.extend(image if c.lists_images(disaggregated=False) else [])
            mm.prefill_decode_modalities.extend(image if c.lists_images(disaggregated=True) else [])
            mm.source_types.extend([generation_pb2.MEDIA_SOURCE_TYPE_URL, generation_pb2.MEDIA_SOURCE_TYPE_DATA_URI,
                                    generation_pb2.MEDIA_SOURCE_TYPE_RAW_BYTES])
            mm.supports_per_request_media_options = True
            if self.image_token_id is not None and c.lists_images(disaggregated=False):
                mm.routing_image_token_id = self.image_token_id
        return info

    async def GetLoad(self, request, context):
        s = self.scheduler
        prefill_tokens, decode_batch = s.last_step
        return server_pb2.LoadInfo(
            instance_id=self.instance_id, timestamp_unix_nanos=time.time_ns(),
            running_requests=s.running, queued_requests=len(s.waiting),
            active_kv_sessions=len(self.sessions.sessions), used_kv_blocks=s.used_blocks,
            total_kv_blocks=s.total_blocks, running_tokens=sum(r.prompt_len + r.generated for r in s.decoding),
            waiting_tokens=sum(r.prompt_len for r in s.waiting), prefill_batch_size=len(s.prefilling),
            decode_batch_size=decode_batch,
            attributes=_struct({"tokens_emitted": s.tokens_emitted, "steps": s.steps,
                                "kv_sessions_expired": self.sessions.expired,
                                "kv_sessions_pulled": self.sessions.pulled,
                                "cancelled_by_client": self.cancelled_by_client,
                                "model_info_calls": self.model_info_calls,
                                "recent_requests": list(self.recent)}),
        )

    async def Abort(self, request, context):
        target = request.WhichOneof("target")
        if target == "request_id":
            sim_request = self.active.get(request.request_id)
            if sim_request is not None and self.scheduler.cancel(sim_request):
                sim_request.on_finish(sim_request, "cancelled", None)
                return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ABORTED)
            if request.request_id in self.finished_ids or sim_request is not None or self.persona.trtllm:
                # TensorRT-LLM: "an already-finished or never-seen request is not an error"
                return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED)
            return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_UNSPECIFIED,
                                               message=f"request {request.request_id!r} not found")
        if target == "kv_session":
            if not self.config.abort_cleanup:
                if self.persona.trtllm:
                    await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                        "aborting by kv_session is not supported; abort by request_id")
                return lifecycle_pb2.AbortResponse(
                    status=lifecycle_pb2.ABORT_STATUS_UNSPECIFIED,
                    message="abort by kv_session is not supported (supports_abort_cleanup is false); "
                            "blocks are released when a decode pulls them or the transfer timeout expires")
            if self.sessions.drop(request.kv_session.session_id):
                return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ABORTED)
            return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED)
        if target == "all_requests":
            for sim_request in list(self.active.values()):
                if self.scheduler.cancel(sim_request):
                    sim_request.on_finish(sim_request, "cancelled", None)
            return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ABORTED)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "abort needs a target")

    async def _unimplemented(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "LoRA adapters are not supported by the simulated worker")

    LoadLora = UnloadLora = ListLoras = _unimplemented

    async def GetKvEventSources(self, request, context):
        return kv_pb2.GetKvEventSourcesResponse()

    async def SubscribeKvEvents(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV events are not published by the simulated worker")

    # ---- Inference -------------------------------------------------------------------------------
    async def Generate(self, request: generation_pb2.GenerateRequest, context) -> AsyncIterator:
        rid = request.request_id
        outbox = _Outbox()
        sim_request: SimRequest | None = None
        try:
            try:
                sim_request = await self._admit(request, outbox)
            except EngineFailure as failure:
                if self.persona.errors_as_status and not failure.in_stream and failure.code in _STATUS_OF:
                    await context.abort(_STATUS_OF[failure.code], failure.message)
                yield generation_pb2.GenerateResponse(request_id=rid, error=error_pb2.EngineError(
                    code=failure.code, message=failure.message, retryable=failure.retryable))
                return
            while True:
                batch = await outbox.drain()
                for response in batch:
                    yield response
                if outbox.closed and not outbox.items:
                    return
        finally:
            if sim_request is not None:
                self.active.pop(rid, None)
                if self.scheduler.cancel(sim_request):
                    self.cancelled_by_client += 1
                    log.info("request %s cancelled by the client", rid)
                self._remember_finished(rid)

    def _remember_finished(self, rid: str) -> None:
        self.finished_ids[rid] = None
        while len(self.finished_ids) > 10_000:
            self.finished_ids.popitem(last=False)

    def _leg_kind(self, request: generation_pb2.GenerateRequest, extra: dict) -> str:
        """Which phase a request asks for, by the persona's rules (see orchestrator.sim.persona)."""
        c, persona = self.config, self.persona
        request_type = extra.get("request_type")
        if persona.trtllm:
            if request_type == "generation_only":
                raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "a generation_only request must carry its "
                                    "context handoff in kv.session; extra.request_type alone cannot address one")
            if request_type not in (None, "context_only", "context_and_generation"):
                raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "extra.request_type must be one of "
                                    "['context_and_generation', 'context_only']")
            for key, kind in (("detokenize", bool), ("conversation_id", str)):
                if key in extra and not isinstance(extra[key], kind):
                    raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT,
                                        f"extra.{key} must be a {'boolean' if kind is bool else 'string'}")
        has_session = request.kv.HasField("session")
        if has_session:
            kind = GENERATION_ONLY
        elif request_type == "context_only":
            kind = CONTEXT_ONLY
        else:
            kind = FULL
        if persona.revision_1_trtllm:
            return kind  # one build serves either phase
        if persona.trtllm:  # revision 3: the process's declared role decides (tensorrt_llm/openengine/server.py)
            if c.role == "prefill":
                if has_session:
                    raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "Prefill requests cannot consume a KV session")
                return CONTEXT_ONLY
            if c.role == "decode" and not has_session:
                raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "Decode requests require a prefill KV session")
            if c.role == "aggregated" and has_session:
                raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "Aggregated requests cannot consume a KV session")
            return kind
        allowed = {"aggregated": {FULL}, "prefill": {CONTEXT_ONLY}, "decode": {FULL, GENERATION_ONLY}}[c.role]
        if kind not in allowed:
            raise EngineFailure(E.ERROR_CODE_ROLE_MISMATCH, f"a {kind} request cannot run on a {c.role} worker")
        if kind == CONTEXT_ONLY and request.stopping.max_tokens != 1:
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "a context-only leg must set stopping.max_tokens = 1")
        return kind

    async def _admit(self, request: generation_pb2.GenerateRequest, outbox: _Outbox) -> SimRequest:
        c, persona = self.config, self.persona
        if self.draining:
            raise EngineFailure(E.ERROR_CODE_DRAINING, "worker is draining", retryable=True)
        if self.health_state() != HS.HEALTH_STATE_READY:
            raise EngineFailure(E.ERROR_CODE_OVERLOADED, "worker is not ready", retryable=True)
        if not request.request_id:
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "request_id must be non-empty")
        if request.request_id in self.active:
            raise EngineFailure(E.ERROR_CODE_DUPLICATE_REQUEST, f"request_id '{request.request_id}' is already active")
        if persona.revision_1_trtllm:
            if not request.model:  # any non-empty name is served by the loaded model
                raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "model must be non-empty")
        elif request.model and request.model != c.model:
            raise EngineFailure(E.ERROR_CODE_MODEL_NOT_FOUND, f"Unknown model {request.model!r}")
        extra = json_format.MessageToDict(request.extra) if request.HasField("extra") else {}
        kind = self._leg_kind(request, extra)
        if request.sampling.HasField("num_sequences") and request.sampling.num_sequences > 1:
            raise EngineFailure(E.ERROR_CODE_UNSUPPORTED_FEATURE, "num_sequences > 1 is not supported")
        if request.HasField("media_options") and self.persona.session_profile:
            options = json_format.MessageToDict(request.media_options)
            unknown = sorted(set(options) - {"image", "video", "audio"})
            if unknown or not all(isinstance(v, dict) for v in options.values()):  # converters.validate_media_options
                raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, f"Unknown media option modalities: {unknown}"
                                    if unknown else "Media options must be objects")
        if request.HasField("guided"):
            guide = request.guided.WhichOneof("guide")
            raise EngineFailure(E.ERROR_CODE_UNSUPPORTED_FEATURE, f"guided decoding mode '{guide}' is not supported "
                                "by the 'configured' grammar backend")
        self._maybe_inject_error(kind)

        source = request.WhichOneof("input")
        if source == "token_ids":
            prompt_ids = list(request.token_ids.ids)
        elif source == "prompt":
            prompt_ids = self.tokenizer.encode(request.prompt, add_special_tokens=False).ids
        else:
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "exactly one of prompt or token_ids must be set")
        if not prompt_ids:
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "prompt is empty")
        session = None
        if kind == GENERATION_ONLY:
            try:
                session = handoff.decode(persona, request.kv.session, has_media=bool(request.media))
            except handoff.HandoffInvalid as exc:
                raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, str(exc)) from exc
        media_ids = await self._resolve_media(request, prompt_ids, disaggregated=kind != FULL)
        stopping = request.stopping
        self.recent.append({"id": request.request_id, "kind": kind, "prompt_tokens": len(prompt_ids),
                            "extra": {k: v for k, v in extra.items() if k != "request_type"},
                            "stopping": json_format.MessageToDict(stopping, preserving_proto_field_name=True),
                            "logprobs": request.response.return_output_logprobs,
                            "media_options": json_format.MessageToDict(request.media_options), "media": [
            {"source": m.WhichOneof("source"), "value": getattr(m, m.WhichOneof("source"))[:80]
             if m.WhichOneof("source") != "raw_bytes" else "", "uuid": m.uuid, "identity": identity}
            for m, identity in zip(request.media, media_ids)]})
        prompt_len = len(prompt_ids) + len(media_ids) * c.profile.image_tokens
        window = c.context_window
        if prompt_len >= window:
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT,
                                f"prompt of {prompt_len} tokens ({len(prompt_ids)} text, {len(media_ids)} images x "
                                f"{c.profile.image_tokens}) does not fit the context window of {window} tokens")
        max_tokens = self._max_tokens(request.stopping, window - prompt_len, prompt_len, window)
        seed = request.sampling.seed if request.sampling.HasField("seed") else None
        key = output.request_key(prompt_ids, media_ids, seed)

        first_gen: tuple[int, ...] = ()
        if session is not None:
            first_gen = await self._pull_kv(session, prompt_ids, media_ids)

        rid = request.request_id
        want_logprobs = request.response.return_output_logprobs
        top_n = request.response.output_candidates.top_n if want_logprobs else 0
        sim_request = SimRequest(
            request_id=rid, kind=kind, prompt_len=prompt_len, key=key, max_tokens=max_tokens,
            min_tokens=stopping.min_tokens, ignore_eos=stopping.ignore_eos,
            stop_token_ids=frozenset(cond.stop_token_id for cond in stopping.conditions
                                     if cond.WhichOneof("condition") == "stop_token_id"),
            include_stop=stopping.include_stop_in_output, first_gen_tokens=first_gen,
        )
        stop_texts = [cond.stop_text for cond in stopping.conditions if cond.WhichOneof("condition") == "stop_text"]
        token_response = self._token_response(rid, want_logprobs, top_n)
        sim_request.on_token = self._token_callback(outbox, token_response, stop_texts)
        sim_request.on_finish = self._finish_callback(outbox, rid, prompt_len)
        sim_request.on_context_done = self._context_callback(outbox, rid, prompt_ids, media_ids, prompt_len,
                                                             token_response, stop_texts, want_logprobs)
        self.active[rid] = sim_request
        self.scheduler.submit(sim_request)
        return sim_request

    def _max_tokens(self, stopping, room: int, prompt_len: int, window: int) -> int:
        persona = self.persona
        if not stopping.HasField("max_tokens"):
            default = persona.omitted_max_tokens
            if default == "room":
                return room
            if default == "profile":
                return min(self.config.profile.max_output_tokens, room)
            return min(int(default), room)
        max_tokens = stopping.max_tokens
        if max_tokens < 1:
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "max_tokens must be at least 1")
        if max_tokens > room:
            if persona.clamps_max_tokens:  # TensorRT-LLM's executor: "using default_max_tokens instead"
                return room
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT,
                                f"prompt of {prompt_len} tokens + max_tokens {max_tokens} exceeds the context "
                                f"window of {window} tokens")
        return max_tokens

    def _maybe_inject_error(self, kind: str) -> None:
        c = self.config
        if c.error_rate <= 0:
            return
        phase = {CONTEXT_ONLY: "prefill", GENERATION_ONLY: "decode", FULL: "aggregated"}[kind]
        if c.error_phase not in ("any", phase):
            return
        if self.random.random() < c.error_rate:
            raise EngineFailure(E.Value(c.error_code), f"injected fault in the {phase} phase",
                                retryable=c.error_retryable, in_stream=True)

    async def _resolve_media(self, request: generation_pb2.GenerateRequest, prompt_ids: list[int], *,
                             disaggregated: bool) -> list[str]:
        if not request.media:
            return []
        c = self.config
        if not c.images_on(disaggregated):
            if self.persona.revision_1_trtllm:
                raise EngineFailure(E.ERROR_CODE_UNSUPPORTED_FEATURE, "multimodal media is not supported")
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT if self.persona.trtllm else
                                E.ERROR_CODE_UNSUPPORTED_FEATURE,
                                "Media modalities are not supported for this role: ['image']")
        if self.image_token_id is not None:
            # The input processor expands each placeholder into one image's tokens: they must match.
            placeholders = prompt_ids.count(self.image_token_id)
            if placeholders != len(request.media):
                raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT,
                                    f"the prompt has {placeholders} image placeholder(s) "
                                    f"({self.tokenizer.id_to_token(self.image_token_id)}) but the request carries "
                                    f"{len(request.media)} image(s)")
        if self.http is None:
            self.http = httpx.AsyncClient(follow_redirects=False)
        try:
            return [await media.resolve(item, c.media_limits, self.http) for item in request.media]
        except media.MediaError as exc:
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, str(exc)) from exc

    async def _pull_kv(self, session: handoff.Handoff, prompt_ids, media_ids) -> tuple[int, ...]:
        profile = self.config.profile
        try:
            await kv_transfer.pull(
                session.kv_host, session.kv_port,
                {"session_id": session.session_key, "prompt": output.prompt_digest(prompt_ids),
                 "media": output.media_digest(media_ids), "opaque_state": session.opaque_state,
                 "first_gen_tokens": list(session.first_gen_tokens)},
                lambda tokens: profile.kv_transfer_ms(tokens) * self.config.time_scale / 1000.0)
        except kv_transfer.KvTransferError as exc:
            raise EngineFailure(E.Value("ERROR_CODE_" + exc.code), str(exc),
                                retryable=exc.code == "KV_TRANSFER_FAILED", in_stream=True) from exc
        return session.first_gen_tokens

    # ---- scheduler callbacks -> responses ----------------------------------------------------------
    def _token_response(self, rid: str, want_logprobs: bool, top_n: int):
        GenerateResponse, TokenOutput, TokenInfo = (generation_pb2.GenerateResponse, generation_pb2.TokenOutput,
                                                    generation_pb2.TokenInfo)
        vocab_words = self.vocab.word_ids

        def token_response(token: int, position: int) -> generation_pb2.GenerateResponse:
            info = TokenInfo(token_id=token)
            if want_logprobs:
                info.logprob = _logprob(token, position)
                for rank in range(top_n):
                    alt = vocab_words[(token + rank * 31) % len(vocab_words)]
                    info.candidates.add(token_id=alt, logprob=info.logprob - rank * 0.5, rank=rank + 1)
            return GenerateResponse(request_id=rid, token=TokenOutput(output_index=0, tokens=[info]))

        return token_response

    def _token_callback(self, outbox: _Outbox, token_response, stop_texts: list[str]):
        def on_token(request: SimRequest, token: int) -> None:
            outbox.put(token_response(token, request.generated - 1))
            if stop_texts:
                text = self.tokenizer.decode(request.output_ids[-16:])
                for stop in stop_texts:
                    if stop in text and self.scheduler.cancel(request):
                        request.on_finish(request, "stop", ("stop_text", stop))
                        return

        return on_token

    def _finish_callback(self, outbox: _Outbox, rid: str, prompt_len: int):
        reasons = {"stop": generation_pb2.FINISH_REASON_STOP, "length": generation_pb2.FINISH_REASON_LENGTH,
                   "cancelled": generation_pb2.FINISH_REASON_CANCELLED}

        def on_finish(request: SimRequest, reason: str, match) -> None:
            stop_match = None
            if match is not None:
                stop_match = generation_pb2.StopMatch(**{match[0]: match[1]})
            outbox.put(generation_pb2.GenerateResponse(
                request_id=rid,
                finished=generation_pb2.GenerationFinished(output_index=0, reason=reasons[reason],
                                                           stop_match=stop_match),
                usage=generation_pb2.Usage(prompt_tokens=prompt_len, completion_tokens=request.generated,
                                           total_tokens=prompt_len + request.generated)), last=True)

        return on_finish

    def _context_callback(self, outbox: _Outbox, rid: str, prompt_ids, media_ids, prompt_len: int, token_response,
                          stop_texts: list[str], want_logprobs: bool):
        def on_context_done(request: SimRequest, first_token: int) -> None:
            c = self.config
            if self.persona.streams_context_token:
                # Revision-1 TensorRT-LLM streams the context phase's token before the handoff.
                outbox.put(token_response(first_token, 0))
                text = self.tokenizer.decode([first_token])
                stop = next((s for s in stop_texts if s in text), None)
                if stop is not None:  # the one token stopped the request: no KV to hand off
                    self.scheduler.release_blocks(request.blocks)
                    request.blocks = 0
                    request.generated = 1
                    request.on_finish(request, "stop", ("stop_text", stop))
                    return
            context_id = str(next(self.context_ids)) if self.persona.trtllm else rid
            opaque = handoff.new_opaque_state(context_id, c.host, self.kv_port, uuidlib.uuid4().hex)
            held = kv_transfer.HeldSession(
                session_id=context_id, blocks=request.blocks, tokens=prompt_len,
                prompt_digest=output.prompt_digest(prompt_ids), media_digest=output.media_digest(media_ids),
                opaque_state=opaque, first_gen_tokens=[first_token])
            request.blocks = 0  # the blocks now belong to the session, not the request
            if not c.drop_kv_sessions:
                self.sessions.hold(held)
            else:
                self.scheduler.release_blocks(held.blocks)
            session = handoff.encode(self.persona, handoff.Handoff(
                session_key=context_id, kv_host=c.host, kv_port=self.kv_port, opaque_state=opaque,
                first_gen_tokens=(first_token,), requires_decode_media=bool(media_ids), prompt_tokens=prompt_len,
                first_gen_log_probs=(_logprob(first_token, 0),) if want_logprobs else ()))
            outbox.put(generation_pb2.GenerateResponse(
                request_id=rid, prefill_ready=generation_pb2.PrefillReady(kv_session=session),
                usage=generation_pb2.Usage(prompt_tokens=prompt_len, completion_tokens=0,
                                           total_tokens=prompt_len)), last=True)

        return on_context_done

    # ---- drain ---------------------------------------------------------------------------------
    async def drain(self, grace_s: float) -> None:
        self.draining = True
        log.info("draining: %d running, %d queued", self.scheduler.running, len(self.scheduler.waiting))
        deadline = time.monotonic() + grace_s
        while not self.scheduler.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def _logprob(token: int, position: int) -> float:
    """A deterministic stand-in logprob, the same for a token on either leg."""
    return -((token * 7919 + position) % 1000) / 400.0


def _image_token_id(model_dir: Path, tokenizer: Tokenizer) -> int | None:
    """The model's image placeholder (tokenizer_config.json or processor_config.json `image_token`)."""
    for name in ("tokenizer_config.json", "processor_config.json"):
        path = model_dir / name
        if path.exists():
            token = json.loads(path.read_text()).get("image_token")
            if token:
                return tokenizer.token_to_id(token)
    return None


def _struct(values: dict) -> struct_pb2.Struct:
    result = struct_pb2.Struct()
    result.update(values)
    return result


async def serve(config: SimConfig, *, slow_start_s: float = 0.0, drain_grace_s: float = 30.0,
                on_ready=None) -> int:
    """Run a sim worker until SIGTERM/SIGINT; drain, then return 0."""
    if slow_start_s > 0:
        log.info("fault injection: slow start, binding in %.1f s", slow_start_s)
        await asyncio.sleep(slow_start_s)
    worker = SimWorker(config)
    kv_server = await asyncio.start_server(worker.sessions.serve_connection, config.host, 0)
    worker.kv_port = kv_server.sockets[0].getsockname()[1]
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    openengine_pb2_grpc.add_InferenceServicer_to_server(worker, server)
    openengine_pb2_grpc.add_ControlServicer_to_server(worker, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"cannot bind gRPC port {config.host}:{config.port}")
    await server.start()
    scheduler_task = asyncio.create_task(worker.scheduler.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    address = f"grpc://{config.host}:{port}"
    log.info("sim worker %s role=%s model=%s profile=%s time_scale=%g kv=%s:%d", worker.instance_id, config.role,
             config.model, config.profile.name, config.time_scale, config.host, worker.kv_port)
    if on_ready is not None:
        await on_ready(worker, address)
    print(f"ready {address}", flush=True)
    await stop.wait()
    worker.draining = True  # health says DRAINING at once, so a registration withdraws now
    await worker.drain(drain_grace_s)
    for task in worker.background:
        task.cancel()
    if worker.background:
        await asyncio.gather(*worker.background, return_exceptions=True)
    await server.stop(grace=1.0)
    scheduler_task.cancel()
    kv_server.close()
    if worker.http is not None:
        await worker.http.aclose()
    log.info("sim worker %s stopped", worker.instance_id)
    return 0
