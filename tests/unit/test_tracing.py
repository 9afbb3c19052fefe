"""Tracing on the fake workers: each leg attempt is a span with its worker, attempt, retry and migration, and each
engine call carries that span's traceparent; with tracing off no engine call carries any."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from orchestrator import tracing
from orchestrator.config import TracingConfig
from orchestrator.decode import StreamProgress
from orchestrator.decode.stage import DecodeLeg
from orchestrator.engine import EngineError, PrefillReady
from orchestrator.kv import generation_leg
from orchestrator.testkit.plugin import Fail, Send
from orchestrator.tokenizer import IncrementalDetokenizer
from test_stages_unit import SESSION, TOKENIZER, Sink, decode_tokens, deployment, full, prefill_script, workers

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
         "headers": [(b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]}


async def run_split(prefill, decode, pool):
    lease = (await prefill.run(workers(pool, "prefill")[0], full())).lease
    await decode.run(DecodeLeg(workers(pool, "decode")[0], generation_leg(full(), lease.session), 3,
                               on_chunk=lambda n: None, lease=lease, migration=2),
                     StreamProgress(Sink(), IncrementalDetokenizer(TOKENIZER)))


def attributes(span: ReadableSpan) -> Mapping[str, Any]:
    """A finished span's attributes (the SDK's span always has them; None only in the API's type)."""
    if span.attributes is None:
        raise AssertionError(f"span {span.name} has no attributes")
    return span.attributes


def parent_id(span: ReadableSpan) -> int:
    if span.parent is None:
        raise AssertionError(f"span {span.name} has no parent")
    return span.parent.span_id


def traceparent(span) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-01"


async def test_every_leg_attempt_is_a_span_whose_traceparent_its_engine_call_carries(autojump_clock):
    busy = EngineError("overloaded", worker="p0", rpc="Generate", retryable=True)
    pool, (p0, p1), (d0,), prefill, decode, *_ = deployment(
        [prefill_script(Fail(busy)), prefill_script(Send(PrefillReady(SESSION)))], [lambda request: decode_tokens(2)])
    exported = InMemorySpanExporter()
    tracer = tracing.Tracing(TracingConfig(endpoint="http://127.0.0.1:9/v1/traces"), exporter=exported)
    with tracer.request(SCOPE, "team-a"):
        await run_split(prefill, decode, pool)
    spans = {(s.name, attributes(s).get("orchestrator.attempt")): s for s in exported.get_finished_spans()}
    root = spans["POST /v1/chat/completions", None]
    assert f"{root.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"  # the client's trace goes on
    assert f"{parent_id(root):016x}" == "b7ad6b7169203331" and attributes(root)["orchestrator.api_key"] == "team-a"
    first, second, generation = spans["prefill", 1], spans["prefill", 2], spans["decode", 1]
    assert (attributes(first)["orchestrator.worker"], attributes(first)["orchestrator.retry"]) == ("grpc://p0", False)
    assert (attributes(second)["orchestrator.worker"], attributes(second)["orchestrator.retry"]) == ("grpc://p1", True)
    assert attributes(generation)["orchestrator.migration"] == 2 and attributes(first)["orchestrator.migration"] == 0
    assert all(parent_id(span) == root.context.span_id for span in (first, second, generation))
    assert first.status.status_code.name == "ERROR"  # the failed attempt says so
    assert p0.metadata["r1"] == (("traceparent", traceparent(first)),)
    assert p1.metadata["r1"] == (("traceparent", traceparent(second)),)
    assert d0.metadata["r1-gen"] == (("traceparent", traceparent(generation)),)
    tracer.provider.shutdown()


async def test_without_tracing_no_engine_call_carries_trace_metadata(autojump_clock):
    pool, (p0,), (d0,), prefill, decode, *_ = deployment([prefill_script(Send(PrefillReady(SESSION)))],
                                                         [lambda request: decode_tokens(2)])
    await run_split(prefill, decode, pool)
    assert p0.metadata == {"r1": ()} and d0.metadata == {"r1-gen": ()}
    assert tracing.span("plan") is tracing.NO_SPAN and tracing.DISABLED.request(SCOPE, None) is tracing.NO_SPAN
