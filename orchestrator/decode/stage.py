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

import trio

from orchestrator import tracing
from orchestrator.decode.deltas import OutputSink, StreamState
from orchestrator.decode.output import finish_answer, stream_output
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


class DecodeStage:
    def __init__(self, pool, metrics, releaser: KvReleaser, *, retries: int, cleanup_timeout_s: float):
        self.pool, self.metrics, self.releaser = pool, metrics, releaser
        self.retries, self.cleanup_timeout_s = retries, cleanup_timeout_s

    async def run(self, worker, leg: g.GenerateRequest, sink: OutputSink, state: StreamState, *, detokenizer,
                  on_chunk: Callable[[int], None], prompt_tokens: int, lease: KvLease | None = None,
                  migration: int = 0, accepts: Callable[[object], bool] | None = None,
                  target_rank: int | None = None) -> None:
        """Stream `leg` into `sink` until it finishes; `state` tells the caller how far it got. `state` and
        `detokenizer` may carry on from an earlier leg of the same request (a migration: the `migration`th).
        Raises EngineError when it failed before this leg streamed a token (after the retries), else
        MidStreamFailure."""
        streamed_before = state.completion_tokens
        if lease is not None and streamed_before == 0:
            state.carried_logprobs = lease.first_logprobs  # the decode leg replays that token without its logprob
        failed_on = [worker]
        attempts = 0

        async def attempt(chosen) -> None:
            nonlocal attempts
            attempts += 1
            failed_on[0] = chosen
            with tracing.leg_span("decode", chosen.address, leg.request_id, attempts, migration) as span:
                await self._one_attempt(chosen, leg, sink, state, detokenizer, on_chunk, prompt_tokens, lease,
                                        streamed_before, with_target_rank(span.metadata, target_rank, chosen is worker))

        try:
            await with_retries(self.pool, worker, attempt, retries=self.retries, metrics=self.metrics,
                               what=f"{worker.role} leg {leg.request_id}",
                               may_retry=lambda error: state.completion_tokens == streamed_before, accepts=accepts)
        except EngineError as error:
            if state.completion_tokens == streamed_before:
                raise
            raise MidStreamFailure(error, failed_on[0]) from error

    async def _one_attempt(self, worker, leg: g.GenerateRequest, sink: OutputSink, state: StreamState, detokenizer,
                           on_chunk, prompt_tokens: int, lease: KvLease | None, streamed_before: int,
                           metadata) -> None:
        with self.pool.lease(worker):
            try:
                async with worker.client.generate(leg, metadata=metadata) as stream:
                    try:
                        await stream_output(stream, sink, detokenizer, state, worker=worker.address,
                                            on_chunk=on_chunk)
                    except trio.Cancelled:
                        # The KV rule: cancelled before this leg's first token, the decode worker may be pulling
                        # the prefill's blocks right now, and nothing but a pulled session is proof they are
                        # free. So the stream is kept (shielded, bounded) until its first token, instead of
                        # leaving a session that no one will read. The cancellation is re-raised either way.
                        if lease is not None and not lease.settled and state.completion_tokens == streamed_before \
                                and not state.terminal:
                            await self._settle_on_cancel(stream, state, lease, streamed_before)
                        raise
                    finally:
                        if lease is not None and state.completion_tokens > streamed_before:
                            lease.pulled = True  # this leg streamed a token: its worker has the KV
            finally:
                # Leaving the `generate` block cancelled the RPC; an engine that had not finished is also told
                # to abort (shielded: this runs while the request is being cancelled, too).
                if state.finished is None:
                    await self._abort(worker, leg.request_id, metadata)
        if not state.terminal:
            raise EngineError("generation ended without a terminal event", worker=worker.address, rpc="Generate",
                              code=ErrorCode.ERROR_CODE_INTERNAL)
        engine_prompt = state.prompt_tokens - state.resent_tokens if state.prompt_tokens else None
        prompt = engine_prompt or prompt_tokens
        # A decode leg's engine counts the blocks it pulled as cached: what the prefill found cached is the answer.
        await finish_answer(sink, state, prompt, lease.cached_tokens if lease is not None else state.cached_tokens)

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

    async def _settle_on_cancel(self, stream, state: StreamState, lease: KvLease, streamed_before: int) -> None:
        """KV rule for a cancellation between prefill_ready and the decode's first token."""
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self.cleanup_timeout_s
            while not state.terminal and state.completion_tokens == streamed_before:
                batch = await stream.next_batch()
                if not batch:
                    break
                if any(isinstance(e, Tokens) for e in batch):
                    state.first_token_at = state.first_token_at or trio.current_time()
                    state.completion_tokens += 1  # only "a token came": the client is gone, nothing is sent
                    self.metrics.kv_cleanups.labels("decode_first_token").inc()
                for event in batch:
                    if isinstance(event, Finished):
                        state.finished = event
                    elif isinstance(event, Failed):
                        log.info("decode leg of session %s failed during KV cleanup: %s", lease.session.session_id,
                                 event.error)
                        return
        if scope.cancelled_caught:
            log.warning("KV cleanup of session %s on %s timed out after %.0f s", lease.session.session_id,
                        lease.prefill_worker.address, self.cleanup_timeout_s)
