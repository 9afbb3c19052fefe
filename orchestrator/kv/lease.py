"""A KV lease: one KV session held on a prefill worker, from its PrefillReady until a decode pulls it.

The prefill stage makes the lease; the decode stage consumes it and marks it `pulled` when its first
token arrives (that token means the decode worker has the KV).

The KV rule: only a pull frees a session, on every revision. Revision-1 TensorRT-LLM cannot abort by
session and holds an unpulled one until its process exits; the sibling server answers Abort(kv_session)
ABORTED, but once the context request has finished (always so after PrefillReady) it only drops its own
handle and the blocks stay held. So a decode leg already on its way is kept until its first token
(decode/stage.py), and a session no decode leg will read is pulled by a one-token release leg
(kv/release.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from orchestrator.engine.events import TokenLogprob
from orchestrator.openengine.v1 import kv_pb2

if TYPE_CHECKING:
    from orchestrator.workers.pool import Worker


@attrs.define(eq=False)
class KvLease:
    prefill_worker: Worker  # imported only for type checking: this module is pure
    session: kv_pb2.KvSessionRef
    cached_tokens: int | None = None  # what the prefill found cached (its PrefillReady usage)
    first_logprobs: tuple[TokenLogprob, ...] = ()  # of the token the prefill streamed (prefill/legs.py)
    pulled: bool = False  # a decode leg streamed a token: the worker holds nothing for us any more
    released: bool = False  # pulled by a release leg

    @property
    def settled(self) -> bool:
        return self.pulled or self.released
