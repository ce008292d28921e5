"""A range log as one replica of a replicated range: write, epochs and fencing, segments with
gaps, the roll policy, sealing to a given length, installing sealed segments, the commit index."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock

from logbroker.storage import (
    CopyState,
    DamageReason,
    FencedError,
    IntegrityEvent,
    InvalidBatchError,
    LogClosedError,
    LogConfig,
    LogFailedError,
    NotContiguousError,
    OverloadedError,
    RangeLog,
    Record,
    SegmentInfo,
    SegmentNotFoundError,
    SegmentStateError,
    _pipeline,
)
from logbroker.storage._format import EpochMarker, encode_batch, encode_epoch
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from tests.unit.storage.helpers import (
    RANGE_DIR,
    append_each,
    batch_positions,
    failure_of,
    offsets,
    open_log,
    record,
    result_of,
    result_of_running,
    segment_path,
)

REPLICA = LogConfig(replicated=True, auto_roll=False)


def batch(first: int, count: int = 1) -> bytes:
    return encode_batch(first, [record(n) for n in range(first, first + count)])


def replica(fs: MemoryFileSystem, events: list[IntegrityEvent] | None = None) -> RangeLog:
    return open_log(fs, REPLICA, events)


def stepped_replica(fs: MemoryFileSystem) -> tuple[RangeLog, ManualExecutor]:
    """A replica log whose jobs run only when the test runs them, and their executor."""
    executor = ManualExecutor()
    log = result_of_running(
        RangeLog.open(RANGE_DIR, fs=fs, clock=Clock(), executor=executor, config=REPLICA),
        executor,
    )
    return log, executor


def started(fs: MemoryFileSystem, base: int = 0, epoch: int = 1) -> RangeLog:
    log = replica(fs)
    result_of(log.start_segment(base, epoch))
    return log


def stored_records(log: RangeLog, start: int | None = None) -> list[int]:
    """Offsets every read path returns from ``start`` (default: the log start); the
    synchronous and the threaded one must agree."""
    start = log.start_offset if start is None else start
    chunks = result_of(log.read_chunks(start, 1 << 30))
    threaded = [s.offset for chunk in chunks for s in chunk.records() if s.offset >= start]
    assert threaded == offsets(log, start)
    return threaded


# -- write ---------------------------------------------------------------------------------


def test_write_gives_the_offsets_and_stored_bytes_before_they_are_durable() -> None:
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    log = result_of_running(
        RangeLog.open(RANGE_DIR, fs=fs, clock=Clock(), executor=executor), executor
    )
    result_of_running(log.append([record(0)]), executor)

    written = log.write([record(1), record(2)])

    assert (written.base_offset, written.record_count) == (1, 2)
    assert written.data == batch(1, 2), "the very bytes a follower stores with append_raw"
    assert not written.durable.called
    executor.run_all()
    assert result_of(written.durable).next_offset == 3
    assert fs.read_file(segment_path(0)).endswith(written.data)


def test_write_raises_the_refusal_instead_of_taking_the_records() -> None:
    log = open_log(MemoryFileSystem(), LogConfig(max_inflight_records=1))

    with pytest.raises(OverloadedError):
        log.write([record(0), record(1)])
    with pytest.raises(ValueError, match="at least one record"):
        log.write([])
    assert log.next_offset == 0
    assert failure_of(log.append([record(0), record(1)])).check(OverloadedError)


def test_write_at_an_epoch_older_than_the_copys_fence_is_refused_and_stores_nothing() -> None:
    # A primary another node took the segment over from must not go on writing into its own
    # copy: those bytes would be a second primary's in one segment.
    log = started(MemoryFileSystem(), epoch=4)
    result_of(log.write([record(0)], epoch=4).durable)
    result_of(log.fence(0, 5))

    with pytest.raises(FencedError, match="epoch 5"):
        log.write([record(1)], epoch=4)

    assert log.next_offset == 1
    assert result_of(log.write([record(1)], epoch=5).durable).next_offset == 2


# -- epochs and fencing --------------------------------------------------------------------


def test_a_segment_without_an_epoch_marker_is_at_epoch_0() -> None:
    log = open_log(MemoryFileSystem())
    append_each(log, 0, 1)

    assert log.segment_epoch(0) == 0
    with pytest.raises(SegmentNotFoundError):
        log.segment_epoch(5)


def test_fence_refuses_older_epochs_at_once_and_answers_where_the_copy_ends() -> None:
    fs = MemoryFileSystem()
    log, executor = stepped_replica(fs)
    result_of_running(log.start_segment(0, 3), executor)
    in_flight = log.append_raw(0, batch(0, 2), epoch=3)

    fencing = log.fence(0, 5)

    assert log.segment_epoch(0) == 5, "in memory at once"
    refused = failure_of(log.append_raw(2, batch(2), epoch=4))
    assert refused.check(FencedError)
    assert "epoch 5" in refused.getErrorMessage()
    assert "epoch 4" in refused.getErrorMessage()
    assert not fencing.called, "durable after the appends queued before it"
    executor.run_all()
    assert result_of(in_flight).next_offset == 2
    fenced = result_of(fencing)
    assert (fenced.base_offset, fenced.epoch, fenced.end_offset) == (0, 5, 2)
    assert fenced.byte_size == fs.size(segment_path(0)) == log.active_bytes
    assert result_of_running(log.append_raw(2, batch(2), epoch=5), executor).next_offset == 3
    assert result_of_running(log.append_raw(3, batch(3), epoch=6), executor).next_offset == 4


def test_fence_refuses_an_older_epoch_and_accepts_the_same_one_again() -> None:
    log = started(MemoryFileSystem(), epoch=4)

    failure = failure_of(log.fence(0, 3))
    assert failure.check(FencedError)
    assert "epoch 4" in failure.getErrorMessage()
    assert "epoch 3" in failure.getErrorMessage()
    assert log.segment_epoch(0) == 4
    assert result_of(log.fence(0, 4)).epoch == 4
    assert failure_of(log.fence(9, 4)).check(SegmentNotFoundError)
    assert failure_of(log.fence(0, -1)).check(ValueError)


def test_the_epoch_survives_a_restart_and_its_marker_is_written_atomically() -> None:
    fs = MemoryFileSystem()
    log = started(fs, epoch=2)
    result_of(log.append_raw(0, batch(0), epoch=2))
    result_of(log.fence(0, 7))
    result_of(log.close())

    reopened = replica(fs)

    assert reopened.segment_epoch(0) == 7
    # The fence did not make the records epoch 7's: they are still the epoch 2 primary's.
    assert reopened.segment_data_epoch(0) == 2
    assert failure_of(reopened.append_raw(1, batch(1), epoch=6)).check(FencedError)
    assert fs.read_file(segment_path(0, ".epoch")) == encode_epoch(EpochMarker(0, 7, 2))


def test_an_empty_copy_takes_the_fences_data_epoch_and_one_holding_records_keeps_its_own() -> None:
    fs = MemoryFileSystem()
    log = started(fs, epoch=2)
    result_of(log.fence(0, 3))
    assert (log.segment_epoch(0), log.segment_data_epoch(0)) == (3, 3), "nobody's records yet"
    result_of(log.fence(0, 4, data_epoch=1))
    assert (log.segment_epoch(0), log.segment_data_epoch(0)) == (4, 1)
    result_of(log.append_raw(0, batch(0), epoch=4))

    refused = failure_of(log.fence(0, 5, data_epoch=5))
    assert refused.check(SegmentStateError)
    assert "holds records" in refused.getErrorMessage()
    assert (log.segment_epoch(0), log.segment_data_epoch(0)) == (4, 1), "refused whole"
    result_of(log.fence(0, 5))
    assert (log.segment_epoch(0), log.segment_data_epoch(0)) == (5, 1)
    # Cut empty, it may be named anew.
    result_of(log.trim(0, 0))
    result_of(log.fence(0, 5, data_epoch=5))
    result_of(log.close())
    assert (replica(fs).segment_epoch(0), replica(fs).segment_data_epoch(0)) == (5, 5)


def test_a_copy_sealed_at_an_epoch_is_that_epochs_whatever_it_was_fenced_with() -> None:
    fs = MemoryFileSystem()
    log = started(fs, epoch=0)
    data = batch(0)
    result_of(log.append_raw(0, data, epoch=0))
    result_of(log.fence(0, 3))
    assert log.segment_data_epoch(0) == 0

    result_of(log.seal_copy(0, 1, len(data), epoch=3))

    assert (log.segment_epoch(0), log.segment_data_epoch(0)) == (3, 3)
    # Every copy sealed at epoch 3 holds the same marker, as every earlier build wrote it.
    assert fs.read_file(segment_path(0, ".epoch")) == encode_epoch(EpochMarker(0, 3))
    assert len(fs.read_file(segment_path(0, ".epoch"))) == 32


def test_a_fence_taken_while_the_copy_is_sealed_leaves_the_seals_marker() -> None:
    # A claim's fence, sent before its sender knew of the seal, taken while the seal is under
    # way: its marker is written after the seal's, and must not put the older data epoch back.
    fs = MemoryFileSystem()
    log, executor = stepped_replica(fs)
    data = batch(0)
    for step in (
        lambda: log.start_segment(0, 0),
        lambda: log.append_raw(0, data, epoch=0),
        lambda: log.fence(0, 1),
    ):
        result_of_running(step(), executor)
    assert log.segment_data_epoch(0) == 0, "the records are the epoch 0 primary's"

    sealing = log.seal_copy(0, 1, len(data), epoch=1)
    fencing = log.fence(0, 1)
    executor.run_all()

    assert result_of(sealing).state is CopyState.SEALED
    assert result_of(fencing).epoch == 1
    assert (log.segment_epoch(0), log.segment_data_epoch(0)) == (1, 1)
    assert fs.read_file(segment_path(0, ".epoch")) == encode_epoch(EpochMarker(0, 1))
    result_of(log.close())
    assert replica(fs).segment_data_epoch(0) == 1


def test_an_unreadable_epoch_marker_is_reported_and_refuses_appends_until_fenced_again(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = started(fs, epoch=2)
    result_of(log.append_raw(0, batch(0), epoch=2))
    result_of(log.close())
    fs.corrupt(segment_path(0, ".epoch"), 25)
    events: list[IntegrityEvent] = []

    reopened = replica(fs, events)

    assert [(e.reason, e.segment, e.counted) for e in events] == [
        (DamageReason.METADATA, segment_path(0, ".epoch"), True)
    ]
    assert [event["reason"] for event in logged_errors] == ["metadata"]
    logged_errors.clear()
    with pytest.raises(FencedError, match="unknown"):
        reopened.segment_epoch(0)
    assert isinstance(reopened.refusal(1), FencedError)
    assert failure_of(reopened.append_raw(1, batch(1), epoch=9)).check(FencedError)
    assert reopened.durable_offset == 1, "the data is unharmed"

    assert result_of(reopened.fence(0, 1)).end_offset == 1, "any epoch fences it again"
    assert reopened.refusal(1) is None
    assert result_of(reopened.append_raw(1, batch(1), epoch=1)).next_offset == 2


def test_append_raw_without_an_epoch_is_not_checked_against_one() -> None:
    log = started(MemoryFileSystem(), epoch=9)

    assert result_of(log.append_raw(0, batch(0))).next_offset == 1
    assert failure_of(log.append_raw(5, batch(5))).check(NotContiguousError)


# -- segments with gaps --------------------------------------------------------------------


def test_start_segment_closes_the_active_one_and_leaves_a_gap() -> None:
    fs = MemoryFileSystem()
    log = started(fs, 0, epoch=1)
    result_of(log.append_raw(0, batch(0, 3), epoch=1))

    info = result_of(log.start_segment(300, 2))

    assert (info.base_offset, info.state, info.record_count) == (300, CopyState.ACTIVE, 0)
    assert [(s.base_offset, s.state) for s in log.segments()] == [
        (0, CopyState.CLOSED),
        (300, CopyState.ACTIVE),
    ]
    assert (log.next_offset, log.durable_offset, log.segment_epoch(300)) == (300, 300, 2)
    assert log.segment_epoch(0) == 1
    assert fs.exists(segment_path(300))
    assert fs.exists(segment_path(300, ".epoch"))
    result_of(log.append_raw(300, batch(300, 2), epoch=2))
    log.commit(302)
    assert stored_records(log) == [0, 1, 2, 300, 301]


def test_appends_made_while_a_segment_starts_take_offsets_in_it() -> None:
    executor = ManualExecutor()
    log = result_of_running(
        RangeLog.open(
            RANGE_DIR, fs=MemoryFileSystem(), clock=Clock(), executor=executor, config=REPLICA
        ),
        executor,
    )

    starting = log.start_segment(100, 1)
    written = log.write([record(100)])
    raw = log.append_raw(101, batch(101), epoch=1)
    executor.run_all()

    assert result_of(starting).base_offset == 100
    assert written.base_offset == 100
    assert result_of(raw).next_offset == 102
    assert [s.base_offset for s in log.segments()] == [100]


def test_start_segment_is_refused_before_the_end_of_the_log() -> None:
    log = started(MemoryFileSystem(), 0)
    result_of(log.append_raw(0, batch(0, 3), epoch=1))

    failure = failure_of(log.start_segment(2, 1))

    assert failure.check(SegmentStateError)
    assert "up to 3" in failure.getErrorMessage()
    assert log.segments()[0].state is CopyState.ACTIVE


def test_starting_the_empty_active_segment_again_only_records_the_epoch() -> None:
    fs = MemoryFileSystem()
    log = started(fs, 50, epoch=1)

    assert result_of(log.start_segment(50, 4)).base_offset == 50
    assert log.segment_epoch(50) == 4
    assert [s.base_offset for s in log.segments()] == [50]
    assert failure_of(log.start_segment(50, 3)).check(FencedError)
    result_of(log.close())
    assert replica(fs).segment_epoch(50) == 4


def test_a_replicated_log_appends_only_to_a_segment_it_was_told_to_start() -> None:
    fs = MemoryFileSystem()
    log = replica(fs)

    refusal = log.refusal(1)
    assert isinstance(refusal, SegmentStateError)
    assert "start_segment" in str(refusal)
    assert failure_of(log.append_raw(0, batch(0))).check(SegmentStateError)
    assert failure_of(log.roll()).check(SegmentStateError)
    assert fs.files() == []


def test_recovery_keeps_a_gap_and_only_the_last_segment_active() -> None:
    fs = MemoryFileSystem()
    fs.make_dirs(RANGE_DIR)
    fs.write_atomic(segment_path(0), batch(0, 3))  # an unsealed replica copy
    fs.write_atomic(segment_path(100), batch(100, 2))
    fs.write_atomic(segment_path(300), batch(300, 2))

    log = open_log(fs)

    assert [(s.base_offset, s.state) for s in log.segments()] == [
        (0, CopyState.CLOSED),
        (100, CopyState.CLOSED),
        (300, CopyState.ACTIVE),
    ]
    assert (log.start_offset, log.end_offset) == (0, 302)
    assert offsets(log) == [0, 1, 2, 100, 101, 300, 301]
    assert offsets(log, 50) == [100, 101, 300, 301], "a read in a gap starts after it"
    assert offsets(log, 102) == [300, 301]
    assert log.read_raw(50) == batch(100, 2)
    assert result_of(log.append([record(302)])).base_offset == 302


@given(
    layout=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 4)), min_size=1, max_size=5),
    start=st.integers(0, 400),
    max_bytes=st.integers(1, 2000),
)
def test_reads_across_gaps_return_every_later_record_in_order(
    layout: list[tuple[int, int]], start: int, max_bytes: int
) -> None:
    fs = MemoryFileSystem()
    fs.make_dirs(RANGE_DIR)
    held: list[int] = []
    base = 0
    for gap, count in layout:
        base += gap
        fs.write_atomic(segment_path(base), batch(base, count))
        held += range(base, base + count)
        base += count
    log = open_log(fs)
    start = max(start, log.start_offset)

    later = [offset for offset in held if offset >= start]
    assert offsets(log, start) == later
    chunks = result_of(log.read_chunks(start, max_bytes))
    read = [s.offset for chunk in chunks for s in chunk.records() if s.offset >= start]
    assert read == later[: len(read)]
    assert read or not later, "at least one batch when there is one"


def test_a_replicas_active_copy_trimmed_back_goes_on_taking_appends() -> None:
    # A newer primary sends from where its copy ends: the older epoch's tail goes.
    fs = MemoryFileSystem()
    log = started(fs, epoch=1)
    result_of(log.append_raw(0, batch(0, 2), epoch=1))
    kept = log.active_bytes
    result_of(log.append_raw(2, batch(2, 3), epoch=1))
    result_of(log.fence(0, 2))

    info = result_of(log.trim(0, kept))

    assert (info.state, info.record_count) == (CopyState.ACTIVE, 2)
    assert (log.next_offset, log.durable_offset, log.active_bytes) == (2, 2, kept)
    assert result_of(log.append_raw(2, batch(2, 1), epoch=2)).next_offset == 3
    assert [s.base_offset for s in log.segments()] == [0]
    log.commit(3)
    assert offsets(log) == [0, 1, 2]


def test_appends_queued_when_rot_closes_a_replicas_active_copy_fail_without_a_new_segment(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log, executor = stepped_replica(fs)
    result_of_running(log.start_segment(0, 1), executor)
    result_of_running(log.append_raw(0, batch(0), epoch=1), executor)
    fs.corrupt(segment_path(0), 30)
    assert log.read_raw(0) == b""  # the read finds the rot
    logged_errors.clear()

    queued = log.append_raw(1, batch(1), epoch=1)
    executor.run_all()

    failure = failure_of(queued)
    assert failure.check(SegmentStateError)
    assert "start_segment" in failure.getErrorMessage()
    assert not log.failed
    assert [s.base_offset for s in log.segments()] == [0]
    assert isinstance(log.refusal(1), SegmentStateError)


def test_a_replicas_segment_at_the_formats_size_limit_refuses_appends(monkeypatch: Any) -> None:
    monkeypatch.setattr(_pipeline, "MAX_SEGMENT_BYTES", 300)
    log = started(MemoryFileSystem())
    for first in range(3):
        result_of(log.append_raw(first, batch(first), epoch=1))

    failure = failure_of(log.append_raw(3, batch(3, 2), epoch=1))

    assert failure.check(SegmentStateError)
    assert "full" in failure.getErrorMessage()
    assert [s.base_offset for s in log.segments()] == [0]
    assert result_of(log.start_segment(5, 1)).base_offset == 5, "its offsets are not reused"


# -- the roll policy -----------------------------------------------------------------------


def test_without_auto_roll_the_active_segment_grows_past_the_roll_size() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, LogConfig(roll_bytes=200, auto_roll=False))
    append_each(log, 0, 10)

    assert [s.base_offset for s in log.segments()] == [0]
    assert log.active_bytes == fs.size(segment_path(0)) > 200
    assert result_of(log.roll()).record_count == 10, "a roll still seals on request"


def test_a_replicated_log_must_not_roll_by_itself() -> None:
    with pytest.raises(ValueError, match="auto_roll=False"):
        LogConfig(replicated=True)


# -- seal to a given length ----------------------------------------------------------------


def test_seal_copy_cuts_back_to_the_sealed_length_then_seals_without_starting_a_segment() -> None:
    fs = MemoryFileSystem()
    sealed_hooks: list[SegmentInfo] = []
    log = result_of(
        RangeLog.open(
            RANGE_DIR,
            fs=fs,
            clock=Clock(),
            executor=ImmediateExecutor(),
            config=REPLICA,
            on_sealed=sealed_hooks.append,
        )
    )
    result_of(log.start_segment(0, 1))
    result_of(log.append_raw(0, batch(0, 2), epoch=1))
    sealed_size = log.active_bytes
    result_of(log.append_raw(2, batch(2, 3), epoch=1))  # never reached a quorum

    info = result_of(log.seal_copy(0, 2, sealed_size, epoch=1))

    assert (info.state, info.record_count, info.byte_size) == (CopyState.SEALED, 2, sealed_size)
    assert fs.size(segment_path(0)) == sealed_size
    assert fs.exists(segment_path(0, ".sealed"))
    assert fs.exists(segment_path(0, ".index"))
    assert (log.next_offset, log.durable_offset, log.active_bytes) == (2, 2, 0)
    assert isinstance(log.refusal(1), SegmentStateError), "no active segment until started"
    assert sealed_hooks == [], "the control plane holds this seal already"
    assert result_of(log.start_segment(2, 2)).base_offset == 2
    result_of(log.close())
    reopened = replica(fs)
    assert [(s.base_offset, s.state) for s in reopened.segments()] == [
        (0, CopyState.SEALED),
        (2, CopyState.ACTIVE),
    ]
    assert reopened.committed_offset == 2, "a replica starts committed to its last seal"


def test_seal_copy_of_a_copy_that_ends_at_the_seal_writes_its_own_index() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    for first in range(0, 400, 50):
        result_of(log.append([record(n) for n in range(first, first + 50)]))
    size = log.active_bytes

    info = result_of(log.seal_copy(0, 400, size, epoch=0))

    assert (info.record_count, info.byte_size) == (400, size)
    assert offsets(log, 377)[:2] == [377, 378]
    assert result_of(log.seal_copy(0, 400, size, epoch=0)) == info, "sealing again answers at once"
    result_of(log.close())
    assert offsets(open_log(fs), 377)[:2] == [377, 378]


def test_seal_copy_refuses_a_short_copy_another_count_and_a_different_seal() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 3)
    size = log.active_bytes

    assert failure_of(log.seal_copy(0, 4, size + 76, epoch=0)).check(SegmentStateError)
    assert failure_of(log.seal_copy(0, 2, size, epoch=0)).check(SegmentStateError)
    assert failure_of(log.seal_copy(0, 3, size - 1, epoch=0)).check(SegmentStateError)
    assert failure_of(log.seal_copy(0, 0, 0, epoch=0)).check(ValueError)
    assert log.segments()[0].state is CopyState.ACTIVE, "a refusal changes nothing"
    assert result_of(log.append([record(3)])).base_offset == 3
    sealed = result_of(log.seal_copy(0, 4, log.active_bytes, epoch=0))
    assert failure_of(log.seal_copy(0, 3, size, epoch=0)).check(SegmentStateError)
    assert sealed.record_count == 4


def test_seal_copy_cuts_rot_past_the_sealed_length_and_refuses_rot_before_it(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 4)
    size = fs.size(segment_path(0))
    last_start, _ = batch_positions(fs, segment_path(0))[-1]
    fs.corrupt(segment_path(0), size - 10)  # rot in the last batch
    assert not result_of(log.verify_segment(0)).verified
    assert len(logged_errors) == 1
    logged_errors.clear()

    assert failure_of(log.seal_copy(0, 4, size, epoch=0)).check(SegmentStateError)
    info = result_of(log.seal_copy(0, 3, last_start, epoch=0))

    assert (info.record_count, info.byte_size, info.damage) == (3, last_start, None)
    assert fs.size(segment_path(0)) == last_start
    assert offsets(log) == [0, 1, 2]
    assert result_of(log.verify_segment(0)).verified


def test_seal_copy_of_an_older_copy_does_not_stop_appends_to_the_active_one() -> None:
    fs = MemoryFileSystem()
    log, executor = stepped_replica(fs)
    result_of_running(log.start_segment(0, 1), executor)
    result_of_running(log.append_raw(0, batch(0, 2), epoch=1), executor)
    size = log.active_bytes
    result_of_running(log.start_segment(10, 1), executor)

    sealing = log.seal_copy(0, 2, size, epoch=1)
    appended = log.append_raw(10, batch(10), epoch=1)
    executor.run_all()

    assert result_of(sealing).state is CopyState.SEALED
    assert result_of(appended).next_offset == 11


# -- install a sealed segment --------------------------------------------------------------


def test_install_segment_writes_a_whole_sealed_segment_in_offset_order() -> None:
    fs = MemoryFileSystem()
    log = started(fs, 300)
    result_of(log.append_raw(300, batch(300), epoch=1))
    data = batch(100, 3) + batch(103, 2)

    info = result_of(log.install_segment(100, data, 5, epoch=0))

    assert (info.base_offset, info.state, info.record_count, info.byte_size) == (
        100,
        CopyState.SEALED,
        5,
        len(data),
    )
    assert [s.base_offset for s in log.segments()] == [100, 300]
    assert fs.read_file(segment_path(100)) == data
    log.commit(301)
    assert stored_records(log) == [100, 101, 102, 103, 104, 300]
    result_of(log.close())
    reopened = replica(fs)
    assert [(s.base_offset, s.state) for s in reopened.segments()] == [
        (100, CopyState.SEALED),
        (300, CopyState.ACTIVE),
    ]
    assert result_of(reopened.verify_segment(100)).verified


def test_install_segment_refuses_overlaps_and_bytes_that_do_not_verify() -> None:
    fs = MemoryFileSystem()
    log = started(fs, 300)
    result_of(log.install_segment(100, batch(100, 5), 5, epoch=0))
    bad = bytearray(batch(200, 2))
    bad[-1] ^= 1

    assert failure_of(log.install_segment(103, batch(103, 5), 5, epoch=0)).check(SegmentStateError)
    assert failure_of(log.install_segment(98, batch(98, 3), 3, epoch=0)).check(SegmentStateError)
    assert failure_of(log.install_segment(299, batch(299, 2), 2, epoch=0)).check(SegmentStateError)
    assert failure_of(log.install_segment(200, bytes(bad), 2, epoch=0)).check(InvalidBatchError)
    assert failure_of(log.install_segment(200, batch(200, 2), 3, epoch=0)).check(InvalidBatchError)
    assert failure_of(log.install_segment(200, batch(201, 2), 2, epoch=0)).check(InvalidBatchError)
    assert [s.base_offset for s in log.segments()] == [100, 300]
    assert not fs.exists(segment_path(200))


def test_install_segment_refuses_the_base_of_an_empty_segment_it_shares_a_name_with() -> None:
    fs = MemoryFileSystem()
    log = started(fs, 100)
    result_of(log.start_segment(200, 1))

    refused = failure_of(log.install_segment(100, batch(100, 5), 5, epoch=1))

    assert refused.check(SegmentStateError)
    assert [(s.base_offset, s.next_offset) for s in log.segments()] == [(100, 100), (200, 200)]
    assert fs.read_file(segment_path(100)) == b""
    result_of(log.delete_segment(100))
    assert result_of(log.install_segment(100, batch(100, 5), 5, epoch=1)).next_offset == 105


def test_a_fresh_copy_can_take_an_installed_segment_past_its_end() -> None:
    log = replica(MemoryFileSystem())

    result_of(log.install_segment(500, batch(500, 2), 2, epoch=0))

    assert (log.start_offset, log.durable_offset, log.next_offset) == (500, 502, 502)
    assert result_of(log.start_segment(502, 1)).base_offset == 502


def test_install_segment_verifies_in_the_reader_thread_then_writes_in_the_log_queue() -> None:
    writer, reader = ManualExecutor(), ManualExecutor()
    log = result_of_running(
        RangeLog.open(
            RANGE_DIR,
            fs=MemoryFileSystem(),
            clock=Clock(),
            executor=writer,
            reader=reader,
            config=REPLICA,
        ),
        writer,
    )

    installing = log.install_segment(7, batch(7, 2), 2, epoch=0)

    assert [job.__name__ for job, _, _ in reader.pending] == ["check_install"]
    assert writer.pending == []
    reader.run_all()
    assert [job.__name__ for job, _, _ in writer.pending] == ["_install_job"]
    writer.run_all()
    assert result_of(installing).record_count == 2


# -- the commit index ----------------------------------------------------------------------


def test_readers_of_a_replicated_log_see_only_committed_records() -> None:
    log = started(MemoryFileSystem())
    result_of(log.append_raw(0, batch(0, 3), epoch=1))
    result_of(log.append_raw(3, batch(3, 2), epoch=1))

    assert (log.end_offset, log.durable_offset, log.committed_offset) == (0, 5, 0)
    assert stored_records(log) == []
    log.commit(3)
    assert stored_records(log) == [0, 1, 2]
    log.commit(4)  # inside a batch: its later records stay unseen
    assert stored_records(log) == [0, 1, 2, 3]
    log.commit(2)
    assert log.committed_offset == 4, "never back"
    log.commit(50)
    assert (log.end_offset, log.committed_offset) == (5, 50), "a follower may hear it first"
    assert log.read_raw(0) == batch(0, 3) + batch(3, 2), "followers read what is durable"


def test_without_replication_the_committed_offset_is_the_durable_one() -> None:
    log = open_log(MemoryFileSystem())
    append_each(log, 0, 2)
    log.commit(1)

    assert (log.committed_offset, log.end_offset, log.durable_offset) == (2, 2, 2)
    assert offsets(log) == [0, 1]


def test_a_replicated_log_recovers_committed_to_the_end_of_its_last_sealed_segment() -> None:
    fs = MemoryFileSystem()
    log = started(fs)
    result_of(log.append_raw(0, batch(0, 2), epoch=1))
    result_of(log.seal_copy(0, 2, log.active_bytes, epoch=1))
    result_of(log.start_segment(2, 1))
    result_of(log.append_raw(2, batch(2, 2), epoch=1))
    log.commit(4)
    result_of(log.close())

    reopened = replica(fs)

    assert (reopened.committed_offset, reopened.durable_offset, reopened.end_offset) == (2, 4, 2)
    assert offsets(reopened) == [0, 1]
    fresh = replica(MemoryFileSystem())
    assert (fresh.committed_offset, fresh.end_offset) == (0, 0)


def test_a_single_node_log_keeps_epoch_0_and_commits_what_is_durable() -> None:
    log = open_log(MemoryFileSystem(), LogConfig(roll_bytes=300))
    append_each(log, 0, 6)

    assert [s.state for s in log.segments()][-1] is CopyState.ACTIVE
    assert all(log.segment_epoch(s.base_offset) == 0 for s in log.segments())
    assert log.end_offset == log.durable_offset == log.committed_offset == 6
    assert result_of(log.append([Record(b"x")])).base_offset == 6


def test_a_closed_log_refuses_the_replica_operations() -> None:
    log = replica(MemoryFileSystem())
    result_of(log.close())

    assert failure_of(log.fence(0, 1)).check(LogClosedError)
    assert failure_of(log.start_segment(0, 1)).check(LogClosedError)
    assert failure_of(log.seal_copy(0, 1, 100, epoch=0)).check(LogClosedError)
    assert failure_of(log.install_segment(0, batch(0), 1, epoch=0)).check(LogClosedError)


def test_a_copy_whose_seal_failed_on_a_full_disk_returns_to_service_and_seals_again(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = replica(fs)
    result_of(log.start_segment(0, 1))
    result_of(log.append_raw(0, batch(0, 2), epoch=1))
    size = log.active_bytes
    fs.failing_atomic_writes = 1  # the disk is full as the seal's sidecars are written

    assert failure_of(log.seal_copy(0, 2, size, epoch=1)).check(OSError)
    assert log.failed
    logged_errors.clear()

    assert result_of(log.return_to_service()) is True

    info = result_of(log.seal_copy(0, 2, size, epoch=1))
    assert (info.state, info.record_count, info.byte_size) == (CopyState.SEALED, 2, size)
    assert result_of(log.start_segment(2, 1)).base_offset == 2
    result_of(log.append_raw(2, batch(2, 1), epoch=1))
    assert log.durable_offset == 3


def _fail_at_directory_sync(number: int) -> Callable[[str, str], None]:
    """An ``on_atomic_step`` that fails the ``number``th directory sync it sees."""
    seen = 0

    def step(name: str, path: str) -> None:
        nonlocal seen
        if name == "sync-dir":
            seen += 1
            if seen == number:
                raise OSError(28, "No space left on device (injected)", path)

    return step


@pytest.mark.parametrize(
    ("failing", "shared_flush"),
    [
        ("marker-staged", False),
        ("marker-staged", True),
        ("marker-renamed", False),
        ("marker-renamed", True),
        # Only the shared flush syncs a new file's directory through a handle a test can fail.
        ("file-made", True),
    ],
)
def test_a_copy_whose_segment_start_failed_on_a_full_disk_returns_to_service_started(
    shared_flush: bool, failing: str, logged_errors: list[dict[str, Any]]
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, REPLICA, shared_flush=shared_flush)
    result_of(log.start_segment(0, 1))
    result_of(log.append_raw(0, batch(0, 2), epoch=1))
    size = log.active_bytes
    result_of(log.seal_copy(0, 2, size, epoch=1))
    if failing == "marker-staged":
        fs.failing_atomic_writes = 1
    else:
        fs.on_atomic_step = _fail_at_directory_sync(1 if failing == "marker-renamed" else 2)

    assert failure_of(log.start_segment(2, 3, data_epoch=2)).check(OSError)
    assert log.failed
    assert fs.exists(segment_path(2)) is (failing == "file-made")
    assert failure_of(log.append_raw(2, batch(2), epoch=3)).check(LogFailedError)
    fs.on_atomic_step = None
    logged_errors.clear()

    assert result_of(log.return_to_service()) is True

    assert [s.base_offset for s in log.segments()] == [0, 2]
    assert (log.segment_epoch(2), log.segment_data_epoch(2)) == (3, 2)
    result_of(log.append_raw(2, batch(2, 3), epoch=3))
    assert log.durable_offset == 5
    result_of(log.close())
    reopened = open_log(fs.crash(), REPLICA)
    assert [(s.base_offset, s.state) for s in reopened.segments()] == [
        (0, CopyState.SEALED),
        (2, CopyState.ACTIVE),
    ]
    assert (reopened.segment_epoch(2), reopened.segment_data_epoch(2)) == (3, 2)
    assert reopened.next_offset == reopened.durable_offset == 5


def test_a_segment_start_that_failed_while_the_disk_is_still_full_is_tried_again_later(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = started(fs)
    result_of(log.append_raw(0, batch(0, 2), epoch=1))
    result_of(log.seal_copy(0, 2, log.active_bytes, epoch=1))
    fs.failing_atomic_writes = 2  # the start's marker, then the first probe

    assert failure_of(log.start_segment(2, 1)).check(OSError)
    logged_errors.clear()
    assert result_of(log.return_to_service()) is False
    assert log.failed
    assert not fs.exists(segment_path(2)), "a failed probe touches nothing"

    assert result_of(log.return_to_service()) is True
    result_of(log.append_raw(2, batch(2), epoch=1))
    assert log.durable_offset == 3


def test_a_segment_start_queued_behind_a_failed_write_is_forgotten_when_the_copy_returns(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log, executor = stepped_replica(fs)
    result_of_running(log.start_segment(0, 1), executor)
    result_of_running(log.append_raw(0, batch(0, 2), epoch=1), executor)
    fs.failing_syncs = 1
    failed_append = log.append_raw(2, batch(2), epoch=1)
    queued_start = log.start_segment(3, 2)
    executor.run_all()

    assert failure_of(failed_append).check(LogFailedError)
    assert failure_of(queued_start).check(LogFailedError)
    logged_errors.clear()
    assert result_of_running(log.return_to_service(), executor) is True

    assert [s.base_offset for s in log.segments()] == [0]
    assert log.next_offset == log.durable_offset == 2, "the failed append is cut back"
    assert result_of_running(log.start_segment(2, 2), executor).base_offset == 2
    result_of_running(log.append_raw(2, batch(2), epoch=2), executor)
    assert log.durable_offset == 3


def test_a_segment_start_queued_behind_a_failed_seal_is_forgotten_not_made(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log, executor = stepped_replica(fs)
    result_of_running(log.start_segment(0, 1), executor)
    result_of_running(log.append_raw(0, batch(0, 2), epoch=1), executor)
    size = log.active_bytes
    fs.failing_atomic_writes = 1  # the seal's sidecars
    sealing = log.seal_copy(0, 2, size, epoch=1)
    queued_start = log.start_segment(2, 1)
    executor.run_all()

    assert failure_of(sealing).check(OSError)
    assert failure_of(queued_start).check(LogFailedError)
    logged_errors.clear()
    assert result_of_running(log.return_to_service(), executor) is True

    assert not fs.exists(segment_path(2)), "the start that never ran is not made"
    assert [(s.base_offset, s.state) for s in log.segments()] == [(0, CopyState.ACTIVE)]
    info = result_of_running(log.seal_copy(0, 2, size, epoch=1), executor)
    assert info.state is CopyState.SEALED
    assert result_of_running(log.start_segment(2, 1), executor).base_offset == 2
