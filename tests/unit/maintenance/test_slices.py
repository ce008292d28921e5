"""``Slices``: a long pass lets the reactor turn once it has run its slice, not before."""

from __future__ import annotations

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from logbroker.maintenance.slices import Slices


def _pass(clock: Clock, items: int, seconds: float, done: list[object]) -> Slices:
    """A pass over ``items`` that each take a millisecond of ``clock``; each noted in ``done``."""
    slices = Slices(clock, seconds)

    async def run() -> None:
        for item in range(items):
            await slices.next()
            done.append(item)
            clock.rightNow += 0.001

    Deferred.fromCoroutine(run())
    return slices


def test_a_pass_within_its_slice_runs_at_once() -> None:
    clock, done = Clock(), list[object]()
    slices = _pass(clock, 9, 0.01, done)
    assert done == list(range(9))
    assert slices.breaks == 0


def test_a_long_pass_lets_other_work_run_between_slices() -> None:
    clock, done = Clock(), list[object]()
    for _ in range(3):
        clock.callLater(0, done.append, "other")
    slices = _pass(clock, 35, 0.01, done)
    # The first slice ran ten items (10 ms), then the pass gave the reactor back.
    assert done == list(range(10))
    clock.advance(0)
    # Other work waiting ran before the rest of the pass; the pass went on, ten at a time.
    assert done == [*range(10), "other", "other", "other", *range(10, 35)]
    assert slices.breaks == 3
