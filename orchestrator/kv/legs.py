"""The legs that pull a KV session, pure: the generation leg and the one-token release leg.

The generation leg is the full request plus `kv.session`, the KvSessionRef exactly as the prefill
returned it, and the prefill's media when the handoff needs them. The release leg only pulls a
session: the one way to make a prefill worker free a session no decode leg read (orchestrator/kv/lease.py).
Both read a session, so they live with the KV rule, below the decode stage that runs the first and the
releaser (kv/release.py) that runs the second.
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


def release_leg(full: g.GenerateRequest, session: kv_pb2.KvSessionRef) -> g.GenerateRequest:
    """A generation leg whose only job is to pull the session: one token, nothing else asked of it."""
    leg = generation_leg(full, session)
    leg.request_id = f"{full.request_id}-kv-release"
    leg.ClearField("stopping")
    leg.stopping.max_tokens = 1
    leg.ClearField("response")
    leg.ClearField("guided")
    return leg
