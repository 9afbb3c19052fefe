"""Distributed tracing: OpenTelemetry spans exported over OTLP/HTTP, off unless the config has `tracing:`.

One trace per request, continued from the client's W3C `traceparent` when it sends one:

    POST /v1/chat/completions          (server span; frontend/app.py)
      plan                             chat template, tokenizer, worker choice
      prefill                          one per attempt: worker, attempt, retry, migration (prefill/stage.py)
      kv_handoff                       PrefillReady -> the decode leg's first token (flow.py)
      decode                           one per attempt, likewise (decode/stage.py)
      kv_release                       a session no decode leg pulled (kv/release.py)

Every leg's engine call carries its span as gRPC metadata `traceparent` (and `tracestate`), the keys
TensorRT-LLM's OpenEngine servicer copies into `trace_headers` for `generate_async`, so the engine's own
spans join the trace under the leg.

Off costs nothing per request: App uses DISABLED, whose request() and span() return one shared no-op
object; no OpenTelemetry module is imported. On, the current request's tracer travels in a context
variable (trio gives each task its own copy), so the stages open their spans without a parameter threaded
through every call, and OpenTelemetry's own context makes each span the parent of those opened inside it.
"""

from __future__ import annotations

import contextvars
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

import trio

log = logging.getLogger("orchestrator.tracing")

_TRACER: contextvars.ContextVar[Any] = contextvars.ContextVar("orchestrator_tracer", default=None)
# How long the exit waits for the spans still batched to reach the collector. The exporter's own shutdown has
# no overall deadline (each attempt waits its timeout, then backs off and retries), so a collector that is
# down or never answers held the exit for up to 30 s; past this, what is left is dropped.
SHUTDOWN_FLUSH_S = 2.0


class _NoSpan:
    """What every tracing call returns while tracing is off: one shared object that does nothing."""

    metadata: tuple[tuple[str, str], ...] = ()  # no trace context for the engine

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc_info) -> None:
        return None

    def set(self, key: str, value) -> None:
        pass


NO_SPAN = _NoSpan()


class _NothingToFlush:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc_info) -> None:
        return None


class _Disabled:
    enabled = False

    def request(self, scope: dict, api_key: str | None) -> _NoSpan:
        return NO_SPAN

    def running(self) -> _NothingToFlush:
        return _NothingToFlush()


DISABLED = _Disabled()


def span(name: str, **attributes) -> _NoSpan | Span:
    """A child of the current span of this request's trace (a context manager); NO_SPAN when not tracing."""
    tracer = _TRACER.get()
    if tracer is None:
        return NO_SPAN
    return Span(tracer.start_span(name, attributes=_clean(attributes)))


def leg_span(name: str, worker: str, request_id: str, attempt: int = 1, migration: int = 0) -> _NoSpan | Span:
    """The span of one engine leg (an attempt of it) on `worker`; its `metadata` goes with the engine call."""
    tracer = _TRACER.get()
    if tracer is None:
        return NO_SPAN
    from opentelemetry.trace import SpanKind

    return Span(tracer.start_span(name, kind=SpanKind.CLIENT, attributes={
        "orchestrator.worker": worker, "orchestrator.engine_request_id": request_id, "orchestrator.attempt": attempt,
        "orchestrator.retry": attempt > 1, "orchestrator.migration": migration}))


def span_between(name: str, start: float, end: float, **attributes) -> None:
    """A finished child span from `start` to `end`, two readings of trio's clock (e.g. a hand-off measured by
    its two ends); `attributes` are named orchestrator.KEY."""
    tracer = _TRACER.get()
    if tracer is None:
        return
    now_ns, now = time.time_ns(), trio.current_time()
    attributes = {f"orchestrator.{key}": value for key, value in attributes.items() if value is not None}
    tracer.start_span(name, attributes=attributes, start_time=now_ns - int((now - start) * 1e9)).end(
        end_time=now_ns - int((now - end) * 1e9))


def _clean(attributes: dict) -> dict:
    """OpenTelemetry drops None values with a warning each time: leave them out."""
    return {key: value for key, value in attributes.items() if value is not None}


class Span:
    """An OpenTelemetry span made current while the block runs; `metadata` is its trace context as the gRPC
    metadata of an engine call."""

    __slots__ = ("otel", "metadata", "_use")

    def __init__(self, otel_span) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.otel = otel_span
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(otel_span))
        self.metadata = tuple(carrier.items())
        self._use = trace.use_span(otel_span, end_on_exit=True)

    def __enter__(self) -> Span:
        self._use.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._use.__exit__(*exc_info)

    def set(self, key: str, value) -> None:
        """One attribute (positional: no keyword dict to build on the request path when tracing is off)."""
        if value is not None:
            self.otel.set_attribute(key, value)


class Tracing:
    """One orchestrator's tracer: its own provider (several orchestrators may share a test process), sampling
    `sample_ratio` of the traces that start here and following a client's sampling decision, spans batched
    to the OTLP/HTTP endpoint on the SDK's exporter thread."""

    enabled = True

    def __init__(self, config, *, exporter=None) -> None:
        """`exporter`: a span exporter to use at once instead of batching to `config.endpoint` (tests)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from orchestrator import __version__

        # shutdown_on_exit=False: `running` shuts the provider down, bounded; the SDK's own atexit hook would
        # wait for the collector again, unbounded, after the event loop is gone
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name, "service.version": __version__}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)), shutdown_on_exit=False)
        self.endpoint = config.endpoint
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint))
                                         if exporter is None else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("orchestrator")
        self._propagator = TraceContextTextMapPropagator()

    def request(self, scope: dict, api_key: str | None) -> RequestSpan:
        """The server span of one HTTP request (an ASGI scope), continuing the client's `traceparent` /
        `tracestate` if it sent them."""
        from opentelemetry.trace import SpanKind

        carrier = {}
        for key, value in scope.get("headers", ()):
            if key in (b"traceparent", b"tracestate"):
                carrier[key.decode()] = value.decode("latin-1")
        parent = self._propagator.extract(carrier) if carrier else None
        otel = self.tracer.start_span(f"{scope['method']} {scope['path']}", context=parent, kind=SpanKind.SERVER,
                                      attributes=_clean({"http.request.method": scope["method"],
                                                         "url.path": scope["path"], "orchestrator.api_key": api_key}))
        return RequestSpan(otel, self.tracer)

    @asynccontextmanager
    async def running(self, flush_s: float = SHUTDOWN_FLUSH_S):
        """Serve with this tracer; on the way out, whatever way, export what is still batched, for at most
        `flush_s` (on a thread, left behind when the collector takes longer: its threads are daemons, and the
        process exits without waiting for them)."""
        try:
            yield
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(flush_s) as bounded:
                await trio.to_thread.run_sync(self.provider.shutdown, abandon_on_cancel=True)
            if bounded.cancelled_caught:
                log.warning("the trace collector at %s did not take the last spans within %g s: they are dropped",
                            self.endpoint, flush_s)


class RequestSpan(Span):
    """The request's server span; while its block runs, `span()` in this task opens its children."""

    __slots__ = ("_tracer", "_token")

    def __init__(self, otel_span, tracer) -> None:
        super().__init__(otel_span)
        self._tracer = tracer
        self._token: contextvars.Token | None = None

    def __enter__(self) -> RequestSpan:
        super().__enter__()
        self._token = _TRACER.set(self._tracer)
        return self

    def __exit__(self, *exc_info):
        if self._token is not None:
            _TRACER.reset(self._token)
        return super().__exit__(*exc_info)


def from_config(config):
    """The tracing of a config: DISABLED without a `tracing:` section."""
    return DISABLED if config.tracing is None else Tracing(config.tracing)
