"""The Control service of the simulated worker: health, server and model info, load, abort, the rest."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import grpc
from google.protobuf import struct_pb2

from orchestrator.openengine.v1 import generation_pb2, kv_pb2, lifecycle_pb2, lora_pb2, model_pb2, server_pb2
from orchestrator.roles import Role
from orchestrator.sim import handoff, kv_events, kv_transfer, prefix_cache
from orchestrator.sim.lora import Adapter, LoraRefused
from orchestrator.sim.worker_state import SimWorkerState

HS = lifecycle_pb2.HealthState


ENGINE_NAME = "tensorrt_llm-sim"
ENGINE_VERSION = "1.0.0-sim"
# ServerInfo.schema_release: immutable schema identities, as Dynamo's sidecar requires (32 or 40 hex digits).
SCHEMA_RELEASES = {1: "768a93c7b44e40f28c692ad0b471a8f2",  # the BSR commit tensorrt_llm/grpc/openengine pins
                   3: "f1a7189311770f8aa1f0dd787561df809847595d"}  # tensorrt_llm/openengine's OPENENGINE_COMMIT


class ControlService(SimWorkerState):
    """Control RPCs; mixed into SimWorker (orchestrator.sim.server), which owns the state."""

    def health_state(self) -> lifecycle_pb2.HealthState:
        """In v0.1.0's numbering. It has no DRAINING state: revision-1 TensorRT-LLM says NOT_READY once its engine
        stops serving (the sibling server's DRAINING is the persona's wire_health)."""
        if self.draining or self.config.not_ready:
            return HS.HEALTH_STATE_NOT_READY
        if time.monotonic() - self.started_at < self.config.warmup_s:
            return HS.HEALTH_STATE_STARTING
        return HS.HEALTH_STATE_READY

    async def Health(self, request, context):
        if self.config.health_delay_s > 0 and not self.scheduler.idle:
            # fault: a health answer late while requests run (a servicer's loop busy streaming 1,024 of them)
            await asyncio.sleep(self.config.health_delay_s)
        ours = self.health_state()
        state = cast(lifecycle_pb2.HealthState, self.persona.wire_health(ours, draining=self.draining)
                     if self.config.report_health_state is None else self.config.report_health_state)
        return lifecycle_pb2.HealthResponse(state=state, checks=[
            lifecycle_pb2.HealthCheck(name="engine", state=state, message=HS.Name(ours))])

    async def GetServerInfo(self, request, context):
        c = self.config
        kv = kv_pb2.KvConnectorInfo(
            enabled=True, transfer_backend=kv_transfer.PROTOCOL,
            local_endpoints=[kv_pb2.KvEndpoint(host=c.host, port=self.kv_port, protocol=kv_transfer.PROTOCOL)],
            supported_protocols=[kv_transfer.PROTOCOL], supports_remote_prefill=True,
            supports_decode_pull=not self.persona.trtllm or self.persona.schema_revision >= 3,
            supports_abort_cleanup=c.abort_cleanup, schema_version=c.schema_revision)
        if self.persona.drain_numbering:
            # The sibling's KvConnectorInfo: supports_drain at 8 and schema_version 1 at 9 (servicer.py
            # _kv_connector_info), which v0.1.0 numbers schema_version = 8 and leaves 9 free.
            kv.ClearField("schema_version")
            kv.MergeFromString(bytes([8 << 3, 1, 9 << 3, 1]))
        if self.persona.session_profile:
            kv.handoff_profile = handoff.TRTLLM_PROFILE
            kv.supports_client_bootstrap = False
        return server_pb2.ServerInfo(
            engine_name=ENGINE_NAME, engine_version=ENGINE_VERSION,
            # Revision-1 TensorRT-LLM: "the same build serves either phase; the role is per request".
            engine_role=Role(c.role).engine_role if self.persona.declares_role else server_pb2.ENGINE_ROLE_UNSPECIFIED,
            instance_id=self.instance_id, supported_models=[c.model],
            # one KV event publisher per attention-DP rank: a subscriber needs the count to know it has all
            parallelism=server_pb2.ParallelismInfo(tensor_parallel_size=1, pipeline_parallel_size=1,
                                                   data_parallel_size=len(self.scheduler.ranks),
                                                   data_parallel_rank=0),
            kv_connector=kv, minimum_client_revision=c.minimum_client_revision,
            schema_revision=c.schema_revision if c.reported_schema_revision is None else c.reported_schema_revision,
            schema_release=SCHEMA_RELEASES[c.schema_revision],
            capacity=server_pb2.DeploymentCapacity(
                kv_block_size=c.profile.kv_block_size, total_kv_blocks=self.scheduler.total_blocks,
                max_running_requests=c.profile.max_batch_size, max_batched_tokens=c.profile.max_num_tokens,
                # the sibling server: lora_config.max_loras when it has a LoRA config (servicer.py GetServerInfo)
                max_loras=c.max_loras if c.lora_configured else None),
            extra=_struct({"profile": c.profile.name, "time_scale": c.time_scale, "persona": self.persona.name,
                           "handoff_shape": self.persona.handoff_shape, **self._kv_event_extra(),
                           # what revision-1 TensorRT-LLM advertises without conversation affinity (control.py)
                           **({"trtllm_supports_dp_rank_targeting": True, "trtllm_supports_subagent_affinity": False}
                              if self.persona.revision_1_trtllm else {})}),
        )

    def _kv_event_extra(self) -> dict:
        # Revision-1 TensorRT-LLM names the hash of the blocks it publishes, only while events are on
        # (control.py @06cb2191b0be); revision 3 advertises nothing in ServerInfo.extra.
        if self.persona.revision_1_trtllm and self.config.kv_events.enabled:
            return {"trtllm_kv_event_hash_algo": prefix_cache.HASH_ALGO}
        return {}

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
                guided_decoding=model_pb2.GuidedDecodingCapabilities(
                    supported=c.guided_backend != "none",
                    modes=["GUIDED_DECODING_MODE_" + mode.upper()  # by name: protobuf refuses an unknown one
                           for mode in self.persona.guide_modes(c.guided_backend)]),
                max_num_sequences=1, supports_stop_in_output=True,
                supports_cache_salt=True),
            supports_lora=c.lora_configured, supports_multimodal=c.multimodal,
            # revision 1 fills reasoning_parser from llm.args.reasoning_parser and never tool_call_parser, though
            # its proto has the field (control.py); the sibling server fills both (servicer.py GetModelInfo)
            reasoning_parser=c.reasoning_parser,
            tool_call_parser="" if self.persona.revision_1_trtllm else c.tool_call_parser,
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
        self.load_calls += 1
        s = self.scheduler
        if self.config.load_metrics == "unavailable":  # control.py: a stale or missing load sample
            await context.abort(grpc.StatusCode.UNAVAILABLE, "load metrics are stale")
        if self.config.load_metrics == "off":
            # Without load metrics TensorRT-LLM reports only the requests it is serving (queued ones included).
            return server_pb2.LoadInfo(instance_id=self.instance_id, timestamp_unix_nanos=time.time_ns(),
                                       running_requests=s.running + len(s.waiting))
        _prefill_tokens, decode_batch = s.last_step
        return server_pb2.LoadInfo(
            instance_id=self.instance_id, timestamp_unix_nanos=time.time_ns(),
            # TensorRT-LLM's running_requests is its active count, queued ones included; revision 1 leaves
            # queued_requests unset (UPSTREAM load-kv), the sibling server sets it too (UPSTREAM r3-load)
            running_requests=s.running + len(s.waiting),
            queued_requests=len(s.waiting) if self.persona.schema_revision >= 3 else None,
            active_kv_sessions=len(self.sessions.sessions), used_kv_blocks=s.used_blocks,
            total_kv_blocks=s.total_blocks, running_tokens=sum(r.prompt_len + r.generated for r in s.decoding),
            waiting_tokens=sum(r.prompt_len for r in s.waiting), prefill_batch_size=len(s.prefilling),
            decode_batch_size=decode_batch,
            attributes=_struct({"tokens_emitted": s.tokens_emitted, "steps": s.steps,
                                "kv_sessions_expired": self.sessions.expired,
                                "kv_sessions_pulled": self.sessions.pulled,
                                "cancelled_by_client": self.cancelled_by_client,
                                "cancelled_after_terminal": self.cancelled_after_terminal,
                                "late_session_aborts": self.late_session_aborts,
                                "stalled_requests": self.stalled_requests,
                                "model_info_calls": self.model_info_calls,
                                "load_calls": self.load_calls,
                                "recent_requests": list(self.recent), **self._prefix_cache_attributes()}),
            ranks=[server_pb2.RankLoadInfo(data_parallel_rank=rank.index, running_requests=rank.active,
                                           used_kv_blocks=rank.used_blocks, total_kv_blocks=rank.total_blocks)
                   for rank in s.ranks] if request.include_per_rank else [],
        )

    def _prefix_cache_attributes(self) -> dict:
        """How the prefix cache did: what tests and the bench read (figures in simulated GPU time)."""
        s = self.scheduler
        caches = [rank.cache for rank in s.ranks]
        events = self.kv_event_counts()
        return {"prompt_tokens_total": s.prompt_tokens_total, "cached_prompt_tokens_total": s.cached_tokens_total,
                "prefill_tokens_computed": s.prefill_tokens_computed, "prefill_ms_total": s.prefill_ms_total,
                "cached_blocks": sum(c.resident for c in caches),
                "cached_blocks_evicted": sum(c.evicted_total for c in caches),
                "kv_event_batches_published": events[0], "kv_event_batches_dropped": events[1]}

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
            session_id = request.kv_session.session_id
            if self.persona.trtllm and session_id in self.sessions.sessions:
                # The sibling server (servicer.py Abort) answers ABORTED, but once the context request has
                # finished (always so after PrefillReady) it only drops its own handle: the engine is not told
                # and the blocks stay held. An answered abort is not proof.
                self.late_session_aborts += 1
                return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ABORTED,
                                                   message=f"Released KV session {session_id}")
            if self.sessions.drop(session_id):
                return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ABORTED)
            return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ALREADY_FINISHED)
        if target == "all_requests":
            for sim_request in list(self.active.values()):
                if self.scheduler.cancel(sim_request):
                    sim_request.on_finish(sim_request, "cancelled", None)
            return lifecycle_pb2.AbortResponse(status=lifecycle_pb2.ABORT_STATUS_ABORTED)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "abort needs a target")

    # LoRA: revision 1 answers every RPC UNIMPLEMENTED (control.py); the sibling server keeps a registry
    # (orchestrator/sim/lora.py) and, without a LoRA config, answers FAILED_PRECONDITION (servicer.py)
    async def LoadLora(self, request, context):
        await self._lora_surface(context, "runtime LoRA load is not supported; configure adapters at startup")
        adapter = request.adapter
        try:
            loaded, already = self.loras.load(adapter.lora_id, adapter.lora_name, adapter.source_path)
        except LoraRefused as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return lora_pb2.LoadLoraResponse(adapter=_adapter(loaded), already_loaded=already)

    async def UnloadLora(self, request, context):
        await self._lora_surface(context, "runtime LoRA unload is not supported; configure adapters at startup")
        try:
            adapter = self.loras.unload(request.lora_name)
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA {request.lora_name!r} is not loaded")
        return lora_pb2.UnloadLoraResponse(adapter=_adapter(adapter))

    async def ListLoras(self, request, context):
        await self._lora_surface(context, "runtime LoRA enumeration is not supported")
        return lora_pb2.ListLorasResponse(adapters=[_adapter(a) for a in self.loras.listed()])

    async def _lora_surface(self, context, unimplemented: str) -> None:
        if not self.persona.serves_lora:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, unimplemented)
        if not self.config.lora_configured:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "TensorRT-LLM was not configured with LoRA support")

    # KV events: what each persona's engine does is in orchestrator/sim/kv_events.py.
    async def GetKvEventSources(self, request, context):
        if not self.config.kv_events.enabled:
            return kv_pb2.GetKvEventSourcesResponse()  # implemented, nothing to publish
        ranks = len(self.scheduler.ranks)
        unknown = sorted(set(request.data_parallel_ranks) - set(range(ranks)))
        if self.persona.revision_1_trtllm:
            if unknown:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"no KV event source for data-parallel rank(s) {unknown}; this engine "
                                    f"publishes ranks 0..{ranks - 1}")
            wanted = sorted(set(request.data_parallel_ranks)) or range(ranks)
            return kv_pb2.GetKvEventSourcesResponse(sources=[self.zmq_publishers[r].source() for r in wanted])
        if unknown:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Unknown data-parallel ranks: {unknown}")
        return kv_pb2.GetKvEventSourcesResponse(sources=[
            kv_pb2.KvEventSource(transport="grpc", endpoint_addr=kv_pb2.KvEndpoint(
                host=self.config.host, port=self.grpc_port, protocol="grpc"), data_parallel_rank=rank,
                encoding="protobuf", schema_version=1, max_queue_size=kv_events.FANOUT_BUFFER)
            for rank in sorted(set(request.data_parallel_ranks) or range(ranks))])

    async def SubscribeKvEvents(self, request, context: grpc.aio.ServicerContext):
        if self.persona.revision_1_trtllm:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "SubscribeKvEvents is not implemented; use "
                                "GetKvEventSources and subscribe directly over ZMQ")
        if not self.config.kv_events.enabled or self.kv_fanout is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "KV event collection is disabled")
        if request.include_snapshot or request.start_sequence_number:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "KV event snapshot and replay subscriptions are not implemented")
        unknown = sorted(set(request.data_parallel_ranks) - set(range(len(self.scheduler.ranks))))
        if unknown:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Unknown data-parallel ranks: {unknown}")
        async for batch in self.kv_fanout.subscribe(request.data_parallel_ranks):
            yield kv_pb2.SubscribeKvEventsResponse(batch=batch)

    def kv_event_counts(self) -> tuple[int, int]:
        """(published, dropped) batches over every publisher."""
        publishers = list(self.zmq_publishers) + ([self.kv_fanout] if self.kv_fanout is not None else [])
        return sum(p.published for p in publishers), sum(p.dropped for p in publishers)


def _adapter(adapter: Adapter) -> lora_pb2.LoraAdapter:
    return lora_pb2.LoraAdapter(lora_id=adapter.lora_id, lora_name=adapter.name, source_path=adapter.source_path)


def _struct(values: dict) -> struct_pb2.Struct:
    result = struct_pb2.Struct()
    result.update(values)
    return result
