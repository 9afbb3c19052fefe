"""What the orchestrator's metrics measure: tokens, not chunks; every series present from start-up."""

from __future__ import annotations

import pytest

import os

from orchestrator.metrics import OUTCOMES, ROUTES, FrontendProcesses, Metrics


def sample(metrics: Metrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    if value is None:
        raise LookupError(f"no sample {name}{labels}")
    return value


def test_a_gap_before_tokens_that_arrived_together_counts_once_per_token():
    metrics = Metrics("aggregated")
    metrics.observe_tokens("aggregated", None, 3)  # the first batch: TTFT, then two tokens with it
    metrics.observe_tokens("aggregated", 0.030, 3)  # 30 ms later, three more
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
    assert sample(metrics, "orchestrator_kv_cleanups_total", way="abort_session") == 0
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
