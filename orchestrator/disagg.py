"""The KV handoff between the two stages, as a pure codec, and the rule for sessions no decode pulled.

From one full engine request it derives
- the context-only leg: the full request with `extra.request_type = "context_only"` and
  `stopping.max_tokens = 1`. Everything else stays: the first token is sampled on the prefill worker
  (it travels as `first_gen_tokens`), so its logprobs, guide, min_tokens, stop conditions and
  ignore_eos must apply there;
- the generation leg: the full request plus `kv.session`, the KvSessionRef exactly as the prefill
  returned it, and the same media when the handoff needs them;
- the release leg: a one-token generation leg that only pulls a session, so a worker that cannot
  abort sessions frees its blocks.
`check_session` accepts what TensorRT-LLM's own validator accepts; `prefill_outcome` reads how a
context-only leg ended; `unpulled_session_action` is the KV rule as a table.
Each upstream fact is cited in tests/test_trtllm_conformance.py.
"""

from __future__ import annotations

import enum
import json
from typing import Sequence
from urllib.parse import urlsplit

import attrs

from orchestrator.engine.events import Event, Failed, Finished, FinishReason, PrefillReady, Tokens
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import kv_pb2

CONTEXT_ONLY = "context_only"
# Revision-3 TensorRT-LLM packs its whole handoff as one JSON string under this attributes key and names
# the same string in KvSessionRef.handoff_profile (tensorrt_llm/openengine/converters.py).
TRTLLM_HANDOFF_PROFILE = "tensorrt_llm.disaggregated_params.v1"
# Attributes revision-1 TensorRT-LLM may put in KvSessionRef.attributes_struct
# (tensorrt_llm/grpc/openengine/disagg.py); all reach the decode leg untouched, whichever are present.
SESSION_ATTRIBUTES = ("ctx_info_endpoint", "opaque_state", "first_gen_tokens", "draft_tokens", "disagg_request_id",
                      "ctx_dp_rank", "ctx_usage", "first_gen_log_probs", "schedule_style")


class HandoffError(ValueError):
    pass


def context_only_leg(full: g.GenerateRequest) -> g.GenerateRequest:
    leg = g.GenerateRequest()
    leg.CopyFrom(full)
    leg.stopping.max_tokens = 1
    leg.extra["request_type"] = CONTEXT_ONLY
    return leg


def generation_leg(full: g.GenerateRequest, session: kv_pb2.KvSessionRef) -> g.GenerateRequest:
    leg = g.GenerateRequest()
    leg.CopyFrom(full)
    leg.kv.session.CopyFrom(session)
    if not decode_needs_media(session):
        del leg.media[:]
    return leg


def release_leg(full: g.GenerateRequest, session: kv_pb2.KvSessionRef) -> g.GenerateRequest:
    """A generation leg whose only job is to pull the session: one token, nothing else asked of it."""
    leg = generation_leg(full, session)
    leg.request_id = f"{full.request_id}-kv-release"
    leg.ClearField("stopping")
    leg.stopping.max_tokens = 1
    leg.ClearField("response")
    leg.ClearField("guided")
    return leg


def _trtllm_payload(session: kv_pb2.KvSessionRef) -> dict | None:
    """The revision-3 TensorRT-LLM handoff JSON, or None for a revision-1 style session."""
    fields = session.attributes_struct.fields
    if session.handoff_profile != TRTLLM_HANDOFF_PROFILE and TRTLLM_HANDOFF_PROFILE not in fields:
        return None
    value = fields.get(TRTLLM_HANDOFF_PROFILE)
    if value is None or value.WhichOneof("kind") != "string_value":
        raise HandoffError(f"kv session {session.session_id!r} names profile {TRTLLM_HANDOFF_PROFILE} but its "
                           "attributes_struct lacks that JSON string")
    try:
        payload = json.loads(value.string_value)
    except json.JSONDecodeError as exc:
        raise HandoffError(f"kv session {session.session_id!r}: the {TRTLLM_HANDOFF_PROFILE} attribute is not "
                           f"JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise HandoffError(f"kv session {session.session_id!r}: the {TRTLLM_HANDOFF_PROFILE} attribute is not an "
                           "object")
    return payload


def decode_needs_media(session: kv_pb2.KvSessionRef) -> bool:
    """Revision-3 TensorRT-LLM says per session (requires_decode_media) and refuses media it did not ask
    for; a revision-1 decode leg carries the prefill's media (the spec's rule)."""
    try:
        payload = _trtllm_payload(session)
    except HandoffError:
        return True  # check_session refuses it
    return True if payload is None else payload.get("requires_decode_media") is True


def _endpoint_text(session: kv_pb2.KvSessionRef) -> str:
    verbatim = session.attributes_struct.fields.get("ctx_info_endpoint")
    if verbatim is not None and verbatim.WhichOneof("kind") == "string_value" and verbatim.string_value:
        return verbatim.string_value
    if session.endpoints and session.endpoints[0].host:
        first = session.endpoints[0]
        return f"{first.host}:{first.port}" if first.port else first.host
    return ""


def check_session(session: kv_pb2.KvSessionRef) -> None:
    """Refuse a handoff the decode worker could not resolve, naming what is missing.

    Revision 1: an endpoint with a port (ZMQ builds) or an opaque_state (inline builds) locates the
    context worker, and a session_id or disagg_request_id names the request. Revision 3: the profile's
    JSON must parse and name the request.
    """
    payload = _trtllm_payload(session)
    fields = session.attributes_struct.fields
    if payload is not None:
        if not (session.session_id or payload.get("ctx_request_id") or payload.get("disagg_request_id")):
            raise HandoffError("the kv session names no request (session_id, ctx_request_id, disagg_request_id)")
        return
    endpoint = _endpoint_text(session)
    if endpoint:
        try:
            parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
            usable = bool(parts.hostname) and bool(parts.port)
        except ValueError:
            usable = False
        if not usable:
            raise HandoffError(f"kv session {session.session_id!r}: endpoint {endpoint!r} is not a usable "
                               "host:port address")
    elif not _has_value(fields.get("opaque_state")):
        raise HandoffError(f"kv session {session.session_id!r} carries neither an endpoint (endpoints or "
                           "attributes_struct.ctx_info_endpoint) nor attributes_struct.opaque_state")
    if not session.session_id and "disagg_request_id" not in fields:
        raise HandoffError("the kv session carries neither a session_id nor a disagg_request_id")


def _has_value(value) -> bool:
    return value is not None and value.WhichOneof("kind") not in (None, "null_value") and (
        value.WhichOneof("kind") != "string_value" or bool(value.string_value))


def first_gen_tokens(session: kv_pb2.KvSessionRef) -> list[int]:
    value = session.attributes_struct.fields.get("first_gen_tokens")
    if value is None:
        return []
    return [int(v.number_value) for v in value.list_value.values]


# ---- how a context-only leg ended -------------------------------------------------------------------

@attrs.frozen
class PrefillOutcome:
    """Exactly one of: a session to hand to decode, the whole answer, or an error."""

    session: kv_pb2.KvSessionRef | None = None
    answer: tuple[Event, ...] = ()  # tokens + Finished: the request is complete (the first token stopped it)
    error: str | None = None
    failed: Failed | None = None


def prefill_outcome(events: Sequence[Event]) -> PrefillOutcome | None:
    """Read the context-only leg's events so far; None while it has not ended.

    TensorRT-LLM streams the first token on this leg, then ends it with PrefillReady; the token is held
    back, because the decode leg replays it from first_gen_tokens. Without a PrefillReady the leg ends
    with the real Finished: a stop (EOS, a stop token or string on the one token) makes the held tokens
    the whole answer; a length finish means no KV was handed off and there is nothing to answer with.
    """
    for event in events:
        if isinstance(event, PrefillReady):
            return PrefillOutcome(session=event.kv_session)
        if isinstance(event, Failed):
            return PrefillOutcome(failed=event)
        if isinstance(event, Finished):
            if event.reason == FinishReason.FINISH_REASON_STOP:
                return PrefillOutcome(answer=tuple(e for e in events if isinstance(e, (Tokens, Finished))))
            return PrefillOutcome(error=f"the context-only leg finished ({event.reason_name}) without a kv_session "
                                        "handoff")
    return None


# ---- the KV rule -------------------------------------------------------------------------------------

class KvAction(enum.Enum):
    ABORT_SESSION = "abort_session"  # Control.Abort(kv_session) on the prefill worker
    KEEP_DECODE_UNTIL_FIRST_TOKEN = "keep_decode_until_first_token"  # its first token means it pulled
    PULL_WITH_RELEASE_LEG = "pull_with_release_leg"  # a one-token decode leg pulls and frees it


def unpulled_session_action(*, supports_abort_cleanup: bool, decode_leg_in_flight: bool) -> KvAction:
    """What frees a session that no decode has pulled (yet), so no prefill blocks are stranded.

    TensorRT-LLM without abort cleanup holds such a session until its process exits, so only a pull
    frees it: the decode leg already on its way, or else a release leg. If an abort by session fails,
    the caller falls back to the same no-abort action.
    """
    if supports_abort_cleanup:
        return KvAction.ABORT_SESSION
    if decode_leg_in_flight:
        return KvAction.KEEP_DECODE_UNTIL_FIRST_TOKEN
    return KvAction.PULL_WITH_RELEASE_LEG
