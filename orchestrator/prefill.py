"""The prefill stage: run the context-only leg; return its KV session, or the whole answer.

A retryable failure before the session exists is retried once (configurable) on another prefill
worker. If the request is cancelled while its prefill runs, the prefill is aborted and its outcome
awaited (shielded, bounded): should the prefill have finished anyway, its session is handed to
`release_session`, so no KV blocks are stranded on the prefill worker.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from orchestrator.convert.errors import ApiError
from orchestrator.disagg import PrefillOutcome, prefill_outcome
from orchestrator.engine import EngineError, WorkerUnavailable
from orchestrator.engine.errors import ErrorCode
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import kv_pb2
from orchestrator.pool import Worker, WorkerPool

log = logging.getLogger(__name__)


async def _until_outcome(stream, worker: Worker) -> PrefillOutcome:
    events = []
    while True:
        batch = await stream.next_batch()
        if not batch:
            return PrefillOutcome(error="the context-only stream ended without prefill_ready or finished")
        events.extend(batch)
        outcome = prefill_outcome(events)
        if outcome is not None:
            return outcome


async def run_prefill(pool: WorkerPool, first: Worker, leg: g.GenerateRequest, *, retries: int,
                      cleanup_timeout: float, metrics,
                      release_session: Callable[[Worker, kv_pb2.KvSessionRef], Awaitable[None]]
                      ) -> tuple[Worker, PrefillOutcome]:
    """Returns the worker that prefilled and an outcome with a `session` or an `answer`; raises the error."""
    tried: list[Worker] = []
    worker = first
    while True:
        tried.append(worker)
        try:
            outcome = await _one_attempt(worker, pool, leg, cleanup_timeout, release_session)
        except EngineError as exc:  # a gRPC status instead of an answer
            if isinstance(exc, WorkerUnavailable):
                pool.report_unreachable(worker, exc)
            error: EngineError = exc
        else:
            if outcome.session is not None or outcome.answer:
                return worker, outcome
            error = (outcome.failed.error if outcome.failed is not None else
                     EngineError(outcome.error, worker=worker.address, rpc="Generate",
                                 code=ErrorCode.ERROR_CODE_INTERNAL))
        metrics.engine_errors.labels(error.code_name).inc()
        if not error.retryable or len(tried) > retries:
            raise error
        try:
            worker = pool.pick("prefill", exclude=tuple(tried))
        except ApiError:  # no other prefill worker: the original error says more
            raise error from None
        metrics.retries.labels("prefill").inc()
        log.warning("prefill of %s failed on %s (%s); retrying on %s", leg.request_id, tried[-1].address,
                    error.code_name, worker.address)


async def _one_attempt(worker: Worker, pool: WorkerPool, leg: g.GenerateRequest, cleanup_timeout: float,
                       release_session) -> PrefillOutcome:
    with pool.lease(worker):
        async with worker.client.generate(leg) as stream:
            try:
                return await _until_outcome(stream, worker)
            except trio.Cancelled:
                with trio.CancelScope(shield=True) as cleanup:
                    cleanup.deadline = trio.current_time() + cleanup_timeout
                    try:
                        await worker.client.abort(request_id=leg.request_id, timeout=cleanup_timeout)
                        outcome = await _until_outcome(stream, worker)
                    except EngineError as exc:
                        log.warning("abort of prefill %s on %s failed: %s", leg.request_id, worker.address, exc)
                    else:
                        if outcome.session is not None:  # it finished before the abort landed
                            await release_session(worker, outcome.session)
                raise
