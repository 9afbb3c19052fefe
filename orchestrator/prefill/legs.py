"""The prefill stage's leg codec, pure: the context-only leg, and how it ended.

The context-only leg is the full request with `extra.request_type = "context_only"` and
`stopping.max_tokens = 1`. Everything else stays: the first token is sampled on the prefill worker
(it travels as `first_gen_tokens`), so its logprobs, guide, min_tokens, stop conditions and
ignore_eos must apply there.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from orchestrator.engine.events import Event, Failed, Finished, FinishReason, PrefillReady, TokenLogprob, Tokens
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import kv_pb2

CONTEXT_ONLY = "context_only"


def context_only_leg(full: g.GenerateRequest) -> g.GenerateRequest:
    leg = g.GenerateRequest()
    leg.CopyFrom(full)
    leg.stopping.max_tokens = 1
    leg.extra["request_type"] = CONTEXT_ONLY
    return leg


@attrs.frozen
class PrefillOutcome:
    """Exactly one of: a session to hand to decode, the whole answer, or an error."""

    session: kv_pb2.KvSessionRef | None = None
    answer: tuple[Event, ...] = ()  # tokens + Finished: the request is complete (the first token stopped it)
    error: str | None = None
    failed: Failed | None = None
    cached_tokens: int | None = None  # PrefillReady's usage.cached_prompt_tokens: what this prompt found cached
    # the logprobs of the token(s) the leg streamed before PrefillReady: the decode leg replays that token
    # without one (TensorRT-LLM's context worker does not transfer it), so it is filled in from here
    first_logprobs: tuple[TokenLogprob, ...] = ()


def prefill_outcome(events: Sequence[Event]) -> PrefillOutcome | None:
    """Read the context-only leg's events so far; None while it has not ended.

    TensorRT-LLM streams the first token on this leg, then ends it with PrefillReady; the token is held
    back, because the decode leg replays it from first_gen_tokens. Without a PrefillReady the leg ends
    with the real Finished: a stop (EOS, a stop token or string on the one token) makes the held tokens
    the whole answer; a length finish means no KV was handed off and there is nothing to answer with.
    """
    for event in events:
        if isinstance(event, PrefillReady):
            cached = event.usage.cached_prompt_tokens if event.usage is not None else None
            first = tuple(lp for e in events if isinstance(e, Tokens) for lp in e.logprobs if lp.logprob is not None)
            return PrefillOutcome(session=event.kv_session, cached_tokens=cached, first_logprobs=first)
        if isinstance(event, Failed):
            return PrefillOutcome(failed=event)
        if isinstance(event, Finished):
            if event.reason == FinishReason.FINISH_REASON_STOP:
                return PrefillOutcome(answer=tuple(e for e in events if isinstance(e, (Tokens, Finished))))
            return PrefillOutcome(error=f"the context-only leg finished ({event.reason_name}) without a kv_session "
                                        "handoff")
    return None
