"""Worker choice per role: round robin, or least loaded from Control.GetLoad.

Pure policies over candidate lists; the pool keeps the inputs (load samples, local in-flight
counts) fresh. Least loaded scores a worker by the KV cache it has in use when every candidate's
engine reports it (TensorRT-LLM fills used/total_kv_blocks when started with load metrics), else by its
engine-reported running + queued requests; in both, the requests we sent it since that sample count
too, so a burst does not all land on one stale minimum.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import attrs


@attrs.frozen
class LoadSample:
    """One GetLoad answer, reduced to what routing uses."""

    at: float  # trio time it arrived
    requests: int  # running + queued
    used_kv_blocks: int | None = None  # both None unless the engine reports KV usage
    total_kv_blocks: int | None = None

    @property
    def reports_kv(self) -> bool:
        return self.used_kv_blocks is not None and bool(self.total_kv_blocks)

    @property
    def blocks_per_request(self) -> float | None:
        return (self.used_kv_blocks or 0) / self.requests if self.requests else None

    def kv_load(self, sent_since: int, per_request: float) -> float:
        """The fraction of the KV cache in use, with each request sent since the sample assumed to take
        `per_request` blocks (an average running request's)."""
        return ((self.used_kv_blocks or 0) + sent_since * per_request) / (self.total_kv_blocks or 1)  # reports_kv


class Candidate(Protocol):
    address: str
    inflight: int
    sent_since_load: int

    def fresh_load(self, now: float, staleness: float) -> LoadSample | None: ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Candidate], now: float) -> Candidate:
        return candidates[next(self._counter) % len(candidates)]


class LeastLoaded:
    def __init__(self, staleness_s: float):
        self.staleness_s = staleness_s
        self._tiebreak = itertools.count()

    def choose(self, candidates: Sequence[Candidate], now: float) -> Candidate:
        turn = next(self._tiebreak)
        samples = [c.fresh_load(now, self.staleness_s) for c in candidates]
        # KV usage only where every candidate reports it: a fraction and a request count do not compare.
        by_kv = all(s is not None and s.reports_kv for s in samples)
        fallback = 1.0
        if by_kv:
            # What a request sent since a sample is assumed to take: that worker's average running request, or
            # for an idle worker the others' (else a burst would all land on the idle one, its score never rising).
            averages = [b for s in samples if s is not None and (b := s.blocks_per_request) is not None]
            fallback = sum(averages) / len(averages) if averages else 1.0

        def score(i: int) -> tuple[float, float, int]:
            c, sample = candidates[i], samples[i]
            rotation = (i - turn) % len(candidates)  # rotate ties
            if sample is None:
                return 0.0, float(c.inflight), rotation
            requests = float(sample.requests + c.sent_since_load)
            if not by_kv:
                return 0.0, requests, rotation
            per_request = sample.blocks_per_request
            return sample.kv_load(c.sent_since_load, fallback if per_request is None else per_request), requests, \
                rotation

        return candidates[min(range(len(candidates)), key=score)]


def make_policy(name: str, staleness_s: float):
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(staleness_s)
    raise ValueError(f"unknown routing policy {name!r}")
