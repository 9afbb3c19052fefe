"""The decode stage's leg codec, pure: the continuation leg a migration sends to another worker.

The legs that pull a KV session (the generation leg and the release leg) are the KV rule's, in
orchestrator/kv/legs.py.
"""

from __future__ import annotations

from orchestrator.openengine.v1 import generation_pb2 as g


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
