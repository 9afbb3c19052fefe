"""The per-request flow: plan the legs, then run them in one trio nursery per request.

    plan()     tokenize, choose workers, apply capability gating and the context-window rule,
               build the engine request (pure conversion lives in orchestrator.convert);
    execute()  open the request's nursery (it also runs the caller's disconnect watcher), run
               aggregated / disaggregated / local legs, and keep the cancellation rules:

- any cancellation (client disconnect, deadline, shutdown) cancels the RPCs and sends
  Control.Abort to every worker still holding the request;
- KV rule (orchestrator.disagg.unpulled_session_action): once a prefill returned a kv_session, its
  blocks must not be stranded. If the prefill worker can abort sessions (supports_abort_cleanup) the
  session is aborted; otherwise the decode leg is kept (shielded, bounded) until its first token - it
  pulls the KV - and a session no decode leg will read is pulled by a one-token release leg.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

import attrs
import trio

from orchestrator import disagg
from orchestrator.config import Config
from orchestrator.convert import (
    ApiError,
    ApiRequest,
    check_media_capability,
    check_media_options,
    check_media_sources,
    full_leg,
    resolve_limits,
)
from orchestrator.decode import OutputSink, StreamState, finish_reason, stream_output
from orchestrator.engine import (
    DiscoveryFailed,
    EngineError,
    Failed,
    Finished,
    Tokens,
    WorkerCapabilities,
    WorkerUnavailable,
)
from orchestrator.engine.errors import ErrorCode
from orchestrator.metrics import Metrics
from orchestrator.openengine.v1 import generation_pb2 as g
from orchestrator.openengine.v1 import kv_pb2
from orchestrator.pool import Worker, WorkerPool
from orchestrator.prefill import run_prefill
from orchestrator.tokenizer import IncrementalDetokenizer, ModelTokenizer, TemplateError

log = logging.getLogger(__name__)


@attrs.frozen
class Plan:
    request_id: str
    api: ApiRequest
    path: str  # "aggregated" | "disaggregated" | "local"
    full: g.GenerateRequest
    prompt_tokens: int  # text tokens; images add more engine-side
    workers: tuple[Worker, ...]  # (aggregated,) | (prefill, decode) | (decode,)
    caps: tuple[WorkerCapabilities, ...]


class Coordinator:
    def __init__(self, config: Config, pool: WorkerPool, tokenizer: ModelTokenizer, metrics: Metrics):
        self.config = config
        self.pool = pool
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.model_names = {config.model.name, *config.model.aliases}

    # ---- planning ----------------------------------------------------------------------------------
    def prompt_ids(self, api: ApiRequest) -> list[int]:
        if api.prompt_ids is not None:
            return list(api.prompt_ids)
        if api.kind == "completion":
            return self.tokenizer.encode(api.prompt or "")
        try:
            text = self.tokenizer.render_chat([m.as_template_dict() for m in api.messages])
        except TemplateError as exc:
            raise ApiError(400, f"messages: {exc}", param="messages") from exc
        return self.tokenizer.encode(text)

    async def plan(self, api: ApiRequest, request_id: str) -> Plan:
        if api.model not in self.model_names:
            raise ApiError(404, f"the model {api.model!r} does not exist; this server serves "
                                f"{', '.join(sorted(self.model_names))}", param="model", code="model_not_found")
        prompt_ids = self.prompt_ids(api)
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", param="messages" if api.kind == "chat" else "prompt")
        mode = self.config.mode
        if mode == "aggregated":
            path, roles = "aggregated", ("aggregated",)
        elif (mode == "conditional" and not api.images
              and len(prompt_ids) <= self.config.conditional.max_local_prefill_length):
            path, roles = "local", ("decode",)
        else:
            path, roles = "disaggregated", ("prefill", "decode")
        workers = tuple(self.pool.pick(role) for role in roles)
        caps = tuple([await self._capabilities(w) for w in workers])
        if path == "local" and not caps[0].runs_whole_requests_on_decode:
            # A revision-3 decode worker refuses a request without a KV session: prefill it elsewhere.
            path, workers = "disaggregated", (self.pool.pick("prefill"), *workers)
            caps = (await self._capabilities(workers[0]), *caps)
        if api.images:
            split = path == "disaggregated"
            check_media_capability(api, [(w.role, *c.image_support(split)) for w, c in zip(workers, caps)])
            check_media_sources(api, [(w.role, c.multimodal.source_types if c.multimodal else frozenset())
                                      for w, c in zip(workers, caps)])
        check_media_options(api, [(w.role, c.schema_revision >= 3 and c.multimodal is not None
                                   and c.multimodal.per_request_media_options) for w, c in zip(workers, caps)])
        windows = [c.max_context_length for c in caps if c.max_context_length]
        outputs = [c.max_output_tokens for c in caps if c.max_output_tokens]
        limits = resolve_limits(api, prompt_tokens=len(prompt_ids), configured_window=self.config.model.context_window,
                                engine_window=min(windows) if windows else None,
                                max_output_tokens=min(outputs) if outputs else None)
        full = full_leg(api, request_id=request_id, model=caps[-1].model_id or api.model, prompt_ids=prompt_ids,
                        limits=limits)
        return Plan(request_id, api, path, full, len(prompt_ids), workers, caps)

    async def _capabilities(self, worker: Worker) -> WorkerCapabilities:
        try:
            return await worker.client.capabilities()
        except DiscoveryFailed as exc:
            raise ApiError(503, f"capability discovery of {worker.role} worker {worker.address} failed: "
                                f"{exc.message}", code="worker_discovery_failed", retry_after=1) from exc
        except (EngineError, AttributeError) as exc:
            raise ApiError(503, f"{worker.role} worker {worker.address} is not available", retry_after=1) from exc

    # ---- execution ---------------------------------------------------------------------------------
    async def execute(self, plan: Plan, sink: OutputSink, *,
                      watch: Callable[[trio.CancelScope], Awaitable[None]] | None = None) -> None:
        """Run the plan in the request's own nursery. Raises ApiError/EngineError; trio.Cancelled if the
        watcher or an outer scope cancelled it (after every worker was released)."""
        started = trio.current_time()
        try:
            async with trio.open_nursery() as request_nursery:
                if watch is not None:
                    request_nursery.start_soon(watch, request_nursery.cancel_scope)
                try:
                    with trio.fail_after(self.config.limits.request_timeout_s):
                        if plan.path == "disaggregated":
                            await self._disaggregated(plan, sink, started)
                        else:
                            await self._single_leg(plan, sink, started)
                except trio.TooSlowError:
                    raise ApiError(504, f"the request did not finish within "
                                        f"{self.config.limits.request_timeout_s:g} s", code="timeout") from None
                finally:
                    request_nursery.cancel_scope.cancel()  # stop the watcher
        except BaseExceptionGroup as group:
            raise _sole_error(group) from None

    def _detokenizer(self, plan: Plan) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, stop=plan.api.stop)

    async def _single_leg(self, plan: Plan, sink: OutputSink, started: float) -> None:
        (worker,) = plan.workers
        state = StreamState()
        await self._generate(worker, plan.full, plan, sink, state, started, first_token_matters=False)
        self.metrics.stage.labels("decode").observe(trio.current_time() - started)

    async def _disaggregated(self, plan: Plan, sink: OutputSink, started: float) -> None:
        _, decode_worker = plan.workers
        prefill_caps = plan.caps[0]

        async def release(prefill_worker: Worker, session: kv_pb2.KvSessionRef) -> None:
            await self.release_unpulled(prefill_worker, prefill_caps, plan.full, session, decode_worker)

        prefill_worker, outcome = await run_prefill(
            self.pool, plan.workers[0], disagg.context_only_leg(plan.full),
            retries=self.config.limits.prefill_retries, cleanup_timeout=self.config.limits.kv_cleanup_timeout_s,
            metrics=self.metrics, release_session=release)
        prefill_done = trio.current_time()
        self.metrics.stage.labels("prefill").observe(prefill_done - started)
        if outcome.session is None:  # the one context token finished the request (EOS, a stop): it is the answer
            await self._answer_from_prefill(plan, outcome.answer, sink, started)
            return
        session = outcome.session
        try:
            disagg.check_session(session)
        except disagg.HandoffError as exc:
            await release(prefill_worker, session)
            raise EngineError(str(exc), worker=prefill_worker.address, rpc="Generate") from exc
        # No checkpoint between here and the decode stream: a cancellation lands inside _generate,
        # where the KV rule is kept.
        state = StreamState()
        leg = disagg.generation_leg(plan.full, session)
        try:
            await self._generate(decode_worker, leg, plan, sink, state, started, first_token_matters=True,
                                 prefill=(prefill_worker, prefill_caps, session))
        except EngineError:
            if state.first_token_at is None:  # no decode pulled the session: do not strand its blocks
                with trio.CancelScope(shield=True):
                    await release(prefill_worker, session)
            raise
        if state.first_token_at is not None:
            self.metrics.stage.labels("kv_handoff").observe(state.first_token_at - prefill_done)
            self.metrics.stage.labels("decode").observe(trio.current_time() - state.first_token_at)

    async def _answer_from_prefill(self, plan: Plan, events, sink: OutputSink, started: float) -> None:
        state = StreamState()
        await stream_output(ReplayedStream(events), sink, self._detokenizer(plan), state, worker="prefill")
        if state.first_token_at is not None:
            self.metrics.ttft.labels(plan.path).observe(state.first_token_at - started)
        self.metrics.prefill_answers.inc()
        await sink.finish(finish_reason(state), state.prompt_tokens or plan.prompt_tokens, state.completion_tokens)

    async def _generate(self, worker: Worker, leg: g.GenerateRequest, plan: Plan, sink: OutputSink,
                        state: StreamState, started: float, *, first_token_matters: bool, prefill=None) -> None:
        """Run a generation leg; a retryable failure before anything was streamed moves it to another
        worker of the same role (a decode leg can pull the same KV session from there)."""
        tried = [worker]
        while True:
            try:
                await self._generate_once(worker, leg, plan, sink, state, started,
                                          first_token_matters=first_token_matters, prefill=prefill)
                return
            except EngineError as exc:
                if (state.first_token_at is not None or not exc.retryable
                        or len(tried) > self.config.limits.decode_retries):
                    raise
                try:
                    worker = self.pool.pick(worker.role, exclude=tuple(tried))
                except ApiError:
                    raise exc from None
                tried.append(worker)
                self.metrics.retries.labels(worker.role).inc()
                log.warning("%s leg %s failed before its first token (%s); retrying on %s", worker.role,
                            leg.request_id, exc.code_name, worker.address)

    async def _generate_once(self, worker: Worker, leg: g.GenerateRequest, plan: Plan, sink: OutputSink,
                             state: StreamState, started: float, *, first_token_matters: bool, prefill=None) -> None:
        mode = plan.path
        last_chunk = [None]

        def on_chunk() -> None:
            now = trio.current_time()
            if last_chunk[0] is None:
                self.metrics.ttft.labels(mode).observe(now - started)
            else:
                self.metrics.itl.labels(mode).observe(now - last_chunk[0])
            last_chunk[0] = now

        detokenizer = self._detokenizer(plan)
        cleanup_timeout = self.config.limits.kv_cleanup_timeout_s
        with self.pool.lease(worker):
            try:
                async with worker.client.generate(leg) as stream:
                    try:
                        await stream_output(stream, sink, detokenizer, state, worker=worker.address,
                                            on_chunk=on_chunk)
                    except trio.Cancelled:
                        if first_token_matters and state.first_token_at is None and not state.terminal:
                            await self._keep_until_first_token(stream, state, worker, prefill, cleanup_timeout)
                        raise
            except WorkerUnavailable as exc:
                self.pool.report_unreachable(worker, exc)
                self.metrics.engine_errors.labels(exc.code_name).inc()
                raise
            except EngineError as exc:
                self.metrics.engine_errors.labels(exc.code_name).inc()
                raise
            finally:
                if state.finished is None:
                    # The RPC is cancelled already; Abort makes sure the engine lets go as well.
                    with trio.CancelScope(shield=True) as scope:
                        scope.deadline = trio.current_time() + min(5.0, cleanup_timeout)
                        try:
                            await worker.client.abort(request_id=leg.request_id, timeout=5.0)
                        except EngineError as exc:
                            log.info("abort of %s on %s: %s", leg.request_id, worker.address, exc)
        if not state.terminal:
            raise EngineError("generation ended without a terminal event", worker=worker.address, rpc="Generate",
                              code=ErrorCode.ERROR_CODE_INTERNAL)
        await sink.finish(finish_reason(state), state.prompt_tokens or plan.prompt_tokens, state.completion_tokens)

    async def _keep_until_first_token(self, stream, state: StreamState, decode_worker: Worker, prefill,
                                      timeout: float) -> None:
        """KV rule for a cancellation between prefill_ready and the decode's first token."""
        prefill_worker, prefill_caps, session = prefill
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + timeout
            action = disagg.unpulled_session_action(supports_abort_cleanup=prefill_caps.supports_abort_cleanup,
                                                    decode_leg_in_flight=True)
            if action is disagg.KvAction.ABORT_SESSION and await self._abort_session(prefill_worker, session):
                return
            while not state.terminal and state.first_token_at is None:
                batch = await stream.next_batch()
                if not batch:
                    break
                if any(isinstance(e, Tokens) for e in batch):
                    state.first_token_at = trio.current_time()
                    self.metrics.kv_cleanups.labels("decode_first_token").inc()
                for event in batch:
                    if isinstance(event, Finished):
                        state.finished = event
                    elif isinstance(event, Failed):
                        log.info("decode leg %s failed during KV cleanup: %s", session.session_id, event.error)
                        return
        if scope.cancelled_caught:
            log.warning("KV cleanup of session %s on %s timed out after %.0f s", session.session_id,
                        prefill_worker.address, timeout)

    async def _abort_session(self, prefill_worker: Worker, session: kv_pb2.KvSessionRef) -> bool:
        try:
            await prefill_worker.client.abort(kv_session=session, timeout=5.0)
        except EngineError as exc:  # e.g. UNIMPLEMENTED although the worker claimed abort cleanup
            log.warning("abort of kv session %s on %s failed (%s); pulling it instead", session.session_id,
                        prefill_worker.address, exc)
            return False
        self.metrics.kv_cleanups.labels("abort_session").inc()
        return True

    async def release_unpulled(self, prefill_worker: Worker, prefill_caps: WorkerCapabilities,
                               full: g.GenerateRequest, session: kv_pb2.KvSessionRef, decode_worker: Worker) -> None:
        """Free a session no decode leg will read (cancelled, failed, retries exhausted): abort it, or pull it
        with a one-token release leg on a decode worker (the request's, or another routable one)."""
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self.config.limits.kv_cleanup_timeout_s
            action = disagg.unpulled_session_action(supports_abort_cleanup=prefill_caps.supports_abort_cleanup,
                                                    decode_leg_in_flight=False)
            if action is disagg.KvAction.ABORT_SESSION and await self._abort_session(prefill_worker, session):
                return
            candidates = [decode_worker] if decode_worker.routable else []
            try:
                candidates.append(self.pool.pick("decode", exclude=tuple(candidates)))
            except ApiError:
                pass
            leg = disagg.release_leg(full, session)
            for worker in candidates:
                with self.pool.lease(worker):
                    try:
                        async with worker.client.generate(leg) as stream:
                            while batch := await stream.next_batch():
                                failed = next((e for e in batch if isinstance(e, Failed)), None)
                                if failed is not None:
                                    raise failed.error
                    except EngineError as exc:
                        log.warning("KV release of session %s via %s failed: %s", session.session_id,
                                    worker.address, exc)
                        continue
                self.metrics.kv_cleanups.labels("decode_pull").inc()
                return
        log.warning("kv session %s on %s could not be released (%s): its blocks stay held until the worker's "
                    "transfer timeout or restart", session.session_id, prefill_worker.address,
                    "timed out" if scope.cancelled_caught else "no decode worker could pull it")


class ReplayedStream:
    """Events already received, read like a generate stream (the prefill leg's answer)."""

    def __init__(self, events) -> None:
        self._batches = [list(events)]

    async def next_batch(self) -> list:
        await trio.lowlevel.checkpoint()
        return self._batches.pop() if self._batches else []


def _sole_error(group: BaseExceptionGroup) -> BaseException:
    """The request nursery runs one flow and one watcher that never fails: unwrap their one error."""
    errors = group.exceptions
    while len(errors) == 1 and isinstance(errors[0], BaseExceptionGroup):
        errors = errors[0].exceptions
    return errors[0] if len(errors) == 1 else group


def new_request_id(given: str | None) -> str:
    """Honour the client's X-Request-Id when it is sane; engine legs get a unique suffix."""
    if given and len(given) <= 128 and given.isprintable():
        return given
    return f"req-{time.time_ns():x}"
