"""Worker choice policies (pure)."""

import attrs

from orchestrator.workers.routing import LeastLoaded, LoadSample, RoundRobin, make_policy


@attrs.define
class FakeWorker:
    address: str
    inflight: int = 0
    sent_since_load: int = 0
    finished_since_load: int = 0
    sample: tuple | None = None  # LoadSample's fields: (at, requests[, used_kv_blocks, total_kv_blocks, queued])

    def fresh_load(self, now, staleness):
        if self.sample is None or now - self.sample[0] > staleness:
            return None
        return LoadSample(*self.sample)


def test_round_robin_cycles_through_candidates():
    workers = [FakeWorker("a"), FakeWorker("b"), FakeWorker("c")]
    policy = RoundRobin()
    assert [policy.choose(workers, 0).address for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_uses_fresh_engine_load_plus_what_we_sent_since():
    busy = FakeWorker("busy", sample=(10.0, 8))
    idle = FakeWorker("idle", sample=(10.0, 1), sent_since_load=2)
    assert LeastLoaded(0.5).choose([busy, idle], now=10.1).address == "idle"
    idle.sent_since_load = 9  # a burst went there since the sample
    assert LeastLoaded(0.5).choose([busy, idle], now=10.1).address == "busy"


def test_least_loaded_scores_by_kv_usage_when_every_engine_reports_it():
    """UPSTREAM load-kv: TensorRT-LLM reports used/total_kv_blocks with load metrics on; a few long requests can
    fill a worker's KV cache while many short ones leave another's nearly empty."""
    long_ones = FakeWorker("long", sample=(10.0, 2, 900, 1000))
    short_ones = FakeWorker("short", sample=(10.0, 6, 100, 1000))
    assert LeastLoaded(0.5).choose([long_ones, short_ones], now=10.1).address == "short"
    short_ones.sent_since_load = 50  # each charged an average admitted request's blocks: 50 x (1000 / 8)
    assert LeastLoaded(0.5).choose([long_ones, short_ones], now=10.1).address == "long"
    no_kv = FakeWorker("no-kv", sample=(10.0, 3))  # one engine without KV figures: all compare by requests
    assert LeastLoaded(0.5).choose([long_ones, FakeWorker("short", sample=(10.0, 6, 100, 1000)), no_kv],
                                   now=10.1).address == "long"


def test_a_burst_does_not_all_land_on_an_idle_worker_when_scoring_by_kv():
    """An idle worker's sample says nothing of what a request takes: the others' average does."""
    idle = FakeWorker("idle", sample=(10.0, 0, 0, 1000))
    busy = FakeWorker("busy", sample=(10.0, 1, 10, 1000))
    policy, picks = LeastLoaded(0.5), []
    for _ in range(20):
        chosen = policy.choose([idle, busy], now=10.1)
        chosen.sent_since_load += 1
        picks.append(chosen.address)
    assert 8 <= picks.count("idle") <= 12, picks  # they share it, the idle one first


def test_queued_requests_count_though_they_hold_no_kv_blocks_yet():
    """An engine admits its queue between steps: a worker in a long step shows the blocks of its last admission
    while requests queue behind it. Each queued one is charged an average running request's blocks."""
    stepping = FakeWorker("stepping", sample=(10.0, 7, 50, 1000, 6))  # 1 running (50 blocks), 6 queued
    other = FakeWorker("other", sample=(10.0, 2, 200, 1000))  # 2 requests holding 200 blocks (queued not said)
    # the average running request holds 250 / 3 blocks: 50 + 6 x 83 > 200
    assert LeastLoaded(0.5).choose([stepping, other], now=10.1).address == "other"


def test_requests_arriving_during_a_step_spread_over_the_workers():
    """Fresh samples at every pick (as in bench reuse), every worker in a step that admits nothing until it
    ends: by blocks in use alone all twelve went to the one whose running request is smallest."""
    used = {"a": 126, "b": 50, "c": 113, "d": 71}
    queued = dict.fromkeys(used, 0)
    workers = [FakeWorker(name) for name in used]
    policy = LeastLoaded(0.5)
    for _ in range(12):
        for worker in workers:  # one running request each, and what queued behind it
            name = worker.address
            worker.sample = (10.0, 1 + queued[name], used[name], 1000, queued[name])
        queued[policy.choose(workers, now=10.0).address] += 1
    assert sorted(queued.values()) == [3, 3, 3, 3], queued


def test_a_queued_request_costs_the_average_over_all_workers_not_its_workers_own():
    """A request costs what it costs wherever it waits: by its own worker's average, one running a single short
    request would look nearly free per queued request and draw the queue again."""
    short = FakeWorker("short", sample=(10.0, 4, 10, 1000, 3))  # 1 running (10 blocks), 3 queued
    long = FakeWorker("long", sample=(10.0, 1, 200, 1000))  # 1 request holding 200 blocks (queued not said)
    # average 105: 10 + 3 x 105 > 200 (by its own average, 10 + 3 x 10 < 200)
    assert LeastLoaded(0.5).choose([short, long], now=10.1).address == "long"


def test_least_loaded_falls_back_to_local_inflight_when_samples_are_stale():
    a = FakeWorker("a", inflight=3, sample=(0.0, 0))
    b = FakeWorker("b", inflight=1, sample=(0.0, 50))
    assert LeastLoaded(0.25).choose([a, b], now=10.0).address == "b"


def test_least_loaded_rotates_ties():
    workers = [FakeWorker("a"), FakeWorker("b")]
    policy = LeastLoaded(1.0)
    assert {policy.choose(workers, 0).address for _ in range(4)} == {"a", "b"}


def test_make_policy_refuses_unknown_names():
    import pytest

    assert isinstance(make_policy("round_robin", 1), RoundRobin)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", 1)


def test_a_queue_behind_few_kv_blocks_counts_where_the_engine_does_not_tell_queued_from_running():
    """UPSTREAM load-kv: TensorRT-LLM counts its queued requests in running_requests and leaves queued_requests
    unset. a: 14 requests, of which only those admitted hold its 400 blocks; b: 6 requests holding 600. An average
    request holds 1000 / 20 = 50 blocks, so a's requests weigh 700, more than its blocks in use and than b's 600."""
    a, b = FakeWorker("a", sample=(10.0, 14, 400, 10_000)), FakeWorker("b", sample=(10.0, 6, 600, 10_000))
    assert LeastLoaded(0.5).choose([a, b], now=10.1).address == "b"
    # As many requests on each: the one with fewer blocks in use is the less loaded.
    c, d = FakeWorker("c", sample=(10.0, 6, 600, 10_000)), FakeWorker("d", sample=(10.0, 6, 700, 10_000))
    assert LeastLoaded(0.5).choose([c, d], now=10.1).address == "c"


def test_a_nearly_full_kv_cache_counts_as_full_whatever_the_request_counts():
    """From TensorRT-LLM (queued requests not told apart) many short requests weigh more than a few long ones;
    a worker whose cache is 90% in use still counts as full: a new request may not fit there and would wait."""
    long = FakeWorker("long", sample=(10.0, 2, 900, 1000))
    short = FakeWorker("short", sample=(10.0, 20, 100, 1000))
    assert LeastLoaded(0.5).choose([long, short], now=10.1).address == "short"
    # Below the mark the estimate decides: short's 20 requests at the average weigh more than long's 850 blocks.
    long = FakeWorker("long", sample=(10.0, 2, 850, 1000))
    assert LeastLoaded(0.5).choose([long, short], now=10.1).address == "long"
