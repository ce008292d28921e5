"""Deterministic fault injection into RangeLog: fsync ordering, group commit, failed fsyncs.

Every test runs the log on a ``MemoryFileSystem`` with a ``ManualExecutor`` (the test decides
when each writer job runs) and a ``Clock`` (the test decides when group-commit timers fire).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import formatEvent
from twisted.python.failure import Failure

from logbroker.storage import (
    Appended,
    Flush,
    LogClosedError,
    LogConfig,
    LogFailedError,
    OverloadedError,
    RangeLog,
    Record,
)
from logbroker.storage._format import scan_batches
from logbroker.testing import JournalEntry, ManualExecutor, MemoryFileSystem
from tests.unit.storage.helpers import failure_of, result_of

RANGE_DIR = "/data/ranges/topic/0"
GROUP_COMMIT = LogConfig(
    group_commit=True, group_commit_interval_ms=5, flush_max_records=100, max_inflight_records=1000
)


def segment_path(base_offset: int) -> str:
    return f"{RANGE_DIR}/{base_offset:020d}.log"


def record(number: int, size: int = 8) -> Record:
    return Record(b"v%d-" % number + b"x" * size, key=b"k%d" % number, timestamp_ms=1000 + number)


def fired(deferred: Deferred[Any]) -> list[Any]:
    """The Deferred's result so far: [] while it has not fired, [result] once it has."""
    results: list[Any] = []
    deferred.addBoth(results.append)
    return results


class Harness:
    """A range log whose writer jobs and timers run only when the test says so."""

    def __init__(
        self,
        fs: MemoryFileSystem,
        config: LogConfig | None = None,
        on_flushed: Callable[[Flush], None] = lambda flush: None,
    ) -> None:
        self.fs = fs
        self.clock = Clock()
        self.executor = ManualExecutor()
        opened = RangeLog.open(
            RANGE_DIR,
            fs=fs,
            clock=self.clock,
            executor=self.executor,
            config=config,
            on_flushed=on_flushed,
        )
        self.executor.run_all()
        self.log: RangeLog = result_of(opened)

    def journal_since(self, mark: int) -> list[JournalEntry]:
        return self.fs.journal[mark:]

    def read_all(self) -> list[Record]:
        stored = self.log.read(0, max_records=10_000)
        assert [item.offset for item in stored] == list(range(len(stored)))
        return [item.record for item in stored]


def batch_ends(fs: MemoryFileSystem) -> dict[int, tuple[str, int]]:
    """For every batch in the range: its base offset -> (segment file, byte after the batch)."""
    ends = {}
    for path in fs.files():
        if posixpath.dirname(path) == RANGE_DIR and path.endswith(".log"):
            base = int(posixpath.basename(path)[:20])
            scan = scan_batches(fs.read_file(path), 0, base)
            assert scan.damage is None, (path, scan.damage)
            for batch in scan.batches:
                ends[batch.base_offset] = (path, batch.end)
    return ends


# -- acknowledgements and fsyncs ------------------------------------------------------------------


@pytest.mark.parametrize("group_commit", [False, True], ids=["per-job", "group-commit"])
def test_no_append_is_acknowledged_before_the_fsync_that_covers_it(group_commit: bool) -> None:
    fs = MemoryFileSystem()
    config = LogConfig(
        roll_bytes=400,
        group_commit=group_commit,
        group_commit_interval_ms=5,
        flush_max_records=4,
    )
    h = Harness(fs, config)
    # (base offset, Appended, length of the journal when the acknowledgement fired)
    acks: list[tuple[int, Appended, int]] = []
    rolls: list[Any] = []
    number = 0

    def append(count: int) -> None:
        nonlocal number
        base = h.log.next_offset
        records = [record(number + i, size=10 * (number % 7)) for i in range(count)]
        number += count
        h.log.append(records).addCallback(
            lambda appended: acks.append((base, appended, len(fs.journal)))
        )

    # Waves of appends: one at a time, several queued behind a running job, a roll in the middle
    # of a queue, and enough bytes to roll by size several times.
    for wave in range(12):
        for count in (1, 3, 2)[: 1 + wave % 3]:
            append(count)
        if wave % 4 == 1:
            rolls.append(fired(h.log.roll()))
            append(1)
        if wave % 2:
            if h.executor.pending:
                h.executor.run_next()
        else:
            while h.executor.pending or h.clock.getDelayedCalls():
                h.executor.run_all()
                h.clock.advance(0.005)
    while h.executor.pending or h.clock.getDelayedCalls():
        h.executor.run_all()
        h.clock.advance(0.005)

    assert all(len(result) == 1 and not isinstance(result[0], Failure) for result in rolls)
    assert len(acks) == len({base for base, _, _ in acks})
    assert sum(appended.record_count for _, appended, _ in acks) == number == h.log.end_offset
    ends = batch_ends(fs)
    assert len([path for path in fs.files() if path.endswith(".sealed")]) >= 3
    for base, appended, journal_length in acks:
        assert appended.base_offset == base
        path, end = ends[base]
        covering = [
            entry
            for entry in fs.journal[:journal_length]
            if entry.operation == "sync" and entry.path == path and entry.size >= end
        ]
        assert covering, f"append at {base} ({path} up to byte {end}) acked before its fsync"


def test_appends_queued_behind_a_running_job_share_one_write_and_one_fsync() -> None:
    fs = MemoryFileSystem()
    h = Harness(fs, LogConfig(group_commit=False))
    first = fired(h.log.append([record(0)]))
    assert len(h.executor.pending) == 1, "an append to an idle writer starts a job at once"
    queued = [fired(h.log.append([record(n), record(n + 100)])) for n in (1, 3, 5)]
    assert len(h.executor.pending) == 1, "one job at a time"

    h.executor.run_next()
    assert first == [Appended(0, 1)]
    assert queued == [[], [], []]
    assert len(h.executor.pending) == 1, "the queued appends go out in the next job"
    size_before = fs.size(segment_path(0))
    mark = len(fs.journal)

    h.executor.run_next()

    path = segment_path(0)
    assert h.journal_since(mark) == [
        JournalEntry("write", path, fs.size(path) - size_before),
        JournalEntry("sync", path, fs.size(path)),
    ]
    assert queued == [[Appended(1, 2)], [Appended(3, 2)], [Appended(5, 2)]]
    assert not h.executor.pending
    assert len(h.read_all()) == 7


# -- group commit ---------------------------------------------------------------------------------


def test_group_commit_parks_appends_until_the_interval_ends_then_writes_them_once() -> None:
    fs = MemoryFileSystem()
    h = Harness(fs, GROUP_COMMIT)
    mark = len(fs.journal)
    results = [fired(h.log.append([record(n)])) for n in range(3)]
    assert not h.executor.pending, "parked, waiting for more appends"

    h.clock.advance(0.004)
    assert not h.executor.pending
    assert results == [[], [], []]
    h.clock.advance(0.001)
    assert len(h.executor.pending) == 1, "the interval ended: one job for all three"
    h.executor.run_next()

    assert results == [[Appended(0, 1)], [Appended(1, 1)], [Appended(2, 1)]]
    path = segment_path(0)
    assert h.journal_since(mark) == [
        JournalEntry("write", path, fs.size(path)),
        JournalEntry("sync", path, fs.size(path)),
    ]
    assert not h.clock.getDelayedCalls()
    assert h.read_all() == [record(n) for n in range(3)]


def test_group_commit_flushes_at_flush_max_records_without_waiting_for_the_timer() -> None:
    fs = MemoryFileSystem()
    h = Harness(fs, LogConfig(group_commit=True, group_commit_interval_ms=5, flush_max_records=3))
    mark = len(fs.journal)
    two = fired(h.log.append([record(0), record(1)]))
    assert not h.executor.pending
    assert h.clock.getDelayedCalls(), "a timer waits for the interval"

    one = fired(h.log.append([record(2)]))

    assert len(h.executor.pending) == 1, "three parked records flush at once"
    assert not h.clock.getDelayedCalls(), "the timer is cancelled"
    h.executor.run_next()
    assert (two, one) == ([Appended(0, 2)], [Appended(2, 1)])
    assert [entry.operation for entry in h.journal_since(mark)] == ["write", "sync"]


def test_each_write_and_fsync_is_reported_once_with_the_records_it_covered() -> None:
    fs = MemoryFileSystem()
    flushes: list[Flush] = []
    config = LogConfig(group_commit=True, group_commit_interval_ms=5, flush_max_records=3)
    h = Harness(fs, config, on_flushed=flushes.append)
    acks = [fired(h.log.append([record(n)])) for n in range(4)]

    h.executor.run_next()
    assert [flush.records for flush in flushes] == [3], "three parked records flush at once"
    assert acks[-1] == [], "the fourth waits for the interval"
    h.clock.advance(0.005)
    h.executor.run_next()

    assert [flush.records for flush in flushes] == [3, 1]
    assert all(flush.seconds >= 0 for flush in flushes)
    assert acks == [[Appended(n, 1)] for n in range(4)]


def test_a_failed_fsync_is_not_reported_as_a_flush(logged_errors: list[dict[str, Any]]) -> None:
    fs = MemoryFileSystem()
    flushes: list[Flush] = []
    h = Harness(fs, LogConfig(group_commit=False), on_flushed=flushes.append)
    fs.failing_syncs = 1

    failed = h.log.append([record(0)])
    h.executor.run_all()

    assert failure_of(failed).check(LogFailedError)
    assert flushes == []
    logged_errors.clear()


def test_appends_past_max_inflight_records_fail_at_once_and_earlier_ones_succeed() -> None:
    fs = MemoryFileSystem()
    config = LogConfig(
        group_commit=True, group_commit_interval_ms=5, flush_max_records=100, max_inflight_records=4
    )
    h = Harness(fs, config)
    accepted = [fired(h.log.append([record(n), record(n + 1)])) for n in (0, 2)]

    refused = h.log.append([record(4)])

    failure = failure_of(refused)
    assert failure.check(OverloadedError)
    assert failure.value.reason == "overloaded"
    assert h.log.next_offset == 4, "a refused append takes no offset"
    h.clock.advance(0.005)
    assert len(h.executor.pending) == 1
    failure = failure_of(h.log.append([record(4)]))
    assert failure.check(OverloadedError), "records in flight count against the limit too"
    h.executor.run_next()
    assert accepted == [[Appended(0, 2)], [Appended(2, 2)]]
    again = fired(h.log.append([record(4)]))
    h.clock.advance(0.005)
    h.executor.run_all()
    assert again == [Appended(4, 1)], "once durable, the records no longer count"
    assert h.read_all() == [record(n) for n in range(5)]


# -- failed fsyncs --------------------------------------------------------------------------------


def test_failed_fsync_fails_the_job_and_everything_behind_it_and_takes_the_log_down(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    h = Harness(fs, LogConfig(group_commit=False))
    assert result_of_run(h, h.log.append([record(0)])) == Appended(0, 1)
    fs.failing_syncs = 1
    acks: list[Appended] = []
    covered = h.log.append([record(1)])
    behind = [h.log.append([record(n)]) for n in (2, 3)]
    roll_behind = h.log.roll()
    for deferred in [covered, *behind]:
        deferred.addCallback(acks.append)
    assert len(h.executor.pending) == 1

    h.executor.run_next()

    for deferred in [covered, *behind, roll_behind]:
        assert failure_of(deferred).check(LogFailedError)
    assert acks == []
    assert h.log.failed
    assert not h.executor.pending
    assert failure_of(h.log.append([record(4)])).check(LogFailedError), "refused at once"
    assert failure_of(h.log.roll()).check(LogFailedError)
    assert not h.executor.pending
    assert [formatEvent(event).split(";")[0] for event in logged_errors] == [
        f"A write, fsync or seal failed in {RANGE_DIR}"
    ]
    logged_errors.clear()
    assert fs.size(segment_path(0)) > fs.durable_size(segment_path(0)), "written, not fsynced"

    recovered = Harness(fs.crash())

    assert recovered.read_all() == [record(0)], "only what was fsynced before the failure"
    assert recovered.log.end_offset == 1
    assert result_of_run(recovered, recovered.log.append([record(5)])) == Appended(1, 1)
    assert recovered.read_all() == [record(0), record(5)]


def test_once_a_probe_write_and_fsync_succeed_the_log_takes_appends_again_with_what_was_acked(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    h = Harness(fs, LogConfig(group_commit=False))
    assert result_of_run(h, h.log.append([record(0)])) == Appended(0, 1)
    acknowledged = fs.size(segment_path(0))
    fs.failing_syncs = 2
    failed = h.log.append([record(1)])
    h.executor.run_all()
    assert failure_of(failed).check(LogFailedError)
    logged_errors.clear()

    # The disk still fails: the probe's fsync fails, and the log stays out of service.
    assert result_of_run(h, h.log.return_to_service()) is False
    assert h.log.failed
    assert failure_of(h.log.append([record(2)])).check(LogFailedError)

    assert result_of_run(h, h.log.return_to_service()) is True

    assert not h.log.failed
    # Cut back to what was acknowledged, durably; the unacknowledged append is gone.
    assert fs.size(segment_path(0)) == fs.durable_size(segment_path(0)) == acknowledged
    assert not fs.exists(f"{RANGE_DIR}/.probe")
    assert result_of_run(h, h.log.append([record(3)])) == Appended(1, 1)
    assert h.read_all() == [record(0), record(3)]
    recovered = Harness(fs.crash())
    assert recovered.read_all() == [record(0), record(3)]


def test_a_log_that_never_failed_is_in_service() -> None:
    h = Harness(MemoryFileSystem(), LogConfig(group_commit=False))
    assert result_of_run(h, h.log.return_to_service()) is True


def result_of_run(h: Harness, deferred: Deferred[Any]) -> Any:
    h.executor.run_all()
    return result_of(deferred)


# -- new segments ---------------------------------------------------------------------------------


def crash_at_first_ack(h: Harness, records: list[Record]) -> tuple[Appended, MemoryFileSystem]:
    """Append ``records`` and take a crash image at the moment the append is acknowledged."""
    images: list[tuple[Appended, MemoryFileSystem]] = []
    h.log.append(records).addCallback(lambda appended: images.append((appended, h.fs.crash())))
    h.executor.run_all()
    assert len(images) == 1
    return images[0]


def test_a_fresh_logs_first_segment_survives_a_crash_right_after_the_first_ack() -> None:
    h = Harness(MemoryFileSystem())

    appended, image = crash_at_first_ack(h, [record(0)])

    assert appended == Appended(0, 1)
    assert image.exists(segment_path(0)), "the directory entry was not fsynced before the ack"
    assert Harness(image).read_all() == [record(0)]


@pytest.mark.parametrize("how", ["roll", "size"])
def test_a_new_segments_directory_entry_is_fsynced_before_its_first_ack(how: str) -> None:
    h = Harness(MemoryFileSystem(), LogConfig(roll_bytes=200))
    assert result_of_run(h, h.log.append([record(0)])) == Appended(0, 1)
    if how == "roll":
        assert result_of_run(h, h.log.roll()) is not None
        records = [record(1)]
    else:
        records = [record(1, size=150)]

    appended, image = crash_at_first_ack(h, records)

    assert appended == Appended(1, 1)
    assert h.fs.exists(segment_path(0)[:-4] + ".sealed")
    assert image.exists(segment_path(1)), "the directory entry was not fsynced before the ack"
    assert Harness(image).read_all() == [record(0), records[0]]


# -- closing --------------------------------------------------------------------------------------


def test_close_flushes_parked_appends_at_once_then_refuses_appends() -> None:
    fs = MemoryFileSystem()
    h = Harness(fs, GROUP_COMMIT)
    parked = [fired(h.log.append([record(n)])) for n in range(2)]
    assert not h.executor.pending
    assert h.clock.getDelayedCalls()

    closed = fired(h.log.close())

    assert len(h.executor.pending) == 1, "close flushes without waiting for the timer"
    assert not h.clock.getDelayedCalls()
    assert closed == [], "close waits for the flush"
    refused = h.log.append([record(2)])
    assert failure_of(refused).check(LogClosedError)
    h.executor.run_all()
    assert parked == [[Appended(0, 1)], [Appended(1, 1)]]
    assert closed == [None]
    assert failure_of(h.log.append([record(2)])).check(LogClosedError)
    assert failure_of(h.log.roll()).check(LogClosedError)
    assert Harness(fs.crash()).read_all() == [record(0), record(1)]
