"""The per-range log API: appends, reads, rolling, sealing, deleting, verifying, replication."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from twisted.internet.task import Clock

from logbroker.storage import (
    CopyState,
    InvalidBatchError,
    LogConfig,
    NotContiguousError,
    OffsetOutOfRangeError,
    RangeLog,
    Record,
    SegmentNotFoundError,
    SegmentStateError,
    StorageError,
)
from logbroker.storage._format import encode_batch
from logbroker.testing import ManualExecutor, MemoryFileSystem
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


def test_records_come_back_byte_exact_with_null_and_empty_keys_distinct() -> None:
    log = open_log(MemoryFileSystem())
    records = [
        Record(b"", key=None, timestamp_ms=0),
        Record(b"\x00\xff" * 50, key=b"", timestamp_ms=2**64 - 1),
        Record(b"v", key=b"k", timestamp_ms=7, headers=((b"h", None), (None, b""), (b"", b"x"))),
    ]

    appended = result_of(log.append(records))

    assert (appended.base_offset, appended.next_offset) == (0, 3)
    stored = log.read(0)
    assert [s.offset for s in stored] == [0, 1, 2]
    assert [s.record for s in stored] == records


def test_offsets_are_contiguous_across_segments_and_reopen() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, LogConfig(roll_bytes=300))
    append_each(log, 0, 10)
    assert len(log.segments()) > 2
    result_of(log.close())

    reopened = open_log(fs, LogConfig(roll_bytes=300))

    assert offsets(reopened) == list(range(10))
    assert reopened.end_offset == 10
    assert result_of(reopened.append([record(10), record(11)])).base_offset == 10
    segments = reopened.segments()
    for before, after in itertools.pairwise(segments):
        assert before.next_offset == after.base_offset


def test_active_segment_rolls_before_it_would_pass_the_roll_size() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, LogConfig(roll_bytes=300))
    append_each(log, 0, 10)

    segments = log.segments()
    assert all(s.byte_size <= 300 for s in segments)
    assert [s.state for s in segments[:-1]] == [CopyState.SEALED] * (len(segments) - 1)
    assert segments[-1].state is CopyState.ACTIVE
    for sealed in segments[:-1]:
        assert fs.exists(segment_path(sealed.base_offset, ".sealed"))
        assert fs.exists(segment_path(sealed.base_offset, ".index"))
        assert fs.size(segment_path(sealed.base_offset)) == sealed.byte_size


def test_a_batch_larger_than_the_roll_size_gets_a_segment_of_its_own() -> None:
    log = open_log(MemoryFileSystem(), LogConfig(roll_bytes=200))
    append_each(log, 0, 1)

    result_of(log.append([Record(b"x" * 500)]))
    append_each(log, 2, 1)

    assert [(s.base_offset, s.record_count) for s in log.segments()] == [(0, 1), (1, 1), (2, 1)]
    assert offsets(log) == [0, 1, 2]


def test_roll_seals_with_record_count_and_byte_size_for_the_control_plane() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 4)

    sealed = result_of(log.roll())

    assert sealed.base_offset == 0
    assert sealed.record_count == 4
    assert sealed.byte_size == fs.size(segment_path(0))
    assert sealed.state is CopyState.SEALED
    assert result_of(log.roll()) is None  # nothing new to seal
    append_each(log, 4, 1)
    assert [s.base_offset for s in log.segments()] == [0, 4]


def test_read_limits_by_records_and_bytes_but_always_returns_one() -> None:
    log = open_log(MemoryFileSystem(), LogConfig(roll_bytes=400))
    result_of(log.append([Record(b"x" * 100) for _ in range(20)]))

    assert len(log.read(0, max_records=5)) == 5
    assert [s.offset for s in log.read(3, max_bytes=250)] == [3, 4, 5]
    assert len(log.read(7, max_bytes=1)) == 1
    assert log.read(20) == []
    assert log.read(1000) == []


def test_read_from_the_middle_of_a_batch_and_across_index_entries() -> None:
    log = open_log(MemoryFileSystem())
    for first in range(0, 2000, 100):
        result_of(log.append([record(n) for n in range(first, first + 100)]))

    assert [s.offset for s in log.read(1234, max_records=3)] == [1234, 1235, 1236]
    assert log.read(1999)[0].record == record(1999)
    assert len(log.read(0, max_records=2000, max_bytes=10**9)) == 2000


def test_deleting_sealed_segments_moves_the_start_offset() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 3)
    result_of(log.roll())
    append_each(log, 3, 3)

    result_of(log.delete_segment(0))

    assert log.start_offset == 3
    assert not fs.exists(segment_path(0))
    assert not fs.exists(segment_path(0, ".sealed"))
    assert not fs.exists(segment_path(0, ".index"))
    assert offsets(log, 3) == [3, 4, 5]
    with pytest.raises(OffsetOutOfRangeError, match="below the log start 3"):
        log.read(1)


def test_the_active_segment_cannot_be_deleted() -> None:
    log = open_log(MemoryFileSystem())
    append_each(log, 0, 2)

    assert failure_of(log.delete_segment(0)).check(SegmentStateError)
    assert failure_of(log.delete_segment(77)).check(SegmentNotFoundError)
    assert offsets(log) == [0, 1]


def test_verify_reports_a_clean_segment_as_verified() -> None:
    log = open_log(MemoryFileSystem())
    append_each(log, 0, 5)
    sealed = result_of(log.roll())

    verification = result_of(log.verify_segment(0))

    assert verification.verified
    assert (verification.record_count, verification.byte_size) == (5, sealed.byte_size)


def _log_with_own_reader(fs: MemoryFileSystem) -> tuple[RangeLog, ManualExecutor, ManualExecutor]:
    """A log whose writes and reads each run on a ``ManualExecutor`` of their own."""
    writer, reader = ManualExecutor(), ManualExecutor()
    opening = RangeLog.open(RANGE_DIR, fs=fs, clock=Clock(), executor=writer, reader=reader)
    writer.run_all()
    return result_of(opening), writer, reader


def test_a_sealed_segment_is_checked_beside_the_range_s_writes_not_between_them() -> None:
    fs = MemoryFileSystem()
    log, writer, reader = _log_with_own_reader(fs)
    appended = [log.append([record(n)]) for n in range(3)]
    writer.run_all()
    sealed = log.roll()
    writer.run_all()
    assert result_of(sealed).record_count == 3
    assert all(result_of(append).base_offset == n for n, append in enumerate(appended))
    # An append under way: its job waits on the writer threads.
    pending = log.append([record(3)])

    checking = log.verify_segment(0)
    reader.run_all()

    assert result_of(checking).verified, "checked without waiting for the append"
    assert not pending.called
    writer.run_all()
    assert result_of(pending).base_offset == 3


def test_a_sealed_segment_deleted_while_it_is_checked_is_reported_gone() -> None:
    fs = MemoryFileSystem()
    log, writer, reader = _log_with_own_reader(fs)
    appending = log.append([record(0)])
    writer.run_all()
    result_of(appending)
    rolling = log.roll()
    writer.run_all()
    result_of(rolling)
    checking = log.verify_segment(0)
    deleting = log.delete_segment(0)
    writer.run_all()
    result_of(deleting)

    reader.run_all()

    assert failure_of(checking).check(SegmentNotFoundError)


def test_follower_copy_from_raw_frames_is_byte_identical() -> None:
    primary_fs, follower_fs = MemoryFileSystem(), MemoryFileSystem()
    primary = open_log(primary_fs)
    follower = open_log(follower_fs)
    for first in range(0, 30, 3):
        result_of(primary.append([record(n) for n in range(first, first + 3)]))

    while follower.end_offset < primary.end_offset:
        chunk = primary.read_raw(follower.end_offset, max_bytes=200)
        result_of(follower.append_raw(follower.end_offset, chunk))

    assert follower_fs.read_file(segment_path(0)) == primary_fs.read_file(segment_path(0))
    assert offsets(follower) == list(range(30))


def test_raw_append_must_follow_the_copy_and_verify() -> None:
    log = open_log(MemoryFileSystem())
    append_each(log, 0, 2)
    batch = bytearray(encode_batch(2, [record(2)]))

    assert failure_of(log.append_raw(5, bytes(encode_batch(5, [record(5)])))).check(
        NotContiguousError
    )
    batch[-1] ^= 1
    assert failure_of(log.append_raw(2, bytes(batch))).check(InvalidBatchError)
    assert failure_of(log.append_raw(2, bytes(encode_batch(3, [record(2)])))).check(
        InvalidBatchError
    )
    assert log.end_offset == 2


def test_trim_cuts_a_copy_back_to_its_sealed_length() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 3)
    sealed_size = fs.size(segment_path(0))
    append_each(log, 3, 2)  # never acknowledged by a quorum: past the sealed length

    trimmed = result_of(log.trim(0, sealed_size))

    assert (trimmed.record_count, trimmed.byte_size) == (3, sealed_size)
    assert fs.size(segment_path(0)) == sealed_size
    assert log.end_offset == 3
    assert result_of(log.append([record(3)])).base_offset == 3
    assert [s.base_offset for s in log.segments()] == [0, 3]


def test_trim_refuses_rot_a_sealed_file_and_a_length_off_a_frame_boundary(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 4)
    size = fs.size(segment_path(0))
    assert failure_of(log.trim(0, size - 1)).check(SegmentStateError)

    fs.corrupt(segment_path(0), 40)
    assert not result_of(log.verify_segment(0)).verified
    assert len(logged_errors) == 1
    logged_errors.clear()
    assert failure_of(log.trim(0, size)).check(SegmentStateError)
    assert fs.size(segment_path(0)) == size

    sealed_log = open_log(MemoryFileSystem())
    append_each(sealed_log, 0, 2)
    sealed = result_of(sealed_log.roll())
    assert failure_of(sealed_log.trim(0, sealed.byte_size)).check(SegmentStateError)


def test_appends_must_hold_at_least_one_record() -> None:
    log = open_log(MemoryFileSystem())

    assert failure_of(log.append([])).check(ValueError)
    assert log.next_offset == 0


def test_an_append_in_flight_when_rot_is_found_fails_and_its_offsets_are_not_reused(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    log = result_of_running(
        RangeLog.open(RANGE_DIR, fs=fs, clock=Clock(), executor=executor), executor
    )
    result_of_running(log.append([record(0)]), executor)
    in_flight = log.append([record(1)])
    fs.corrupt(segment_path(0), 30)

    assert log.read(0) == []  # the read finds the rot
    executor.run_all()

    failure = failure_of(in_flight)
    assert failure.check(StorageError)
    assert "found damaged" in failure.getErrorMessage()
    assert len(logged_errors) == 1
    logged_errors.clear()
    appended = result_of_running(log.append([record(2)]), executor)
    assert appended.base_offset == 2
    assert [s.base_offset for s in log.segments()] == [0, 2]
    assert offsets(log, 2) == [2]


def test_an_empty_log_starts_at_its_durable_end_while_its_first_append_is_in_flight() -> None:
    executor = ManualExecutor()
    log = result_of_running(
        RangeLog.open(RANGE_DIR, fs=MemoryFileSystem(), clock=Clock(), executor=executor), executor
    )

    log.append([record(0)])

    assert (log.start_offset, log.end_offset, log.next_offset) == (0, 0, 1)
    executor.run_all()
    assert (log.start_offset, log.end_offset, log.next_offset) == (0, 1, 1)
