"""A replica's copy sealed behind its appends (``seal_copy(..., behind=True)``): closed at once,
so the next segment starts and takes appends, while its read back and sidecars run on the
sealer; every other operation on it waits for them; a failure or a crash meanwhile leaves it
closed, in service."""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock

from logbroker.storage import CopyState, LogConfig, RangeLog, SegmentInfo
from logbroker.storage._format import encode_batch
from logbroker.testing import ManualExecutor, MemoryFileSystem
from tests.unit.storage.helpers import (
    RANGE_DIR,
    failure_of,
    offsets,
    record,
    result_of,
    result_of_running,
    segment_path,
)

REPLICA = LogConfig(replicated=True, auto_roll=False)


class SealingCopy:
    """A replica log holding segment 0 (records 0 and 1, at epoch 1), whose writes run on
    ``writer`` and whose seals behind the appends on ``sealer``, each when the test says."""

    def __init__(self, fs: MemoryFileSystem | None = None) -> None:
        self.fs = fs or MemoryFileSystem()
        self.writer = ManualExecutor()
        self.sealer = ManualExecutor()
        opening = RangeLog.open(
            RANGE_DIR,
            fs=self.fs,
            clock=Clock(),
            executor=self.writer,
            sealer=self.sealer,
            config=REPLICA,
        )
        self.log = result_of_running(opening, self.writer)
        self.written(self.log.start_segment(0, 1))
        self.written(self.log.append_raw(0, encode_batch(0, [record(0), record(1)]), epoch=1))
        self.size = self.log.active_bytes

    def written(self, deferred: Any) -> Any:
        """The result of ``deferred`` once the writer's jobs ran (never the sealer's)."""
        return result_of_running(deferred, self.writer)

    def seal_behind(self) -> SegmentInfo:
        return self.written(self.log.seal_copy(0, 2, self.size, epoch=1, behind=True))

    def state(self, base_offset: int = 0) -> CopyState:
        info = self.log.segment(base_offset)
        assert info is not None
        return info.state


def test_a_copy_sealed_behind_is_closed_at_once_and_the_next_segment_takes_appends_meanwhile() -> (
    None
):
    copy = SealingCopy()

    closed = copy.seal_behind()

    assert (closed.state, closed.record_count, closed.byte_size) == (CopyState.CLOSED, 2, copy.size)
    assert copy.sealer.pending, "its read back and sidecars wait for the sealer"
    assert copy.log.committed_offset == 2, "its records are committed: the seal is recorded"
    assert copy.written(copy.log.start_segment(2, 1)).base_offset == 2
    copy.written(copy.log.append_raw(2, encode_batch(2, [record(2)]), epoch=1))
    assert copy.log.durable_offset == 3
    assert not copy.fs.exists(segment_path(0, ".sealed"))

    copy.sealer.run_all()
    copy.writer.run_all()  # the sidecars' atomic writes

    assert copy.state(0) is CopyState.SEALED
    assert copy.fs.exists(segment_path(0, ".sealed"))
    assert copy.fs.exists(segment_path(0, ".index"))
    assert copy.state(2) is CopyState.ACTIVE
    assert copy.log.next_offset == 3, "the seal behind did not move the range's end back"
    copy.log.commit(3)
    assert offsets(copy.log) == [0, 1, 2]


def test_a_second_seal_behind_of_the_same_copy_is_answered_at_once_and_a_plain_one_waits() -> None:
    copy = SealingCopy()
    copy.seal_behind()

    again = copy.seal_behind()
    waiting = copy.log.seal_copy(0, 2, copy.size, epoch=1)
    copy.writer.run_all()

    assert again.state is CopyState.CLOSED
    assert not waiting.called, "a plain seal answers once the copy is sealed"
    assert len(copy.sealer.pending) == 1, "one read back, not two"
    copy.sealer.run_all()
    copy.writer.run_all()
    assert result_of(waiting).state is CopyState.SEALED


def test_an_operation_on_a_copy_being_sealed_behind_waits_for_its_seal() -> None:
    copy = SealingCopy()
    copy.written(copy.log.append_raw(2, encode_batch(2, [record(2)]), epoch=1))
    # Sealed at 2 records: record 2 never reached a quorum, so this one needs a cut, in the
    # queue; sealing at 3 needs none.
    copy.written(copy.log.seal_copy(0, 3, copy.log.active_bytes, epoch=1, behind=True))

    fencing = copy.log.fence(0, 2, None)
    deleting = copy.log.delete_segment(0)
    copy.writer.run_all()

    assert not fencing.called
    assert not deleting.called
    copy.sealer.run_all()
    copy.writer.run_all()
    assert failure_of(deleting), "the last segment of its range is never deleted"
    assert result_of(fencing).epoch == 2
    assert copy.state(0) is CopyState.SEALED


def test_a_seal_behind_that_fails_leaves_the_copy_closed_and_in_service(
    logged_errors: list[dict[str, Any]],
) -> None:
    copy = SealingCopy()
    copy.seal_behind()
    copy.fs.failing_atomic_writes = 1  # the disk is full as its sidecars are written

    copy.sealer.run_all()
    copy.writer.run_all()

    assert [e["log_format"][:40] for e in logged_errors] == [
        "Sealing {path} behind the appends failed"
    ]
    logged_errors.clear()
    assert copy.state(0) is CopyState.CLOSED
    assert not copy.log.failed
    assert copy.written(copy.log.start_segment(2, 1)).base_offset == 2
    # Healing seals it in place later, as recorded.
    sealing = copy.log.seal_copy(0, 2, copy.size, epoch=1)
    copy.writer.run_all()
    assert result_of(sealing).state is CopyState.SEALED


def test_a_crash_before_the_seal_behind_leaves_the_copy_closed_with_every_record() -> None:
    copy = SealingCopy()
    copy.seal_behind()
    copy.written(copy.log.start_segment(2, 1))

    crashed = copy.fs.crash()
    executor = ManualExecutor()
    reopened = result_of_running(
        RangeLog.open(RANGE_DIR, fs=crashed, clock=Clock(), executor=executor, config=REPLICA),
        executor,
    )

    assert [(s.base_offset, s.state, s.record_count) for s in reopened.segments()] == [
        (0, CopyState.CLOSED, 2),
        (2, CopyState.ACTIVE, 0),
    ]


def test_closing_the_log_waits_for_a_seal_behind() -> None:
    copy = SealingCopy()
    copy.seal_behind()

    closing = copy.log.close()
    copy.writer.run_all()
    assert not closing.called

    copy.sealer.run_all()
    copy.writer.run_all()
    assert closing.called
    assert copy.fs.exists(segment_path(0, ".sealed"))
