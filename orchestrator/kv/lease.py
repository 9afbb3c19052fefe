"""A KV lease: one KV session held on a prefill worker, from its PrefillReady until a decode pulls it.

The prefill stage makes the lease; the decode stage consumes it and marks it `pulled` when its first
token arrives (that token means the decode worker has the KV). What frees a session nobody pulled is
one small pure rule, `unpulled_session_action`: whether a decode leg is on its way.
orchestrator.kv.release carries the action out.
"""

from __future__ import annotations

import enum

import attrs

from orchestrator.openengine.v1 import kv_pb2


class KvAction(enum.Enum):
    KEEP_DECODE_UNTIL_FIRST_TOKEN = "keep_decode_until_first_token"  # its first token means it pulled
    PULL_WITH_RELEASE_LEG = "pull_with_release_leg"  # a one-token decode leg pulls and frees it


def unpulled_session_action(*, decode_leg_in_flight: bool) -> KvAction:
    """What frees a session that no decode has pulled (yet), so no prefill blocks are stranded.

    Only a pull is proof, on every revision. Revision-1 TensorRT-LLM cannot abort by session and holds such
    a session until its process exits. The sibling server answers Abort(kv_session) ABORTED, but once the
    context request has finished (always so once PrefillReady was sent) it only drops its own handle: nothing
    reaches the engine and the blocks stay held. So the decode leg already on its way is kept until its
    first token, or else a one-token release leg pulls the session.
    """
    if decode_leg_in_flight:
        return KvAction.KEEP_DECODE_UNTIL_FIRST_TOKEN
    return KvAction.PULL_WITH_RELEASE_LEG


@attrs.define(eq=False)
class KvLease:
    prefill_worker: object  # orchestrator.pool.Worker (kept loose: this module is pure)
    session: kv_pb2.KvSessionRef
    cached_tokens: int | None = None  # what the prefill found cached (its PrefillReady usage)
    pulled: bool = False  # a decode leg streamed a token: the worker holds nothing for us any more
    released: bool = False  # pulled by a release leg

    @property
    def settled(self) -> bool:
        return self.pulled or self.released

    def action(self, *, decode_leg_in_flight: bool) -> KvAction:
        return unpulled_session_action(decode_leg_in_flight=decode_leg_in_flight)
