"""What the orchestrator's metrics measure: tokens, not chunks; every series present from start-up."""

from __future__ import annotations

import os

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from orchestrator.metrics import OUTCOMES, ROUTES, FrontendProcesses, Metrics, TokenMeter


def sample(metrics: Metrics, name: str, **labels) -> float:
    if name.startswith("orchestrator_"):  # the families of Metrics(): one model's view, here model ""
        labels = {"model": metrics.model, **labels}
    value = metrics.registry.get_sample_value(name, labels)
    if value is None:
        raise LookupError(f"no sample {name}{labels}")
    return value


def test_a_gap_before_tokens_that_arrived_together_counts_once_per_token():
    metrics = Metrics("aggregated")
    meter = metrics.token_meter("aggregated")
    meter.add(None, 3)  # the first batch: TTFT, then two tokens with it
    meter.add(0.030, 3)  # 30 ms later, three more
    meter.flush()  # what the end of the stream does
    assert sample(metrics, "orchestrator_output_tokens_total", mode="aggregated") == 6
    assert sample(metrics, "orchestrator_inter_token_latency_seconds_count", mode="aggregated") == 5
    assert sample(metrics, "orchestrator_inter_token_latency_seconds_sum", mode="aggregated") == pytest.approx(0.030)
    # three gaps of 10 ms, two of 0: all at or under the 10 ms bucket, none under 0.5 ms but the zeros
    assert sample(metrics, "orchestrator_inter_token_latency_seconds_bucket", mode="aggregated", le="0.0005") == 2
    assert sample(metrics, "orchestrator_inter_token_latency_seconds_bucket", mode="aggregated", le="0.01") == 5


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated", "conditional"])
def test_every_labelled_series_exists_at_zero_before_its_first_event(mode):
    metrics = Metrics(mode)
    for route in ROUTES:
        for outcome in OUTCOMES:
            assert sample(metrics, "orchestrator_requests_total", route=route, mode=mode, outcome=outcome) == 0
    for path in ("aggregated", "disaggregated", "local"):
        assert sample(metrics, "orchestrator_output_tokens_total", mode=path) == 0
        assert sample(metrics, "orchestrator_migrations_total", mode=path) == 0
    assert sample(metrics, "orchestrator_retries_total", role="decode") == 0
    assert sample(metrics, "orchestrator_kv_cleanups_total", way="decode_pull") == 0
    assert sample(metrics, "orchestrator_engine_errors_total", code="ERROR_CODE_OVERLOADED") == 0


def test_the_process_itself_is_measured():
    metrics = Metrics()
    assert sample(metrics, "process_cpu_seconds_total") > 0
    assert sample(metrics, "process_resident_memory_bytes") > 0


def test_frontend_process_metrics_sum_the_live_processes_of_the_multiprocess_directory(tmp_path):
    """A process is live while its livesum gauge file exists; a file whose process is gone counts nothing."""
    gone = 4194305  # above Linux's largest pid_max: no such process
    for pid in (os.getpid(), gone):
        (tmp_path / f"gauge_livesum_{pid}.db").write_bytes(b"")
    (tmp_path / "counter_12.db").write_bytes(b"")  # counters of a dead process stay (they are totals)
    collector = FrontendProcesses(str(tmp_path))
    assert collector.live_pids() == [os.getpid(), gone]
    values = {family.name: family.samples[0].value for family in collector.collect()}
    assert values["orchestrator_frontend_processes"] == 1
    assert values["process_cpu_seconds"] > 0 and values["process_resident_memory_bytes"] > 10e6


def _series(registry, name: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples
            if s.name.startswith(name) and not s.name.endswith("_created")}


@settings(max_examples=100, deadline=None)
@example([(0.01, 1), (0.0005, 1), (None, 4), (2.5, 1), (3.0, 1), (0.0, 2)])  # on bucket bounds, past the last
@given(st.lists(st.tuples(st.one_of(st.none(), st.floats(0, 3, allow_nan=False)), st.integers(1, 40)), max_size=60))
def test_a_token_meter_adds_up_to_what_observing_every_token_gives(chunks):
    """The batched path (bucket counts added to prometheus_client's own values) against its public
    observe(), one call per token."""
    batched, reference = Metrics("aggregated"), Metrics("aggregated")
    meter = batched.token_meter("aggregated")
    for gap, tokens in chunks:
        meter.add(gap, tokens)
        output_tokens, itl = reference.by_path["aggregated"].output_tokens, reference.by_path["aggregated"].itl
        output_tokens.inc(tokens)
        value, count = (0.0, tokens - 1) if gap is None else (gap / tokens, tokens)
        for _ in range(count):
            itl.observe(value)
    meter.flush()
    for name in ("orchestrator_inter_token_latency_seconds", "orchestrator_output_tokens"):
        got, want = _series(batched.registry, name), _series(reference.registry, name)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), key


def test_a_token_meter_shows_a_long_stream_while_it_runs():
    metrics = Metrics("aggregated")
    meter = metrics.token_meter("aggregated")
    for _ in range(100):
        meter.add(0.01, 1)
    assert 100 - TokenMeter.FLUSH_TOKENS < sample(metrics, "orchestrator_output_tokens_total", mode="aggregated") <= 100
    meter.flush()
    assert sample(metrics, "orchestrator_output_tokens_total", mode="aggregated") == 100
    assert sample(metrics, "orchestrator_inter_token_latency_seconds_count", mode="aggregated") == 100


def test_forgetting_a_worker_never_routed_to_is_no_error_even_where_prometheus_raises(monkeypatch):
    """prometheus_client before 0.22 raised KeyError removing a series never created; forget_worker runs in the
    pool's task, which must not end for it."""
    from prometheus_client import Counter, Gauge

    def remove_unknown(self, *labels):
        raise KeyError(labels)

    monkeypatch.setattr(Gauge, "remove", remove_unknown)
    monkeypatch.setattr(Counter, "remove", remove_unknown)
    Metrics().forget_worker("grpc://127.0.0.1:9")


def test_each_model_counts_in_its_own_series_of_the_one_registry():
    """for_model() is a view: the same families, labelled by the model, its series at 0 from the start; what one
    model's requests do never shows in another's."""
    metrics = Metrics("", model="")
    chat, small = metrics.for_model("chat", "disaggregated"), metrics.for_model("small", "aggregated")
    assert chat.registry is small.registry is metrics.registry
    chat.retries.labels("prefill").inc()
    small.prefill_answers.inc()
    small.request_done("chat", "ok")
    assert sample(chat, "orchestrator_retries_total", role="prefill") == 1
    assert sample(small, "orchestrator_retries_total", role="prefill") == 0
    assert sample(small, "orchestrator_prefill_answers_total") == 1
    assert sample(chat, "orchestrator_prefill_answers_total") == 0
    assert sample(small, "orchestrator_requests_total", route="chat", mode="aggregated", outcome="ok") == 1
    assert sample(chat, "orchestrator_requests_total", route="chat", mode="disaggregated", outcome="ok") == 0
    chat.kv_index_blocks.labels("grpc://w:1").set(3)
    small.kv_index_blocks.labels("grpc://w:1").set(5)
    chat.forget_worker("grpc://w:1")  # one model's pool lost the worker: the other's series stays
    assert metrics.registry.get_sample_value("orchestrator_kv_index_blocks", {"worker": "grpc://w:1",
                                                                              "model": "chat"}) is None
    assert sample(small, "orchestrator_kv_index_blocks", worker="grpc://w:1") == 5
