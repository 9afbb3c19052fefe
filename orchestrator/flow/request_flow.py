"""One planned request's legs: the prefill stage then the decode stage joined by a KV lease, or one whole leg,
and request migration when a worker fails mid-stream.

The flow calls down only: into the stages (orchestrator.prefill, orchestrator.decode), the KV releaser
(orchestrator.kv) and the worker pool, all handed to it in one `FlowCollaborators` by its creator (the
coordinator); it writes to the client only through the `OutputSink` it was given.

Migration is a loop in `RequestFlow.run`: a decode leg (or a whole leg) that fails after tokens went to the
client is not retried by its stage (the client has those tokens); the stage raises `MidStreamFailure`, and
`_migration` decides, in this one place, whether the request goes on elsewhere: the prompt plus the tokens
already sent, what is left of the budget, a new prefill where the path is split
(orchestrator.decode.legs.continuation_leg). The request's `StreamProgress` (its detokenizer too) carries on
across the passes, so the text neither repeats nor skips. At most `limits.migration_limit` times. A replacement
worker, a migration's or a stage's retry's, must be able to do what the planner checked of the first ones
(`_replacement_check`): on conditional mode's local path, run the whole request on a decode worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import trio

from orchestrator import tracing
from orchestrator.convert import serves_features
from orchestrator.decode import OutputSink, ReplayedStream, StreamProgress, continuation_leg, stream_output
from orchestrator.decode.stage import DecodeLeg, DecodeStage, MidStreamFailure
from orchestrator.engine import EngineError
from orchestrator.engine.errors import EngineCancelled, ErrorCode, StreamStalled
from orchestrator.errors import NoWorkerAvailable
from orchestrator.flow.plan import LOCAL, Plan, SplitPlan
from orchestrator.kv import HandoffError, KvLease, check_session, generation_leg
from orchestrator.kv.release import KvReleaser
from orchestrator.metrics import Metrics
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.prefill.stage import PrefillStage
from orchestrator.roles import Role
from orchestrator.tokenizer import IncrementalDetokenizer, ModelTokenizer
from orchestrator.workers.pool import Worker, WorkerPool

KV_SESSION_NOT_FOUND = ErrorCode.ERROR_CODE_KV_SESSION_NOT_FOUND  # (an enum member looked up once)
log = logging.getLogger(__name__)


@attrs.frozen
class FlowCollaborators:
    """What every request flow works with; built once by the coordinator and passed down."""

    pool: WorkerPool
    metrics: Metrics
    tokenizer: ModelTokenizer
    prefill: PrefillStage
    decode: DecodeStage
    releaser: KvReleaser
    migration_limit: int  # limits.migration_limit: continuations per request


class RequestFlow:
    def __init__(self, parts: FlowCollaborators, plan: Plan, sink: OutputSink, started: float, *,
                 keep_special_tokens: bool = False):
        self.parts, self.plan, self.started = parts, plan, started
        # what went to the sink so far, and the detokenizer: one text across the legs and any migration
        self.progress = StreamProgress(sink, IncrementalDetokenizer(parts.tokenizer, stop=plan.api.stop,
                                                                    keep_special=keep_special_tokens))
        self.migrations = 0
        self.failed: list[Worker] = []  # workers a leg of this request failed on mid-stream
        self._last_chunk: float | None = None
        self._token_meter = parts.metrics.token_meter(plan.path)
        self._handoff: tuple[float, KvLease] | None = None  # (prefill done, lease) of the first decode leg
        self.accepts = _replacement_check(plan)  # where a retry or a migration may take this request

    async def run(self) -> None:
        plan, metrics = self.plan, self.parts.metrics
        series = metrics.by_path[plan.path]
        series.prompt_tokens.inc(plan.prompt_tokens)
        leg, workers = plan.full, plan.workers
        try:
            while True:  # one pass per worker set: the planned one, then one per migration
                try:
                    await self._legs(leg, workers)
                    break
                except MidStreamFailure as failure:
                    error, failed_worker = failure.error, failure.worker
                # Decided outside the handler: an error raised from here carries no MidStreamFailure as context.
                continuation = await self._migration(error, failed_worker)
                if continuation is None:  # the answer was whole after all: finished here
                    break
                leg, workers = continuation
        finally:
            self._token_meter.flush()  # whatever way the request ends
        self._observe_stages()
        cached_tokens = self.progress.cached_tokens
        if cached_tokens:  # most requests have none: no counter call for them
            series.cached_tokens.inc(cached_tokens)

    async def _legs(self, leg: g.GenerateRequest, workers: tuple[Worker, ...]) -> None:
        if isinstance(self.plan, SplitPlan):
            await self._split(leg, *workers)
        else:
            await self._whole(workers[0], leg)

    def _on_chunk(self, tokens: int) -> None:
        now = trio.current_time()
        if self._last_chunk is None:
            self.parts.metrics.by_path[self.plan.path].ttft.observe(now - self.started)
            self._token_meter.add(None, tokens)
        else:
            self._token_meter.add(now - self._last_chunk, tokens)
        self._last_chunk = now

    async def _whole(self, worker: Worker, leg: g.GenerateRequest) -> None:
        await self.parts.decode.run(DecodeLeg(worker, leg, self.plan.prompt_tokens, self._on_chunk, None,
                                              self.migrations, self.accepts, self.plan.target_rank(worker)),
                                    self.progress)

    async def _split(self, full: g.GenerateRequest, prefill_worker: Worker, decode_worker: Worker) -> None:
        parts, progress = self.parts, self.progress
        result = await parts.prefill.run(prefill_worker, full, decode_worker, migration=self.migrations,
                                         accepts=self.accepts, target_rank=self.plan.target_rank(prefill_worker))
        prefill_done = trio.current_time()
        parts.metrics.by_stage["prefill"].observe(prefill_done - self.started)
        if result.lease is None:  # the one context token finished the request (EOS, a stop): it is the answer
            await stream_output(ReplayedStream(result.answer), progress, worker="prefill")
            parts.metrics.prefill_answers.inc()
            await progress.finish_answer(self.plan.prompt_tokens, progress.cached_tokens)
            return
        lease = result.lease
        # The KV rule: from here until a decode leg pulls the session (or the releaser does), the prefill
        # worker holds its blocks for us. Every way out of this method below either leaves the lease pulled
        # (a decode leg streamed a token) or releases it in the `finally`.
        try:
            check_session(lease.session)
        except HandoffError as exc:
            await parts.releaser.release_unpulled(lease, full, decode_worker)
            raise EngineError(str(exc), worker=lease.prefill_worker.address, rpc="Generate") from exc
        if progress.completion_tokens == 0:
            self._handoff = (prefill_done, lease)  # the request's first decode leg: its handoff is measured
        # No checkpoint between here and the decode stream: a cancellation lands in the decode stage,
        # which keeps the KV rule for the lease.
        streamed_before = progress.completion_tokens
        try:
            await parts.decode.run(DecodeLeg(decode_worker, generation_leg(full, lease.session),
                                             self.plan.prompt_tokens, self._on_chunk, lease, self.migrations,
                                             self.accepts), progress)
        except EngineError as error:
            if error.code != KV_SESSION_NOT_FOUND or progress.completion_tokens != streamed_before:
                raise
            # The prefill worker no longer holds the session: a decode leg pulled it and its worker died before
            # its first token reached us (the retry on another decode worker then finds it gone), or the prefill
            # worker restarted. Nothing is left to free, and nothing was streamed from it: the request goes on
            # as a migration does, with a new prefill.
            lease.released = True
            log.warning("request %s: the KV session of %s is gone (%s); prefilling again", self.plan.request_id,
                        lease.prefill_worker.address, error.message)
            raise MidStreamFailure(error, decode_worker) from None
        finally:
            if not lease.settled:  # no decode leg pulled it (failed, retries exhausted): do not strand it
                await parts.releaser.release_unpulled(lease, full, decode_worker)

    def _observe_stages(self) -> None:
        """The stage durations of a request that ended well (a migrated one included)."""
        by_stage, first_token_at = self.parts.metrics.by_stage, self.progress.first_token_at
        if not isinstance(self.plan, SplitPlan):
            by_stage["decode"].observe(trio.current_time() - self.started)
        elif self._handoff is not None and first_token_at is not None:
            prefill_done, lease = self._handoff
            # PrefillReady -> the decode leg's first token: the KV transfer and the decode's first step
            tracing.span_between("kv_handoff", prefill_done, first_token_at, kv_session=lease.session.session_id,
                                 prefill_worker=lease.prefill_worker.address)
            by_stage["kv_handoff"].observe(first_token_at - prefill_done)
            by_stage["decode"].observe(trio.current_time() - first_token_at)

    async def _migration(self, error: EngineError, failed_worker: Worker
                         ) -> tuple[g.GenerateRequest, tuple[Worker, ...]] | None:
        """After `failed_worker` failed mid-stream: the continuation leg and the workers to run it on, or None
        when the answer is whole and was finished here. Raises `error` when the request cannot go on."""
        parts, plan, progress = self.parts, self.plan, self.progress
        if isinstance(error, StreamStalled):
            raise error  # we read too slowly; another worker would be read just as slowly
        if isinstance(error, EngineCancelled) and error.timed_out:
            raise error  # the engine's time for it ran out: a continuation would only run out again
        stopping = plan.full.stopping
        if stopping.HasField("max_tokens") and len(progress.token_ids) >= stopping.max_tokens:
            # It failed after the last token, before its finish: the answer is whole (a continuation would
            # have to ask for one token more than the client's max_tokens).
            log.warning("request %s: %s failed after its last token (%s); finishing it here", plan.request_id,
                        failed_worker.address, error.code_name)
            # What the detokenizer held back (an incomplete character, a possible stop string) is text the
            # client is owed: stream_output would have sent it after a finish, and the error skipped that.
            if tail := progress.text_tail():
                await progress.sink.deltas(tail)
            await progress.finish_answer(plan.prompt_tokens, progress.cached_tokens, reason="length")
            return None
        if self.migrations >= parts.migration_limit:
            raise error
        self.failed.append(failed_worker)
        workers: tuple[Worker, ...]
        try:
            if isinstance(plan, SplitPlan):
                decode_worker = parts.pool.pick(Role.DECODE, exclude=tuple(self.failed), accepts=self.accepts)
                workers = (parts.pool.pick(Role.PREFILL, accepts=self.accepts), decode_worker)
            else:  # (local: only a decode worker that runs whole requests, through self.accepts)
                decode_worker = parts.pool.pick(failed_worker.role, exclude=tuple(self.failed), accepts=self.accepts)
                workers = (decode_worker,)
        except NoWorkerAvailable:
            raise error from None
        self.migrations += 1
        parts.metrics.migrations.labels(plan.path).inc()
        generated = list(progress.token_ids)
        log.warning("request %s: %s failed after %d tokens (%s); continuing on %s", plan.request_id,
                    failed_worker.address, len(generated), error.code_name, decode_worker.address)
        progress.resending(len(generated))
        return continuation_leg(plan.full, generated, self.migrations), workers


def _replacement_check(plan: Plan) -> Callable[[object], bool] | None:
    """What a worker that takes over the request (a retry, a migration) must be able to do, which the planner
    checked of the first workers only: serve the guide, the logprobs and the cache salt asked for, and on the local
    path run the whole request on a decode worker (the planner split a request whose decode worker cannot; a
    replacement leg is never split), and hold the request's LoRA adapter. None: nothing to check, any worker of
    the role will do (most requests)."""
    api = plan.api
    needs_features = api.guided is not None or bool(api.logprobs) or api.cache_salt is not None
    runs_whole = plan.path is LOCAL
    adapter = api.lora_adapter
    if not needs_features and not runs_whole and adapter is None:
        return None

    def accepts(worker) -> bool:
        if adapter is not None and not worker.adapters.holds(adapter):
            return False
        caps = worker.client.cached_capabilities if worker.client is not None else None
        if caps is None:
            # Not discovered yet (discovery runs before a worker is READY, and may fail after). Features: the
            # benefit of the doubt, its engine refuses what it cannot do (but for a guide the sibling server
            # would ignore). A whole request: no, the sibling server's refusal is not retryable and would end
            # the request with that error instead of the one it migrated from. A cache salt: no, an engine that
            # ignored it would share the tenant's blocks.
            return not runs_whole and api.cache_salt is None
        if runs_whole and not caps.runs_whole_requests_on_decode:
            return False
        return not needs_features or serves_features(api, caps)

    return accepts
