"""The simulated worker's settings (from `orchestrator sim-worker` flags) and what follows from them."""

from __future__ import annotations

from pathlib import Path

import attrs

from orchestrator.sim import media
from orchestrator.sim.kv_events import KvEventsConfig
from orchestrator.sim.persona import Persona
from orchestrator.sim.profiles import Profile


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
    supports_abort_cleanup: bool = False  # advertise and answer abort-by-session where the persona does not
    supports_multimodal: bool | None = None  # None: the persona's
    image_paths: str = "both"  # revision 3: where MODALITY_IMAGE is listed (both | aggregate | none)
    max_context_length: int | None = None
    total_kv_blocks: int | None = None
    attention_dp_size: int | None = attrs.field(  # None: the profile's
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    prefix_caching: bool = True  # TensorRT-LLM reuses KV blocks by default (kv_cache_config.enable_block_reuse)
    kv_events: KvEventsConfig = KvEventsConfig()
    reported_schema_revision: int | None = None  # fault: claim another ServerInfo.schema_revision
    minimum_client_revision: int = 1
    tls_cert: Path | None = None  # serve TLS with this certificate chain and key (PEM)
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # and require client certificates signed by this CA (mTLS)
    # faults
    error_rate: float = 0.0
    error_phase: str = "any"  # prefill | decode | aggregated | any
    error_code: str = "ERROR_CODE_INTERNAL"
    error_retryable: bool = False
    crash_after_tokens: int | None = None
    stall_after_tokens: int | None = None
    status_delay_s: float = 0.0  # after a call's last response, before its status (the servicer resumes late)
    drop_kv_sessions: bool = False
    not_ready: bool = False
    health_delay_s: float = 0.0  # every Health answer this late while requests run (a loaded servicer)
    report_health_state: int | None = None  # fault: answer Health with this number, whatever it means
    fail_model_info: bool = False
    eos_probability: float = 0.0
    seed: int = 0
    guided_backend: str = "none"  # TensorRT-LLM's guided_decoding_backend (persona.GUIDED_BACKENDS)
    # the model's output parsers, by TensorRT-LLM's names (sim/tool_formats.py): what the simulated model writes
    # and what ModelInfo advertises (revision 1 advertises only the reasoning parser, as its control.py does)
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    natural_eos: bool = False  # free text ends at a natural length even under a given max_tokens (--natural-eos)
    load_metrics: str = "on"  # persona.LOAD_METRICS
    stall_timeout_s: float | None = None  # None: the persona's; 0: no watchdog
    media_limits: media.MediaLimits = media.MediaLimits()
    # lora_config.max_loras (--max-loras): the adapters the GPU LoRA cache holds at once (DeploymentCapacity.max_loras);
    # 0: started without a LoRA config (the LoRA RPCs answer FAILED_PRECONDITION). Revision 1 serves no adapters.
    max_loras: int = attrs.field(default=4, validator=attrs.validators.ge(0))

    @property
    def lora_configured(self) -> bool:
        return self.persona.serves_lora and self.max_loras > 0

    @property
    def context_window(self) -> int:
        return self.max_context_length or self.profile.max_context_length

    @property
    def dp_size(self) -> int:
        return self.attention_dp_size or self.profile.attention_dp_size

    @property
    def schema_revision(self) -> int:
        return self.persona.schema_revision

    @property
    def multimodal(self) -> bool:
        return self.persona.default_multimodal() if self.supports_multimodal is None else self.supports_multimodal

    @property
    def stall_timeout(self) -> float | None:
        if self.stall_timeout_s is None:
            return self.persona.default_stall_timeout_s
        return self.stall_timeout_s or None

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
