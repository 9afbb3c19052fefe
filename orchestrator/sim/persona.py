"""Which real engine the simulated worker behaves like. Pure: a table of behaviours, no I/O.

The default persona is TensorRT-LLM's own OpenEngine server, so the orchestrator is tested against the
engine as it is, not against our reading of the spec:

- revision 1 (default): `tensorrt_llm/grpc/openengine/` (control.py, servicer.py, streaming.py,
  disagg.py, request_mapping.py). One build serves either phase: ServerInfo says
  ENGINE_ROLE_UNSPECIFIED and every request is routed by its own fields. The context-only leg streams
  its first token, then ends with PrefillReady (or with the real Finished when that token stopped the
  request). Abort by kv_session is UNIMPLEMENTED and supports_abort_cleanup is false: a session no
  decode pulls holds its blocks until the process exits. Media are UNIMPLEMENTED (supports_multimodal
  false). Validation errors are gRPC statuses. An omitted max_tokens means "up to the window".
- revision 3: `tensorrt_llm/openengine/` (server.py, converters.py), the sibling server with a
  declared role per process, image support reported per path in multimodal_capabilities, a JSON
  handoff under one named profile, an abort by kv_session answered ABORTED that frees nothing once the
  context request finished, and max_tokens 32 when omitted.
- "strict": the simulator's original behaviour, written from the spec alone (declared roles, errors
  as EngineError events, every KV attribute required, a 30 s transfer timeout). Kept as an explicit
  option because it catches protocol slips the real engine would tolerate.

The upstream facts and their commits are listed in tests/e2e/test_trtllm_conformance.py.
"""

from __future__ import annotations

import attrs

PERSONAS = ("trtllm", "strict")
GUIDED_BACKENDS = ("none", "xgrammar", "llguidance")  # TensorRT-LLM's guided_decoding_backend
LOAD_METRICS = ("on", "off", "unavailable")
# The guide modes each backend takes, as each server advertises them in ModelInfo.generation.guided_decoding:
# revision 1 (capabilities.py GUIDE_SUPPORT_BY_BACKEND) never offers choice; the sibling server (servicer.py
# GetModelInfo) does, and structural_tag only with xgrammar.
_GUIDE_MODES = {1: {"xgrammar": ("json_schema", "regex", "ebnf_grammar", "structural_tag", "json_object"),
                    "llguidance": ("json_schema", "regex", "ebnf_grammar", "json_object")},
                3: {"xgrammar": ("json_schema", "regex", "ebnf_grammar", "choice", "json_object", "structural_tag"),
                    "llguidance": ("json_schema", "regex", "ebnf_grammar", "choice", "json_object")}}
HANDOFF_SHAPES = ("both", "endpoint", "opaque")  # revision-1 TensorRT-LLM builds: ZMQ info, inline state, both
IMAGE_PATHS = ("both", "aggregate", "none")  # revision 3: where MODALITY_IMAGE is listed


@attrs.frozen
class Persona:
    name: str = attrs.field(default="trtllm", validator=attrs.validators.in_(PERSONAS))
    schema_revision: int = attrs.field(default=1, validator=attrs.validators.in_((1, 3)))
    handoff_shape: str = attrs.field(default="both", validator=attrs.validators.in_(HANDOFF_SHAPES))

    @property
    def trtllm(self) -> bool:
        return self.name == "trtllm"

    @property
    def revision_1_trtllm(self) -> bool:
        return self.trtllm and self.schema_revision == 1

    @property
    def declares_role(self) -> bool:
        """ServerInfo.engine_role is the process's role (else ENGINE_ROLE_UNSPECIFIED)."""
        return not self.revision_1_trtllm

    @property
    def serves_lora(self) -> bool:
        """The LoRA RPCs and GenerateRequest.lora_name are served (with a LoRA config: --max-loras > 0) as the
        sibling server serves them (lora_registry.py). Revision 1 answers the RPCs UNIMPLEMENTED, reports
        supports_lora false and refuses a lora_name UNIMPLEMENTED (control.py, servicer.py)."""
        return not self.revision_1_trtllm

    @property
    def streams_context_token(self) -> bool:
        """The context-only leg streams its one token before PrefillReady (revision-1 streaming.py)."""
        return self.revision_1_trtllm

    @property
    def errors_as_status(self) -> bool:
        """Refused requests end the RPC with a gRPC status (TensorRT-LLM), not a GenerateResponse.error."""
        return self.trtllm

    @property
    def session_profile(self) -> bool:
        """Revision 3 packs the handoff as JSON under one named profile (converters.encode_handoff)."""
        return self.trtllm and self.schema_revision == 3

    @property
    def abort_by_session(self) -> bool:
        """Control.Abort(kv_session) is answered (revision 3: ABORTED, freeing nothing after PrefillReady;
        control.py). Revision 1 answers UNIMPLEMENTED."""
        return not self.revision_1_trtllm

    @property
    def default_session_ttl_s(self) -> float | None:
        """How long an unpulled session holds its blocks; None: until the process exits."""
        if self.revision_1_trtllm:
            return None  # README: "held on the context worker until that process exits"
        return 300.0 if self.trtllm else 30.0  # revision 3: kv_session_ttl_seconds; strict: our old default

    @property
    def omitted_max_tokens(self) -> int | str:
        """"room": window - prompt (revision 1: None -> _deduce_max_tokens); an int: a fixed default."""
        if self.trtllm:
            return "room" if self.schema_revision == 1 else 32
        return "profile"  # strict: min(profile.max_output_tokens, room)

    @property
    def clamps_max_tokens(self) -> bool:
        """A max_tokens above the room left is clamped to it (executor _deduce_max_tokens), not refused."""
        return self.trtllm

    @property
    def advertises_max_output_tokens(self) -> bool:
        """TensorRT-LLM leaves ModelInfo.max_output_tokens unset (control.py: it is per request)."""
        return not self.trtllm

    def default_multimodal(self) -> bool:
        return not self.revision_1_trtllm

    def guide_modes(self, backend: str) -> tuple[str, ...]:
        """The guide modes advertised with this grammar backend (none: guided decoding unsupported)."""
        return () if backend == "none" else _GUIDE_MODES[self.schema_revision][backend]

    @property
    def ignores_unsupported_guides(self) -> bool:
        """The sibling server passes a guide on without a grammar backend, and the engine ignores it: an
        unconstrained answer (servicer.py _validate_generate checks only guided.backend). Revision 1 refuses a
        mode its backend lacks (UNIMPLEMENTED); the strict persona refuses too."""
        return self.trtllm and self.schema_revision == 3

    @property
    def duplicate_id_status(self) -> str:
        """How a request_id that is already active is refused: revision 1 ALREADY_EXISTS (servicer.py); the
        sibling server raises ValueError, so INVALID_ARGUMENT."""
        return "INVALID_ARGUMENT" if self.trtllm and self.schema_revision == 3 else "ALREADY_EXISTS"

    @property
    def drain_numbering(self) -> bool:
        """The sibling server speaks openengine a66ff6f's numbering (_schema_pin.py): ERROR_CODE_DRAINING 11 and
        INTERNAL 12, HEALTH_STATE_DRAINING 4 and NOT_READY 5, KvConnectorInfo.schema_version at field 9
        (orchestrator/engine/numbering.py reads it; this persona sends it)."""
        return self.trtllm and self.schema_revision == 3

    def wire_error_code(self, code: int) -> int:
        """An ErrorCode (v0.1.0 numbering) as this server numbers it on the wire."""
        return 12 if self.drain_numbering and code == 11 else code  # INTERNAL; 11 is DRAINING there

    def wire_health(self, state: int, *, draining: bool) -> int:
        """A HealthState (v0.1.0 numbering) as this server numbers it; the sibling says DRAINING while it drains."""
        if not self.drain_numbering:
            return state
        if draining:
            return 4  # HEALTH_STATE_DRAINING
        return 5 if state == 4 else state  # NOT_READY

    @property
    def default_stall_timeout_s(self) -> float | None:
        """Revision 1's StallWatchdog (streaming.py RESPONSE_STALL_TIMEOUT_SECONDS): a response not read for 30 s
        aborts the request, which then ends with ERROR_CODE_OVERLOADED (retryable)."""
        return 30.0 if self.revision_1_trtllm else None
