"""The simulated worker's KvSessionRef codec: what a prefill puts in PrefillReady, what a decode accepts.

Three encodings, by persona (see orchestrator.sim.persona):
- revision-1 TensorRT-LLM (tensorrt_llm/grpc/openengine/disagg.py): session_id is the integer context
  request id; attributes_struct carries ctx_info_endpoint (verbatim) and/or opaque_state (base64),
  first_gen_tokens, disagg_request_id, ctx_dp_rank, schedule_style, ctx_usage and, when logprobs were
  asked for, first_gen_log_probs; `endpoints` mirrors ctx_info_endpoint. Builds differ in what locates
  the context worker: an endpoint (ZMQ), the opaque state (inline) or both, selected by flag;
- revision-3 TensorRT-LLM (tensorrt_llm/openengine/converters.py): one canonical JSON string under
  the profile name, also named in handoff_profile, with requires_decode_media;
- strict: every revision-1 attribute plus endpoints, all required.
The decode side validates exactly as that engine does and returns where to pull the KV from.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from urllib.parse import urlsplit

import attrs
from google.protobuf import json_format, struct_pb2

from orchestrator.openengine.v1 import kv_pb2
from orchestrator.sim import kv_transfer
from orchestrator.sim.persona import Persona

TRTLLM_PROFILE = "tensorrt_llm.disaggregated_params.v1"
STRICT_ATTRIBUTES = ("opaque_state", "first_gen_tokens", "draft_tokens", "disagg_request_id", "ctx_usage",
                     "first_gen_log_probs", "schedule_style")
CONTEXT_FIRST = 1  # DisaggScheduleStyle.CONTEXT_FIRST


class HandoffInvalid(ValueError):
    """The decode worker cannot resolve this session; INVALID_ARGUMENT."""


@attrs.frozen
class Handoff:
    """What a prefill knows about its session, and what a decode needs to pull it."""

    session_key: str  # the SessionStore key (the context request id)
    kv_host: str
    kv_port: int
    opaque_state: str | None
    first_gen_tokens: tuple[int, ...]
    requires_decode_media: bool = True
    prompt_tokens: int = 0
    first_gen_log_probs: tuple[float, ...] = ()


def new_opaque_state(handoff_key: str, host: str, port: int, nonce: str) -> str:
    # Opaque to everyone but the engine; ours carries the KV endpoint, as an inline build's state does.
    return base64.b64encode(json.dumps({"ctx": handoff_key, "kv": f"{host}:{port}", "nonce": nonce}).encode()).decode()


def encode_unproduced(request_id: str, endpoint: str | None) -> kv_pb2.KvSessionRef:
    """The sibling server's handoff for a context phase that did not run to its end (cancelled): the request's
    own DisaggregatedParams (context_only, its disagg_request_id, no ctx_request_id, no opaque_state, no first
    tokens) and the server's configured ctx_info_endpoint (servicer.py _context_info_endpoint), encoded as
    converters.encode_handoff does."""
    disagg_id = str(int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") & ((1 << 63) - 1))
    payload = {"ctx_request_id": None, "disagg_request_id": disagg_id, "ctx_dp_rank": None,
               "ctx_info_endpoint": endpoint, "opaque_state": None, "first_gen_tokens": None,
               "first_gen_log_probs": None, "draft_tokens": None, "ctx_usage": None, "conversation_id": None,
               "schedule_style": "context_first", "requires_decode_media": False}
    session = kv_pb2.KvSessionRef(session_id=disagg_id, transfer_backend="tensorrt_llm", dp_rank=0,
                                  handoff_profile=TRTLLM_PROFILE)
    session.attributes_struct[TRTLLM_PROFILE] = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return session


def encode(persona: Persona, h: Handoff) -> kv_pb2.KvSessionRef:
    endpoint = f"{h.kv_host}:{h.kv_port}"
    usage = {"prompt_tokens": h.prompt_tokens, "completion_tokens": len(h.first_gen_tokens),
             "total_tokens": h.prompt_tokens + len(h.first_gen_tokens)}
    if persona.session_profile:
        payload = {"ctx_request_id": h.session_key, "disagg_request_id": h.session_key, "ctx_dp_rank": 0,
                   "ctx_info_endpoint": endpoint, "opaque_state": h.opaque_state,
                   "first_gen_tokens": list(h.first_gen_tokens),
                   "first_gen_log_probs": list(h.first_gen_log_probs) or None, "draft_tokens": None,
                   "ctx_usage": usage, "conversation_id": None, "schedule_style": "context_first",
                   "requires_decode_media": h.requires_decode_media}
        session = kv_pb2.KvSessionRef(session_id=h.session_key, transfer_backend="tensorrt_llm", dp_rank=0,
                                      handoff_profile=TRTLLM_PROFILE)
        session.attributes_struct[TRTLLM_PROFILE] = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return session
    session = kv_pb2.KvSessionRef(session_id=h.session_key, transfer_backend=kv_transfer.PROTOCOL, dp_rank=0)
    attributes: dict = {"first_gen_tokens": list(h.first_gen_tokens), "disagg_request_id": h.session_key,
                        "ctx_usage": usage, "schedule_style": CONTEXT_FIRST}
    shape = "both" if persona.name == "strict" else persona.handoff_shape
    if shape in ("both", "endpoint"):
        attributes["ctx_info_endpoint"] = endpoint
        attributes["ctx_dp_rank"] = 0
        session.endpoints.add(host=h.kv_host, port=h.kv_port, protocol=kv_transfer.PROTOCOL)
    if shape in ("both", "opaque"):
        attributes["opaque_state"] = h.opaque_state
    if h.first_gen_log_probs:
        attributes["first_gen_log_probs"] = list(h.first_gen_log_probs)
    if persona.name == "strict":
        attributes.setdefault("first_gen_log_probs", [])
        attributes["draft_tokens"] = []
    struct = struct_pb2.Struct()
    struct.update(attributes)
    session.attributes_struct.CopyFrom(struct)
    return session


def _split(endpoint: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
        return (parts.hostname, parts.port) if parts.hostname and parts.port else None
    except ValueError:
        return None


def _from_opaque(opaque: str) -> tuple[str, int]:
    try:
        state = json.loads(base64.b64decode(opaque, validate=True))
        located = _split(state["kv"])
    except (binascii.Error, ValueError, KeyError, TypeError):
        located = None
    if located is None:
        raise HandoffInvalid("kv.session opaque_state does not locate a context worker")
    return located


def decode(persona: Persona, session: kv_pb2.KvSessionRef, *, has_media: bool) -> Handoff:
    attributes = json_format.MessageToDict(session.attributes_struct) if session.HasField("attributes_struct") else {}
    if persona.session_profile:
        return _decode_profile(session, attributes, has_media)
    if persona.name == "strict":
        missing = [name for name in STRICT_ATTRIBUTES if name not in attributes]
        if missing:
            raise HandoffInvalid(f"kv_session.attributes_struct lacks {', '.join(missing)}")
        if not session.endpoints:
            raise HandoffInvalid("kv_session has no endpoints")
    # TensorRT-LLM's _validate_kv_session, then its int(session_id).
    endpoint = attributes.get("ctx_info_endpoint") or (
        (f"{session.endpoints[0].host}:{session.endpoints[0].port}" if session.endpoints[0].port
         else session.endpoints[0].host) if session.endpoints and session.endpoints[0].host else "")
    opaque = attributes.get("opaque_state") or None
    if endpoint:
        located = _split(str(endpoint))
        if located is None:
            raise HandoffInvalid(f"kv.session ctx_info_endpoint '{endpoint}' is not a usable address")
    elif opaque:
        located = _from_opaque(opaque)
    else:
        raise HandoffInvalid("kv.session carries neither a ctx_info_endpoint nor an opaque_state")
    if not session.session_id and attributes.get("disagg_request_id") is None:
        raise HandoffInvalid("kv.session carries neither a session_id nor a disagg_request_id")
    key = session.session_id or str(attributes["disagg_request_id"])
    if persona.trtllm and not key.isdigit():
        raise HandoffInvalid("kv.session.session_id must be an integer context request id")
    if opaque is not None:
        try:
            base64.b64decode(opaque, validate=True)
        except (binascii.Error, ValueError):
            raise HandoffInvalid("kv.session opaque_state is not base64") from None
    first = tuple(int(t) for t in attributes.get("first_gen_tokens") or ())
    return Handoff(session_key=key, kv_host=located[0], kv_port=located[1], opaque_state=opaque,
                   first_gen_tokens=first, requires_decode_media=True)


def _decode_profile(session: kv_pb2.KvSessionRef, attributes: dict, has_media: bool) -> Handoff:
    if session.handoff_profile and session.handoff_profile != TRTLLM_PROFILE:
        raise HandoffInvalid(f"Unsupported TensorRT-LLM handoff profile {session.handoff_profile!r}")
    encoded = attributes.get(TRTLLM_PROFILE)
    if not isinstance(encoded, str):
        raise HandoffInvalid(f"KV session is missing {TRTLLM_PROFILE!r}")
    try:
        payload = json.loads(encoded)
    except json.JSONDecodeError:
        raise HandoffInvalid("TensorRT-LLM handoff is not valid JSON") from None
    if not isinstance(payload, dict):
        raise HandoffInvalid("TensorRT-LLM handoff must contain a JSON object")
    requires_media = payload.get("requires_decode_media", False)
    if requires_media and not has_media:
        raise HandoffInvalid("Decode request must resend the ordered context-phase media")
    if has_media and not requires_media:
        raise HandoffInvalid("Decode KV session does not require raw media")
    located = _split(str(payload.get("ctx_info_endpoint") or ""))
    if located is None:
        raise HandoffInvalid("TensorRT-LLM handoff has no usable ctx_info_endpoint")
    # converters.decode_handoff's decimal_id: absent (null) is accepted, as a cancelled context phase's handoff
    # carries it (UPSTREAM r3-cancelled-handoff); the pull then finds no session and the KV transfer fails
    raw = payload.get("ctx_request_id")
    if raw is not None and (not isinstance(raw, str) or not raw.isdecimal()):
        raise HandoffInvalid("ctx_request_id must be a decimal string")
    key = raw or ""
    return Handoff(session_key=key, kv_host=located[0], kv_port=located[1], opaque_state=payload.get("opaque_state"),
                   first_gen_tokens=tuple(int(t) for t in payload.get("first_gen_tokens") or ()),
                   requires_decode_media=bool(requires_media))
