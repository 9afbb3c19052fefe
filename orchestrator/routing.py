"""Worker choice per role: round robin, or least loaded from Control.GetLoad.

Pure policies over candidate lists; the pool keeps the inputs (load samples, local in-flight
counts) fresh. Least loaded scores a worker by its engine-reported running + queued requests plus
the requests we sent it since that sample, so a burst does not all land on one stale minimum.
"""

from __future__ import annotations

import itertools
from typing import Protocol, Sequence


class Candidate(Protocol):
    address: str
    inflight: int
    sent_since_load: int

    def load_score(self, now: float, staleness: float) -> float | None: ...


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

        def score(i_c: tuple[int, Candidate]) -> tuple[float, int]:
            i, c = i_c
            engine = c.load_score(now, self.staleness_s)
            value = (engine + c.sent_since_load) if engine is not None else float(c.inflight)
            return value, (i - turn) % len(candidates)  # rotate ties

        return min(enumerate(candidates), key=score)[1]


def make_policy(name: str, staleness_s: float):
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(staleness_s)
    raise ValueError(f"unknown routing policy {name!r}")
