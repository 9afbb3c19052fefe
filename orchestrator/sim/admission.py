"""Admission of a Generate call: what the persona accepts, which phase it asks for, media, max_tokens, the KV pull."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import cast

import grpc
import httpx
from google.protobuf import json_format

from orchestrator.openengine.v1 import error_pb2, generation_pb2, lifecycle_pb2
from orchestrator.sim import answers, chat_prompt, handoff, kv_transfer, media, output, prefix_cache
from orchestrator.sim.outbox import Outbox
from orchestrator.sim.scheduler import CONTEXT_ONLY, FULL, GENERATION_ONLY, SimRequest
from orchestrator.sim.worker_state import SimWorkerState

log = logging.getLogger("orchestrator.sim")
E = error_pb2.ErrorCode
HS = lifecycle_pb2.HealthState


# How refused requests end under a persona whose errors are gRPC statuses (TensorRT-LLM's servicers).
_STATUS_OF = {E.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
              E.ERROR_CODE_UNSUPPORTED_FEATURE: grpc.StatusCode.UNIMPLEMENTED,
              E.ERROR_CODE_DUPLICATE_REQUEST: grpc.StatusCode.ALREADY_EXISTS,
              E.ERROR_CODE_ROLE_MISMATCH: grpc.StatusCode.INVALID_ARGUMENT,
              E.ERROR_CODE_MODEL_NOT_FOUND: grpc.StatusCode.INVALID_ARGUMENT}


class EngineFailure(Exception):
    """A refused request. `in_stream`: reported as GenerateResponse.error even where the persona's
    refusals are gRPC statuses (engine-side failures after acceptance: faults, KV transfer)."""

    def __init__(self, code: int, message: str, retryable: bool = False, in_stream: bool = False,
                 status: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = cast(error_pb2.ErrorCode, code)  # an ErrorCode number (E.X, or E.Value(name) typed as int)
        self.message, self.retryable, self.in_stream = message, retryable, in_stream
        self.status = status  # the gRPC status, where the server's is not the code's usual one (_STATUS_OF)


class StallWatch:
    """Revision-1 TensorRT-LLM's StallWatchdog (streaming.py): only the time a response waits to be read counts,
    so a slow engine never trips it; a reader that stops reading does, after `timeout` seconds."""

    def __init__(self, timeout: float, on_stall):
        self.timeout, self.on_stall = timeout, on_stall
        self.waiting_since: float | None = None  # set while a response waits at the yield
        self.stalled = False

    async def run(self) -> None:
        while not self.stalled:
            await asyncio.sleep(self.timeout / 4)
            since = self.waiting_since
            if since is not None and time.monotonic() - since >= self.timeout:
                self.stalled = True
                self.on_stall()


def trace_headers(context) -> dict[str, str] | None:
    """The W3C trace context a call's gRPC metadata carries, as TensorRT-LLM's servicer reads it for
    `generate_async(trace_headers=...)` (tensorrt_llm/grpc/openengine/request_mapping.py `_trace_headers`): the keys
    `traceparent` and `tracestate`, anything else ignored."""
    headers = {item.key: item.value for item in context.invocation_metadata() or ()
               if item.key in ("traceparent", "tracestate")}
    return headers or None


def target_dp_rank(context) -> str | None:
    """The attention-DP rank a call asks to run on (gRPC metadata `openengine-target-dp-rank`, which revision-1
    TensorRT-LLM honours where ServerInfo.extra says trtllm_supports_dp_rank_targeting), unparsed."""
    for item in context.invocation_metadata() or ():
        if item.key == "openengine-target-dp-rank":
            return item.value
    return None


def metadata_value(context, key: str) -> str | None:
    for item in context.invocation_metadata() or ():
        if item.key == key:
            return item.value
    return None


def engine_conversation_id(persona, kind: str, extra: dict, metadata_conversation: str | None) -> str | None:
    """The conversation id the engine is given, read where each server reads it: revision 1 from
    extra.conversation_id (request_mapping.py conversation_params_from_request), the sibling server only from
    the gRPC metadata key `conversation_id`, and only on its prefill role (servicer.py _disaggregated_params)."""
    if persona.revision_1_trtllm:
        return extra.get("conversation_id")
    return metadata_conversation if kind == CONTEXT_ONLY else None


class EngineUnavailable(Exception):
    """The worker takes no new calls (starting, draining): UNAVAILABLE, as a grpc server that is not serving says."""


class AdmissionService(SimWorkerState):
    """Inference.Generate and its admission rules; mixed into SimWorker (orchestrator.sim.server)."""

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator:
        rid = request.request_id
        outbox = Outbox()
        sim_request: SimRequest | None = None
        terminal_in_flight = False  # suspended at the yield of the last response
        watch: StallWatch | None = None
        watchdog: asyncio.Task | None = None
        try:
            try:
                sim_request = await self._admit(request, outbox, trace_headers(context), target_dp_rank(context),
                                                metadata_conversation=metadata_value(context, "conversation_id"))
            except EngineUnavailable as refusal:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(refusal))
            except EngineFailure as failure:
                if self.persona.errors_as_status and not failure.in_stream and (
                        failure.status is not None or failure.code in _STATUS_OF):
                    await context.abort(failure.status or _STATUS_OF[failure.code], failure.message)
                yield generation_pb2.GenerateResponse(request_id=rid, error=error_pb2.EngineError(
                    code=cast(error_pb2.ErrorCode, self.persona.wire_error_code(failure.code)),
                    message=failure.message, retryable=failure.retryable))
                return
            timeout = self.config.stall_timeout
            if timeout is not None:
                watch = StallWatch(timeout, on_stall=lambda: self._on_stall(sim_request))
                watchdog = asyncio.create_task(watch.run())
            while True:
                batch = await outbox.drain()
                last = len(batch) - 1 if outbox.closed else -1  # a closed outbox: the batch ends with the terminal
                for index, response in enumerate(batch):
                    terminal_in_flight = index == last
                    if watch is not None:
                        watch.waiting_since = time.monotonic()
                    yield response  # returns when the transport took it: a reader that does not read blocks here
                    if watch is not None:
                        watch.waiting_since = None
                        if watch.stalled and not terminal_in_flight:  # aborted meanwhile: say why, now we can
                            yield generation_pb2.GenerateResponse(request_id=rid, error=error_pb2.EngineError(
                                code=E.ERROR_CODE_OVERLOADED, retryable=True,
                                message=f"response stream not read for {timeout:g} s; request aborted"))
                            return
                    if terminal_in_flight and self.config.status_delay_s > 0:
                        await asyncio.sleep(self.config.status_delay_s)  # still "at the yield" upstream
                terminal_in_flight = False
                if outbox.closed and not outbox.items:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            # TensorRT-LLM's servicer marks a request terminal only after the yield of its last response returns;
            # a cancel landing at that yield makes its `finally` abort the engine request (servicer.py).
            if terminal_in_flight:
                self.cancelled_after_terminal += 1
                log.info("request %s was cancelled after its terminal response was sent", rid)
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()
            if sim_request is not None:
                if self.active.get(rid) is sim_request:  # a stalled stream's id may have been taken again
                    del self.active[rid]
                if self.scheduler.cancel(sim_request):
                    self.cancelled_by_client += 1
                    log.info("request %s cancelled by the client", rid)
                self._remember_finished(rid)

    def _on_stall(self, sim_request: SimRequest) -> None:
        """The watchdog's verdict, as upstream's on_stall: abort the engine request (its blocks come back, if it
        still runs) and release its request id, while the stream itself may stay blocked."""
        self.scheduler.cancel(sim_request)
        self.active.pop(sim_request.request_id, None)
        self.stalled_requests += 1
        log.warning("request %s aborted: its response stream was not read for %g s", sim_request.request_id,
                    self.config.stall_timeout)

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
            for key, expected in (("detokenize", bool), ("conversation_id", str)):
                if key in extra and not isinstance(extra[key], expected):
                    raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT,
                                        f"extra.{key} must be a {'boolean' if expected is bool else 'string'}")
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

    async def _admit(self, request: generation_pb2.GenerateRequest, outbox: Outbox,
                     trace: dict[str, str] | None = None, target_rank: str | None = None, *,
                     metadata_conversation: str | None = None) -> SimRequest:
        c, persona = self.config, self.persona
        rank = None
        if target_rank is not None and persona.revision_1_trtllm:  # others do not advertise targeting: ignored
            ranks = len(self.scheduler.ranks)
            if not target_rank.isdigit() or int(target_rank) >= ranks:
                raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, f"openengine-target-dp-rank {target_rank!r} is "
                                    f"not a rank of this worker (0..{ranks - 1})")
            rank = int(target_rank)
        if self.draining:  # a stopping grpc server refuses new calls UNAVAILABLE; there is no DRAINING code
            raise EngineUnavailable("worker is draining")
        if self.health_state() != HS.HEALTH_STATE_READY:
            raise EngineUnavailable("worker is not ready")
        if not request.request_id:
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, "request_id must be non-empty")
        if request.request_id in self.active:
            code = (E.ERROR_CODE_INVALID_ARGUMENT if persona.duplicate_id_status == "INVALID_ARGUMENT"
                    else E.ERROR_CODE_DUPLICATE_REQUEST)
            raise EngineFailure(code, f"request_id '{request.request_id}' is already active")
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
            if guide not in persona.guide_modes(c.guided_backend) and not persona.ignores_unsupported_guides:
                raise EngineFailure(E.ERROR_CODE_UNSUPPORTED_FEATURE, f"guided decoding mode '{guide}' is not "
                                    f"supported by the '{c.guided_backend}' grammar backend")
            # Taken (a backend that has the mode: answers.py writes a valid instance), or passed on and ignored by
            # the engine (the sibling server without a backend: the text stays free).
        lora = self._lora(request.lora_name)
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
                            "target_dp_rank": rank,
                            "lora_name": request.lora_name,
                            "cache_salt": request.kv.cache_salt if request.kv.HasField("cache_salt") else None,
                            "conversation_id": engine_conversation_id(persona, kind, extra, metadata_conversation),
                            "extra": {k: v for k, v in extra.items() if k != "request_type"},
                            "stopping": json_format.MessageToDict(stopping, preserving_proto_field_name=True),
                            "logprobs": request.response.return_output_logprobs,
                            "top_n": request.response.output_candidates.top_n,
                            "guided": request.guided.WhichOneof("guide") if request.HasField("guided") else None,
                            "media_options": json_format.MessageToDict(request.media_options), "media": [
            {"source": m.WhichOneof("source"), "value": getattr(m, m.WhichOneof("source"))[:80]
             if m.WhichOneof("source") != "raw_bytes" else "", "uuid": m.uuid, "identity": identity}
            for m, identity in zip(request.media, media_ids)], "trace": trace or {}})
        prompt_len = len(prompt_ids) + len(media_ids) * c.profile.image_tokens
        window = c.context_window
        if prompt_len >= window:
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT,
                                f"prompt of {prompt_len} tokens ({len(prompt_ids)} text, {len(media_ids)} images x "
                                f"{c.profile.image_tokens}) does not fit the context window of {window} tokens")
        max_tokens = self._max_tokens(request.stopping, window - prompt_len, prompt_len, window)
        seed = request.sampling.seed if request.sampling.HasField("seed") else None
        key = output.request_key(prompt_ids, media_ids, seed, request.lora_name)
        plan = self._plan_answer(request, prompt_ids, media_ids, seed, key)

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
            tokens=prefix_cache.prompt_tokens(prompt_ids, media_ids, image_tokens=c.profile.image_tokens,
                                              id_offset=self.vocab_size, placeholder=self.image_token_id),
            target_rank=rank, script=plan.script, script_ends=plan.ends, answer_offset=plan.offset,
            natural_length=plan.natural_length,
            cache_salt=request.kv.cache_salt if request.kv.HasField("cache_salt") else None,
            lora=lora,
        )
        stop_texts = [cond.stop_text for cond in stopping.conditions if cond.WhichOneof("condition") == "stop_text"]
        token_response = self._token_response(rid, want_logprobs, top_n, first_without_logprob=kind == GENERATION_ONLY)
        sim_request.on_token = self._token_callback(outbox, token_response, stop_texts)
        sim_request.on_finish = self._finish_callback(outbox, rid, prompt_len)
        sim_request.on_context_done = self._context_callback(outbox, rid, prompt_ids, media_ids, prompt_len,
                                                             token_response, stop_texts, want_logprobs)
        self.active[rid] = sim_request
        self.scheduler.submit(sim_request)
        return sim_request

    def _plan_answer(self, request: generation_pb2.GenerateRequest, prompt_ids: list[int], media_ids: list[str],
                     seed: int | None, key: int) -> answers.Plan:
        """What the model answers (orchestrator.sim.answers): read from the chat the prompt renders and the guide
        the engine takes (one it ignores, the sibling server's without a backend, leaves the text free)."""
        c = self.config
        guide = None
        if request.HasField("guided"):
            kind = request.guided.WhichOneof("guide")
            if kind in self.persona.guide_modes(c.guided_backend):
                guide = (kind, request.guided.choice.choices if kind == "choice" else getattr(request.guided, kind))
        chat = chat_prompt.read(prompt_ids, self.tokenizer)
        if chat is not None:  # the answer is a function of the conversation before it, not of what it resends
            key = output.request_key(prompt_ids[:chat.prefix_len], media_ids, seed, request.lora_name)
        return answers.plan(chat, guide, answers.Parsers(c.tool_call_parser, c.reasoning_parser), key,
                            self.tokenizer,
                            max_tokens_given=request.stopping.HasField("max_tokens") and not c.natural_eos)

    def _lora(self, name: str) -> tuple[int, str] | None:
        """The request's LoRA adapter as (lora_id, lora_name) (None: the base model). Revision 1 refuses one
        UNIMPLEMENTED (servicer.py "LoRA selection is not supported"); the sibling server one it does not hold
        FAILED_PRECONDITION "LoRA is not loaded: NAME" (servicer.py Generate, KeyError from its registry)."""
        if not name:
            return None
        if not self.persona.serves_lora:
            raise EngineFailure(E.ERROR_CODE_UNSUPPORTED_FEATURE, "LoRA selection is not supported")
        adapter = self.loras.get(name)
        if adapter is None:
            raise EngineFailure(E.ERROR_CODE_INVALID_ARGUMENT, f"LoRA is not loaded: {name}",
                                status=grpc.StatusCode.FAILED_PRECONDITION)
        return adapter.lora_id, adapter.name

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
                lambda tokens: profile.kv_transfer_ms(tokens) * self.config.time_scale / 1000.0, self.kv_sleep)
        except kv_transfer.KvTransferError as exc:
            raise EngineFailure(E.Value("ERROR_CODE_" + exc.code), str(exc),
                                retryable=exc.code == "KV_TRANSFER_FAILED", in_stream=True) from exc
        return session.first_gen_tokens
