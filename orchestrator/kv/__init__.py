"""The KV session between the stages: the handoff codec (pure), the lease and its rule (pure), the legs that
pull a session (pure), and the releaser that frees a session nobody pulled (orchestrator.kv.release)."""

from orchestrator.kv.handoff import (
    SESSION_ATTRIBUTES,
    TRTLLM_HANDOFF_PROFILE,
    HandoffError,
    check_session,
    decode_needs_media,
    first_gen_tokens,
)
from orchestrator.kv.lease import KvLease
from orchestrator.kv.legs import generation_leg, release_leg

__all__ = ["SESSION_ATTRIBUTES", "TRTLLM_HANDOFF_PROFILE", "HandoffError", "KvLease", "check_session",
           "decode_needs_media", "first_gen_tokens", "generation_leg", "release_leg"]
