"""A power cut at every step of the replica operations: fence, start_segment, seal_copy and
install_segment. Recovery must find the state before the operation or after it (for seal_copy,
also the copy cut back but not sealed yet, which sealing again completes), and never lose a
record the operation was to keep.

Each test runs the operation on a ``MemoryFileSystem`` that takes crash images before every
change a job makes to the disk (each step of an atomic replace, each file creation, truncation,
removal and directory fsync) and after the operation, each twice: with nothing that was not
fsynced, and with every unsynced byte and directory entry written back anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

from logbroker.storage import CopyState, IntegrityEvent, LogConfig, RangeLog
from logbroker.storage._format import encode_batch
from logbroker.testing import MemoryFileSystem
from tests.unit.storage.helpers import offsets, open_log, record, result_of

REPLICA = LogConfig(replicated=True, auto_roll=False)


def batch(first: int, count: int = 1) -> bytes:
    return encode_batch(first, [record(n) for n in range(first, first + count)])


class CrashEveryStep:
    """Crash images of ``fs`` before each change a job makes to it."""

    def __init__(self, fs: MemoryFileSystem) -> None:
        self.fs = fs
        self.images: list[MemoryFileSystem] = []
        fs.on_atomic_step = lambda step, path: self.take()
        for name in ("create_append", "truncate", "remove", "sync_dir"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        original: Callable[..., Any] = getattr(self.fs, name)

        def step(*args: Any) -> Any:
            self.take()
            return original(*args)

        setattr(self.fs, name, step)

    def take(self) -> None:
        self.images.append(self.fs.crash())
        self.images.append(self.fs.crash(lambda path, unsynced: unsynced, lambda path: True))


@attrs.frozen
class Seen:
    """What recovery finds: each segment as (base, state, records, bytes), and the epochs."""

    segments: tuple[tuple[int, CopyState, int, int], ...]
    epochs: tuple[int, ...]
    records: tuple[int, ...]


def seen(log: RangeLog) -> Seen:
    segments = log.segments()
    log.commit(log.durable_offset)
    start = log.start_offset
    return Seen(
        tuple((s.base_offset, s.state, s.record_count, s.byte_size) for s in segments),
        tuple(log.segment_epoch(s.base_offset) for s in segments),
        tuple(offsets(log, start)) if segments else (),
    )


def recovered(image: MemoryFileSystem) -> Seen:
    events: list[IntegrityEvent] = []
    log = open_log(image, REPLICA, events)
    assert [event for event in events if event.counted] == [], "a crash is not rot"
    return seen(log)


@pytest.fixture(params=[False, True], ids=["own-syncs", "shared-flush"])
def shared(request: pytest.FixtureRequest) -> bool:
    """Whether the operation's syncs are its own or rounds of a shared flush, which stages
    each atomic replace and syncs it in steps (``logbroker.storage._atomic``)."""
    flag: bool = request.param
    return flag


def run_with_crashes(
    fs: MemoryFileSystem, operation: Callable[[RangeLog], object], shared: bool
) -> tuple[Seen, Seen, list[Seen]]:
    """Run ``operation`` on a log of ``fs``: the state before, after, and in every image."""
    result_of(open_log(fs, REPLICA).close())
    before = recovered(fs)
    log = open_log(fs, REPLICA, shared_flush=shared)
    crashes = CrashEveryStep(fs)
    result_of(operation(log))  # type: ignore[arg-type]
    crashes.take()
    result_of(log.close())
    after = recovered(fs)
    assert after != before, "the operation changed nothing"
    return before, after, [recovered(image) for image in crashes.images]


def replica_with(*batches: tuple[int, int], epoch: int = 1) -> MemoryFileSystem:
    """A replica whose active segment at 0 holds ``batches`` (first offset, count)."""
    fs = MemoryFileSystem()
    log = open_log(fs, REPLICA)
    result_of(log.start_segment(0, epoch))
    for first, count in batches:
        result_of(log.append_raw(first, batch(first, count), epoch=epoch))
    result_of(log.close())
    return fs


def test_a_crash_during_a_fence_leaves_the_old_epoch_or_the_new(shared: bool) -> None:
    fs = replica_with((0, 2), epoch=3)

    before, after, images = run_with_crashes(fs, lambda log: log.fence(0, 8), shared)

    assert after.epochs == (8,)
    assert len(images) >= 8
    assert all(image in (before, after) for image in images)
    assert before in images
    assert after in images


def test_a_crash_during_start_segment_leaves_the_old_segments_or_the_new_one(shared: bool) -> None:
    fs = replica_with((0, 2), epoch=1)

    before, after, images = run_with_crashes(fs, lambda log: log.start_segment(300, 5), shared)

    assert [s[:2] for s in after.segments] == [(0, CopyState.CLOSED), (300, CopyState.ACTIVE)]
    assert after.epochs == (1, 5)
    assert all(image in (before, after) for image in images), [
        image for image in images if image not in (before, after)
    ]
    assert before in images
    assert after in images


def test_a_crash_during_seal_copy_never_loses_a_record_of_the_sealed_length(shared: bool) -> None:
    fs = replica_with((0, 2), (2, 1), (3, 2), epoch=1)
    log = open_log(fs, REPLICA)
    size = len(batch(0, 2)) + len(batch(2, 1))
    result_of(log.close())

    before, after, images = run_with_crashes(
        fs, lambda log: log.seal_copy(0, 3, size, epoch=1), shared
    )

    assert after.segments == ((0, CopyState.SEALED, 3, size),)
    cut = Seen(((0, CopyState.ACTIVE, 3, size),), (1,), (0, 1, 2))
    assert all(image in (before, cut, after) for image in images), [
        image for image in images if image not in (before, cut, after)
    ]
    assert before in images
    assert cut in images, "the cut comes before the marker (see the next test)"
    assert after in images


def test_sealing_again_after_a_crash_between_the_cut_and_the_marker_completes(
    shared: bool,
) -> None:
    fs = replica_with((0, 2), (2, 2), epoch=1)
    size = len(batch(0, 2))
    log = open_log(fs, REPLICA, shared_flush=shared)
    images: list[MemoryFileSystem] = []
    fs.on_atomic_step = lambda step, path: images.append(fs.crash()) if step == "write" else None
    result_of(log.seal_copy(0, 2, size, epoch=1))
    image = images[0]  # cut, index not written yet

    retried = open_log(image, REPLICA)
    assert retried.segments()[0].byte_size == size
    info = result_of(retried.seal_copy(0, 2, size, epoch=0))

    assert (info.state, info.record_count, info.byte_size) == (CopyState.SEALED, 2, size)
    assert offsets(retried) == [0, 1]


def test_a_crash_during_install_segment_leaves_nothing_or_the_whole_segment(shared: bool) -> None:
    fs = MemoryFileSystem()
    log = open_log(fs, REPLICA)
    result_of(log.start_segment(300, 1))
    result_of(log.append_raw(300, batch(300), epoch=1))
    result_of(log.close())
    data = batch(100, 3) + batch(103, 4)

    before, after, images = run_with_crashes(
        fs, lambda log: log.install_segment(100, data, 7, epoch=2), shared
    )

    assert after.segments[0] == (100, CopyState.SEALED, 7, len(data))
    assert after.epochs == (2, 1), "installed at the epoch the control plane sealed it at"
    assert after.records == (100, 101, 102, 103, 104, 105, 106, 300)
    assert all(image in (before, after) for image in images), [
        image for image in images if image not in (before, after)
    ]
    assert before in images
    assert after in images
