"""Every file of a sealed segment is a function of the sealed segment alone: the same bytes give
the same ``.index``, ``.sealed`` and ``.epoch``, however they arrived (appends chunked one way
or another, a roll, a cut back to the sealed length, a whole copy installed), whenever and on
whichever node they were sealed. Without it, replicas of one segment cannot end byte-identical
(the spec's guarantee 4)."""

from __future__ import annotations

import itertools
import struct
from typing import Any

from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock

from logbroker.records import Record
from logbroker.storage import CopyState, IntegrityEvent, LogConfig, RangeLog
from logbroker.storage._format import (
    INDEX_INTERVAL_BYTES,
    decode_epoch,
    decode_index,
    decode_seal,
    encode_batch,
)
from logbroker.storage.errors import SegmentStateError
from logbroker.testing import ImmediateExecutor, MemoryFileSystem
from tests.unit.storage.helpers import (
    RANGE_DIR,
    failure_of,
    open_log,
    result_of,
    segment_path,
)

REPLICA = LogConfig(replicated=True, auto_roll=False)
SUFFIXES = (".log", ".index", ".sealed", ".epoch")

#: Batches of one to five records of 0 to 3000 bytes: a segment of a few dozen crosses the
#: index interval many times, at batch starts that a chunking can hide.
batch_shapes = st.lists(
    st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 2**64 - 1)), min_size=1, max_size=5),
    min_size=1,
    max_size=30,
)


def encode_segment(shapes: list[list[tuple[int, int]]]) -> list[bytes]:
    """The batches of a segment at offset 0: each record ``(value size, timestamp)``."""
    batches = []
    offset = 0
    for shape in shapes:
        records = [Record(b"v" * size, timestamp_ms=stamp) for size, stamp in shape]
        batches.append(encode_batch(offset, records))
        offset += len(records)
    return batches


def files(fs: MemoryFileSystem, base_offset: int = 0) -> dict[str, bytes]:
    return {
        suffix: fs.read_file(segment_path(base_offset, suffix))
        for suffix in SUFFIXES
        if fs.exists(segment_path(base_offset, suffix))
    }


def replica(fs: MemoryFileSystem, clock: Clock) -> RangeLog:
    log: RangeLog = result_of(
        RangeLog.open(RANGE_DIR, fs=fs, clock=clock, executor=ImmediateExecutor(), config=REPLICA)
    )
    return log


def sealed_by_appends(
    batches: list[bytes], cuts: list[int], epoch: int, seconds: float, extra: bytes = b""
) -> MemoryFileSystem:
    """A replica that took ``batches`` in appends split at ``cuts`` (batch numbers), maybe
    bytes past the sealed length (``extra``, never committed), on a node whose clock reads
    ``seconds``, then sealed the copy at ``epoch``."""
    fs = MemoryFileSystem()
    clock = Clock()
    log = replica(fs, clock)
    result_of(log.start_segment(0, epoch))
    offset = 0
    bounds = [0, *sorted({min(cut, len(batches)) for cut in cuts}), len(batches)]
    for start, end in itertools.pairwise(bounds):
        if start == end:
            continue
        chunk = b"".join(batches[start:end])
        result_of(log.append_raw(offset, chunk, epoch=epoch))
        offset = log.next_offset
    count, size = offset, log.active_bytes
    if extra:
        result_of(log.append_raw(offset, extra, epoch=epoch))
    clock.advance(seconds)
    result_of(log.seal_copy(0, count, size, epoch=epoch))
    result_of(log.close())
    return fs


def installed(batches: list[bytes], epoch: int) -> MemoryFileSystem:
    fs = MemoryFileSystem()
    log = replica(fs, Clock())
    count = sum(struct.unpack_from(">I", batch, 20)[0] for batch in batches)
    result_of(log.install_segment(0, b"".join(batches), count, epoch=epoch))
    result_of(log.close())
    return fs


@settings(max_examples=60)
@given(
    batch_shapes,
    st.lists(st.integers(0, 30), max_size=10),
    st.lists(st.integers(0, 30), max_size=10),
    st.integers(0, 2**64 - 1),
)
def test_any_chunking_of_the_same_bytes_seals_into_the_same_files(
    shapes: list[list[tuple[int, int]]], cuts: list[int], other_cuts: list[int], epoch: int
) -> None:
    batches = encode_segment(shapes)
    count = sum(len(shape) for shape in shapes)
    one_by_one = sealed_by_appends(batches, list(range(len(batches))), epoch, 1.0)
    chunked = sealed_by_appends(batches, cuts, epoch, 7_200.5)
    cut_back = sealed_by_appends(
        batches, other_cuts, epoch, 86_400.0, extra=encode_batch(count, [Record(b"late")])
    )
    whole = installed(batches, epoch)

    expected = files(one_by_one)
    assert set(expected) == set(SUFFIXES)
    assert files(chunked) == expected
    assert files(cut_back) == expected
    assert files(whole) == expected


@settings(max_examples=40)
@given(batch_shapes, st.lists(st.integers(0, 30), max_size=10))
def test_the_index_is_the_documented_rule_over_the_sealed_log(
    shapes: list[list[tuple[int, int]]], cuts: list[int]
) -> None:
    batches = encode_segment(shapes)
    fs = sealed_by_appends(batches, cuts, 3, 0.0)

    starts, position, offset = [], 0, 0
    for batch in batches:
        starts.append((offset, position))
        position += len(batch)
        offset += struct.unpack_from(">I", batch, 20)[0]
    expected = []
    for offset, position in starts:
        if not expected or position - expected[-1][1] >= INDEX_INTERVAL_BYTES:
            expected.append((offset, position))
    index = decode_index(fs.read_file(segment_path(0, ".index")), 0)
    assert [(entry.offset, entry.position) for entry in index] == expected


def test_a_roll_writes_the_same_index_and_seal_as_a_replica_and_no_epoch_marker() -> None:
    shapes = [[(1500, 9), (1500, 30)], [(2500, 12)], [(4000, 2)], [(10, 31), (10, 5)]]
    batches = encode_segment(shapes)
    fs = MemoryFileSystem()
    clock = Clock()
    log = open_log(fs, clock=clock)
    for shape in shapes:
        result_of(log.append([Record(b"v" * size, timestamp_ms=t) for size, t in shape]))
    clock.advance(123.0)
    info = result_of(log.roll())

    assert (info.record_count, info.max_timestamp_ms) == (6, 31)
    replicated = files(sealed_by_appends(batches, [2], 0, 5.0))
    assert files(fs) == {suffix: replicated[suffix] for suffix in (".log", ".index", ".sealed")}
    assert not fs.exists(segment_path(0, ".epoch")), "a single node stays at epoch 0, unmarked"


def test_the_seal_records_the_largest_record_timestamp_not_the_time_of_sealing() -> None:
    fs = MemoryFileSystem()
    clock = Clock()
    clock.advance(1_800_000_000.0)
    log = open_log(fs, clock=clock)
    result_of(log.append([Record(b"a", timestamp_ms=500), Record(b"b", timestamp_ms=2**63)]))
    result_of(log.append([Record(b"c", timestamp_ms=7)]))

    info = result_of(log.roll())

    assert info.max_timestamp_ms == 2**63
    seal = decode_seal(fs.read_file(segment_path(0, ".sealed")))
    assert (seal.record_count, seal.max_timestamp_ms) == (3, 2**63)
    assert open_log(fs).segments()[0].max_timestamp_ms == 2**63, "read back by recovery"


def test_seal_copy_and_install_mark_the_copy_with_the_sealed_epoch() -> None:
    batches = encode_segment([[(100, 1)], [(100, 2)]])
    sealed = sealed_by_appends(batches, [1], 6, 0.0)
    whole = installed(batches, 6)

    for fs in (sealed, whole):
        marker = decode_epoch(fs.read_file(segment_path(0, ".epoch")))
        assert (marker.base_offset, marker.epoch) == (0, 6)
        reopened = replica(fs, Clock())
        assert reopened.segment_epoch(0) == 6
        assert reopened.segments()[0].state is CopyState.SEALED


def test_a_copy_without_an_epoch_marker_sealed_at_an_epoch_gets_one() -> None:
    # A copy of the very bytes, written as a single node would (no marker): sealing it as a
    # replica of a segment sealed at epoch 4 marks it like every other copy.
    batches = encode_segment([[(100, 1)], [(300, 2)]])
    fs = MemoryFileSystem()
    log = open_log(fs)
    for batch in batches:
        result_of(log.append_raw(log.next_offset, batch))
    size = log.active_bytes

    result_of(log.seal_copy(0, 2, size, epoch=4))

    assert log.segment_epoch(0) == 4
    assert files(fs) == files(sealed_by_appends(batches, [], 4, 0.0))


def test_recovery_rebuilds_a_lost_index_into_the_same_bytes() -> None:
    batches = encode_segment([[(2000, 1)], [(2000, 2), (2000, 3)], [(10, 4)], [(5000, 5)]])
    fs = sealed_by_appends(batches, [3], 2, 0.0)
    written = fs.read_file(segment_path(0, ".index"))
    fs.remove(segment_path(0, ".index"))

    replica(fs, Clock())

    assert fs.read_file(segment_path(0, ".index")) == written


def test_recovery_reads_a_version_1_seal_marker_of_an_earlier_build() -> None:
    batches = encode_segment([[(10, 1), (10, 2)]])
    fs = sealed_by_appends(batches, [], 1, 0.0)
    size = len(batches[0])
    # What an earlier build wrote: version 1, the node's time of sealing in the last field.
    body = struct.pack(">2sBBIQQQQI", b"LS", 1, 0, 0, 0, 2, size, 1_700_000_000_000, 0)
    fs.write_atomic(segment_path(0, ".sealed"), struct.pack(">I", crc32c(body)) + body)
    events: list[IntegrityEvent] = []

    log = open_log(fs, REPLICA, events)

    assert events == []
    [info] = log.segments()
    assert (info.state, info.record_count, info.byte_size) == (CopyState.SEALED, 2, size)
    assert info.max_timestamp_ms is None, "a version 1 marker does not know it"
    log.commit(2)
    assert [stored.offset for stored in log.read(0)] == [0, 1]


def test_a_roll_over_rot_it_finds_seals_the_segment_whole_and_reports_the_rot(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    events: list[IntegrityEvent] = []
    log = open_log(fs, events=events)
    for number in range(3):
        result_of(log.append([Record(b"x" * 100, timestamp_ms=number)]))
    size = fs.size(segment_path(0))
    fs.corrupt(segment_path(0), size - 10)  # rot in the last batch, unknown to the log

    info = result_of(log.roll())

    assert (info.state, info.record_count) == (CopyState.SEALED, 3)
    assert fs.size(segment_path(0)) == size, "rot is never cut"
    assert [(event.reason.value, event.counted) for event in events] == [("checksum", True)]
    assert len(logged_errors) == 1
    logged_errors.clear()
    assert [stored.offset for stored in log.read(0)] == [0, 1], "reads stop before the rot"
    assert result_of(log.append([Record(b"next")])).base_offset == 3


def test_seal_copy_refuses_rot_it_finds_before_the_sealed_length() -> None:
    batches = encode_segment([[(100, 1)], [(100, 2)]])
    fs = MemoryFileSystem()
    log = replica(fs, Clock())
    result_of(log.start_segment(0, 1))
    result_of(log.append_raw(0, b"".join(batches), epoch=1))
    size = log.active_bytes
    fs.corrupt(segment_path(0), 30)  # unknown to the log: found when sealing reads it back

    failure = failure_of(log.seal_copy(0, 2, size, epoch=1))

    assert failure.check(SegmentStateError), "fetched whole from a replica instead"
    assert not fs.exists(segment_path(0, ".sealed"))
    assert fs.size(segment_path(0)) == size
