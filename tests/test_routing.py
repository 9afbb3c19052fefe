"""Worker choice policies (pure)."""

import attrs

from orchestrator.workers.routing import LeastLoaded, LoadSample, RoundRobin, make_policy


@attrs.define
class FakeWorker:
    address: str
    inflight: int = 0
    sent_since_load: int = 0
    sample: tuple | None = None  # LoadSample's fields: (at, requests[, used_kv_blocks, total_kv_blocks])

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
    short_ones.sent_since_load = 50  # each assumed to take an average running request's blocks: 50 x 16.7
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
