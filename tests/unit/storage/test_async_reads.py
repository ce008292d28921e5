"""Reads in a reader thread: ``read_chunks`` and ``read_raw_async`` on their own executor, over a
snapshot of the segments taken when they were asked for."""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock

from logbroker.storage import (
    DamageReason,
    IntegrityEvent,
    LogConfig,
    OffsetOutOfRangeError,
    RangeLog,
)
from logbroker.storage._format import encode_batch
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from tests.unit.storage.helpers import (
    RANGE_DIR,
    append_each,
    batch_positions,
    failure_of,
    record,
    result_of,
    segment_path,
)


def open_split(
    fs: MemoryFileSystem,
    writer: ImmediateExecutor | ManualExecutor,
    reader: ManualExecutor,
    events: list[IntegrityEvent] | None = None,
) -> RangeLog:
    """A log whose writes and reads run on different executors."""
    sink = events if events is not None else []
    opening = RangeLog.open(
        RANGE_DIR,
        fs=fs,
        clock=Clock(),
        executor=writer,
        reader=reader,
        config=LogConfig(roll_bytes=400),
        on_integrity_event=sink.append,
    )
    if isinstance(writer, ManualExecutor):
        writer.run_all()
    log: RangeLog = result_of(opening)
    return log


def chunk_offsets(chunks: list[Any]) -> list[int]:
    return [stored.offset for chunk in chunks for stored in chunk.records()]


def test_reads_run_on_the_reader_and_never_wait_behind_writes() -> None:
    writer, reader = ManualExecutor(), ManualExecutor()
    log = open_split(MemoryFileSystem(), writer, reader)
    log.append([record(0)])
    writer.run_all()
    log.append([record(1)])  # its write waits in the writer

    reading = log.read_chunks(0)
    raw = log.read_raw_async(0)

    assert [job.__name__ for job, _, _ in reader.pending] == ["read_chunks_job", "read_raw_job"]
    assert [job.__name__ for job, _, _ in writer.pending] == ["_write_job"]
    reader.run_all()
    assert chunk_offsets(result_of(reading)) == [0], "what was durable when it was asked"
    assert result_of(raw) == encode_batch(0, [record(0)])
    writer.run_all()


def test_read_chunks_reads_about_max_bytes_and_at_least_one_batch() -> None:
    fs = MemoryFileSystem()
    reader = ManualExecutor()
    log = open_split(fs, ImmediateExecutor(), reader)
    append_each(log, 0, 12)
    batch_size = batch_positions(fs, segment_path(0))[0][1]

    one = log.read_chunks(3, 1)
    some = log.read_chunks(0, 3 * batch_size)
    everything = log.read_chunks(0, 1 << 20)
    reader.run_all()

    assert chunk_offsets(result_of(one)) == [3]
    assert chunk_offsets(result_of(some)) == [0, 1, 2]
    assert chunk_offsets(result_of(everything)) == list(range(12)), "across segments"
    assert len(log.segments()) > 1


def test_a_read_below_the_start_fails_at_once() -> None:
    fs = MemoryFileSystem()
    log = open_split(fs, ImmediateExecutor(), ManualExecutor())
    append_each(log, 0, 3)
    result_of(log.roll())
    append_each(log, 3, 1)
    result_of(log.delete_segment(0))

    assert failure_of(log.read_chunks(1)).check(OffsetOutOfRangeError)
    assert failure_of(log.read_raw_async(1)).check(OffsetOutOfRangeError)


def test_damage_a_reader_finds_is_applied_when_the_read_comes_back(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    reader = ManualExecutor()
    events: list[IntegrityEvent] = []
    log = open_split(fs, ImmediateExecutor(), reader, events)
    append_each(log, 0, 3)
    result_of(log.roll())
    second, second_end = batch_positions(fs, segment_path(0))[1]
    fs.corrupt(segment_path(0), second_end - 5)  # in the value of its record

    reading = log.read_chunks(0)
    assert events == [], "nothing is applied from the reader thread"
    reader.run_all()

    assert chunk_offsets(result_of(reading)) == [0], "the records before the damage"
    assert [(e.reason, e.position) for e in events] == [(DamageReason.CHECKSUM, second + 24)]
    assert log.segments()[0].damage is not None
    assert len(logged_errors) == 1
    logged_errors.clear()
    again = log.read_chunks(0)
    reader.run_all()
    assert chunk_offsets(result_of(again)) == [0]
    assert len(events) == 1, "reported once per copy"


def test_a_read_that_raced_a_trim_reports_no_damage() -> None:
    fs = MemoryFileSystem()
    reader = ManualExecutor()
    events: list[IntegrityEvent] = []
    log = open_split(fs, ImmediateExecutor(), reader, events)
    append_each(log, 0, 4)
    _, second_end = batch_positions(fs, segment_path(0))[1]

    reading = log.read_chunks(0)  # planned over four batches
    result_of(log.trim(0, second_end))
    reader.run_all()

    assert chunk_offsets(result_of(reading)) == [0, 1]
    assert events == [], "the bytes were cut on purpose, not lost"
    assert log.segments()[0].damage is None


def test_a_read_that_raced_a_delete_ends_quietly() -> None:
    fs = MemoryFileSystem()
    reader = ManualExecutor()
    events: list[IntegrityEvent] = []
    log = open_split(fs, ImmediateExecutor(), reader, events)
    append_each(log, 0, 2)
    result_of(log.roll())
    append_each(log, 2, 2)

    reading = log.read_chunks(0)
    result_of(log.delete_segment(0))
    reader.run_all()

    assert chunk_offsets(result_of(reading)) == []
    assert events == []


def test_read_raw_async_returns_whole_batches_of_one_segment() -> None:
    fs = MemoryFileSystem()
    reader = ManualExecutor()
    log = open_split(fs, ImmediateExecutor(), reader)
    append_each(log, 0, 3)
    result_of(log.roll())
    append_each(log, 3, 2)
    first_segment = fs.read_file(segment_path(0))

    whole = log.read_raw_async(0, 1 << 20)
    one = log.read_raw_async(1, 1)
    next_segment = log.read_raw_async(3)
    at_the_end = log.read_raw_async(5)
    reader.run_all()

    assert result_of(whole) == first_segment
    assert result_of(one) == encode_batch(1, [record(1)])
    assert result_of(next_segment) == fs.read_file(segment_path(3))
    assert result_of(at_the_end) == b""
    assert reader.pending == []
