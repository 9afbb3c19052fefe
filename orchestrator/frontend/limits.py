"""Per-key limits: requests per second and tokens per minute as token buckets, and requests in flight.

Checked when a request arrives, before its body is read, so a key over its limits costs no tokenizer and
no worker: a 429 with Retry-After (RateLimited). Tokens (prompt + completion) are taken when they are
known: the prompt's once the request is planned, the completion's when it ends; the bucket may go below
zero then, and the key's next request waits until it is back above zero. So a key may burst one second
of requests and one minute of tokens, and over time gets what its limits say.

Each orchestrator process keeps its own buckets: limits hold per replica (per frontend process with
`http.processes` > 1), not across a fleet.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from orchestrator.config import KeyLimits
from orchestrator.errors import RateLimited


class TokenBucket:
    """`rate` per second, holding at most `capacity`; starts full."""

    __slots__ = ("rate", "capacity", "level", "_at")

    def __init__(self, rate: float, capacity: float, now: float):
        self.rate, self.capacity, self.level, self._at = rate, capacity, capacity, now

    def _fill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now

    def wait(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds `amount` (0: it does now)."""
        self._fill(now)
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        """Take `amount`, into debt if need be (tokens are counted after they were used)."""
        self._fill(now)
        self.level -= amount


class KeyLimiter:
    """One key's limits. `admit()` before a request (raises RateLimited), then `charge()` its tokens as they
    become known and `release()` once it ended, whatever way."""

    def __init__(self, key: str, limits: KeyLimits, clock: Callable[[], float] = time.monotonic):
        self.key, self.clock = key, clock
        now = clock()
        self.requests = (None if limits.requests_per_s is None else
                         TokenBucket(limits.requests_per_s, max(1.0, limits.requests_per_s), now))
        self.tokens = (None if limits.tokens_per_min is None else
                       TokenBucket(limits.tokens_per_min / 60.0, float(limits.tokens_per_min), now))
        self.max_concurrency = limits.max_concurrency
        self.in_flight = 0

    def admit(self) -> None:
        """Count the request in, or raise RateLimited naming the limit (`code`) and when to retry."""
        if self.max_concurrency is not None and self.in_flight >= self.max_concurrency:
            raise RateLimited(f"API key {self.key!r} has {self.in_flight} requests in flight, its limit "
                              f"(max_concurrency); retry when one has finished", code="concurrency_limit_exceeded",
                              retry_after=1)
        now = self.clock()
        if self.requests is not None and (wait := self.requests.wait(1, now)) > 0:
            raise RateLimited(f"API key {self.key!r} is over its limit of {self.requests.rate:g} requests per second; "
                              f"retry in {_seconds(wait)} s", code="rate_limit_exceeded", retry_after=_seconds(wait))
        if self.tokens is not None and (wait := self.tokens.wait(1, now)) > 0:
            raise RateLimited(f"API key {self.key!r} is over its limit of {self.tokens.rate * 60:g} tokens per minute; "
                              f"retry in {_seconds(wait)} s", code="token_limit_exceeded", retry_after=_seconds(wait))
        if self.requests is not None:
            self.requests.take(1, now)
        self.in_flight += 1

    def charge(self, tokens: int) -> None:
        if self.tokens is not None and tokens:
            self.tokens.take(tokens, self.clock())

    def release(self) -> None:
        self.in_flight -= 1


def _seconds(wait: float) -> int:
    """Retry-After is whole seconds; rounding down would send the client back too early."""
    return max(1, math.ceil(wait))


class KeyAccount:
    """One API key's usage series (metrics.KeyUsage) and, when it has limits, its limiter."""

    def __init__(self, name: str, usage, limits: KeyLimits | None, clock: Callable[[], float] = time.monotonic):
        self.name, self.usage = name, usage
        self.limiter = None if limits is None else KeyLimiter(name, limits, clock)

    def admit(self) -> None:
        if self.limiter is not None:
            try:
                self.limiter.admit()
            except RateLimited as refusal:
                self.usage.rejections[refusal.code].inc()
                raise
        self.usage.requests.inc()

    def planned(self, prompt_tokens: int) -> None:
        if self.limiter is not None:
            self.limiter.charge(prompt_tokens)

    def ended(self, answered: tuple[int, int, int | None] | None) -> None:
        """An admitted request ended; `answered` is its usage (prompt, completion, cached) if it was answered."""
        if answered is not None:
            self.usage.answered(*answered)
        if self.limiter is not None:
            if answered is not None:
                self.limiter.charge(answered[1])
            self.limiter.release()
