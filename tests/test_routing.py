"""Worker choice policies (pure)."""

import attrs

from orchestrator.routing import LeastLoaded, RoundRobin, make_policy


@attrs.define
class FakeWorker:
    address: str
    inflight: int = 0
    sent_since_load: int = 0
    sample: tuple[float, int] | None = None

    def load_score(self, now, staleness):
        if self.sample is None or now - self.sample[0] > staleness:
            return None
        return float(self.sample[1])


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
