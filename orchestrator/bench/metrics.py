"""Serving metrics from request timelines. Pure arithmetic, tested on hand-made timelines.

Definitions (the ones serving benchmarks quote):
- TTFT: first content chunk - request start.
- TPOT: (last token time - first token time) / (output tokens - 1), per request (needs >= 2 tokens).
- ITL: time between consecutive chunks, spread over the tokens a chunk carries (a chunk of k tokens
  after a gap g contributes k gaps of g/k), so coalesced streams are not flattered.
- E2E latency: end - start.
- Throughput: requests/s and output tokens/s over the measured window (first start to last end).
- Tokens/s per user: mean over requests of output tokens / (end - first token) for streaming users.
- Tokens/s per GPU: output tokens/s divided by the topology's GPU count.
- Goodput: requests/s that met every SLO bound given (TTFT and/or TPOT).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs


@attrs.frozen
class RequestRecord:
    start: float
    end: float
    chunks: tuple[tuple[float, int], ...] = ()  # (arrival time, tokens in the chunk)
    output_tokens: int = 0
    input_tokens: int = 0
    error: str | None = None  # error kind, e.g. "http_429", "timeout", "connection"
    error_message: str | None = None  # what the server said (its OpenAI error message), when it said something

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.start if self.chunks else None

    @property
    def tpot(self) -> float | None:
        if not self.chunks or self.output_tokens < 2:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        gaps = []
        for (previous, _), (at, tokens) in zip(self.chunks, self.chunks[1:]):
            k = max(tokens, 1)
            gaps.extend([(at - previous) / k] * k)
        return gaps

    @property
    def e2e(self) -> float:
        return self.end - self.start


@attrs.frozen
class Overhead:
    """The time of a request that is not the workers' simulated GPU time: the client's, the orchestrator's and
    the workers' own CPU. Measured on the same topology with workers at time scale 0 (zero GPU time), so a
    conversion to GPU time leaves it as it is instead of multiplying it by 1/time_scale."""

    ttft_s: float = 0.0  # request start to its first token
    per_token_s: float = 0.0  # from one token to the next
    tail_s: float = 0.0  # last token to the end of the response

    @classmethod
    def measure(cls, records: Sequence[RequestRecord]) -> Overhead:
        """Medians over the completed requests of a zero-cost run (zeros if none completed): a host's hiccups
        skew a mean, and the conversion multiplies every error in these by 1/time_scale - 1."""
        ok = [r for r in records if r.ok]
        if not ok:
            return cls()
        per_token = [(r.chunks[-1][0] - r.chunks[0][0]) / (r.output_tokens - 1) for r in ok if r.output_tokens >= 2]
        return cls(ttft_s=percentile([r.chunks[0][0] - r.start for r in ok], 50),
                   per_token_s=percentile(per_token, 50) if per_token else 0.0,
                   tail_s=percentile([r.end - r.chunks[-1][0] for r in ok], 50))


def to_gpu_time(records: Sequence[RequestRecord], time_scale: float, overhead: Overhead | None = None, *,
                closed_loop: bool = False) -> list[RequestRecord]:
    """A run against simulated workers at `time_scale`, converted to GPU time.

    Within a request, each interval (start to first token, token to token, last token to end) keeps its share of
    `overhead` and has the rest, the simulated GPU time, divided by `time_scale`; no overhead given: all of it
    is divided (which overstates the orchestrator's time by 1/time_scale).

    Between requests, every start is stretched around one origin (the first start), so that the gaps between
    requests scale with their durations and rates stay consistent with latencies: by 1/time_scale for scheduled
    arrivals (the load generator paced them in scaled time), by the ratio of the converted to the measured
    request time for a `closed_loop` (each user sends when its last request ended). (Rescaling each request
    around its own start alone leaves the window unscaled and inflates every rate.)
    """
    if (time_scale == 1.0 and overhead is None) or not records:
        return list(records)
    cost = overhead or Overhead()

    def gpu(interval: float, own: float) -> float:
        """An interval of which `own` s are not GPU time (never more than the interval itself)."""
        own = min(own, max(interval, 0.0))
        return own + (interval - own) / time_scale if time_scale > 0 else interval

    converted = []
    for r in records:
        offsets, at, previous = [], 0.0, r.start
        for i, (chunk_at, tokens) in enumerate(r.chunks):
            at += gpu(chunk_at - previous, cost.ttft_s if i == 0 else cost.per_token_s * max(tokens, 1))
            offsets.append((at, tokens))
            previous = chunk_at
        duration = at + gpu(r.end - previous, cost.tail_s if r.chunks else cost.ttft_s)
        converted.append((r, offsets, duration))
    measured = sum(r.end - r.start for r in records)
    stretch = (sum(d for _, _, d in converted) / measured if closed_loop and measured > 0
               else 1.0 / time_scale if time_scale > 0 else 1.0)
    origin = min(r.start for r in records)
    out = []
    for r, offsets, duration in converted:
        start = origin + (r.start - origin) * stretch
        out.append(attrs.evolve(r, start=start, end=start + duration,
                                chunks=tuple((start + offset, k) for offset, k in offsets)))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def aggregate(records: Sequence[RequestRecord], *, gpus: int = 1, slo_ttft: float | None = None,
              slo_tpot: float | None = None) -> dict:
    """All figures of one run (seconds and per-second units)."""
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    messages: dict[str, str] = {}  # the first message of each error kind
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
            if r.error_message and r.error not in messages:
                messages[r.error] = r.error_message
    if records:
        window = max(r.end for r in records) - min(r.start for r in records)
    else:
        window = 0.0
    output = sum(r.output_tokens for r in ok)
    per_user = [r.output_tokens / (r.end - r.chunks[0][0]) for r in ok
                if r.output_tokens >= 2 and r.end > r.chunks[0][0]]

    def meets(r: RequestRecord) -> bool:
        if slo_ttft is not None and (r.ttft is None or r.ttft > slo_ttft):
            return False
        if slo_tpot is not None and r.tpot is not None and r.tpot > slo_tpot:
            return False
        return True

    good = [r for r in ok if meets(r)]
    rate = (lambda n: n / window) if window > 0 else (lambda n: 0.0)
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": errors,
        "error_messages": messages,
        "duration_s": window,
        "ttft_s": summary([t for r in ok if (t := r.ttft) is not None]),  # ok: it has chunks, so a ttft
        "tpot_s": summary([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": summary([gap for r in ok for gap in r.itls]),
        "e2e_s": summary([r.e2e for r in ok]),
        "request_throughput": rate(len(ok)),
        "output_tokens_per_s": rate(output),
        "tokens_per_s_per_user": sum(per_user) / len(per_user) if per_user else math.nan,
        "tokens_per_s_per_gpu": rate(output) / max(gpus, 1),
        "goodput": rate(len(good)),
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot, "met": len(good)},
        "input_tokens_mean": sum(r.input_tokens for r in ok) / len(ok) if ok else math.nan,
        "output_tokens_mean": output / len(ok) if ok else math.nan,
    }
