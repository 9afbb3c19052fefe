"""The decode stage's leg codec, pure: the generation leg and the one-token release leg.

The generation leg is the full request plus `kv.session`, the KvSessionRef exactly as the prefill
returned it, and the prefill's media when the handoff needs them. The release leg only pulls a
session: the one way to make a prefill worker free a session no decode leg read (orchestrator/kv/lease.py).
"""

from __future__ import annotations

from orchestrator.kv.handoff import decode_needs_media
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import kv_pb2

GENERATION_SUFFIX = "-gen"


def generation_leg(full: g.GenerateRequest, session: kv_pb2.KvSessionRef) -> g.GenerateRequest:
    leg = g.GenerateRequest()
    leg.CopyFrom(full)
    # Its own request_id: a revision-1 worker serves either phase, so the same engine may run both legs, and it
    # marks the context request finished only after that call's status; a reused id is ALREADY_EXISTS. The KV is
    # found through the session (its session_id / disagg_request_id), never through this id.
    leg.request_id = full.request_id + GENERATION_SUFFIX
    leg.kv.session.CopyFrom(session)
    if not decode_needs_media(session):
        del leg.media[:]
    return leg


def continuation_leg(full: g.GenerateRequest, generated: list[int], attempt: int) -> g.GenerateRequest:
    """The request again, for another worker, after `generated` tokens were streamed: the prompt plus those
    tokens, and what is left of the budget. (A deterministic engine goes on with the same tokens.)"""
    leg = g.GenerateRequest()
    leg.CopyFrom(full)
    leg.request_id = f"{full.request_id}-m{attempt}"
    leg.token_ids.ids.extend(generated)
    if leg.stopping.HasField("max_tokens"):
        leg.stopping.max_tokens = max(1, leg.stopping.max_tokens - len(generated))
    if leg.stopping.HasField("min_tokens"):
        leg.stopping.min_tokens = max(0, leg.stopping.min_tokens - len(generated))
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
