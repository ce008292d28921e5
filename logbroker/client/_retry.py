"""Idempotent produce on the client side, the pure part: stamps, the window, the retry schedule.

Every client object is a producer: it picks a random 64-bit producer id and numbers its produces
from 0, one sequence per ``produce`` call, never reused. It sends sequence ``s`` only once every
produce up to ``s - PRODUCER_WINDOW`` has finished (``SequenceWindow``), which is what lets each
range remember a window of sequences per producer rather than all of them (docs/protocol.md).

A produce answered ``not_primary``, ``unreachable`` or ``no_quorum`` is sent again with the same
stamp after a back-off (``ProduceRetry``, ``Retries``): the ranges that stored it the first time
do not store it again. No I/O here; the clients bring the clock and the socket.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable

import attrs

from logbroker.errors import Reason
from logbroker.wire import PRODUCER_WINDOW

#: The refusals a produce is retried after: each means "not stored here now, try again".
RETRIED_REASONS: frozenset[str] = frozenset(
    {Reason.NOT_PRIMARY, Reason.UNREACHABLE, Reason.NO_QUORUM, Reason.STORAGE_UNAVAILABLE}
)


def new_producer_id() -> int:
    """A random producer id: from the system's randomness, so that processes forked from one
    parent never share one."""
    return secrets.randbits(64)


def _at_least(minimum: float) -> Callable[[object, attrs.Attribute[float], float], None]:
    def check(_: object, attribute: attrs.Attribute[float], value: float) -> None:
        if not value >= minimum:
            raise ValueError(f"{attribute.name} must be at least {minimum}, not {value!r}")

    return check


def _fraction(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 <= value <= 1:
        raise ValueError(f"{attribute.name} must be between 0 and 1, not {value!r}")


@attrs.frozen
class ProduceRetry:
    """How a produce refused ``not_primary``, ``unreachable`` or ``no_quorum`` is retried: after
    ``first_delay`` seconds, each later delay ``multiplier`` times the one before up to
    ``max_delay``, each shortened at random by up to ``jitter`` of it (so that clients refused
    together do not come back together); no retry starts later than ``give_up_after`` seconds
    after the first try, and the produce then fails with the last refusal."""

    first_delay: float = attrs.field(default=0.05, validator=_at_least(0))
    multiplier: float = attrs.field(default=2.0, validator=_at_least(1))
    max_delay: float = attrs.field(default=1.0, validator=_at_least(0))
    give_up_after: float = attrs.field(default=30.0, validator=_at_least(0))
    jitter: float = attrs.field(default=0.5, validator=_fraction)

    def delay(self, retry: int, draw: float) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first), ``draw`` being
        uniform in [0, 1)."""
        try:
            nominal = min(self.max_delay, self.first_delay * self.multiplier ** (retry - 1))
        except OverflowError:
            nominal = self.max_delay
        return nominal * (1 - self.jitter * draw)


#: What the clients retry with unless told otherwise.
DEFAULT_PRODUCE_RETRY = ProduceRetry()


class Retries:
    """The retries of one produce, whose first try started at ``started`` (seconds on the
    client's clock); ``give_up_after`` (seconds) overrides the policy's."""

    def __init__(
        self,
        policy: ProduceRetry,
        started: float,
        give_up_after: float | None = None,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self._policy = policy
        self._deadline = started + (
            policy.give_up_after if give_up_after is None else give_up_after
        )
        self._draw = draw
        self._retries = 0

    def remaining(self, now: float) -> float:
        """Seconds left before the produce gives up (0 once it has)."""
        return max(0.0, self._deadline - now)

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the next try, or None: give up (it would start too late)."""
        self._retries += 1
        delay = self._policy.delay(self._retries, self._draw())
        return delay if now + delay <= self._deadline else None


class SequenceWindow:
    """A producer's sequences: ``take`` the next one when the window lets it go out, ``finish``
    it once its produce has finished (answered, or given up)."""

    def __init__(self, size: int = PRODUCER_WINDOW) -> None:
        self._size = size
        self._next = 0
        self._unfinished: set[int] = set()

    def take(self) -> int | None:
        """The next sequence, now unfinished; None while the oldest unfinished one is
        ``size`` or more behind it."""
        sequence = self._next
        if self._unfinished and sequence - min(self._unfinished) >= self._size:
            return None
        self._next += 1
        self._unfinished.add(sequence)
        return sequence

    def finish(self, sequence: int) -> None:
        self._unfinished.discard(sequence)
