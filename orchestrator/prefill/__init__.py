"""The prefill stage (stage.py: attempts, retries, cancellation cleanup) and its leg codec (legs.py, pure)."""

from orchestrator.prefill.legs import CONTEXT_ONLY, PrefillOutcome, context_only_leg, prefill_outcome

__all__ = ["CONTEXT_ONLY", "PrefillOutcome", "context_only_leg", "prefill_outcome"]
