"""Segment lifecycle under faults and odd calls: seal, roll, trim, delete, verify, reads of files
that shrank, and the range end surviving a restart."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, TypeVar

from crc32c import crc32c
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from logbroker.storage import (
    CopyState,
    DamageReason,
    IntegrityEvent,
    InvalidBatchError,
    LogConfig,
    LogFailedError,
    RangeLog,
    SegmentInfo,
    SegmentStateError,
)
from logbroker.storage._format import encode_batch, scan_batches
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from tests.unit.storage.helpers import (
    RANGE_DIR,
    append_each,
    failure_of,
    offsets,
    open_log,
    record,
    result_of,
    result_of_running,
    segment_path,
)


def recording_seals(
    fs: MemoryFileSystem,
    sealed: list[SegmentInfo],
    executor: ImmediateExecutor | ManualExecutor | None = None,
    config: LogConfig | None = None,
) -> RangeLog:
    """A log of ``fs`` that rolls at 200 bytes (unless ``config`` says otherwise) and adds
    every seal it decides to ``sealed``."""
    executor = executor or ImmediateExecutor()
    opening = RangeLog.open(
        RANGE_DIR,
        fs=fs,
        clock=Clock(),
        executor=executor,
        config=config or LogConfig(roll_bytes=200),
        on_sealed=sealed.append,
    )
    if isinstance(executor, ManualExecutor):
        executor.run_all()
    return result_of(opening)


def roll_with_a_failing_seal(fs: MemoryFileSystem, log: RangeLog) -> None:
    """Records 0 and 1 fill segment 0 (``roll_bytes=200``); record 2 rolls it over into
    segment 2, and its seal behind the appends fails on a full disk (logged)."""
    append_each(log, 0, 2)
    fs.failing_atomic_writes = 1
    result_of(log.append([record(2)]))


def test_a_failed_seal_takes_the_range_out_of_service_and_never_writes_through_a_closed_file(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 2)
    fs.failing_atomic_writes = 1  # the index of the seal cannot be written

    assert failure_of(log.roll()).check(OSError)

    assert log.failed
    assert failure_of(log.append([record(2)])).check(LogFailedError)
    assert len(logged_errors) == 1
    logged_errors.clear()
    result_of(log.close())  # closes each file exactly once (a second close would raise)
    reopened = open_log(fs)
    assert offsets(reopened) == [0, 1]
    assert result_of(reopened.append([record(2)])).base_offset == 2


def test_a_seal_behind_the_appends_that_fails_leaves_the_segment_closed_until_a_later_roll(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, LogConfig(roll_bytes=200))
    append_each(log, 0, 2)
    fs.failing_atomic_writes = 1  # the full segment's index cannot be written

    rolled = log.append([record(2), record(3)])

    assert result_of(rolled).base_offset == 2, "the appends go on in the next segment"
    assert not log.failed
    assert len(logged_errors) == 1
    assert "Sealing" in logged_errors[0]["log_format"]
    logged_errors.clear()
    assert [(s.base_offset, s.state) for s in log.segments()] == [
        (0, CopyState.CLOSED),
        (2, CopyState.ACTIVE),
    ]
    assert offsets(log) == [0, 1, 2, 3], "a closed segment stays readable"
    assert not fs.exists(segment_path(0).removesuffix(".log") + ".seal")

    append_each(log, 4, 2)  # the next roll seals both, in order

    states = [(s.base_offset, s.state) for s in log.segments()]
    assert states[:2] == [(0, CopyState.SEALED), (2, CopyState.SEALED)]
    assert offsets(log) == [0, 1, 2, 3, 4, 5]
    result_of(log.close())


def test_a_segment_that_rolled_over_unsealed_before_a_crash_is_sealed_at_open(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, LogConfig(roll_bytes=200))
    roll_with_a_failing_seal(fs, log)  # as if the power went before the seal was durable
    assert log.segments()[0].state is CopyState.CLOSED
    logged_errors.clear()

    reopened = open_log(fs.crash(), LogConfig(roll_bytes=200))

    assert [(s.base_offset, s.state) for s in reopened.segments()] == [
        (0, CopyState.SEALED),
        (2, CopyState.ACTIVE),
    ]
    assert offsets(reopened) == [0, 1, 2]


def test_a_rolling_write_that_fails_leaves_a_range_that_returns_without_its_new_file(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, LogConfig(roll_bytes=200))
    append_each(log, 0, 2)
    fs.failing_syncs = 1  # the rolling write's sync, in the next segment's new file

    assert failure_of(log.append([record(2)])).check(LogFailedError)
    assert fs.exists(segment_path(2)), "the failed write made the next segment's file"
    logged_errors.clear()

    assert result_of(log.return_to_service()) is True

    assert not fs.exists(segment_path(2)), "nothing in it was acknowledged"
    assert [(s.base_offset, s.state) for s in log.segments()] == [(0, CopyState.ACTIVE)]
    assert result_of(log.append([record(2)])).base_offset == 2
    assert [(s.base_offset, s.state) for s in log.segments()] == [
        (0, CopyState.SEALED),
        (2, CopyState.ACTIVE),
    ]
    assert offsets(log) == [0, 1, 2]


def test_a_segment_waiting_for_its_seal_is_never_deleted(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, LogConfig(roll_bytes=200))
    roll_with_a_failing_seal(fs, log)  # segment 0 stays closed, waiting
    logged_errors.clear()

    refused = failure_of(log.delete_segment(0))

    assert refused.check(SegmentStateError)
    assert "waits for its seal" in str(refused.value)
    assert offsets(log) == [0, 1, 2]


def test_an_explicit_roll_waits_for_the_seal_behind_the_appends_and_seals_after_it() -> None:
    sealed: list[SegmentInfo] = []
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    log = recording_seals(fs, sealed, executor, LogConfig(roll_bytes=200, group_commit=False))
    for n in range(2):
        result_of_running(log.append([record(n)]), executor)
    appended = log.append([record(2)])  # rolls over: segment 0's seal runs behind it
    executor.run_next()
    assert result_of(appended).base_offset == 2
    assert executor.pending, "segment 0's seal has not run yet"

    rolled = log.roll()
    assert len(executor.pending) == 1, "the roll's own job waits for segment 0's seal"
    executor.run_all()

    assert result_of(rolled).base_offset == 2
    assert [info.base_offset for info in sealed] == [0, 2], "recorded in order"


def test_an_explicit_roll_is_refused_while_a_failed_seal_behind_the_appends_fails_again(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, LogConfig(roll_bytes=200))
    roll_with_a_failing_seal(fs, log)
    fs.failing_atomic_writes = 1  # it is tried again first, and fails again

    refused = failure_of(log.roll())

    assert refused.check(SegmentStateError)
    assert "roll again once it is sealed" in str(refused.value)
    assert not log.failed
    assert len(logged_errors) == 2
    logged_errors.clear()
    rolled = result_of(log.roll())  # the disk has room again
    assert rolled is not None
    assert rolled.base_offset == 2
    assert [s.state for s in log.segments()][:2] == [CopyState.SEALED, CopyState.SEALED]


def test_a_rolled_segment_found_damaged_before_its_seal_is_sealed_first_with_its_damage(
    logged_errors: list[dict[str, Any]],
) -> None:
    sealed: list[SegmentInfo] = []
    fs = MemoryFileSystem()
    log = recording_seals(fs, sealed)
    roll_with_a_failing_seal(fs, log)
    fs.corrupt(segment_path(0), 30)
    result_of(log.verify_segment(0))  # finds the rot: reads of segment 0 stop before it
    logged_errors.clear()

    append_each(log, 3, 2)  # the next roll seals segment 0, then segment 2, in order

    assert [info.base_offset for info in sealed][:2] == [0, 2]
    first = log.segments()[0]
    assert first.state is CopyState.SEALED
    assert first.record_count == 2, "sealed as it rolled, not cut at the rot"
    logged_errors.clear()


def test_every_seal_is_reported_with_its_count_and_size() -> None:
    sealed: list[SegmentInfo] = []
    log = recording_seals(MemoryFileSystem(), sealed)
    append_each(log, 0, 4)  # size-triggered rolls
    manual = result_of(log.roll())

    assert manual in sealed
    assert [s.base_offset for s in sealed] == [s.base_offset for s in log.segments()[:-1]]
    assert all(s.state is CopyState.SEALED and s.record_count >= 1 for s in sealed)
    assert sum(s.record_count for s in sealed) == 4


def test_the_range_end_survives_a_restart_after_every_sealed_segment_is_deleted() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 3)
    result_of(log.roll())
    append_each(log, 3, 3)
    result_of(log.roll())

    result_of(log.delete_segment(0))
    result_of(log.delete_segment(3))
    assert failure_of(log.delete_segment(6)).check(SegmentStateError)  # the last one stays
    result_of(log.close())

    reopened = open_log(fs)
    assert (reopened.start_offset, reopened.end_offset) == (6, 6)
    assert result_of(reopened.append([record(6)])).base_offset == 6


def test_appends_made_while_a_trim_is_pending_are_refused() -> None:
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    log = result_of_running(
        RangeLog.open(RANGE_DIR, fs=fs, clock=Clock(), executor=executor), executor
    )
    result_of_running(log.append([record(n) for n in range(3)]), executor)
    size = fs.size(segment_path(0))
    result_of_running(log.append([record(3)]), executor)

    before = log.append([record(4)])
    trim = log.trim(0, size)
    during = log.append([record(5)])
    executor.run_all()

    assert result_of(before).base_offset == 4
    assert failure_of(during).check(SegmentStateError)
    assert result_of(trim).record_count == 3
    assert log.end_offset == 3
    assert result_of_running(log.append([record(3)]), executor).base_offset == 3
    assert offsets(log) == [0, 1, 2, 3]


def test_trim_to_nothing_keeps_the_last_segment_empty_so_the_range_end_survives() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 3)
    result_of(log.roll())
    append_each(log, 3, 2)  # never sealed by a quorum: this copy's sealed length is 0
    result_of(log.delete_segment(0))

    trimmed = result_of(log.trim(3, 0))

    assert (trimmed.record_count, trimmed.byte_size) == (0, 0)
    assert fs.files() == [segment_path(3)]
    assert fs.size(segment_path(3)) == 0
    result_of(log.close())
    reopened = open_log(fs)
    assert reopened.end_offset == 3
    assert result_of(reopened.append([record(9)])).base_offset == 3
    assert [stored.record for stored in reopened.read(3)] == [record(9)]


def test_trim_to_nothing_removes_a_copy_that_is_not_the_last() -> None:
    fs = MemoryFileSystem()
    fs.make_dirs(RANGE_DIR)
    fs.write_atomic(segment_path(0), encode_batch(0, [record(0)]))  # a replica copy, no marker
    fs.write_atomic(segment_path(1), encode_batch(1, [record(1)]))
    log = open_log(fs, LogConfig(replicated=True, auto_roll=False))

    result_of(log.trim(0, 0))

    assert fs.files() == [segment_path(1)]
    assert [s.base_offset for s in log.segments()] == [1]
    assert log.next_offset == 2


def test_a_refused_trim_changes_nothing() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 4)
    size = fs.size(segment_path(0))

    assert failure_of(log.trim(0, size - 5)).check(SegmentStateError)

    assert fs.size(segment_path(0)) == size
    assert offsets(log) == [0, 1, 2, 3]
    assert log.segments()[0].state is CopyState.ACTIVE
    assert result_of(log.append([record(4)])).base_offset == 4
    assert offsets(log) == [0, 1, 2, 3, 4]


def test_a_trim_whose_io_fails_takes_the_range_out_of_service(
    logged_errors: list[dict[str, Any]], monkeypatch: Any
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 4)
    boundary = scan_batches(fs.read_file(segment_path(0))).batches[2].position

    def broken_truncate(path: str, size: int) -> None:
        raise OSError(5, "Input/output error (injected)", path)

    monkeypatch.setattr(fs, "truncate", broken_truncate)
    assert failure_of(log.trim(0, boundary)).check(OSError)

    assert log.failed
    assert failure_of(log.append([record(4)])).check(LogFailedError)
    assert len(logged_errors) == 1
    logged_errors.clear()


def test_a_failing_seal_hook_is_logged_and_never_wedges_the_range(
    logged_errors: list[dict[str, Any]],
) -> None:
    def broken_hook(info: SegmentInfo) -> None:
        raise RuntimeError("control plane unreachable")

    log = result_of(
        RangeLog.open(
            RANGE_DIR,
            fs=MemoryFileSystem(),
            clock=Clock(),
            executor=ImmediateExecutor(),
            config=LogConfig(roll_bytes=200),
            on_sealed=broken_hook,
        )
    )
    append_each(log, 0, 4)  # rolls, and the hook fails each time

    assert offsets(log) == [0, 1, 2, 3]
    assert logged_errors
    assert all("storage hook failed" in str(e.get("log_format")) for e in logged_errors)
    logged_errors.clear()
    result_of(log.close())


def test_an_operation_that_fails_to_start_fails_alone(monkeypatch: Any) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 2)
    result_of(log.roll())
    append_each(log, 2, 1)
    offsets(log)  # opens readers
    segment = log._segments[0]
    assert segment.reader is not None

    def broken_close() -> None:
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(segment.reader, "close", broken_close)
    assert failure_of(log.delete_segment(0)).check(OSError)

    assert result_of(log.append([record(3)])).base_offset == 3
    assert result_of(log.verify_segment(2)).verified
    monkeypatch.undo()
    result_of(log.close())


def test_a_new_segment_never_reuses_an_existing_file(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    fs.make_dirs(RANGE_DIR)
    fs.write_atomic(segment_path(0), b"")
    fs.write_atomic(segment_path(0, ".sealed"), b"not a seal marker")

    log = open_log(fs)  # the unreadable marker closes the empty copy
    assert [event["reason"] for event in logged_errors] == ["metadata"]
    logged_errors.clear()
    logged = result_of(log.append([record(0)]))

    assert logged.base_offset == 1
    assert fs.size(segment_path(0)) == 0
    assert offsets(log, 1) == [1]


def test_reads_of_a_sealed_file_that_shrank_under_the_broker_stop_and_report_it(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    events: list[IntegrityEvent] = []
    log = open_log(fs, events=events)
    append_each(log, 0, 5)
    result_of(log.roll())
    batches = scan_batches(fs.read_file(segment_path(0))).batches
    fs.write_atomic(segment_path(0), fs.read_file(segment_path(0))[: batches[3].position])

    assert offsets(log) == [0, 1, 2]  # returns, never spins
    assert [(e.reason, e.position, e.counted) for e in events] == [
        (DamageReason.SIZE, batches[3].position, True)
    ]
    assert len(logged_errors) == 1
    logged_errors.clear()


def test_verify_waits_its_turn_behind_writes() -> None:
    executor = ManualExecutor()
    log = result_of_running(
        RangeLog.open(RANGE_DIR, fs=MemoryFileSystem(), clock=Clock(), executor=executor),
        executor,
    )
    result_of_running(log.append([record(0)]), executor)
    log.append([record(1)])

    verified = log.verify_segment(0)

    assert [job.__name__ for job, _, _ in executor.pending] == ["_write_job"]
    executor.run_all()
    assert result_of(verified).record_count == 2


def test_one_fsync_carries_at_most_flush_max_records() -> None:
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    log = result_of_running(
        RangeLog.open(
            RANGE_DIR,
            fs=fs,
            clock=Clock(),
            executor=executor,
            config=LogConfig(flush_max_records=10),
        ),
        executor,
    )
    log.append([record(0)])
    for number in range(1, 51):
        log.append([record(number)])

    executor.run_all()

    syncs = [entry for entry in fs.journal if entry.operation == "sync"]
    sizes = [b.record_count for b in scan_batches(fs.read_file(segment_path(0))).batches]
    assert sum(sizes) == 51
    assert len(syncs) == 6  # 1, then 10 at a time
    assert offsets(log) == list(range(51))


def _log_with_flush_max(
    executor: ManualExecutor, flush_max_records: int, fs: MemoryFileSystem | None = None
) -> RangeLog:
    return result_of_running(
        RangeLog.open(
            RANGE_DIR,
            fs=fs or MemoryFileSystem(),
            clock=Clock(),
            executor=executor,
            config=LogConfig(flush_max_records=flush_max_records),
        ),
        executor,
    )


def test_a_full_next_write_starts_before_the_acknowledgements_run() -> None:
    executor = ManualExecutor()
    log = _log_with_flush_max(executor, 2)
    first = log.append([record(0)])
    log.append([record(1)])
    log.append([record(2)])  # with record 1, a full job waiting behind the running one
    jobs_pending_at_ack: list[int] = []
    first.addCallback(lambda _: jobs_pending_at_ack.append(len(executor.pending)))

    executor.run_next()

    assert jobs_pending_at_ack == [1]  # the disk was not left idle while the producer ran
    executor.run_all()
    assert offsets(log) == [0, 1, 2]


def test_appends_issued_by_acknowledgements_join_a_next_write_that_is_not_full() -> None:
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    log = _log_with_flush_max(executor, 10, fs)
    first = log.append([record(0)])
    log.append([record(1)])
    first.addCallback(lambda _: log.append([record(2)]))
    syncs_before = sum(entry.operation == "sync" for entry in fs.journal)

    executor.run_next()
    executor.run_next()

    assert executor.pending == []
    assert sum(entry.operation == "sync" for entry in fs.journal) - syncs_before == 2
    assert offsets(log) == [0, 1, 2]


_T = TypeVar("_T")


class _HoldOneJobExecutor(ImmediateExecutor):
    """Runs jobs at once, except the one after ``hold_next()``, which waits for ``release()``."""

    def __init__(self) -> None:
        self._hold = False
        self._held: tuple[Callable[..., Any], tuple[Any, ...], Deferred[Any]] | None = None

    def hold_next(self) -> None:
        self._hold = True

    def release(self) -> None:
        assert self._held is not None
        job, args, done = self._held
        self._held = None
        done.callback(job(*args))

    def run(self, job: Callable[..., _T], *args: Any) -> Deferred[_T]:
        if not self._hold:
            return super().run(job, *args)
        self._hold = False
        done: Deferred[_T] = Deferred()
        self._held = (job, args, done)
        return done


def test_acknowledgements_keep_offset_order_when_the_next_write_finishes_at_once() -> None:
    # The next write starts before the acknowledgements of the one that finished; if it
    # completes inside that call (an executor may fire at once), its appends must still be
    # acknowledged after the earlier ones.
    executor = _HoldOneJobExecutor()
    log = result_of(
        RangeLog.open(
            RANGE_DIR,
            fs=MemoryFileSystem(),
            clock=Clock(),
            executor=executor,
            config=LogConfig(flush_max_records=2),
        )
    )
    executor.hold_next()
    first = log.append([record(0)])
    second = log.append([record(1), record(2), record(3)])  # a full job, queued behind
    acknowledged: list[int] = []
    for appended in (first, second):
        appended.addCallback(lambda result: acknowledged.append(result.base_offset))

    executor.release()

    assert acknowledged == [0, 1]
    assert offsets(log) == [0, 1, 2, 3]


def test_peer_batches_are_checked_record_by_record() -> None:
    log = open_log(MemoryFileSystem())
    honest = encode_batch(0, [record(0), record(1)])
    # A batch whose checksum is right but whose second record names offset 7.
    lying = encode_batch(0, [record(0)]) + encode_batch(7, [record(1)])[24:]
    forged = _rechecksummed_batch(lying, base_offset=0, count=2)

    assert failure_of(log.append_raw(0, forged)).check(InvalidBatchError)
    assert result_of(log.append_raw(0, honest)).next_offset == 2


def _rechecksummed_batch(frames: bytes, base_offset: int, count: int) -> bytes:
    body = frames[24:]
    head = struct.pack(">2sBBIQI", b"LB", 1, 0, 24 + len(body), base_offset, count)
    return struct.pack(">I", crc32c(head + body)) + head + body


def test_a_run_of_zeros_inside_a_sealed_segment_is_reported_and_reads_return(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, LogConfig(roll_bytes=400_000))
    for first in range(0, 3000, 100):
        result_of(log.append([record(n) for n in range(first, first + 100)]))
    result_of(log.roll())
    result_of(log.close())
    data = bytearray(fs.read_file(segment_path(0)))
    batches = scan_batches(bytes(data)).batches
    start, end = batches[10].position, batches[20].position  # well over one read window
    data[start:end] = bytes(end - start)
    fs.write_atomic(segment_path(0), bytes(data))
    reopened = open_log(fs)

    # The index sends this read straight into the zeros; it used to loop there for ever.
    assert reopened.read(1500, max_records=10, max_bytes=100) == []

    assert [event["reason"] for event in logged_errors] == ["header"]
    logged_errors.clear()
    stored = reopened.read(900, max_records=2000, max_bytes=10**6)
    assert [s.offset for s in stored] == list(range(900, 1000))


def test_a_range_whose_seal_failed_returns_to_service_and_seals_on_a_later_try(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 2)
    fs.failing_atomic_writes = 1  # the disk is full as the seal's index is written
    assert failure_of(log.roll()).check(OSError)
    assert log.failed
    logged_errors.clear()

    assert result_of(log.return_to_service()) is True

    assert not log.failed
    assert result_of(log.roll()) is not None, "the seal, tried again, succeeds"
    assert result_of(log.append([record(2)])).base_offset == 2
    assert offsets(log) == [0, 1, 2]
    assert fs.exists(segment_path(0)[:-4] + ".sealed")


def test_hundreds_of_segments_left_unsealed_by_a_crash_are_all_sealed_at_open() -> None:
    # As a writer killed while its seals lagged behind fast rolls leaves them. An executor
    # that runs each job at once must not turn them into one deep chain of callbacks.
    fs = MemoryFileSystem()
    fs.make_dirs(RANGE_DIR)
    for offset in range(600):
        fs.write_atomic(segment_path(offset), encode_batch(offset, [record(offset)]))

    log = open_log(fs)

    states = [s.state for s in log.segments()]
    assert states == [CopyState.SEALED] * 599 + [CopyState.ACTIVE]
    assert offsets(log)[-3:] == [597, 598, 599]
    result_of(log.close())
