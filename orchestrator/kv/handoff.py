"""The KV handoff codec, pure: is a KvSessionRef usable, and what must travel with it.

`check_session` accepts what TensorRT-LLM's own validator accepts (revision 1: an endpoint with a port
or an opaque_state, and a request name; revision 3: its named JSON profile, naming the context request it
ran); `produced_by_context` says whether a session may be pulled at all. `decode_needs_media` says
whether the generation leg resends the prefill's media. Upstream facts: tests/e2e/test_trtllm_conformance.py.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from orchestrator.openengine.v1 import kv_pb2

# Revision-3 TensorRT-LLM packs its whole handoff as one JSON string under this attributes key and names
# the same string in KvSessionRef.handoff_profile (tensorrt_llm/openengine/converters.py).
TRTLLM_HANDOFF_PROFILE = "tensorrt_llm.disaggregated_params.v1"
# Attributes revision-1 TensorRT-LLM may put in KvSessionRef.attributes_struct
# (tensorrt_llm/grpc/openengine/disagg.py); all reach the decode leg untouched, whichever are present.
SESSION_ATTRIBUTES = ("ctx_info_endpoint", "opaque_state", "first_gen_tokens", "draft_tokens", "disagg_request_id",
                      "ctx_dp_rank", "ctx_usage", "first_gen_log_probs", "schedule_style")


class HandoffError(ValueError):
    pass


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
        why = _not_produced(payload)
        if why:
            raise HandoffError(f"kv session {session.session_id!r} names no session a context phase produced: {why}")
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


def produced_by_context(session: kv_pb2.KvSessionRef) -> bool:
    """Whether the session is one a context phase really produced, so that a generation leg (ours, or a release
    leg) can pull it. The sibling server yields a PrefillReady on `finished` whatever the finish reason: a
    context phase cancelled while it ran hands off the request's own parameters (UPSTREAM r3-cancelled-handoff),
    and a generation leg sent for it waits out the engine's KV receive timeout. Revision 1 sends its real
    Finished instead; its sessions are usable when check_session says so."""
    try:
        check_session(session)
    except HandoffError:
        return False
    return True


def _not_produced(payload: dict) -> str:
    """Why a revision-3 handoff is not a context phase's (empty when it is): the engine names the context
    request it ran (ctx_request_id) and where its KV is (opaque_state or ctx_info_endpoint)."""
    if payload.get("ctx_request_id") in (None, ""):
        return "no ctx_request_id (the context phase did not run to its end: cancelled)"
    if not (payload.get("opaque_state") or payload.get("ctx_info_endpoint")):
        return "neither opaque_state nor ctx_info_endpoint"
    return ""


def _has_value(value) -> bool:
    return value is not None and value.WhichOneof("kind") not in (None, "null_value") and (
        value.WhichOneof("kind") != "string_value" or bool(value.string_value))


def first_gen_tokens(session: kv_pb2.KvSessionRef) -> list[int]:
    value = session.attributes_struct.fields.get("first_gen_tokens")
    if value is None:
        return []
    return [int(v.number_value) for v in value.list_value.values]
