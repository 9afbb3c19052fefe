"""Per-key limits on a fake clock: token buckets for requests/s and tokens/min, concurrency, Retry-After."""

import pytest

from orchestrator.config import KeyLimits
from orchestrator.errors import RateLimited
from orchestrator.frontend.limits import KeyLimiter, TokenBucket


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_refills_at_its_rate_up_to_its_capacity_and_may_go_into_debt():
    bucket = TokenBucket(rate=2.0, capacity=4.0, now=0.0)
    assert bucket.wait(4, 0.0) == 0
    bucket.take(10, 0.0)  # tokens are counted after use: into debt
    assert bucket.wait(1, 0.0) == pytest.approx(3.5)  # -6 -> 1 at 2 per second
    assert bucket.wait(1, 100.0) == 0 and bucket.level == 4.0  # never above capacity


def refusal(limiter: KeyLimiter) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        limiter.admit()
    return info.value


def test_requests_per_second_allow_one_second_of_burst_then_say_when_to_retry():
    clock = Clock()
    limiter = KeyLimiter("team", KeyLimits(requests_per_s=3), clock)
    for _ in range(3):
        limiter.admit()
        limiter.release()
    refused = refusal(limiter)
    assert refused.code == "rate_limit_exceeded" and refused.retry_after == 1
    clock.now += 0.34
    limiter.admit()  # one request's worth is back


def test_tokens_per_minute_admit_while_the_bucket_is_above_zero_and_charge_what_was_used():
    clock = Clock()
    limiter = KeyLimiter("team", KeyLimits(tokens_per_min=600), clock)  # 10 a second
    limiter.admit()
    limiter.charge(500)
    limiter.charge(250)  # 600 - 750: 150 in debt
    limiter.release()
    refused = refusal(limiter)
    assert refused.code == "token_limit_exceeded" and refused.retry_after == 16  # (150 + 1) / 10, rounded up
    clock.now += 16
    limiter.admit()


def test_concurrency_is_released_whatever_way_a_request_ended():
    limiter = KeyLimiter("team", KeyLimits(max_concurrency=2), Clock())
    limiter.admit()
    limiter.admit()
    assert refusal(limiter).code == "concurrency_limit_exceeded" and limiter.in_flight == 2
    limiter.release()
    limiter.admit()


def test_a_refused_request_takes_nothing_from_the_other_limits():
    clock = Clock()
    limiter = KeyLimiter("team", KeyLimits(requests_per_s=1, max_concurrency=1), clock)
    limiter.admit()
    assert refusal(limiter).code == "concurrency_limit_exceeded"
    limiter.release()
    assert refusal(limiter).code == "rate_limit_exceeded"
    clock.now += 1
    limiter.admit()
