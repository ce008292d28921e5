"""The seals of segments that rolled over, made behind the appends.

When a range's active segment is full, the write that rolls creates the next segment's file
and appends go on there at once; the full segment is sealed behind them: read back and
verified, its index and seal marker derived from those bytes and made durable
(``_seal_rolled``). For a 64 MiB segment that takes tens of milliseconds, which every produce
to the range waited for while the roll sealed first (a produce's p99.9 of about 100 ms on one
node, against 15 ms with segments too large to roll during the run). Until its seal is
durable the segment is ``CLOSED``: readable (its index lives in memory), taking no appends,
not yet retention's or the scrub's.

A crash before the seal is durable leaves an unsealed segment before the last one; the log
seals it once open. A seal that fails (a full disk) is logged, the segment stays closed, and
it is tried again at the next roll, return to service or start.

Seals run one at a time per log, in offset order, so that each seal's hook (which records the
sealed segment and its successor in the control plane) hears of them in order. Only a log
that rolls its own segments has any: a replica's end with ``seal_copy``, which can be made
behind the appends too (``CopySealsBehind``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TypeVar

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.storage._executor import Executor
from logbroker.storage._fs import FileSystem
from logbroker.storage._jobs import Rolled, SealPlan, _seal_rolled, plan_seal
from logbroker.storage._segment import CopyState, Segment
from logbroker.storage._state import LogState

log = Logger()

_T = TypeVar("_T")


def awaits_seal(state: LogState, segment: Segment) -> bool:
    """Whether ``segment`` rolled over and waits for its seal behind the appends
    (``_rolled_unsealed``)."""
    return not state.replicated and _rolled_unsealed(segment, state.following(segment))


def first_awaiting_seal(state: LogState) -> Segment | None:
    """The first segment that waits for its seal behind the appends, in one pass."""
    if state.replicated:
        return None
    pairs = itertools.pairwise(state.segments)
    return next((segment for segment, after in pairs if _rolled_unsealed(segment, after)), None)


def _rolled_unsealed(segment: Segment, following: Segment | None) -> bool:
    """A closed, unsealed segment of a log that rolls its own, before another and ending
    where it begins, as a roll leaves it (a segment before a gap is a copy some replication
    left, which only its primary seals). One found damaged after it rolled counts too: it is
    sealed as a roll that found the rot would have sealed it."""
    return (
        segment.state is CopyState.CLOSED
        and not segment.has_marker
        and following is not None
        and segment.next_offset == following.base_offset
    )


def _seal_whole_file(fs: FileSystem, plan: SealPlan) -> Rolled:
    """``_seal_rolled`` of the segment's file as it is on disk: every byte of it was durable
    when it rolled (or recovery kept), even where rot found since narrowed what reads reach."""
    return _seal_rolled(fs, attrs.evolve(plan, byte_size=fs.size(plan.path)))


class _IdleWaiters:
    """What waits for seals to stop running: told once they have."""

    def __init__(self) -> None:
        self._waiting: list[Deferred[None]] = []

    def wait(self, idle: bool) -> Deferred[None]:
        """Fire at once when ``idle``, else at the next ``wake``."""
        if idle:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._waiting.append(waiter)
        return waiter

    def wake(self) -> None:
        waiters, self._waiting = self._waiting, []
        for waiter in waiters:
            waiter.callback(None)


class SealsBehind:
    """The seals behind the appends of one range log (see the module docstring)."""

    def __init__(self, state: LogState, fs: FileSystem, executor: Executor) -> None:
        self._state = state
        self._fs = fs
        self._executor = executor
        self._running = False
        self._closing = False
        self._idle = _IdleWaiters()

    def start(self) -> None:
        """Seal the first segment before the last that rolled over and is not sealed yet,
        then the next, until none is left (or one fails)."""
        if self._running or self._closing or self._state.replicated:
            return
        self._running = True
        self._seal_next()

    def _seal_next(self) -> None:
        # A loop, not a callback chain: an executor that runs jobs at once (and a log opened
        # after a crash with hundreds of segments to seal) would otherwise recurse once per
        # segment, past Python's limit.
        while True:
            segment = None if self._closing else first_awaiting_seal(self._state)
            if segment is None:
                self._stop()
                return
            going_on: list[bool] = []
            sealing = self._executor.run(_seal_whole_file, self._fs, plan_seal(segment))
            outcome: Deferred[bool] = sealing.addCallbacks(
                self._sealed, self._failed, callbackArgs=(segment,), errbackArgs=(segment,)
            )
            outcome.addCallback(going_on.append)
            if not going_on:
                # A writer thread seals it: go on from its outcome.
                outcome.addCallback(self._resume, going_on)
                return
            if not going_on[0]:
                self._stop()
                return

    def settled(self) -> Deferred[None]:
        """Fire once no seal runs and none starts by itself: every segment that rolled over is
        sealed, or the last seal tried failed (an explicit roll waits for this, so that seals
        are recorded in order)."""
        self.start()
        return self._idle.wait(not self._running)

    def close(self) -> Deferred[None]:
        """Start no more seals; fire once the one running, if any, has ended."""
        self._closing = True
        return self._idle.wait(not self._running)

    def _sealed(self, rolled: Rolled, segment: Segment) -> bool:
        state = self._state
        if state.holds(segment) and segment.state is CopyState.CLOSED:
            state.mark_sealed(segment, rolled.sealed, rolled.damage)
        return True

    def _failed(self, failure: Failure, segment: Segment) -> bool:
        log.failure(
            "Sealing {path} failed; it stays closed (readable, taking no appends) and its seal"
            " is tried again at the range's next roll, return to service or start",
            failure,
            path=segment.path,
        )
        return False

    def _resume(self, _: object, going_on: list[bool]) -> None:
        if going_on[0]:
            self._seal_next()
        else:
            self._stop()

    def _stop(self) -> None:
        self._running = False
        self._idle.wake()


class CopySealsBehind:
    """The seals of a replica's copies made behind its appends (``seal_copy`` with
    ``behind``): which are under way, and what waits for them.

    A copy sealed so is closed in the log's queue, at once (it takes no more appends, and the
    next segment may start); its read back and sidecars, tens of milliseconds for a full
    segment and several hundred with every range of three nodes sealing at once, run after
    that, outside the queue, while appends go on in the next segment. Until they are durable
    the copy is ``CLOSED``: readable, its records committed (the control plane holds its
    seal). A crash meanwhile leaves it so, for healing to seal in place; so does a seal that
    fails (logged).

    Every other operation on the segment (fence, trim, seal, delete, install) waits for its
    seal behind to end (``after``), so that none changes the files it is writing.
    """

    def __init__(self) -> None:
        #: Base offset of each copy being sealed -> what waits for its seal to end.
        self._running: dict[int, list[Deferred[None]]] = {}
        self._idle = _IdleWaiters()

    def sealing(self, base_offset: int) -> bool:
        return base_offset in self._running

    def run(self, base_offset: int, sealing: Deferred[None]) -> None:
        """``sealing`` is the seal behind of the copy at ``base_offset`` (it never fails: its
        failures are its own to log)."""
        self._running[base_offset] = []
        sealing.addBoth(self._ended, base_offset)

    def after(self, base_offset: int, call: Callable[[], Deferred[_T]]) -> Deferred[_T]:
        """``call()`` once the seal behind of the copy at ``base_offset`` has ended (at once
        when there is none)."""
        waiting = self._running.get(base_offset)
        if waiting is None:
            return call()
        ended: Deferred[None] = Deferred()
        waiting.append(ended)
        return ended.addCallback(lambda _: call())

    def settled(self) -> Deferred[None]:
        """Fire once no copy seal runs behind the appends."""
        return self._idle.wait(not self._running)

    def _ended(self, _: object, base_offset: int) -> None:
        for waiter in self._running.pop(base_offset):
            waiter.callback(None)
        if not self._running:
            self._idle.wake()
