"""The prefill stage: run the context-only leg; return a KV lease for the decode stage, or the whole answer.

A retryable failure before the session exists moves the leg to another prefill worker
(orchestrator.workers.retry). Cancellation while the prefill runs (a client disconnect, the deadline,
shutdown) aborts it by request id and waits, shielded and bounded, for how it ended: a prefill that
finished anyway left a session, which is released at once so no KV blocks are stranded.
"""

from __future__ import annotations

import logging

import attrs
import trio

from orchestrator import tracing
from orchestrator.engine import EngineError
from orchestrator.engine.errors import ErrorCode
from orchestrator.engine.events import Event
from orchestrator.kv.lease import KvLease
from orchestrator.kv.release import KvReleaser
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.prefill.legs import PrefillOutcome, context_only_leg, prefill_outcome
from orchestrator.workers.retry import with_retries
from orchestrator.workers.routing import with_target_rank

log = logging.getLogger(__name__)


@attrs.frozen
class PrefillResult:
    """Exactly one of: `lease` (the session, for the decode stage) or `answer` (the request is complete)."""

    lease: KvLease | None = None
    answer: tuple[Event, ...] = ()


class PrefillStage:
    def __init__(self, pool, metrics, releaser: KvReleaser, *, retries: int, cleanup_timeout_s: float):
        self.pool, self.metrics, self.releaser = pool, metrics, releaser
        self.retries, self.cleanup_timeout_s = retries, cleanup_timeout_s

    async def run(self, first_worker, full: g.GenerateRequest, decode_worker=None, *,
                  migration: int = 0, accepts=None, target_rank: int | None = None) -> PrefillResult:
        """`accepts(worker)`: whether a retry may go there (orchestrator.workers.retry). `target_rank`: the
        attention-DP rank of `first_worker` that holds the prompt's prefix (KV-aware routing); not for retries."""
        leg = context_only_leg(full)
        attempts = 0

        async def attempt(worker) -> PrefillResult:
            nonlocal attempts
            attempts += 1
            with tracing.leg_span("prefill", worker.address, leg.request_id, attempts, migration) as span:
                outcome = await self._one_attempt(worker, leg, full, decode_worker,
                                                  with_target_rank(span.metadata, target_rank, worker is first_worker))
                if outcome.session is not None:
                    return PrefillResult(lease=KvLease(worker, outcome.session, cached_tokens=outcome.cached_tokens,
                                                       first_logprobs=outcome.first_logprobs))
                if outcome.answer:
                    return PrefillResult(answer=outcome.answer)
                raise (outcome.failed.error if outcome.failed is not None else
                       EngineError(outcome.error or "the prefill leg ended without an outcome",
                                   worker=worker.address, rpc="Generate",
                                   code=ErrorCode.ERROR_CODE_INTERNAL))

        _, result = await with_retries(self.pool, first_worker, attempt, retries=self.retries, metrics=self.metrics,
                                       what=f"prefill of {leg.request_id}", accepts=accepts)
        return result

    async def _one_attempt(self, worker, leg: g.GenerateRequest, full: g.GenerateRequest,
                           decode_worker, metadata) -> PrefillOutcome:
        with self.pool.lease(worker):
            async with worker.client.generate(leg, metadata=metadata) as stream:
                try:
                    return await _until_outcome(stream)
                except trio.Cancelled:
                    with trio.CancelScope(shield=True) as cleanup:
                        cleanup.deadline = trio.current_time() + self.cleanup_timeout_s
                        try:
                            await worker.client.abort(request_id=leg.request_id, timeout=self.cleanup_timeout_s,
                                                      metadata=metadata)
                            outcome = await _until_outcome(stream)
                        except EngineError as exc:
                            log.warning("abort of prefill %s on %s failed: %s", leg.request_id, worker.address, exc)
                        else:
                            if outcome.session is not None:  # it finished before the abort landed
                                lease = KvLease(worker, outcome.session)
                                await self.releaser.release_unpulled(lease, full, decode_worker)
                    raise


async def _until_outcome(stream) -> PrefillOutcome:
    events = []
    while True:
        batch = await stream.next_batch()
        if not batch:
            return PrefillOutcome(error="the context-only stream ended without prefill_ready or finished")
        events.extend(batch)
        outcome = prefill_outcome(events)
        if outcome is not None:
            return outcome
