"""Benchmark metric arithmetic on hand-made timelines."""

import math

import pytest

from orchestrator.bench.metrics import Overhead, RequestRecord, aggregate, percentile, summary, to_gpu_time


def test_ttft_tpot_itl_and_e2e_of_one_request():
    # starts at 0, first chunk (1 token) at 0.5, then 2 tokens at 0.7, then 1 token at 0.8, ends at 0.9
    r = RequestRecord(start=0.0, end=0.9, chunks=((0.5, 1), (0.7, 2), (0.8, 1)), output_tokens=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx((0.8 - 0.5) / 3)
    assert r.itls == pytest.approx([0.1, 0.1, 0.1])  # the 2-token chunk after 0.2 s counts as two 0.1 s gaps
    assert r.e2e == pytest.approx(0.9)


def test_single_token_requests_have_no_tpot():
    r = RequestRecord(start=0.0, end=0.3, chunks=((0.2, 1),), output_tokens=1)
    assert r.tpot is None and r.itls == []


def test_percentiles_interpolate_linearly():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    s = summary([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == pytest.approx(2.5) and s["p99"] == pytest.approx(3.97)


def test_aggregate_throughputs_per_user_per_gpu_and_goodput():
    records = [
        RequestRecord(0.0, 1.0, ((0.2, 1), (1.0, 4)), output_tokens=5),   # ttft .2, tpot .2
        RequestRecord(0.5, 2.0, ((1.5, 1), (2.0, 4)), output_tokens=5),   # ttft 1.0, tpot .125
        RequestRecord(1.0, 2.0, ((1.1, 1), (1.5, 9)), output_tokens=10),  # ttft .1, tpot .0444
        RequestRecord(1.0, 1.2, (), error="http_503"),
    ]
    m = aggregate(records, gpus=2, slo_ttft=0.5, slo_tpot=0.15)
    assert m["requests"] == 4 and m["completed"] == 3 and m["errors"] == {"http_503": 1}
    assert m["duration_s"] == pytest.approx(2.0)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_tokens_per_s"] == pytest.approx(10.0)
    assert m["tokens_per_s_per_gpu"] == pytest.approx(5.0)
    assert m["tokens_per_s_per_user"] == pytest.approx((5 / 0.8 + 5 / 0.5 + 10 / 0.9) / 3)
    # only the third request meets both bounds (the first misses TPOT, the second misses TTFT)
    assert m["goodput"] == pytest.approx(0.5) and m["slo"]["met"] == 1
    assert m["ttft_s"]["p50"] == pytest.approx(0.2)


def test_no_slo_means_every_completed_request_is_good():
    records = [RequestRecord(0.0, 1.0, ((0.5, 1), (1.0, 1)), output_tokens=2)]
    assert aggregate(records)["goodput"] == pytest.approx(1.0)


def closed_loop(users: int, latencies_gpu_s: list[float], time_scale: float, overhead_s: float) -> list[RequestRecord]:
    """What a simulated run records: each user sends its next request when the last one ends; GPU time is
    scaled by time_scale, the client/orchestrator overhead between requests is real time."""
    records, clock = [], [0.0] * users
    for i, latency in enumerate(latencies_gpu_s):
        user = i % users
        start = clock[user] + overhead_s
        wall = latency * time_scale
        records.append(RequestRecord(start, start + wall, ((start + wall * 0.2, 1), (start + wall, 9)),
                                     output_tokens=10))
        clock[user] = start + wall
    return records


@pytest.mark.parametrize("time_scale", [1.0, 0.5, 0.1, 0.02])
def test_a_closed_loop_of_n_users_never_beats_n_over_its_median_latency_at_any_time_scale(time_scale):
    latencies = [1.0 + 0.1 * ((i * 7) % 5) for i in range(40)]  # 1.0 .. 1.4 s of GPU time
    m = aggregate(to_gpu_time(closed_loop(2, latencies, time_scale, overhead_s=0.002), time_scale))
    assert m["request_throughput"] <= 2 / m["e2e_s"]["p50"]
    assert m["e2e_s"]["p50"] == pytest.approx(percentile(latencies, 50), rel=0.01)
    assert m["output_tokens_per_s"] <= 2 * m["tokens_per_s_per_user"] * 1.01


def test_gpu_time_conversion_stretches_the_whole_run_around_its_first_start():
    records = [RequestRecord(10.0, 10.5, ((10.1, 1),), output_tokens=1), RequestRecord(10.5, 11.0, ((10.6, 1),))]
    scaled = to_gpu_time(records, 0.5)
    assert [(r.start, r.end) for r in scaled] == [(10.0, 11.0), (11.0, 12.0)]
    assert scaled[1].chunks == ((11.2, 1),)
    assert aggregate(scaled)["duration_s"] == pytest.approx(2.0)
    assert to_gpu_time(records, 1.0) == records


def timeline(start: float, ttft_gpu: float, gaps_gpu: list[float], time_scale: float, own: Overhead) -> RequestRecord:
    """One request as a simulated run records it: each interval is the deployment's own time (real) plus GPU time
    (scaled)."""
    at = start + own.ttft_s + ttft_gpu * time_scale
    chunks = [(at, 1)]
    for gap in gaps_gpu:
        at += own.per_token_s + gap * time_scale
        chunks.append((at, 1))
    return RequestRecord(start, at + own.tail_s, tuple(chunks), output_tokens=len(chunks))


@pytest.mark.parametrize("time_scale", [1.0, 0.5, 0.1])
def test_gpu_time_conversion_scales_only_the_simulated_gpu_time_not_the_deployments_own(time_scale):
    own = Overhead(ttft_s=0.008, per_token_s=0.0005, tail_s=0.001)
    records = [timeline(i * 0.5, 0.015, [0.007] * 9, time_scale, own) for i in range(4)]
    m = aggregate(to_gpu_time(records, time_scale, own))
    assert m["ttft_s"]["p50"] == pytest.approx(0.008 + 0.015)  # the same at every time scale
    assert m["tpot_s"]["p50"] == pytest.approx(0.0005 + 0.007)
    assert m["e2e_s"]["p50"] == pytest.approx(0.008 + 0.015 + 9 * 0.0075 + 0.001)
    # Without the overhead, all of it is divided by the time scale: the orchestrator's 8 ms read as 80 at 0.1.
    unmeasured = aggregate(to_gpu_time(records, time_scale))["ttft_s"]["p50"]
    assert unmeasured == pytest.approx(0.008 / time_scale + 0.015)


def test_the_overhead_is_measured_as_the_medians_of_a_zero_cost_run_so_a_hiccup_does_not_move_it():
    own, hiccup = Overhead(ttft_s=0.004, per_token_s=0.001, tail_s=0.002), Overhead(ttft_s=0.2, tail_s=0.002)
    measured = Overhead.measure([timeline(0.0, 0.0, [0.0] * 4, 0.0, own), timeline(1.0, 0.0, [0.0] * 4, 0.0, own),
                                 timeline(2.0, 0.0, [0.0] * 4, 0.0, hiccup),
                                 RequestRecord(0.0, 1.0, error="http_503")])
    assert measured.ttft_s == pytest.approx(0.004) and measured.per_token_s == pytest.approx(0.001)
    assert measured.tail_s == pytest.approx(0.002)
    assert Overhead.measure([]) == Overhead()
