"""Token-bucket rate limits per identifier (a client IP) and action, exactly as the spec states.

A bucket holds a token count, the time of its last refill and the start of its window, all in
milliseconds. Each check first refills::

    tokens_to_add = elapsed_ms * (limit / window_ms)
    new_count = min(limit, count + tokens_to_add)

then decides: a count above 0 allows the request and consumes one token; a count of 0 or below
blocks it, counts the block against the identifier and the action, and tells the caller to retry
after ``window_start + window_ms - now``. A window that has ended starts again at the check that
finds it ended, so that figure is always in ``(0, window_ms]``.

Because refill is continuous and any positive count allows a request, a burst of checks within
one millisecond gets ``limit`` of them through; a check a moment later may get one more (the count
is then a fraction above 0), after which the count is negative and stays blocked until it has
refilled past 0. The arithmetic is the spec's; the tests pin this behaviour.

The limiter is pure apart from the injected clock. It is enabled or not as a whole
(``SVC_RATE_LIMIT_ENABLED``): disabled, every check is allowed and nothing is counted.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from enum import StrEnum

import attrs
from twisted.internet.interfaces import IReactorTime

from logbroker.config import RateLimit


class Action(StrEnum):
    """What is being limited. Only ``auth`` and ``dashboard_auth`` are ever checked: the spec
    has ``publish`` and ``subscribe`` configured and reported, never applied."""

    AUTH = "auth"
    DASHBOARD_AUTH = "dashboard_auth"
    PUBLISH = "publish"
    SUBSCRIBE = "subscribe"


#: Identifiers whose blocks are remembered per action, for ``top_blocked``; past it, the one
#: with the fewest blocks is forgotten, so that a flood from many addresses cannot grow memory.
MAX_TRACKED_IDENTIFIERS = 10_000


@attrs.frozen
class Decision:
    allowed: bool
    #: Milliseconds until a retry can succeed; 0 when allowed.
    retry_after_ms: int = 0


ALLOWED = Decision(allowed=True)


@attrs.define
class Bucket:
    """One identifier's bucket for one action."""

    tokens: float
    last_refill_ms: int
    window_start_ms: int

    def check(self, limit: RateLimit, now_ms: int) -> Decision:
        """Refill for the time elapsed, then allow (consuming a token) or block."""
        elapsed = max(0, now_ms - self.last_refill_ms)
        self.tokens = min(limit.limit, self.tokens + elapsed * (limit.limit / limit.window_ms))
        self.last_refill_ms = max(self.last_refill_ms, now_ms)
        if now_ms >= self.window_start_ms + limit.window_ms:
            self.window_start_ms = now_ms
        if self.tokens > 0:
            self.tokens -= 1
            return ALLOWED
        return Decision(False, self.window_start_ms + limit.window_ms - now_ms)

    def expired(self, limit: RateLimit, now_ms: int) -> bool:
        """Refilled to its limit and out of its window: a new bucket would decide the same, so
        forgetting it changes no future decision."""
        refill = max(0, now_ms - self.last_refill_ms) * (limit.limit / limit.window_ms)
        full = self.tokens + refill >= limit.limit
        return full and now_ms >= self.window_start_ms + limit.window_ms


class RateLimiter:
    """The buckets and blocked counters of every limited action."""

    def __init__(
        self,
        limits: Mapping[Action, RateLimit],
        *,
        enabled: bool,
        clock: IReactorTime,
        on_blocked: Callable[[Action, str], None] = lambda action, identifier: None,
    ) -> None:
        self.enabled = enabled
        self._limits = dict(limits)
        self._clock = clock
        self._on_blocked = on_blocked
        self._buckets: dict[tuple[Action, str], Bucket] = {}
        #: Blocks per identifier, for ``top_blocked``; the totals are counted by ``on_blocked``.
        self._blocked: dict[Action, dict[str, int]] = {action: {} for action in Action}

    def limit(self, action: Action) -> RateLimit:
        return self._limits[action]

    def check(self, identifier: str, action: Action) -> Decision:
        """Decide one attempt of ``action`` by ``identifier`` (and count it if blocked)."""
        if not self.enabled:
            return ALLOWED
        limit = self._limits[action]
        now = self._now_ms()
        bucket = self._buckets.get((action, identifier))
        if bucket is None:
            bucket = self._buckets[action, identifier] = Bucket(limit.limit, now, now)
        decision = bucket.check(limit, now)
        if not decision.allowed:
            self._count_block(action, identifier)
        return decision

    def _count_block(self, action: Action, identifier: str) -> None:
        counts = self._blocked[action]
        if identifier not in counts and len(counts) >= MAX_TRACKED_IDENTIFIERS:
            del counts[min(counts, key=counts.__getitem__)]
        counts[identifier] = counts.get(identifier, 0) + 1
        self._on_blocked(action, identifier)

    def top_blocked(self, action: Action, count: int = 10) -> list[tuple[str, int]]:
        """The identifiers blocked most often, most first (ties by identifier)."""
        items = self._blocked[action].items()
        return heapq.nsmallest(count, items, key=lambda item: (-item[1], item[0]))

    def remove_expired(self) -> int:
        """Forget the buckets that are full and out of their window; return how many."""
        now = self._now_ms()
        expired = [
            key
            for key, bucket in self._buckets.items()
            if bucket.expired(self._limits[key[0]], now)
        ]
        for key in expired:
            del self._buckets[key]
        return len(expired)

    def bucket_count(self) -> int:
        return len(self._buckets)

    def _now_ms(self) -> int:
        return round(self._clock.seconds() * 1000)
