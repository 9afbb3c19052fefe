"""The KV handoff between the two stages, as a pure codec.

From one full engine request it derives
- the context-only leg: `extra.request_type = "context_only"`, `stopping.max_tokens = 1`, the same
  prompt tokens, media and sampling (the first token is sampled there);
- the generation leg: the full request plus `kv.session`, the KvSessionRef exactly as the prefill
  returned it (session id, endpoints, dp rank and every attribute, untouched).
`check_session` refuses a PrefillReady whose session lacks what the decode leg needs.
"""

from __future__ import annotations

from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import kv_pb2

# Attributes TRT-LLM puts in KvSessionRef.attributes_struct; all must reach the decode leg.
SESSION_ATTRIBUTES = ("opaque_state", "first_gen_tokens", "draft_tokens", "disagg_request_id", "ctx_usage",
                      "first_gen_log_probs", "schedule_style")


class HandoffError(ValueError):
    pass


def context_only_leg(full: g.GenerateRequest) -> g.GenerateRequest:
    leg = g.GenerateRequest()
    leg.CopyFrom(full)
    leg.ClearField("stopping")
    leg.stopping.max_tokens = 1
    leg.ClearField("response")  # logprobs are the decode leg's business
    leg.ClearField("guided")
    leg.extra["request_type"] = "context_only"
    return leg


def generation_leg(full: g.GenerateRequest, session: kv_pb2.KvSessionRef) -> g.GenerateRequest:
    leg = g.GenerateRequest()
    leg.CopyFrom(full)
    leg.kv.session.CopyFrom(session)
    return leg


def check_session(session: kv_pb2.KvSessionRef) -> None:
    if not session.session_id:
        raise HandoffError("PrefillReady.kv_session has no session_id")
    if not session.endpoints:
        raise HandoffError(f"kv session {session.session_id} has no endpoints")
    present = set(session.attributes_struct.fields) if session.HasField("attributes_struct") else set()
    if "opaque_state" not in present:
        raise HandoffError(f"kv session {session.session_id} lacks attributes_struct.opaque_state")


def first_gen_tokens(session: kv_pb2.KvSessionRef) -> list[int]:
    value = session.attributes_struct.fields.get("first_gen_tokens")
    if value is None:
        return []
    return [int(v.number_value) for v in value.list_value.values]
