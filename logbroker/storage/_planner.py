"""When a range log writes, and what each write takes: the group-commit planner.

Pure (sans-IO): no files, no clock, no Deferreds. The range log tells it what happened (an append
or a control operation was queued at time ``now``, the timer it asked for fired, a job finished,
the log is closing) and each event answers with the next ``Step``:

* ``WAIT``: nothing to do now (the queue is empty, a job is running, or a timer is armed);
* ``ArmTimer(delay)``: park the queued appends; call ``timer_fired`` in ``delay`` seconds;
* ``FLUSH_NOW``: write now; ``take`` says which appends the write carries and whether the active
  segment rolls first (a write cancels any armed timer);
* ``RunControl(item)``: run this control operation (roll, trim, fence...) now.

A job starts with the answer that starts it (``take`` after ``FLUSH_NOW``, or ``RunControl``)
and ends when the log says so (``written`` for a write's records, then ``job_finished``). At most
one job runs at a time, and queued work runs in order: a control operation runs after the
appends queued before it and before those queued after it.

The rules:

* without group commit, queued appends are written as soon as no job runs;
* with group commit, an append is parked for up to ``interval`` seconds, counted from when it was
  queued (even behind a running job), so that more can join it; ``flush_max_records`` parked
  records, a queued control operation (which must not wait for the timer) or closing make the
  parked appends due at once;
* one write takes at most ``flush_max_records`` records, and never takes the active segment past
  ``roll_bytes``, except that a single append larger than that goes alone into an empty segment.
  When the first append would take a non-empty segment past ``roll_bytes``, the segment rolls
  first. Appends a write leaves behind are due at once;
* an append that would take the parked and in-flight records past ``max_inflight_records`` is
  refused (``overloaded``) by the caller before it is queued.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import attrs

_A = TypeVar("_A")
_C = TypeVar("_C")


@attrs.frozen
class Wait:
    """Nothing to do until the next event."""


@attrs.frozen
class FlushNow:
    """Write now: call ``CommitPlanner.take``."""


WAIT = Wait()
FLUSH_NOW = FlushNow()


@attrs.frozen
class ArmTimer:
    """Call ``CommitPlanner.timer_fired`` after ``delay`` seconds (unless a write comes first)."""

    delay: float


@attrs.frozen
class RunControl(Generic[_C]):
    """Run this control operation now; call ``job_finished`` when it is done."""

    control: _C


Step = Wait | FlushNow | ArmTimer | RunControl[_C]


@attrs.frozen
class Write(Generic[_A]):
    """The appends one write carries, in queue order, and whether the active segment seals
    before it (the appends then start the next segment)."""

    appends: list[_A]
    roll: bool
    records: int
    size: int


@attrs.frozen
class _Control(Generic[_C]):
    item: _C


class CommitPlanner(Generic[_A, _C]):
    """Plans the writes and control operations of one range log (see the module docstring)."""

    def __init__(
        self,
        *,
        group_commit: bool,
        interval: float,
        flush_max_records: int,
        max_inflight_records: int,
        roll_bytes: int,
    ) -> None:
        self._group_commit = group_commit
        self._interval = interval
        self._flush_max_records = flush_max_records
        self._max_inflight_records = max_inflight_records
        self._roll_bytes = roll_bytes
        #: Appends as (item, records, bytes, queued at), and wrapped control operations.
        self._queue: deque[tuple[_A, int, int, float] | _Control[_C]] = deque()
        self._queued_controls = 0
        self._parked_records = 0
        self._inflight_records = 0
        self._running = False
        self._timer_armed = False
        #: The parked appends are due without waiting any longer: the timer fired, or a write
        #: left them behind.
        self._due = False
        self._closing = False

    # -- questions ---------------------------------------------------------------------------

    @property
    def waiting_records(self) -> int:
        """Records queued or being written: what ``max_inflight_records`` limits."""
        return self._parked_records + self._inflight_records

    def overloaded(self, records: int) -> bool:
        """Whether queuing ``records`` more would pass ``max_inflight_records``."""
        waiting = self._parked_records + self._inflight_records
        return waiting + records > self._max_inflight_records

    @property
    def running(self) -> bool:
        """A job runs (a write or a control operation)."""
        return self._running

    @property
    def idle(self) -> bool:
        """Nothing queued and no job running."""
        return not self._queue and not self._running

    def would_roll(self, active_bytes: int) -> bool:
        """Whether the write ``take(active_bytes)`` would give now rolls the active segment
        (the queue's head is an append)."""
        head = self._queue[0]
        assert not isinstance(head, _Control), "would_roll() follows FLUSH_NOW"
        return active_bytes > 0 and active_bytes + head[2] > self._roll_bytes

    def full_write_waiting(self) -> bool:
        """Whether the appends at the head of the queue already fill a write."""
        return (
            bool(self._queue)
            and not isinstance(self._queue[0], _Control)
            and self._parked_records >= self._flush_max_records
        )

    # -- events ------------------------------------------------------------------------------

    def append(self, item: _A, records: int, size: int, now: float) -> Step[_C]:
        """An append of ``records`` records in ``size`` bytes was queued at ``now``."""
        self._queue.append((item, records, size, now))
        self._parked_records += records
        # The usual answers first, without the general walk (this runs once per append).
        if self._timer_armed and (
            self._running
            or (self._parked_records < self._flush_max_records and not self._queued_controls)
        ):
            return WAIT
        if self._running and not self._group_commit:
            return WAIT
        return self.step(now)

    def control(self, item: _C, now: float) -> Step[_C]:
        """A control operation was queued at ``now``."""
        self._queue.append(_Control(item))
        self._queued_controls += 1
        return self.step(now)

    def timer_fired(self, now: float) -> Step[_C]:
        self._timer_armed = False
        self._due = True
        return self.step(now)

    def written(self, records: int) -> None:
        """A write of ``records`` records finished (durable or failed): they no longer count
        against ``max_inflight_records``. The job still runs until ``job_finished``."""
        self._inflight_records -= records

    def job_finished(self, now: float) -> Step[_C]:
        self._running = False
        return self.step(now)

    def close(self) -> None:
        """The log is closing: everything queued is due at once, and no timer stays armed
        (the caller cancels its own)."""
        self._closing = True
        self._timer_armed = False

    def drain(self) -> list[_A | _C]:
        """Empty the queue (the log failed): the queued items, in order. The caller cancels
        its timer."""
        items = [entry.item if isinstance(entry, _Control) else entry[0] for entry in self._queue]
        self._queue.clear()
        self._queued_controls = 0
        self._parked_records = 0
        self._timer_armed = False
        return items

    # -- answers -----------------------------------------------------------------------------

    def step(self, now: float) -> Step[_C]:
        """What to do now."""
        if not self._queue:
            return WAIT
        if self._running:
            return self._arm(now)
        head = self._queue[0]
        if isinstance(head, _Control):
            self._queue.popleft()
            self._queued_controls -= 1
            self._running = True
            return RunControl(head.item)
        if self._flush_due():
            return FLUSH_NOW
        return self._arm(now)

    def take(self, active_bytes: int | None) -> Write[_A]:
        """The appends the write ``FLUSH_NOW`` asked for carries, taken off the queue.

        ``active_bytes`` is the verified length of the segment the appends go to, or ``None``
        when they start a new segment.
        """
        head = self._queue[0]
        assert not isinstance(head, _Control), "take() follows FLUSH_NOW"
        roll = (
            active_bytes is not None
            and active_bytes > 0
            and active_bytes + head[2] > self._roll_bytes
        )
        position = active_bytes if active_bytes is not None and not roll else 0
        taken: list[_A] = []
        size = records = 0
        while self._queue and not isinstance(self._queue[0], _Control):
            item, count, length, _ = self._queue[0]
            if taken and (
                position + size + length > self._roll_bytes
                or records + count > self._flush_max_records
            ):
                break
            self._queue.popleft()
            taken.append(item)
            size += length
            records += count
        self._parked_records -= records
        self._inflight_records += records
        self._running = True
        self._timer_armed = False
        # Appends left behind by this write are due at once; appends queued later start a new
        # wait.
        self._due = bool(self._queue) and not isinstance(self._queue[0], _Control)
        return Write(taken, roll, records, size)

    def _flush_due(self) -> bool:
        if not self._group_commit or self._closing or self._due:
            return True
        if self._parked_records >= self._flush_max_records:
            return True
        return self._queued_controls > 0

    def _arm(self, now: float) -> Step[_C]:
        if (
            not self._group_commit
            or self._timer_armed
            or self._due
            or self._closing
            or not self._parked_records
        ):
            return WAIT
        oldest = next(entry[3] for entry in self._queue if not isinstance(entry, _Control))
        self._timer_armed = True
        return ArmTimer(max(0.0, self._interval - (now - oldest)))
