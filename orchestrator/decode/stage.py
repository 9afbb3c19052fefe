"""The decode stage: stream a generation leg (or a whole request) from a worker to the client's sink.

- A retryable failure before anything was streamed moves the leg to another worker of the same role
  (orchestrator.workers.retry); a decode leg pulls the same KV session from there. A failure after tokens
  were streamed is not retried here (the client has those tokens): it is raised as `MidStreamFailure`,
  and the request flow decides whether the request migrates (orchestrator.flow.request_flow).
- Cancellation (client disconnect, deadline, shutdown) cancels the RPC, and a shielded, bounded
  Control.Abort makes sure the engine lets go as well.
- KV rule on cancellation, when the leg consumes a KV lease that is not pulled yet: keep the stream until
  its first token (the decode worker has then pulled the KV) and only then let it go; an abort by session
  is never trusted to free it (orchestrator.kv.lease). Anything else that leaves a lease unpulled is the
  caller's to release (orchestrator.kv.release).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import trio

from orchestrator import tracing
from orchestrator.decode.output import stream_output
from orchestrator.decode.progress import StreamProgress
from orchestrator.engine import EngineError, Failed, Finished, Tokens
from orchestrator.engine.errors import ErrorCode
from orchestrator.kv.lease import KvLease
from orchestrator.kv.release import KvReleaser
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.workers.retry import with_retries
from orchestrator.workers.routing import with_target_rank

log = logging.getLogger(__name__)


class MidStreamFailure(Exception):
    """A leg failed after it streamed tokens to the client: `error` is why, `worker` where (after any retries)."""

    def __init__(self, error: EngineError, worker) -> None:
        super().__init__(error.message)
        self.error, self.worker = error, worker


class DecodeLeg(NamedTuple):
    """One leg the decode stage streams: where, what, and what its retries and its KV depend on. A plain tuple
    (one is made per request and per migration): attrs' frozen class cost ~11k instructions to make, 1% of a
    request."""

    worker: Any  # the pool's Worker it goes to first (a retry may move it)
    request: g.GenerateRequest
    prompt_tokens: int  # the client's, for the usage when the engine does not report it
    on_chunk: Callable[[int], None] | None = None  # told the tokens of each batch sent (the token meter)
    lease: KvLease | None = None  # the KV this leg pulls (a split request's decode leg): the KV rule applies
    migration: int = 0  # the request's nth continuation (0: the planned leg)
    accepts: Callable[[Any], bool] | None = None  # which workers a retry may move it to (None: any of the role)
    target_rank: int | None = None  # the attention-DP rank routing chose on `worker`


class DecodeStage:
    def __init__(self, pool, metrics, releaser: KvReleaser, *, retries: int, cleanup_timeout_s: float):
        self.pool, self.metrics, self.releaser = pool, metrics, releaser
        self.retries, self.cleanup_timeout_s = retries, cleanup_timeout_s

    async def run(self, leg: DecodeLeg, progress: StreamProgress) -> None:
        """Stream `leg` to the request's sink until it finishes; `progress` tells the caller how far it got. It
        may carry on from an earlier leg of the same request (a migration: the `leg.migration`th).
        Raises EngineError when it failed before this leg streamed a token (after the retries), else
        MidStreamFailure."""
        worker, request = leg.worker, leg.request
        streamed_before = progress.completion_tokens
        if leg.lease is not None:
            progress.carry_logprobs(leg.lease.first_logprobs)  # the decode leg replays that token without its logprob
        failed_on = [worker]
        attempts = 0

        async def attempt(chosen) -> None:
            nonlocal attempts
            attempts += 1
            failed_on[0] = chosen
            with tracing.leg_span("decode", chosen.address, request.request_id, attempts, leg.migration) as span:
                await self._one_attempt(chosen, leg, progress, streamed_before,
                                        with_target_rank(span.metadata, leg.target_rank, chosen is worker))

        try:
            await with_retries(self.pool, worker, attempt, retries=self.retries, metrics=self.metrics,
                               what=f"{worker.role} leg {request.request_id}",
                               may_retry=lambda error: progress.completion_tokens == streamed_before,
                               accepts=leg.accepts)
        except EngineError as error:
            if progress.completion_tokens == streamed_before:
                raise
            raise MidStreamFailure(error, failed_on[0]) from error

    async def _one_attempt(self, worker, leg: DecodeLeg, progress: StreamProgress, streamed_before: int,
                           metadata) -> None:
        lease = leg.lease
        with self.pool.lease(worker):
            try:
                async with worker.client.generate(leg.request, metadata=metadata) as stream:
                    try:
                        await stream_output(stream, progress, worker=worker.address, on_chunk=leg.on_chunk)
                    except trio.Cancelled:
                        # The KV rule: cancelled before this leg's first token, the decode worker may be pulling
                        # the prefill's blocks right now, and nothing but a pulled session is proof they are
                        # free. So the stream is kept (shielded, bounded) until its first token, instead of
                        # leaving a session that no one will read. The cancellation is re-raised either way.
                        if lease is not None and not lease.settled \
                                and progress.completion_tokens == streamed_before and not progress.terminal:
                            await self._settle_on_cancel(stream, progress, lease, streamed_before)
                        raise
                    finally:
                        if lease is not None and progress.completion_tokens > streamed_before:
                            lease.pulled = True  # this leg streamed a token: its worker has the KV
            finally:
                # Leaving the `generate` block cancelled the RPC; an engine that had not finished is also told
                # to abort (shielded: this runs while the request is being cancelled, too).
                if progress.finished is None:
                    await self._abort(worker, leg.request.request_id, metadata)
        if not progress.terminal:
            raise EngineError("generation ended without a terminal event", worker=worker.address, rpc="Generate",
                              code=ErrorCode.ERROR_CODE_INTERNAL)
        # A decode leg's engine counts the blocks it pulled as cached: what the prefill found cached is the answer.
        await progress.finish_answer(progress.usage_prompt(leg.prompt_tokens),
                                     lease.cached_tokens if lease is not None else progress.cached_tokens)

    async def _abort(self, worker, request_id: str, metadata) -> None:
        # The RPC is cancelled already; Abort makes sure the engine lets go as well. Not to a worker the pool
        # found unresponsive: the Abort would hold up the retry or migration for its whole timeout, and the
        # connection the pool closed cancels the call on the worker's side when it reads again.
        if worker.unresponsive:
            log.info("abort of %s on %s skipped: the worker is unresponsive", request_id, worker.address)
            return
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + min(5.0, self.cleanup_timeout_s)
            try:
                await worker.client.abort(request_id=request_id, timeout=5.0, metadata=metadata)
            except EngineError as exc:
                log.info("abort of %s on %s: %s", request_id, worker.address, exc)

    async def _settle_on_cancel(self, stream, progress: StreamProgress, lease: KvLease, streamed_before: int
                                ) -> None:
        """KV rule for a cancellation between prefill_ready and the decode's first token."""
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self.cleanup_timeout_s
            while not progress.terminal and progress.completion_tokens == streamed_before:
                batch = await stream.next_batch()
                if not batch:
                    break
                if any(isinstance(e, Tokens) for e in batch):
                    progress.token_after_cancel()  # only "a token came": the client is gone, nothing is sent
                    self.metrics.kv_cleanups.labels("decode_first_token").inc()
                for event in batch:
                    if isinstance(event, Finished):
                        progress.finish_with(event)
                    elif isinstance(event, Failed):
                        log.info("decode leg of session %s failed during KV cleanup: %s", lease.session.session_id,
                                 event.error)
                        return
        if scope.cancelled_caught:
            log.warning("KV cleanup of session %s on %s timed out after %.0f s", lease.session.session_id,
                        lease.prefill_worker.address, self.cleanup_timeout_s)
