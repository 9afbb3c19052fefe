"""One planned request's legs: the prefill stage then the decode stage joined by a KV lease, or one whole leg,
and request migration when a worker fails mid-stream.

Migration: a decode leg (or a whole leg) that fails after tokens were streamed is continued on another
worker, invisibly to the client: the prompt plus the tokens already sent, what is left of the budget, a
new prefill where the path is split (orchestrator.decode.legs.continuation_leg). The output state and the
detokenizer carry on, so the text neither repeats nor skips. Up to `limits.migration_limit` times.
"""

from __future__ import annotations

import logging

import trio

from orchestrator.convert import serves_features
from orchestrator.decode import (
    ReplayedStream,
    StreamState,
    continuation_leg,
    finish_reason,
    generation_leg,
    stream_output,
)
from orchestrator.engine import EngineError
from orchestrator.engine.errors import StreamStalled
from orchestrator.errors import NoWorkerAvailable
from orchestrator.kv import HandoffError, check_session
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.tokenizer import IncrementalDetokenizer
from orchestrator import tracing

log = logging.getLogger(__name__)


class RequestFlow:
    def __init__(self, coordinator, plan, sink, started: float):
        self.c, self.plan, self.sink, self.started = coordinator, plan, sink, started
        self.state = StreamState()
        self.detokenizer = IncrementalDetokenizer(coordinator.tokenizer, stop=plan.api.stop)
        self.migrations = 0
        self.failed: list = []  # workers a leg of this request failed on
        self._last_chunk: float | None = None
        self._token_meter = coordinator.metrics.token_meter(plan.path)
        # Where a retry or a migration may take this request: the planner checked the guide and logprobs
        # against the first workers only; a replacement must serve them too. None: nothing to check.
        api = plan.api
        self.accepts = None if api.guided is None and not api.logprobs else (
            lambda worker: _serves(api, worker))

    async def run(self) -> None:
        series = self.c.metrics.by_path[self.plan.path]
        series.prompt_tokens.inc(self.plan.prompt_tokens)
        try:
            if self.plan.path == "disaggregated":
                await self._split(self.plan.full, *self.plan.workers)
            else:
                await self._whole(self.plan.workers[0], self.plan.full)
                self.c.metrics.by_stage["decode"].observe(trio.current_time() - self.started)
        finally:
            self._token_meter.flush()  # whatever way the request ends
        if self.state.cached_tokens:  # most requests have none: no counter call for them
            series.cached_tokens.inc(self.state.cached_tokens)

    def _on_chunk(self, tokens: int) -> None:
        now = trio.current_time()
        if self._last_chunk is None:
            self.c.metrics.by_path[self.plan.path].ttft.observe(now - self.started)
            self._token_meter.add(None, tokens)
        else:
            self._token_meter.add(now - self._last_chunk, tokens)
        self._last_chunk = now

    async def _whole(self, worker, leg: g.GenerateRequest) -> None:
        await self.c.decode.run(worker, leg, self.sink, self.state, detokenizer=self.detokenizer,
                                on_chunk=self._on_chunk, prompt_tokens=self.plan.prompt_tokens, migrate=self.migrate,
                                migration=self.migrations, accepts=self.accepts,
                                target_rank=self.plan.target_ranks.get(worker))

    async def _split(self, full: g.GenerateRequest, prefill_worker, decode_worker) -> None:
        c, state = self.c, self.state
        result = await c.prefill.run(prefill_worker, full, decode_worker, migration=self.migrations,
                                     accepts=self.accepts, target_rank=self.plan.target_ranks.get(prefill_worker))
        prefill_done = trio.current_time()
        c.metrics.by_stage["prefill"].observe(prefill_done - self.started)
        if result.lease is None:  # the one context token finished the request (EOS, a stop): it is the answer
            await stream_output(ReplayedStream(result.answer), self.sink, self.detokenizer, state, worker="prefill")
            c.metrics.prefill_answers.inc()
            cached = state.settle_cached(self.plan.prompt_tokens, state.cached_tokens)
            await self.sink.finish(finish_reason(state), self.plan.prompt_tokens, state.completion_tokens,
                                   cached_tokens=cached)
            return
        lease = result.lease
        try:
            check_session(lease.session)
        except HandoffError as exc:
            await c.releaser.release_unpulled(lease, full, decode_worker)
            raise EngineError(str(exc), worker=lease.prefill_worker.address, rpc="Generate") from exc
        # No checkpoint between here and the decode stream: a cancellation lands in the decode stage,
        # which keeps the KV rule for the lease.
        streamed_before = state.completion_tokens
        try:
            await c.decode.run(decode_worker, generation_leg(full, lease.session), self.sink, state,
                               detokenizer=self.detokenizer, on_chunk=self._on_chunk,
                               prompt_tokens=self.plan.prompt_tokens, lease=lease, migrate=self.migrate,
                               migration=self.migrations, accepts=self.accepts)
        finally:
            if not lease.settled:  # no decode leg pulled it (failed, retries exhausted): do not strand it
                await c.releaser.release_unpulled(lease, full, decode_worker)
        if state.first_token_at is not None and streamed_before == 0:
            # PrefillReady -> the decode leg's first token: the KV transfer and the decode's first step
            tracing.span_between("kv_handoff", prefill_done, state.first_token_at, kv_session=lease.session.session_id,
                                 prefill_worker=lease.prefill_worker.address)
            c.metrics.by_stage["kv_handoff"].observe(state.first_token_at - prefill_done)
            c.metrics.by_stage["decode"].observe(trio.current_time() - state.first_token_at)

    async def migrate(self, error: EngineError, failed_worker) -> None:
        """Continue the request elsewhere after `failed_worker` failed mid-stream (or let `error` stand)."""
        c, plan = self.c, self.plan
        if isinstance(error, StreamStalled):
            raise error  # we read too slowly; another worker would be read just as slowly
        stopping = plan.full.stopping
        if stopping.HasField("max_tokens") and len(self.state.token_ids) >= stopping.max_tokens:
            # It failed after the last token, before its finish: the answer is whole (a continuation would
            # have to ask for one token more than the client's max_tokens).
            log.warning("request %s: %s failed after its last token (%s); finishing it here", plan.request_id,
                        failed_worker.address, error.code_name)
            cached = self.state.settle_cached(plan.prompt_tokens, self.state.cached_tokens)
            await self.sink.finish("length", plan.prompt_tokens, self.state.completion_tokens, cached_tokens=cached)
            return
        if self.migrations >= c.config.limits.migration_limit:
            raise error
        self.failed.append(failed_worker)
        try:
            if plan.path == "disaggregated":
                decode_worker = c.pool.pick("decode", exclude=tuple(self.failed), accepts=self.accepts)
                prefill_worker = c.pool.pick("prefill", accepts=self.accepts)
            else:
                decode_worker = c.pool.pick(failed_worker.role, exclude=tuple(self.failed), accepts=self.accepts)
        except NoWorkerAvailable:
            raise error from None
        self.migrations += 1
        c.metrics.migrations.labels(plan.path).inc()
        generated = list(self.state.token_ids)
        log.warning("request %s: %s failed after %d tokens (%s); continuing on %s", plan.request_id,
                    failed_worker.address, len(generated), error.code_name, decode_worker.address)
        self.state.resent_tokens = len(generated)
        leg = continuation_leg(plan.full, generated, self.migrations)
        if plan.path == "disaggregated":
            await self._split(leg, prefill_worker, decode_worker)
        else:
            await self._whole(decode_worker, leg)


def _serves(api, worker) -> bool:
    """A worker whose capabilities are not known yet is given the benefit of the doubt (its engine refuses what
    it cannot do, except a guide the sibling server would ignore: discovery runs before a worker is READY)."""
    caps = worker.client.cached_capabilities if worker.client is not None else None
    return caps is None or serves_features(api, caps)
