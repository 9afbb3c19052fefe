"""Worker choice per role: round robin, least loaded from Control.GetLoad, or KV aware.

Pure policies over candidate lists; the pool keeps the inputs (load samples, local in-flight
counts) fresh. Least loaded scores a worker by the KV cache it has in use when every candidate's
engine reports it (TensorRT-LLM fills used/total_kv_blocks when started with load metrics), its queued
requests, which hold none yet, charged an average request's blocks (where the engine does not tell them
apart, as TensorRT-LLM does not, its requests at that average weigh at least as much as its blocks); else by
its engine-reported running + queued requests; in both, the requests we sent it since that sample count too,
so a burst does not all land on one stale minimum.

KV aware (`KvAware`) adds what each worker already holds of the prompt (the KV index,
orchestrator.workers.kv_index, fed by the engines' KV events or, for a worker without events, by our own
routing history): cost = the prompt blocks it would have to compute x a weight + its load in blocks; a
hot-prefix guard keeps one popular prefix from piling onto the worker that holds it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import attrs


@attrs.frozen
class LoadSample:
    """One GetLoad answer, reduced to what routing uses."""

    at: float  # trio time it arrived
    requests: int  # running + queued
    used_kv_blocks: int | None = None  # both None unless the engine reports KV usage
    total_kv_blocks: int | None = None
    # Of `requests`, those waiting to be scheduled (they hold no KV blocks yet); None when the engine does not
    # say: TensorRT-LLM's GetLoad counts them in running_requests and leaves queued_requests unset.
    queued: int | None = None

    @property
    def reports_kv(self) -> bool:
        return self.used_kv_blocks is not None and bool(self.total_kv_blocks)

    @property
    def admitted(self) -> int:
        """The requests holding the KV blocks in use: all of them where the engine does not tell the queued apart."""
        return self.requests - (self.queued or 0)

    @property
    def kv_usage(self) -> float:
        """The fraction of the KV cache in use (where reports_kv)."""
        return (self.used_kv_blocks or 0) / (self.total_kv_blocks or 1)


class Candidate(Protocol):
    address: str
    inflight: int  # our requests there now (leased, not yet finished)
    sent_since_load: int  # of ours, picked for it since its last load sample
    finished_since_load: int  # of ours, finished there since its last load sample

    def fresh_load(self, now: float, staleness: float) -> LoadSample | None: ...


# The pool's own worker type: a policy hands back one of the candidates it was given, as that type.
CandidateT = TypeVar("CandidateT", bound=Candidate)


@attrs.frozen
class Decision(Generic[CandidateT]):
    """Where a leg goes, and why (a metric label)."""

    worker: CandidateT
    reason: str  # one of REASONS
    rank: int | None = None  # the attention-DP rank to target (openengine-target-dp-rank), None: the engine's choice
    cached_blocks: int = 0  # leading prompt blocks the index says that worker (rank) holds
    prompt_blocks: int = 0


# Why a worker was chosen: policy order (round robin / least loaded), its prefix cached there (kv aware), the
# least cost with nothing cached anywhere, the hot-prefix guard overruling the prefix's holder, a sole candidate.
REASONS = ("policy", "prefix", "load", "hot_prefix_guard", "single")
# gRPC metadata of a leg that asks an attention-DP worker for one rank (TensorRT-LLM's OpenEngine servicer reads
# it where ServerInfo.extra says trtllm_supports_dp_rank_targeting); its value is the rank in decimal.
TARGET_DP_RANK = "openengine-target-dp-rank"


def with_target_rank(metadata: tuple[tuple[str, str], ...], rank: int | None,
                     planned: bool) -> tuple[tuple[str, str], ...]:
    """A leg's gRPC metadata, asking for `rank` when the leg runs on the worker it was planned for (`planned`;
    a retry elsewhere has no rank to ask for)."""
    return metadata if rank is None or not planned else (*metadata, (TARGET_DP_RANK, str(rank)))


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[CandidateT], now: float) -> CandidateT:
        return candidates[next(self._counter) % len(candidates)]

    def decide(self, candidates: Sequence[CandidateT], now: float, prompt: Sequence[int] = ()
               ) -> Decision[CandidateT]:
        return Decision(self.choose(candidates, now), "policy")


NEARLY_FULL_KV = 0.9  # least loaded: a worker reporting this much of its KV cache in use counts as full


class LeastLoaded:
    def __init__(self, staleness_s: float):
        self.staleness_s = staleness_s
        self._tiebreak = itertools.count()

    def choose(self, candidates: Sequence[CandidateT], now: float) -> CandidateT:
        turn = next(self._tiebreak)
        samples = [c.fresh_load(now, self.staleness_s) for c in candidates]
        # KV usage only where every candidate reports it: a fraction and a request count do not compare.
        requests, kv_blocks = _loads(candidates, samples, per_request_default=1.0)
        # the fraction of its KV cache in use (the workers' caches may differ in size)
        kv_used = [0.0] * len(candidates) if kv_blocks is None else \
            [b / (s.total_kv_blocks or 1) for b, s in zip(kv_blocks, samples) if s is not None]
        # A cache the engine reports nearly full counts as full: a new request may not fit there and would wait
        # for blocks, whatever the estimate says (from an engine that does not tell its queued requests apart,
        # the estimate may charge a worker's many short requests more than another's few long ones). Only where
        # the others are estimated past full too does it take the request.
        if kv_blocks is not None:
            kv_used = [max(used, 1.0) if s is not None and s.kv_usage >= NEARLY_FULL_KV else used
                       for used, s in zip(kv_used, samples)]

        def score(i: int) -> tuple[float, float, int]:
            return kv_used[i], requests[i], (i - turn) % len(candidates)  # (rotating ties)

        return candidates[min(range(len(candidates)), key=score)]

    def decide(self, candidates: Sequence[CandidateT], now: float, prompt: Sequence[int] = ()
               ) -> Decision[CandidateT]:
        return Decision(self.choose(candidates, now), "policy")


def _loads(candidates: Sequence[Candidate], samples: Sequence[LoadSample | None], per_request_default: float,
           known: Sequence[tuple[int, float]] = ()) -> tuple[list[float], list[float] | None]:
    """Each candidate's load as both policies score it: its requests (running + queued as its fresh sample
    says, plus those we sent it since; without a fresh sample, ours in flight there) and, only where every
    candidate reports KV usage, its load in KV blocks: the blocks in use, with each request that holds none yet
    (queued in the engine, or sent since the sample) charged the blocks of an average admitted request on any of
    them (or `per_request_default` when none holds any).

    Blocks in use alone herd: an engine admits its queue between steps, so a worker in a long step keeps
    showing the blocks of its last admission while its queue grows, and gets every request until the step
    ends. The average is over all the candidates, not each worker's own: a request costs what it costs
    wherever it waits, and one worker running one short request would otherwise look nearly free per queued
    request and draw the queue again. TensorRT-LLM does not say which of its requests are queued (UPSTREAM
    load-kv): there a worker's requests at the average weigh at least as much as its blocks in use, so a queue
    behind few blocks still counts. `known` (per candidate, kv_aware): of those sent since the sample, how many
    and the blocks they have to compute, charged as such instead of at the average (a request following a
    prefix cached or being computed there costs only the rest of its prompt)."""
    # Ours count from the pick until they finish, whatever the sample says: those sent since it are added, those
    # finished since it taken off (a sample read while our last request ran must not outweigh its cached prefix
    # once it is done), and never fewer than ours in flight there (a sample may predate their arrival).
    requests = [float(c.inflight) if s is None
                else float(max(c.inflight, s.requests + c.sent_since_load - c.finished_since_load))
                for c, s in zip(candidates, samples)]
    reporting = [s for s in samples if s is not None and s.reports_kv]
    if len(reporting) != len(samples):
        return requests, None
    admitted = sum(s.admitted for s in reporting)
    used = sum(s.used_kv_blocks or 0 for s in reporting)
    per_request = used / admitted if admitted > 0 and used > 0 else per_request_default

    def blocks(i: int, sample: LoadSample, candidate: Candidate) -> float:
        held = float(sample.used_kv_blocks or 0)
        if sample.queued is None:  # queued requests hidden in `requests`
            held = max(held, sample.requests * per_request)
        else:
            held += sample.queued * per_request
        sent, finished = candidate.sent_since_load, candidate.finished_since_load
        # Ours finished since the sample: those beyond the ones sent since were in it, and take their share of
        # its blocks with them (a request's own blocks, not an average: one long request finished frees them all).
        gone = min(sample.requests, max(0, finished - sent))
        if gone:
            held *= (sample.requests - gone) / sample.requests
        still_sent = max(0, sent - (finished - gone))
        counted, their_blocks = known[i] if known else (0, 0.0)
        counted = min(counted, sent)
        if counted:
            their_blocks *= min(counted, still_sent) / counted
        return held + max(0, still_sent - counted) * per_request + their_blocks

    return requests, [blocks(i, s, c) for i, (c, s) in enumerate(zip(candidates, reporting))]


class PrefixIndex(Protocol):
    """What KvAware reads of the KV index (orchestrator.workers.kv_index.KvIndex)."""

    def overlap(self, keys: Sequence[int], now: float) -> dict[tuple[str, int], int]: ...

    def mode(self, worker: str) -> str: ...

    def routed(self, where: tuple[str, int], keys: Sequence[int], now: float) -> None: ...

    def computing(self, where: tuple[str, int], keys: Sequence[int], depth: int, now: float) -> bool: ...


@attrs.frozen
class KvAwareKnobs:
    """routing.kv_aware in the configuration (orchestrator.config.KvAwareConfig holds the same fields)."""

    # What computing one prompt block costs against one block of load: above 1 favours the cache, below the balance.
    overlap_weight: float = 1.0
    # Hot-prefix guard: a worker more than this many requests (running + queued + sent since its last load
    # sample) above the least loaded candidate gets no request, whatever it holds.
    max_imbalance: int = 4
    # Load ceiling: nor does a worker whose KV cache is fuller than this fraction (when it reports KV usage),
    # unless every candidate is.
    max_kv_usage: float = 0.9


class KvAware:
    """cost(worker) = overlap_weight x (prompt blocks not cached there) + load(worker), in KV blocks.

    load = KV blocks in use (+ an average request's blocks for each one queued or sent since the sample; from an
    engine that does not tell its queued requests apart, at least its requests x that average) where every
    candidate reports KV usage, else its requests x this prompt's blocks (each request there taken to cost
    about as much as this one). Ties go to the one holding more of the prompt, then in rotation. The hot-prefix
    guard rules out a candidate far busier (in requests) than the least loaded one, or whose KV cache is nearly
    full, so that a popular prefix spreads over the workers instead of queueing on the one that holds it. On an
    attention-DP worker that accepts a target rank the cached blocks are the best rank's and that rank is
    targeted; one that does not (the engine balances its ranks itself) counts the ranks' mean. Every decision is
    recorded in the index (`KvIndex.routed`): for a worker without KV events (approximate mode) that is all the
    index learns of it; for one with events, its prompt counts as being computed there until they show it."""

    def __init__(self, index: PrefixIndex, staleness_s: float, knobs: KvAwareKnobs = KvAwareKnobs()):
        self.index, self.staleness_s, self.knobs = index, staleness_s, knobs
        self._tiebreak = itertools.count()
        # Per worker address: (the load sample it was for, requests we sent it since, the blocks they compute)
        self._sent: dict[str, tuple[float, int, float]] = {}

    def decide(self, candidates: Sequence[CandidateT], now: float, prompt: Sequence[int] = ()
               ) -> Decision[CandidateT]:
        turn = next(self._tiebreak)
        blocks = len(prompt)
        overlap = self.index.overlap(prompt, now) if blocks else {}
        samples = [c.fresh_load(now, self.staleness_s) for c in candidates]
        known = [self._sent_since(c.address, s) for c, s in zip(candidates, samples)]
        requests, kv_blocks = _loads(candidates, samples, per_request_default=float(blocks), known=known)
        # without KV usage from every candidate: each request there taken to cost about as much as this one
        loads = kv_blocks if kv_blocks is not None else [r * max(blocks, 1) for r in requests]
        least = min(requests)
        by_worker: dict[str, dict[int, int]] = {}
        for (address, dp_rank), n in overlap.items():
            by_worker.setdefault(address, {})[dp_rank] = n
        if overlap:
            # Where a request of ours runs (or was just sent), the blocks of this prompt cached there are most
            # likely its own, in use and counted in that worker's load (from its sample, or as sent since), or
            # being computed for it: this prompt shares them, allocating and computing none of them again
            # (WorkerChoice.settled waits for those being computed), so they are no load for it there. Without
            # this, one running request sharing a prefix outweighs the hit (a follower of a burst, or the next
            # request of a conversation sent back to back, went elsewhere and computed the prefix again).
            # Without KV usage (each request taken to cost this prompt's blocks), each of ours there is taken to
            # share them likewise.
            loads = [load - min(max(by_worker.get(c.address, {}).values(), default=0)
                                * (1 if kv_blocks is not None else c.inflight + c.sent_since_load), load)
                     if c.inflight or c.sent_since_load else load for load, c in zip(loads, candidates)]
        cached, ranks, eligible = [], [], []
        for i, (c, sample, requests_there) in enumerate(zip(candidates, samples, requests)):
            held, rank = _held(c, by_worker.get(c.address))
            # The guard: a worker this far above the least loaded one (in requests, queued ones included, which
            # blocks in use do not show) or with its KV cache this full takes no request while another does not.
            over = requests_there - least > self.knobs.max_imbalance or (
                sample is not None and sample.reports_kv
                and sample.kv_usage > self.knobs.max_kv_usage)
            cached.append(-held if over else held)  # negative: held but ruled out by the guard
            ranks.append(rank)
            if not over:
                eligible.append(i)
        weight = self.knobs.overlap_weight

        def cost(i: int) -> tuple[float, int, int]:
            uncached = blocks - max(cached[i], 0)
            # At equal cost the one holding more of the prompt (it computes less: the burst measurement in
            # docs/kv-routing.md), then in rotation.
            return weight * uncached + loads[i], -max(cached[i], 0), (i - turn) % len(candidates)

        best = min(eligible or range(len(candidates)), key=cost)
        held = max(cached[best], 0)
        if held:
            reason = "prefix"
        elif any(c < 0 for c in cached):
            reason = "hot_prefix_guard"
        else:
            reason = "load"
        chosen = candidates[best]
        rank = ranks[best] if held else None
        if rank is None and blocks and getattr(chosen, "targets_dp_rank", False):
            # Nothing cached there: a rank chosen by the prompt's last full block (prompts share their first
            # blocks, a chat template's, more often than their last), so that distinct prompts spread over the
            # ranks and our routing history knows which rank took this one.
            rank = (prompt[-1] >> 8) % max(getattr(chosen, "dp_size", 1), 1)  # (a key's low bits are flags)
        sample = samples[best]
        if sample is not None:  # what it computes counts there until its next load sample shows it
            count, sent_blocks = known[best]
            self._sent[chosen.address] = (sample.at, count + 1, sent_blocks + blocks - held)
        if blocks:
            # What we sent where: all the index knows of a worker without events (approximate mode), and of
            # the image blocks of one whose events carry no image keys; for one with events, its blocks count
            # as being computed there until the events show them stored.
            self.index.routed((chosen.address, rank or 0), prompt, now)
        return Decision(chosen, reason, rank, held, blocks)

    def _sent_since(self, address: str, sample: LoadSample | None) -> tuple[int, float]:
        """The requests we sent `address` since its load `sample`, and the blocks they compute there."""
        recorded = self._sent.get(address)
        if recorded is None or sample is None or recorded[0] != sample.at:
            return 0, 0.0
        return recorded[1], recorded[2]


def _held(candidate: Candidate, per_rank: dict[int, int] | None) -> tuple[int, int | None]:
    """The leading blocks `candidate` holds (`per_rank`: its ranks' overlap), and the rank to target for them
    (None: no targeting)."""
    if not per_rank:
        return 0, None
    if getattr(candidate, "targets_dp_rank", False) or (len(per_rank) == 1 and \
            getattr(candidate, "dp_size", 1) <= 1):
        rank = max(per_rank, key=lambda r: (per_rank[r], -r))
        return per_rank[rank], rank if getattr(candidate, "targets_dp_rank", False) else None
    # The engine places the request on a rank of its choosing: expect the mean over its ranks.
    return math.floor(sum(per_rank.values()) / max(getattr(candidate, "dp_size", 1), len(per_rank))), None


POLICY_NAMES = ("round_robin", "least_loaded", "kv_aware")


def make_policy(name: str, staleness_s: float, *, index: PrefixIndex | None = None,
                knobs: KvAwareKnobs = KvAwareKnobs()):
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded(staleness_s)
    if name == "kv_aware":
        if index is None:
            raise ValueError("the kv_aware policy needs a KV index")
        return KvAware(index, staleness_s, knobs)
    raise ValueError(f"unknown routing policy {name!r}")
