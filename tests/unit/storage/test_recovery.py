"""One test per recovery case of the spec's integrity rules 7 and 8 (and the sealed size check).

Each test builds a range on a MemoryFileSystem, damages or cuts it the way a crash or rot would,
reopens it, and checks what was kept, what was reported and what reads return.
"""

from __future__ import annotations

from typing import Any

import pytest

from logbroker.storage import (
    CopyState,
    DamageReason,
    DataDirectory,
    FormatTooNewError,
    IntegrityEvent,
    LogConfig,
    NotADataDirectoryError,
    StorageError,
)
from logbroker.storage._format import BATCH_HEADER_SIZE, encode_batch
from logbroker.testing import MemoryFileSystem
from tests.unit.storage.helpers import (
    RANGE_DIR,
    append_each,
    batch_positions,
    offsets,
    open_log,
    record,
    result_of,
    segment_path,
)

ACTIVE = segment_path(0)


def five_batches() -> MemoryFileSystem:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 5)
    result_of(log.close())
    return fs


def expect_errors(logged_errors: list[dict[str, Any]], count: int) -> None:
    assert len(logged_errors) == count, logged_errors
    logged_errors.clear()


def test_torn_tail_of_active_segment_is_dropped_and_logged_not_counted() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 4)
    log.append([record(4)])
    # The fifth batch was written but its fsync never completed: ImmediateExecutor ran it, so
    # make it look unsynced by cutting the file inside that batch, as a power cut would.
    start, end = batch_positions(fs, ACTIVE)[-1]
    crashed = fs.crash()
    crashed.write_atomic(ACTIVE, fs.read_file(ACTIVE)[: start + (end - start) // 2])
    events: list[IntegrityEvent] = []

    reopened = open_log(crashed, events=events)

    assert crashed.size(ACTIVE) == start
    assert [(e.reason, e.position, e.counted) for e in events] == [
        (DamageReason.INCOMPLETE, start, False)
    ]
    assert offsets(reopened) == [0, 1, 2, 3]
    assert reopened.end_offset == 4
    assert result_of(reopened.append([record(4)])).base_offset == 4


def test_recovery_clamps_at_last_crc_valid_frame() -> None:
    fs = five_batches()
    positions = batch_positions(fs, ACTIVE)
    data = fs.read_file(ACTIVE)
    for cut in range(positions[3][0] + 1, positions[3][1]):
        crashed = MemoryFileSystem()
        crashed.make_dirs(RANGE_DIR)
        crashed.write_atomic(ACTIVE, data[:cut])
        reopened = open_log(crashed)
        assert crashed.size(ACTIVE) == positions[3][0], cut
        assert reopened.end_offset == 3


def test_zero_filled_tail_is_an_unwritten_tail_not_rot() -> None:
    fs = five_batches()
    size = fs.size(ACTIVE)
    fs.write_atomic(ACTIVE, fs.read_file(ACTIVE) + bytes(300))
    events: list[IntegrityEvent] = []

    reopened = open_log(fs, events=events)

    assert fs.size(ACTIVE) == size
    assert [e.counted for e in events] == [False]
    assert offsets(reopened) == [0, 1, 2, 3, 4]


def test_bad_checksum_in_active_segment_is_never_truncated(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = five_batches()
    positions = batch_positions(fs, ACTIVE)
    size = fs.size(ACTIVE)
    flipped = positions[2][1] - 3  # inside the value of the third batch's record
    fs.corrupt(ACTIVE, flipped)
    events: list[IntegrityEvent] = []

    reopened = open_log(fs, events=events)

    assert fs.size(ACTIVE) == size
    assert len(events) == 1
    assert events[0].reason is DamageReason.CHECKSUM
    assert events[0].counted
    assert positions[2][0] <= events[0].position <= flipped
    expect_errors(logged_errors, 1)
    assert reopened.segments()[0].state is CopyState.CLOSED


def test_reads_from_damaged_copy_return_records_before_damage_and_nothing_after(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = five_batches()
    fs.corrupt(ACTIVE, batch_positions(fs, ACTIVE)[2][1] - 3)
    reopened = open_log(fs)
    expect_errors(logged_errors, 1)

    assert offsets(reopened) == [0, 1]
    assert reopened.read(2) == []
    assert reopened.read(4) == []


def test_mangled_frame_header_with_bytes_after_is_rot_not_a_torn_tail(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = five_batches()
    positions = batch_positions(fs, ACTIVE)
    size = fs.size(ACTIVE)
    fs.corrupt(ACTIVE, positions[1][0] + 4)  # the first magic byte of the second batch
    events: list[IntegrityEvent] = []

    open_log(fs, events=events)

    assert fs.size(ACTIVE) == size
    assert [(e.reason, e.position, e.counted) for e in events] == [
        (DamageReason.HEADER, positions[1][0], True)
    ]
    expect_errors(logged_errors, 1)


def test_rotted_length_of_last_whole_batch_is_rot_not_a_torn_tail(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = five_batches()
    last_start, _ = batch_positions(fs, ACTIVE)[-1]
    size = fs.size(ACTIVE)
    fs.corrupt(ACTIVE, last_start + 10, 0x10)  # the batch length grows past the end of the file
    events: list[IntegrityEvent] = []

    open_log(fs, events=events)

    assert fs.size(ACTIVE) == size
    assert [(e.reason, e.counted) for e in events] == [(DamageReason.HEADER, True)]
    expect_errors(logged_errors, 1)


def test_appends_after_rot_go_to_a_new_segment_past_salvageable_offsets(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = five_batches()
    size = fs.size(ACTIVE)
    fs.corrupt(ACTIVE, batch_positions(fs, ACTIVE)[1][1] - 3)
    reopened = open_log(fs)
    expect_errors(logged_errors, 1)

    appended = result_of(reopened.append([record(99)]))

    # Offsets 2..4 are still held, intact, after the damage: they are never reused.
    assert appended.base_offset == 5
    assert fs.size(ACTIVE) == size
    assert fs.exists(segment_path(5))
    assert [s.base_offset for s in reopened.segments()] == [0, 5]
    assert offsets(reopened, 5) == [5]


def test_sealed_segment_cut_short_is_never_truncated_and_is_counted(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 5)
    sealed = result_of(log.roll())
    append_each(log, 5, 1)
    result_of(log.close())
    cut = sealed.byte_size - 10
    fs.write_atomic(ACTIVE, fs.read_file(ACTIVE)[:cut])
    events: list[IntegrityEvent] = []

    reopened = open_log(fs, events=events)

    assert fs.size(ACTIVE) == cut
    assert [(e.reason, e.position, e.sealed, e.counted) for e in events] == [
        (DamageReason.SIZE, cut, True, True)
    ]
    expect_errors(logged_errors, 1)
    assert offsets(reopened)[:4] == [0, 1, 2, 3]
    assert 4 not in offsets(reopened)


def test_sealed_segment_with_extra_bytes_is_never_truncated(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 3)
    sealed = result_of(log.roll())
    result_of(log.close())
    fs.write_atomic(ACTIVE, fs.read_file(ACTIVE) + encode_batch(3, [record(3)]))
    events: list[IntegrityEvent] = []

    reopened = open_log(fs, events=events)

    assert fs.size(ACTIVE) > sealed.byte_size
    assert [(e.reason, e.counted) for e in events] == [(DamageReason.SIZE, True)]
    expect_errors(logged_errors, 1)
    assert offsets(reopened) == [0, 1, 2]


def test_rot_in_sealed_segment_is_reported_by_verify_with_its_position(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 5)
    result_of(log.roll())
    result_of(log.close())
    size = fs.size(ACTIVE)
    damaged_batch = batch_positions(fs, ACTIVE)[3]
    flipped = damaged_batch[1] - 2
    fs.corrupt(ACTIVE, flipped)

    reopened = open_log(fs)  # a sealed segment is trusted on open: only verify reads it all
    verification = result_of(reopened.verify_segment(0))

    assert not verification.verified
    assert verification.damage is not None
    assert verification.damage.reason is DamageReason.CHECKSUM
    assert damaged_batch[0] <= verification.damage.position <= flipped
    assert fs.size(ACTIVE) == size
    expect_errors(logged_errors, 1)
    assert offsets(reopened) == [0, 1, 2]


def test_replica_copy_without_seal_marker_drops_its_torn_tail() -> None:
    # A follower's copy of a segment the control plane sealed has no local marker; a crash
    # mid-copy leaves a torn tail that recovery drops, like any unsealed file.
    fs = MemoryFileSystem()
    fs.make_dirs(RANGE_DIR)
    copy = encode_batch(0, [record(0)]) + encode_batch(1, [record(1)])
    fs.write_atomic(segment_path(0), copy + encode_batch(2, [record(2)])[:20])
    fs.write_atomic(segment_path(3), encode_batch(3, [record(3)]))
    events: list[IntegrityEvent] = []

    reopened = open_log(fs, events=events)

    assert fs.size(segment_path(0)) == len(copy)
    assert [e.counted for e in events] == [False]
    assert [s.state for s in reopened.segments()] == [CopyState.CLOSED, CopyState.ACTIVE]


def test_unreadable_seal_marker_is_counted_and_file_never_truncated(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 3)
    result_of(log.roll())
    result_of(log.close())
    fs.write_atomic(ACTIVE, fs.read_file(ACTIVE)[:-5])
    fs.corrupt(segment_path(0, ".sealed"), 20)
    size = fs.size(ACTIVE)
    events: list[IntegrityEvent] = []

    reopened = open_log(fs, events=events)

    assert fs.size(ACTIVE) == size
    assert [e.reason for e in events] == [DamageReason.METADATA, DamageReason.INCOMPLETE]
    assert all(e.counted for e in events)
    expect_errors(logged_errors, 2)
    assert reopened.segments()[0].state is CopyState.CLOSED


def test_leftovers_of_interrupted_writes_and_deletes_are_removed() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 2)
    result_of(log.roll())
    append_each(log, 2, 1)
    result_of(log.close())
    fs.write_atomic(segment_path(2, ".sealed.tmp"), b"half a marker")
    fs.remove(segment_path(0))  # a delete stopped after unlinking the log

    reopened = open_log(fs)

    assert fs.files() == [segment_path(2)]
    assert reopened.start_offset == 2


def test_data_directory_written_by_newer_format_is_refused() -> None:
    fs = MemoryFileSystem()
    fs.make_dirs("/data")
    fs.write_atomic("/data/FORMAT", b"logbroker storage format 2\n")

    with pytest.raises(FormatTooNewError, match="uses storage format 2"):
        DataDirectory.open("/data", fs)


def test_directory_with_files_but_no_format_marker_is_refused() -> None:
    fs = MemoryFileSystem()
    fs.make_dirs("/data")
    fs.write_atomic("/data/something", b"not ours")

    with pytest.raises(NotADataDirectoryError, match="no FORMAT marker"):
        DataDirectory.open("/data", fs)


def test_new_data_directory_gets_a_format_marker_and_lists_its_ranges() -> None:
    fs = MemoryFileSystem()
    data_dir = DataDirectory.open("/data", fs)
    result_of(open_log(fs, LogConfig()).close())  # creates /data/ranges/topic/0 (helpers.RANGE_DIR)

    assert fs.read_file("/data/FORMAT") == b"logbroker storage format 1\n"
    assert data_dir.range_names() == ["topic/0"]
    assert DataDirectory.open("/data", fs, create=False).range_path("topic/0") == RANGE_DIR
    with pytest.raises(ValueError, match="invalid range name"):
        data_dir.range_path("../escape")


def test_reads_of_a_copy_found_damaged_while_live_stay_the_same(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    result_of(log.append([record(n) for n in range(5)]))
    data = fs.read_file(ACTIVE)
    third_record = BATCH_HEADER_SIZE
    for _ in range(2):  # skip the first two record frames by their length fields
        third_record += int.from_bytes(data[third_record + 8 : third_record + 12], "big")
    fs.corrupt(ACTIVE, third_record + 30)

    reads = [offsets(log) for _ in range(3)]

    assert reads == [[0, 1], [0, 1], [0, 1]]
    assert [stored.record for stored in log.read(0)] == [record(0), record(1)]
    expect_errors(logged_errors, 1)


def test_rot_leaving_nothing_readable_sends_new_writes_to_a_new_file(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    append_each(log, 0, 1)
    result_of(log.close())
    size = fs.size(ACTIVE)
    fs.corrupt(ACTIVE, 0)  # the checksum of the only batch
    reopened = open_log(fs)
    expect_errors(logged_errors, 1)

    appended = result_of(reopened.append([record(7)]))

    # Offset 0 was held by the rotted record: it is skipped, never reused.
    assert appended.base_offset == 1
    assert fs.size(ACTIVE) == size
    assert [stored.record for stored in reopened.read(1)] == [record(7)]
    result_of(reopened.close())
    assert [stored.record for stored in open_log(fs).read(1)] == [record(7)]
    expect_errors(logged_errors, 1)  # the second recovery finds the same rot


def test_rot_in_the_length_and_a_record_of_an_early_batch_is_never_truncated(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = five_batches()
    size = fs.size(ACTIVE)
    fs.corrupt(ACTIVE, 9, 0x01)  # the first batch's length now runs past the end of the file
    fs.corrupt(ACTIVE, 60)  # and its record is damaged too
    events: list[IntegrityEvent] = []

    reopened = open_log(fs, events=events)

    assert fs.size(ACTIVE) == size
    assert [(e.reason, e.counted) for e in events] == [(DamageReason.CHECKSUM, True)]
    expect_errors(logged_errors, 1)
    # Batches 1..4 after the damage still verify: their offsets are never handed out again.
    assert result_of(reopened.append([record(9)])).base_offset == 5


def test_a_data_directory_in_use_by_another_broker_is_refused() -> None:
    fs = MemoryFileSystem()
    held = DataDirectory.open("/data", fs)

    with pytest.raises(StorageError, match="in use by another logbroker process"):
        DataDirectory.open("/data", fs)
    assert DataDirectory.open("/data", fs, create=False).path == "/data"
    del held
    assert DataDirectory.open("/data", fs).path == "/data"


def test_ranges_are_found_at_any_depth_and_stray_directories_are_skipped() -> None:
    fs = MemoryFileSystem()
    data_dir = DataDirectory.open("/data", fs)
    for name in ("orders", "orders/0", "audit/eu/1"):
        fs.make_dirs(f"/data/ranges/{name}")
    fs.write_atomic("/data/ranges/orders/00000000000000000000.log", encode_batch(0, [record(0)]))
    fs.make_dirs("/data/ranges/lost+found")

    assert data_dir.range_names() == ["audit/eu/1", "orders", "orders/0"]


def test_a_first_start_that_failed_before_writing_the_marker_can_be_retried() -> None:
    fs = MemoryFileSystem()
    fs.failing_atomic_writes = 1  # the FORMAT marker cannot be written

    with pytest.raises(OSError, match="No space left"):
        DataDirectory.open("/data", fs)

    assert fs.read_file(DataDirectory.open("/data", fs).path + "/FORMAT") == (
        b"logbroker storage format 1\n"
    )
