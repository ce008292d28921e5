"""``RangeLog.copy_digests``: the SHA-256 of each file of each segment copy, what ``logbroker
cluster verify`` compares between nodes; hashed in the reader executor, in pages."""

from __future__ import annotations

import hashlib

from twisted.internet.task import Clock

from logbroker.records import Record
from logbroker.storage import CopyDigests, CopyState, LogConfig, RangeLog, SegmentFile
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from tests.unit.storage.helpers import RANGE_DIR, open_log, result_of, segment_path


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def rolled_log(fs: MemoryFileSystem, segments: int) -> RangeLog:
    """A single node's log with ``segments`` sealed segments of two records, and an active one."""
    log = open_log(fs)
    for number in range(segments):
        result_of(log.append([Record(b"a" * 50, timestamp_ms=number), Record(b"b")]))
        result_of(log.roll())
    result_of(log.append([Record(b"active")]))
    return log


def test_each_file_of_a_sealed_copy_is_hashed_and_the_active_copy_is_listed_bare() -> None:
    fs = MemoryFileSystem()
    log = rolled_log(fs, 2)

    copies, hashed = result_of(log.copy_digests())

    assert [(c.base_offset, c.state) for c in copies] == [
        (0, CopyState.SEALED),
        (2, CopyState.SEALED),
        (4, CopyState.ACTIVE),
    ]
    for copy in copies[:2]:
        assert copy.digests == {
            kind: sha256(fs.read_file(segment_path(copy.base_offset, kind.suffix)))
            for kind in (SegmentFile.LOG, SegmentFile.INDEX, SegmentFile.SEALED)
        }, "a single node's copy has no epoch marker"
    assert copies[2] == CopyDigests(4, CopyState.ACTIVE, {}), "still being written"
    assert hashed == sum(
        fs.size(segment_path(base, suffix))
        for base in (0, 2)
        for suffix in (".log", ".index", ".sealed")
    )


def test_a_missing_or_changed_file_shows_in_the_digests() -> None:
    fs = MemoryFileSystem()
    log = rolled_log(fs, 2)
    before, _ = result_of(log.copy_digests())
    fs.remove(segment_path(0, ".index"))
    fs.corrupt(segment_path(2, ".sealed"), 40)

    after, _ = result_of(log.copy_digests())

    assert set(after[0].digests) == {SegmentFile.LOG, SegmentFile.SEALED}
    assert after[0].digests[SegmentFile.LOG] == before[0].digests[SegmentFile.LOG]
    assert after[1].digests[SegmentFile.SEALED] != before[1].digests[SegmentFile.SEALED]
    assert after[1].digests[SegmentFile.LOG] == before[1].digests[SegmentFile.LOG]


def test_a_replica_copy_carries_its_epoch_marker() -> None:
    fs = MemoryFileSystem()
    log: RangeLog = result_of(
        RangeLog.open(
            RANGE_DIR,
            fs=fs,
            clock=Clock(),
            executor=ImmediateExecutor(),
            config=LogConfig(replicated=True, auto_roll=False),
        )
    )
    result_of(log.start_segment(0, 3))
    result_of(log.append([Record(b"r")]))
    result_of(log.seal_copy(0, 1, log.active_bytes, epoch=3))

    [copy], _ = result_of(log.copy_digests())

    assert copy.digests[SegmentFile.EPOCH] == sha256(fs.read_file(segment_path(0, ".epoch")))


def test_copies_come_in_pages_after_a_base_offset_within_a_byte_and_copy_budget() -> None:
    fs = MemoryFileSystem()
    log = rolled_log(fs, 4)
    one_copy = sum(fs.size(segment_path(0, s)) for s in (".log", ".index", ".sealed"))

    first, _ = result_of(log.copy_digests(max_bytes=one_copy + 1))
    rest, _ = result_of(log.copy_digests(after=first[-1].base_offset, max_copies=2))
    tiny, hashed = result_of(log.copy_digests(after=2, max_bytes=1))

    assert [c.base_offset for c in first] == [0, 2], "the copy that passes the budget ends it"
    assert [c.base_offset for c in rest] == [4, 6]
    assert [c.base_offset for c in tiny] == [4], "at least one copy"
    assert hashed == sum(fs.size(segment_path(4, s)) for s in (".log", ".index", ".sealed"))


def test_hashing_runs_in_the_reader_executor() -> None:
    fs = MemoryFileSystem()
    rolled_log(fs, 1)
    reader = ManualExecutor()
    log: RangeLog = result_of(
        RangeLog.open(RANGE_DIR, fs=fs, clock=Clock(), executor=ImmediateExecutor(), reader=reader)
    )

    digesting = log.copy_digests()

    assert not digesting.called
    reader.run_all()
    copies, _ = result_of(digesting)
    assert [c.base_offset for c in copies] == [0, 2]
