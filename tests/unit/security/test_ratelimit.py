"""The token bucket: the spec's refill formula and decision table, counted blocks, cleanup."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock

from logbroker.config import RateLimit
from logbroker.security.ratelimit import (
    MAX_TRACKED_IDENTIFIERS,
    Action,
    Bucket,
    Decision,
    RateLimiter,
)

AUTH = RateLimit(limit=10, window_ms=60_000)


class CountingLimiter(RateLimiter):
    """A limiter whose blocks are counted per action through its ``on_blocked`` hook."""

    def __init__(self, limits: dict[Action, RateLimit], *, enabled: bool, clock: Clock) -> None:
        self.blocks: dict[Action, int] = dict.fromkeys(Action, 0)
        super().__init__(limits, enabled=enabled, clock=clock, on_blocked=self._blocked_by)

    def _blocked_by(self, action: Action, identifier: str) -> None:
        self.blocks[action] += 1


def limiter(clock: Clock, *, enabled: bool = True, auth: RateLimit = AUTH) -> CountingLimiter:
    limits = {action: RateLimit(100, 1000) for action in Action}
    limits[Action.AUTH] = auth
    return CountingLimiter(limits, enabled=enabled, clock=clock)


def advance_ms(clock: Clock, ms: int) -> None:
    clock.advance(ms / 1000)


def test_a_burst_in_one_millisecond_gets_exactly_the_limit_through() -> None:
    clock = Clock()
    limits = limiter(clock)
    decisions = [limits.check("10.0.0.1", Action.AUTH) for _ in range(12)]
    assert [d.allowed for d in decisions] == [True] * 10 + [False] * 2
    # retry after = window start + window length - now, at the window's start
    assert decisions[10] == Decision(False, 60_000)
    assert limits.blocks[Action.AUTH] == 2
    assert limits.top_blocked(Action.AUTH) == [("10.0.0.1", 2)]


def test_refill_is_elapsed_times_limit_over_window() -> None:
    clock = Clock()
    limits = limiter(clock)
    for _ in range(10):
        assert limits.check("a", Action.AUTH).allowed
    # Any refill makes the count positive, which lets one attempt through (1/6000 - 1 left) ...
    advance_ms(clock, 1)
    assert limits.check("a", Action.AUTH).allowed
    # ... after which the count stays at or below 0 until 5999.0 ms of refill (10 per 60 s).
    advance_ms(clock, 5998)
    assert limits.check("a", Action.AUTH) == Decision(False, 60_000 - 5999)
    advance_ms(clock, 2)
    assert limits.check("a", Action.AUTH).allowed
    assert not limits.check("a", Action.AUTH).allowed


def test_a_count_just_above_zero_allows_one_request() -> None:
    """Exactly the decision table: "above 0" allows, consuming a whole token."""
    bucket = Bucket(tokens=0.0, last_refill_ms=0, window_start_ms=0)
    limit = RateLimit(limit=10, window_ms=60_000)
    assert bucket.check(limit, 1).allowed
    assert bucket.tokens == pytest.approx(1 / 6000 - 1)
    assert not bucket.check(limit, 2).allowed


def test_the_count_never_refills_past_the_limit() -> None:
    clock = Clock()
    limits = limiter(clock)
    limits.check("a", Action.AUTH)
    advance_ms(clock, 10 * 60_000)
    assert [limits.check("a", Action.AUTH).allowed for _ in range(11)] == [True] * 10 + [False]


def test_retry_after_counts_down_within_the_window_and_restarts_with_the_next() -> None:
    clock = Clock()
    limits = limiter(clock, auth=RateLimit(limit=1, window_ms=1000))
    assert limits.check("a", Action.AUTH).allowed  # count 0
    advance_ms(clock, 300)
    assert limits.check("a", Action.AUTH).allowed  # 0.3 is above 0: -0.7 left
    advance_ms(clock, 1)
    assert limits.check("a", Action.AUTH) == Decision(False, 699)
    # The window ended: it starts again at this check (the count refilled to 0.401 meanwhile).
    advance_ms(clock, 1100)
    assert limits.check("a", Action.AUTH).allowed
    advance_ms(clock, 1)
    assert limits.check("a", Action.AUTH) == Decision(False, 999)


def test_identifiers_and_actions_have_their_own_buckets() -> None:
    clock = Clock()
    limits = limiter(clock, auth=RateLimit(limit=1, window_ms=1000))
    assert limits.check("a", Action.AUTH).allowed
    assert not limits.check("a", Action.AUTH).allowed
    assert limits.check("b", Action.AUTH).allowed
    assert limits.check("a", Action.DASHBOARD_AUTH).allowed
    assert limits.blocks[Action.DASHBOARD_AUTH] == 0
    assert limits.top_blocked(Action.AUTH) == [("a", 1)]


def test_disabled_allows_everything_and_counts_nothing() -> None:
    limits = limiter(Clock(), enabled=False, auth=RateLimit(limit=1, window_ms=1000))
    assert all(limits.check("a", Action.AUTH).allowed for _ in range(100))
    assert limits.blocks[Action.AUTH] == 0
    assert limits.bucket_count() == 0


def test_top_blocked_is_ordered_by_count_then_identifier_and_capped() -> None:
    clock = Clock()
    limits = limiter(clock, auth=RateLimit(limit=1, window_ms=60_000))
    for identifier, attempts in [("c", 3), ("a", 2), ("b", 2), ("d", 5)]:
        for _ in range(attempts + 1):
            limits.check(identifier, Action.AUTH)
    assert limits.top_blocked(Action.AUTH) == [("d", 5), ("c", 3), ("a", 2), ("b", 2)]
    assert limits.top_blocked(Action.AUTH, 2) == [("d", 5), ("c", 3)]


def test_blocked_counts_are_bounded_forgetting_the_fewest() -> None:
    clock = Clock()
    limits = limiter(clock, auth=RateLimit(limit=1, window_ms=60_000))
    for _ in range(3):
        limits.check("loud", Action.AUTH)
    for n in range(MAX_TRACKED_IDENTIFIERS + 5):
        limits.check(f"ip{n}", Action.AUTH)
        limits.check(f"ip{n}", Action.AUTH)
    top = limits.top_blocked(Action.AUTH, MAX_TRACKED_IDENTIFIERS + 10)
    assert len(top) == MAX_TRACKED_IDENTIFIERS
    assert top[0] == ("loud", 2)
    assert limits.blocks[Action.AUTH] == 2 + MAX_TRACKED_IDENTIFIERS + 5


def test_cleanup_forgets_only_buckets_that_are_full_and_out_of_their_window() -> None:
    clock = Clock()
    limits = limiter(clock)
    limits.check("old", Action.AUTH)
    advance_ms(clock, 30_000)
    limits.check("recent", Action.AUTH)
    advance_ms(clock, 30_000)
    assert limits.remove_expired() == 1
    assert limits.bucket_count() == 1
    # Blocks stay reported after the bucket is gone.
    advance_ms(clock, 60_000)
    assert limits.remove_expired() == 1
    assert limits.bucket_count() == 0


def test_blocks_are_reported_to_the_hook() -> None:
    seen: list[tuple[Action, str]] = []
    limits = RateLimiter(
        {Action.AUTH: RateLimit(1, 1000)},
        enabled=True,
        clock=Clock(),
        on_blocked=lambda action, identifier: seen.append((action, identifier)),
    )
    limits.check("a", Action.AUTH)
    limits.check("a", Action.AUTH)
    assert seen == [(Action.AUTH, "a")]


@given(
    limit=st.integers(1, 50),
    window_ms=st.integers(1, 120_000),
    steps=st.lists(st.integers(0, 5000), min_size=1, max_size=200),
)
def test_never_more_than_limit_plus_refill_get_through(
    limit: int, window_ms: int, steps: list[int]
) -> None:
    """Over any run, allowed <= limit + 1 + refill over the elapsed time (the one extra is the
    fractional count above 0 of the decision table)."""
    clock = Clock()
    limits = limiter(clock, auth=RateLimit(limit, window_ms))
    allowed = 0
    for step in steps:
        advance_ms(clock, step)
        decision = limits.check("a", Action.AUTH)
        allowed += decision.allowed
        assert decision.allowed or 0 < decision.retry_after_ms <= window_ms
    elapsed = sum(steps) - steps[0]
    assert allowed <= limit + 1 + elapsed * limit / window_ms


def test_cleanup_keeps_a_bucket_that_is_not_full_again() -> None:
    """A bucket driven below 0 needs more than one window to refill: forgetting it early would
    hand its owner extra attempts."""
    clock = Clock()
    limits = limiter(clock, auth=RateLimit(limit=2, window_ms=1000))
    for _ in range(3):
        limits.check("a", Action.AUTH)
    advance_ms(clock, 1)
    limits.check("a", Action.AUTH)  # a fraction above 0 lets this through: about -1 left
    advance_ms(clock, 1000)
    assert limits.remove_expired() == 0
    advance_ms(clock, 500)
    assert limits.remove_expired() == 1
