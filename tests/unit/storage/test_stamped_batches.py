"""Stamped batches in the range log: written with the stamp of their produce, recovered,
replicated as they are, read like any batch, and their stamps read back (``recent_stamps``)."""

from __future__ import annotations

import struct
from typing import Any

from crc32c import crc32c
from twisted.internet.task import Clock

from logbroker import wire
from logbroker.records import ProducerStamp, Record
from logbroker.storage import DamageReason, IntegrityEvent, InvalidBatchError, LogConfig, RangeLog
from logbroker.storage._format import STAMPED_BATCH_HEADER_SIZE, encode_batch, stamp_batch
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from logbroker.transcode import wire_records, wire_records_python
from tests.unit.storage.helpers import (
    RANGE_DIR,
    batch_positions,
    failure_of,
    offsets,
    open_log,
    record,
    result_of,
    segment_path,
)

ACTIVE = segment_path(0)
FIRST = ProducerStamp(0x5EED, 0)
SECOND = ProducerStamp(0x5EED, 1)


def mixed(log: RangeLog) -> None:
    """Offsets 0 to 5: unstamped, stamped (FIRST: 1 and 2), unstamped, stamped (SECOND: 4 and 5)."""
    result_of(log.append([record(0)]))
    result_of(log.append([record(1), record(2)], FIRST))
    result_of(log.append([record(3)]))
    result_of(log.write([record(4), record(5)], SECOND).durable)


def test_stamped_appends_are_read_back_with_their_offsets_and_counts_in_offset_order() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)

    mixed(log)

    assert result_of(log.recent_stamps()) == [(FIRST, 1, 2), (SECOND, 4, 2)]
    assert [stored.record for stored in log.read(0)] == [record(n) for n in range(6)]
    # The stamped batch is the unstamped one's records after a 40-byte header and stamp.
    start, end = batch_positions(fs, ACTIVE)[1]
    stored = fs.read_file(ACTIVE)[start:end]
    assert stored == stamp_batch(encode_batch(1, [record(1), record(2)]), FIRST)
    assert struct.unpack_from(">BQQ", stored, 6)[0] == 2


def test_unstamped_appends_still_write_version_1_batches() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)

    result_of(log.append([record(0), record(1)]))

    assert fs.read_file(ACTIVE) == encode_batch(0, [record(0), record(1)])
    assert result_of(log.recent_stamps()) == []


def test_stamps_and_records_survive_a_reopen_and_a_roll() -> None:
    fs = MemoryFileSystem()
    config = LogConfig(roll_bytes=300)
    log = open_log(fs, config)
    mixed(log)
    result_of(log.close())

    reopened = open_log(fs, config)
    result_of(reopened.append([record(6)], ProducerStamp(7, 7)))

    assert len(reopened.segments()) > 1
    assert result_of(reopened.recent_stamps()) == [
        (FIRST, 1, 2),
        (SECOND, 4, 2),
        (ProducerStamp(7, 7), 6, 1),
    ]
    assert offsets(reopened) == list(range(7))
    # Sealed segments read from their index sidecar, from any offset.
    assert [stored.offset for stored in reopened.read(5)] == [5, 6]


def test_a_torn_stamped_batch_at_the_tail_is_dropped_by_recovery() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs)
    mixed(log)
    start = batch_positions(fs, ACTIVE)[-1][0]
    crashed = fs.crash()
    # Cut inside the stamp: the header is whole, the batch is not.
    crashed.write_atomic(ACTIVE, fs.read_file(ACTIVE)[: start + STAMPED_BATCH_HEADER_SIZE - 4])
    events: list[IntegrityEvent] = []

    reopened = open_log(crashed, events=events)

    assert crashed.size(ACTIVE) == start
    assert [(e.reason, e.counted) for e in events] == [(DamageReason.INCOMPLETE, False)]
    assert result_of(reopened.recent_stamps()) == [(FIRST, 1, 2)]
    assert reopened.end_offset == 4


def test_recent_stamps_reads_the_newest_bytes_first_across_segments() -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, LogConfig(roll_bytes=400))
    for sequence in range(30):
        result_of(log.append([record(sequence)], ProducerStamp(1, sequence)))
    segments = log.segments()
    assert len(segments) > 3
    batch_size = batch_positions(fs, ACTIVE)[0][1]

    everything = result_of(log.recent_stamps())
    newest = result_of(log.recent_stamps(max_bytes=5 * batch_size))

    assert everything == [(ProducerStamp(1, n), n, 1) for n in range(30)]
    # At least the last five batches, and no more than the segments holding them.
    assert newest == everything[-len(newest) :]
    assert len(newest) >= 5
    holding = [s for s in segments if s.next_offset > 25]
    assert newest[0][1] >= holding[0].base_offset


def test_recent_stamps_reads_in_a_reader_thread() -> None:
    reader = ManualExecutor()
    log = result_of(
        RangeLog.open(
            RANGE_DIR,
            fs=MemoryFileSystem(),
            clock=Clock(),
            executor=ImmediateExecutor(),
            reader=reader,
        )
    )
    result_of(log.append([record(0)], FIRST))

    reading = log.recent_stamps()

    assert [job.__name__ for job, _, _ in reader.pending] == ["recent_stamps_job"]
    assert not reading.called
    reader.run_all()
    assert result_of(reading) == [(FIRST, 0, 1)]


def test_recent_stamps_stop_before_rot_and_report_it(logged_errors: list[dict[str, Any]]) -> None:
    fs = MemoryFileSystem()
    events: list[IntegrityEvent] = []
    log = open_log(fs, events=events)
    for sequence in range(4):
        result_of(log.append([record(sequence)], ProducerStamp(1, sequence)))
    fs.corrupt(ACTIVE, batch_positions(fs, ACTIVE)[2][1] - 3)

    found = result_of(log.recent_stamps())

    assert found == [(ProducerStamp(1, 0), 0, 1), (ProducerStamp(1, 1), 1, 1)]
    assert [(e.reason, e.counted) for e in events] == [(DamageReason.CHECKSUM, True)]
    assert len(logged_errors) == 1
    logged_errors.clear()


def test_a_replica_stores_the_primarys_stamped_bytes_as_they_are() -> None:
    primary_fs, replica_fs = MemoryFileSystem(), MemoryFileSystem()
    primary, replica = open_log(primary_fs), open_log(replica_fs)
    mixed(primary)

    result_of(replica.append_raw(0, primary.read_raw(0)))

    assert replica_fs.read_file(ACTIVE) == primary_fs.read_file(ACTIVE)
    assert result_of(replica.recent_stamps()) == [(FIRST, 1, 2), (SECOND, 4, 2)]
    assert offsets(replica) == list(range(6))


def test_a_stamped_batch_from_a_peer_is_checked_record_by_record() -> None:
    replica = open_log(MemoryFileSystem())
    # A record that claims the wrong offset, in a batch whose own checksum was made to match.
    forged = bytearray(stamp_batch(encode_batch(0, [record(0), record(1)]), FIRST))
    second = STAMPED_BATCH_HEADER_SIZE + struct.unpack_from(">I", forged, 48)[0]
    struct.pack_into(">Q", forged, second + 12, 7)
    struct.pack_into(">I", forged, second, crc32c(bytes(forged[second + 4 :])))
    struct.pack_into(">I", forged, 0, crc32c(bytes(forged[4:])))

    refused = failure_of(replica.append_raw(0, bytes(forged)))

    assert refused.check(InvalidBatchError)
    assert replica.end_offset == 0


def test_fetches_transcode_the_records_of_a_stamped_batch() -> None:
    log = open_log(MemoryFileSystem())
    sent = [record(0), Record(b"", key=None, headers=((b"h", None),)), record(2)]
    result_of(log.append(sent, FIRST))

    [chunk] = result_of(log.read_chunks(0))
    start, end = chunk.records_region

    assert start == chunk.batch.position + STAMPED_BATCH_HEADER_SIZE
    native = wire_records(chunk.view, start, end, 1, 10, 1 << 20)
    assert native == wire_records_python(chunk.view, start, end, 1, 10, 1 << 20)
    data, count, next_offset, _ = native
    assert (count, next_offset) == (2, 3)
    payload = wire.encode_records_data(count, data, "c")
    assert list(wire.decode_records(payload).records) == sent[1:]
