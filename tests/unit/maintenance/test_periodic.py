"""PeriodicTask on a Clock: survives failures, never overlaps itself, stops cleanly."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock

from logbroker.maintenance.periodic import PeriodicTask
from tests.unit.storage.helpers import result_of


class Work:
    """A task's work: records the clock at each run and does what the test says."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.runs: list[float] = []
        self.outcomes: list[object] = []

    def __call__(self) -> object:
        self.runs.append(self.clock.seconds())
        outcome = self.outcomes.pop(0) if self.outcomes else None
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


class RecordingMetrics:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def periodic_task_added(self, task: str) -> None:
        self.calls.append(("added", task))

    def periodic_task_failed(self, task: str) -> None:
        self.calls.append(("failed", task))

    def periodic_task_succeeded(self, task: str, now: float) -> None:
        self.calls.append(("succeeded", task, now))


def fired(deferred: Deferred[Any]) -> list[Any]:
    results: list[Any] = []
    deferred.addBoth(results.append)
    return results


def expect_failures(logged_errors: list[dict[str, Any]], task: str, count: int) -> None:
    assert len(logged_errors) == count, logged_errors
    for event in logged_errors:
        assert event["task"] == task
        assert event["log_failure"] is not None
    logged_errors.clear()


def test_runs_every_interval_from_the_start() -> None:
    clock = Clock()
    work = Work(clock)
    task = PeriodicTask("chore", 10, work, clock)

    task.start(now=True)
    clock.pump([10, 10, 10])

    assert work.runs == [0, 10, 20, 30]
    assert result_of(task.stop()) is None
    assert not clock.getDelayedCalls()


def test_without_now_the_first_run_is_one_interval_later() -> None:
    clock = Clock()
    work = Work(clock)
    task = PeriodicTask("chore", 10, work, clock)

    task.start(now=False)
    clock.advance(9)
    assert work.runs == []
    clock.advance(1)

    assert work.runs == [10]
    result_of(task.stop())


def test_keeps_running_after_an_exception(logged_errors: list[dict[str, Any]]) -> None:
    clock = Clock()
    work = Work(clock)
    work.outcomes = [RuntimeError("disk on fire")]
    task = PeriodicTask("chore", 10, work, clock)

    task.start(now=True)
    expect_failures(logged_errors, "chore", 1)
    clock.advance(10)

    assert work.runs == [0, 10]
    assert task.failures == 1
    assert task.last_success == 10
    result_of(task.stop())


def test_keeps_running_after_a_failed_deferred(logged_errors: list[dict[str, Any]]) -> None:
    clock = Clock()
    work = Work(clock)
    pending: Deferred[None] = Deferred()
    work.outcomes = [fail(ValueError("bad segment")), pending]
    task = PeriodicTask("chore", 10, work, clock)

    task.start(now=True)
    clock.advance(10)
    pending.errback(ValueError("again"))
    expect_failures(logged_errors, "chore", 2)
    clock.advance(10)

    assert work.runs == [0, 10, 20]
    assert task.failures == 2
    assert task.last_success == 20
    result_of(task.stop())


def test_a_slow_run_is_never_overlapped_and_missed_runs_are_skipped() -> None:
    clock = Clock()
    work = Work(clock)
    slow: Deferred[None] = Deferred()
    work.outcomes = [slow]
    task = PeriodicTask("chore", 10, work, clock)

    task.start(now=True)
    clock.pump([10, 10, 10, 5])
    assert work.runs == [0], "due three times while the first run was in progress"
    slow.callback(None)
    assert work.runs == [0], "the missed runs are not made up"
    assert task.last_success == 35
    clock.advance(5)

    assert work.runs == [0, 40], "the next run is at the next whole interval"
    result_of(task.stop())


def test_stop_waits_for_the_run_in_progress() -> None:
    clock = Clock()
    work = Work(clock)
    slow: Deferred[None] = Deferred()
    work.outcomes = [slow]
    task = PeriodicTask("chore", 10, work, clock)
    task.start(now=True)

    stopped = fired(task.stop())
    also = fired(task.stop())
    assert stopped == also == []
    slow.callback(None)

    assert stopped == also == [None]
    assert not clock.getDelayedCalls()
    clock.advance(100)
    assert work.runs == [0]


def test_stop_between_runs_fires_at_once_and_leaves_no_timer() -> None:
    clock = Clock()
    work = Work(clock)
    task = PeriodicTask("chore", 10, work, clock)
    task.start(now=False)

    assert fired(task.stop()) == [None]
    assert not clock.getDelayedCalls()
    assert work.runs == []


def test_stop_before_start_is_fine() -> None:
    clock = Clock()
    task = PeriodicTask("chore", 10, Work(clock), clock)

    assert fired(task.stop()) == [None]
    assert fired(task.stop()) == [None]


def test_a_stopped_task_can_start_again_but_a_running_one_cannot() -> None:
    clock = Clock()
    work = Work(clock)
    task = PeriodicTask("chore", 10, work, clock)
    task.start(now=True)
    with pytest.raises(RuntimeError, match="chore"):
        task.start(now=True)
    result_of(task.stop())
    clock.advance(5)

    task.start(now=True)
    clock.advance(10)

    assert work.runs == [0, 5, 15]
    result_of(task.stop())


def test_as_a_service_it_starts_and_stops_with_its_parent() -> None:
    clock = Clock()
    work = Work(clock)
    slow: Deferred[None] = Deferred()
    work.outcomes = [None, slow]
    task = PeriodicTask("chore", 10, work, clock, now=False)

    task.startService()
    clock.pump([10, 10])
    stopping = fired(task.stopService())
    assert stopping == []
    slow.callback(None)

    assert stopping == [None]
    assert work.runs == [10, 20]
    assert not task.running
    assert not clock.getDelayedCalls()


def test_reports_to_its_metrics(logged_errors: list[dict[str, Any]]) -> None:
    clock = Clock()
    work = Work(clock)
    work.outcomes = [None, KeyError("gone")]
    metrics = RecordingMetrics()
    task = PeriodicTask("chore", 10, work, clock, metrics=metrics)
    assert metrics.calls == [("added", "chore")]

    task.start(now=True)
    clock.advance(10)
    expect_failures(logged_errors, "chore", 1)

    assert metrics.calls == [("added", "chore"), ("succeeded", "chore", 0), ("failed", "chore")]
    result_of(task.stop())


@pytest.mark.parametrize("interval", [0, -1])
def test_an_interval_must_be_positive(interval: float) -> None:
    clock = Clock()
    with pytest.raises(ValueError, match="chore"):
        PeriodicTask("chore", interval, Work(clock), clock)
