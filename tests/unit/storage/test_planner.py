"""The group-commit planner on its own: events in, steps out, no files, clock or Deferreds."""

from __future__ import annotations

from typing import Any

import attrs
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from logbroker.storage._planner import (
    FLUSH_NOW,
    WAIT,
    ArmTimer,
    CommitPlanner,
    RunControl,
    Step,
    Write,
)

INTERVAL = 0.005


def planner(
    group_commit: bool = False,
    flush_max_records: int = 100,
    max_inflight_records: int = 1000,
    roll_bytes: int = 1000,
) -> CommitPlanner[str, str]:
    return CommitPlanner(
        group_commit=group_commit,
        interval=INTERVAL,
        flush_max_records=flush_max_records,
        max_inflight_records=max_inflight_records,
        roll_bytes=roll_bytes,
    )


# -- without group commit ------------------------------------------------------------------


def test_an_append_to_an_idle_log_is_written_at_once_and_later_ones_wait_for_the_job() -> None:
    plan = planner()

    assert plan.append("a", 1, 10, 0.0) is FLUSH_NOW
    assert plan.take(0) == Write(["a"], False, 1, 10)
    assert plan.append("b", 2, 10, 0.0) is WAIT
    assert plan.append("c", 1, 10, 0.0) is WAIT
    plan.written(1)
    assert plan.job_finished(0.0) is FLUSH_NOW
    assert plan.take(10) == Write(["b", "c"], False, 3, 20)
    plan.written(3)
    assert plan.job_finished(0.0) is WAIT
    assert plan.idle


def test_one_write_takes_at_most_flush_max_records_but_never_splits_an_append() -> None:
    plan = planner(flush_max_records=3)
    plan.append("running", 1, 10, 0.0)
    plan.take(0)
    for name, count in (("a", 2), ("b", 1), ("c", 1), ("big", 5)):
        plan.append(name, count, 10, 0.0)
    plan.written(1)

    assert plan.job_finished(0.0) is FLUSH_NOW
    assert plan.take(10).appends == ["a", "b"]
    assert plan.full_write_waiting(), "c and big, parked, hold 6 records"
    plan.written(3)
    assert plan.job_finished(0.0) is FLUSH_NOW
    assert plan.take(30).appends == ["c"]
    plan.written(1)
    plan.job_finished(0.0)
    assert plan.take(40) == Write(["big"], False, 5, 10), "alone, though past the limit"


def test_a_write_never_takes_the_segment_past_the_roll_size_and_rolls_a_full_one() -> None:
    plan = planner(roll_bytes=100)
    plan.append("first", 1, 60, 0.0)
    plan.take(None)
    plan.append("a", 1, 30, 0.0)
    plan.append("b", 1, 30, 0.0)
    plan.written(1)
    plan.job_finished(0.0)

    assert plan.take(60) == Write(["a"], False, 1, 30), "b would pass 100 bytes"
    plan.written(1)
    plan.job_finished(0.0)
    assert plan.take(90) == Write(["b"], True, 1, 30), "the segment rolls first"


def test_a_batch_larger_than_the_roll_size_goes_alone_into_an_empty_segment() -> None:
    plan = planner(roll_bytes=100)
    plan.append("huge", 1, 500, 0.0)

    assert plan.take(0) == Write(["huge"], False, 1, 500), "an empty segment does not roll"
    plan.append("next", 1, 10, 0.0)
    plan.written(1)
    plan.job_finished(0.0)
    assert plan.take(500) == Write(["next"], True, 1, 10)


def test_control_operations_run_in_queue_order_between_appends() -> None:
    plan = planner(group_commit=True)
    assert isinstance(plan.append("a", 1, 10, 0.0), ArmTimer)
    assert plan.control("roll", 0.0) is FLUSH_NOW, "a queued control makes parked appends due"
    assert plan.take(0).appends == ["a"]
    assert plan.append("b", 1, 10, 0.0) == ArmTimer(INTERVAL), "b waits for its own interval"
    plan.written(1)

    assert plan.job_finished(0.0) == RunControl("roll")
    assert plan.job_finished(0.0) is WAIT, "the timer is armed"
    assert plan.timer_fired(INTERVAL) is FLUSH_NOW


def test_overload_counts_parked_and_in_flight_records() -> None:
    plan = planner(max_inflight_records=4)
    plan.append("a", 3, 10, 0.0)
    plan.take(0)
    plan.append("b", 1, 10, 0.0)

    assert plan.waiting_records == 4
    assert plan.overloaded(1)
    assert not plan.overloaded(0)
    plan.written(3)
    assert not plan.overloaded(3)


def test_drain_empties_the_queue_and_hands_back_what_was_in_it() -> None:
    plan = planner(group_commit=True)
    plan.append("a", 1, 10, 0.0)
    plan.control("trim", 0.0)
    plan.take(0)
    plan.append("b", 2, 10, 0.0)

    assert plan.drain() == ["trim", "b"]
    assert plan.waiting_records == 1, "the write in flight still counts until it is done"
    plan.written(1)
    assert plan.job_finished(0.0) is WAIT
    assert plan.idle


# -- with group commit ---------------------------------------------------------------------


def test_group_commit_parks_until_the_timer_then_writes_everything_parked() -> None:
    plan = planner(group_commit=True)

    assert plan.append("a", 1, 10, 1.0) == ArmTimer(INTERVAL)
    assert plan.append("b", 1, 10, 1.002) is WAIT, "one timer for all"
    assert plan.timer_fired(1.005) is FLUSH_NOW
    assert plan.take(0).appends == ["a", "b"]


def test_flush_max_records_parked_records_flush_without_the_timer() -> None:
    plan = planner(group_commit=True, flush_max_records=3)
    plan.append("a", 2, 10, 0.0)

    assert plan.append("b", 1, 10, 0.0) is FLUSH_NOW
    assert plan.take(0).appends == ["a", "b"]
    assert plan.append("c", 1, 10, 0.0) == ArmTimer(INTERVAL), "the write disarmed the old one"
    plan.written(3)
    assert plan.job_finished(0.0) is WAIT


def test_the_wait_counts_from_when_an_append_was_queued_even_behind_jobs() -> None:
    plan = planner(group_commit=True)
    plan.control("verify", 0.0)  # running
    plan.append("a", 1, 10, 0.0)
    plan.control("roll", 0.0)
    plan.append("b", 1, 10, 1.0)

    # The control queued behind a makes a due: it goes out before the roll.
    assert plan.job_finished(2.0) is FLUSH_NOW
    assert plan.take(0).appends == ["a"]
    plan.written(1)
    assert plan.job_finished(2.0) == RunControl("roll")
    # b was queued at 1.0: its interval has long passed.
    assert plan.job_finished(2.0) == ArmTimer(0.0)


def test_appends_left_behind_by_a_write_are_due_at_once() -> None:
    plan = planner(group_commit=True, flush_max_records=2)
    plan.append("a", 1, 10, 0.0)
    plan.append("b", 1, 10, 0.0)
    plan.take(0)
    plan.append("c", 1, 10, 0.0)
    plan.append("d", 1, 10, 0.0)
    plan.append("e", 1, 10, 0.0)
    plan.written(2)
    assert plan.job_finished(0.0) is FLUSH_NOW
    assert plan.take(20).appends == ["c", "d"]
    plan.written(2)

    assert plan.job_finished(0.0) is FLUSH_NOW, "e was left behind: it waits no longer"


def test_closing_makes_everything_due_and_arms_no_timer() -> None:
    plan = planner(group_commit=True)
    plan.append("a", 1, 10, 0.0)
    plan.close()

    assert plan.step(0.0) is FLUSH_NOW
    plan.take(0)
    plan.written(1)
    assert plan.job_finished(0.0) is WAIT
    assert plan.idle


# -- any sequence of events ------------------------------------------------------------------


@attrs.frozen
class _Item:
    """An append (``records`` > 0) or a control operation, numbered in queue order."""

    number: int
    records: int
    size: int
    queued_at: float


class PlannerMachine(RuleBasedStateMachine):
    """Drives a planner as the range log does, with a simulated clock, and checks the rules of
    the module docstring after every event."""

    def __init__(self) -> None:
        super().__init__()
        self.plan: CommitPlanner[_Item, _Item] | None = None
        self.now = 0.0
        self.number = 0
        self.queued: list[_Item] = []
        #: Every item as it was started, appends by write, in the order they started.
        self.started: list[_Item] = []
        self.running: list[_Item] | None = None
        self.deadline: float | None = None
        self.active_bytes: int | None = None
        self.closing = False

    @rule(
        group_commit=st.booleans(),
        flush_max_records=st.integers(1, 6),
        roll_bytes=st.integers(50, 300),
    )
    @precondition(lambda self: self.plan is None)
    def start(self, group_commit: bool, flush_max_records: int, roll_bytes: int) -> None:
        self.group_commit = group_commit
        self.flush_max_records = flush_max_records
        self.roll_bytes = roll_bytes
        self.plan = CommitPlanner(
            group_commit=group_commit,
            interval=INTERVAL,
            flush_max_records=flush_max_records,
            max_inflight_records=1000,
            roll_bytes=roll_bytes,
        )

    def _planner(self) -> CommitPlanner[_Item, _Item]:
        assert self.plan is not None
        return self.plan

    def _apply(self, step: Step[_Item]) -> None:
        plan = self._planner()
        if step is WAIT:
            return
        if isinstance(step, ArmTimer):
            # Also while a job runs: parking counts from when an append was queued.
            assert self.group_commit, "a timer without group commit"
            assert self.deadline is None, "a second timer"
            assert step.delay >= 0
            self.deadline = self.now + step.delay
            return
        assert self.running is None, f"{step} while a job runs"
        if isinstance(step, RunControl):
            control = step.control
            assert control.records == 0
            self.running = [control]
            self.started.append(control)
            return
        self.deadline = None
        write = plan.take(self.active_bytes)
        assert write.appends, "a write takes at least one append"
        assert write.records == sum(item.records for item in write.appends)
        assert write.size == sum(item.size for item in write.appends)
        if len(write.appends) > 1:
            assert write.records <= self.flush_max_records
        if write.roll:
            assert self.active_bytes is not None
            assert self.active_bytes > 0
            assert self.active_bytes + write.appends[0].size > self.roll_bytes
        position = 0 if write.roll or self.active_bytes is None else self.active_bytes
        end = position + write.size
        # Past the roll size only as a single append into an empty segment.
        assert end <= self.roll_bytes or (len(write.appends) == 1 and position == 0)
        self.active_bytes = end
        self.running = list(write.appends)
        self.started.extend(write.appends)

    @precondition(lambda self: self.plan is not None and not self.closing)
    @rule(records=st.integers(1, 4), size=st.integers(10, 150))
    def append(self, records: int, size: int) -> None:
        item = _Item(self.number, records, size, self.now)
        self.number += 1
        self.queued.append(item)
        self._apply(self._planner().append(item, records, size, self.now))

    @precondition(lambda self: self.plan is not None and not self.closing)
    @rule()
    def control(self) -> None:
        item = _Item(self.number, 0, 0, self.now)
        self.number += 1
        self.queued.append(item)
        self._apply(self._planner().control(item, self.now))

    @precondition(lambda self: self.plan is not None and self.running is not None)
    @rule()
    def finish_job(self) -> None:
        plan = self._planner()
        running = self.running
        assert running is not None
        self.running = None
        records = sum(item.records for item in running)
        if records:
            plan.written(records)
        self._apply(plan.job_finished(self.now))

    @precondition(lambda self: self.plan is not None)
    @rule(seconds=st.sampled_from([0.001, 0.002, 0.004, 0.005, 0.01]))
    def wait(self, seconds: float) -> None:
        self.now += seconds
        if self.deadline is not None and self.deadline <= self.now:
            self.now = self.deadline
            self.deadline = None
            self._apply(self._planner().timer_fired(self.now))

    @precondition(lambda self: self.plan is not None and not self.closing)
    @rule()
    def close(self) -> None:
        self.closing = True
        self._planner().close()
        self.deadline = None
        self._apply(self._planner().step(self.now))

    @invariant()
    def everything_runs_in_queue_order(self) -> None:
        assert self.started == self.queued[: len(self.started)]

    @invariant()
    def nothing_waits_without_a_reason(self) -> None:
        if self.plan is None or self.running is not None:
            return
        waiting = self.queued[len(self.started) :]
        if not waiting:
            assert self.plan.idle
            return
        # Not running, work queued: only parked appends may wait, and only under group
        # commit, within their interval, with a timer armed for them.
        assert self.group_commit
        assert not self.closing
        assert all(item.records for item in waiting)
        assert sum(item.records for item in waiting) < self.flush_max_records
        assert self.deadline is not None
        assert self.deadline <= waiting[0].queued_at + INTERVAL + 1e-9
        assert self.now < self.deadline

    @invariant()
    def the_in_flight_limit_counts_what_is_queued_and_running(self) -> None:
        if self.plan is None:
            return
        waiting = self.queued[len(self.started) :] + (self.running or [])
        assert self.plan.waiting_records == sum(item.records for item in waiting)


TestPlannerMachine = PlannerMachine.TestCase
TestPlannerMachine.settings = settings(max_examples=150, stateful_step_count=40)


def test_the_machine_can_fail() -> None:
    """The machine's checks are live: a planner that forgets the roll boundary is caught."""

    class Forgetful(CommitPlanner[Any, Any]):
        def take(self, active_bytes: int | None) -> Write[Any]:
            return super().take(None)

    machine = PlannerMachine()
    machine.start(group_commit=False, flush_max_records=5, roll_bytes=100)
    machine.plan = Forgetful(
        group_commit=False,
        interval=INTERVAL,
        flush_max_records=5,
        max_inflight_records=1000,
        roll_bytes=100,
    )
    machine.append(1, 80)
    machine.append(1, 80)
    try:
        machine.finish_job()
    except AssertionError:
        return
    raise AssertionError("a write past the roll size went unnoticed")
