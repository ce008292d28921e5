"""The shared flush's rounds on the native sync thread (``logbroker.storage._native_rounds``
and ``_syncthread.c``), with real files in a temporary directory: what a round writes and the
outcome it gives for each file, a failed write and a failed ``syncfs``, the rounds it leaves to
the executor, and its stop. The reactor is a recorder of readers; a round's end is taken by
waiting for the thread's event descriptor and calling ``doRead``, as the reactor would."""

from __future__ import annotations

import errno
import os
import select
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from logbroker.storage import NativeRounds, OsFileSystem, SharedFlush
from logbroker.storage._fs import AppendFile, Syncable
from logbroker.storage._syncthread import SyncThread
from logbroker.testing import ImmediateExecutor

_T = TypeVar("_T")


class Readers:
    """The reactor's readers, as far as ``NativeRounds`` uses them."""

    def __init__(self) -> None:
        self.readers: list[Any] = []

    def addReader(self, reader: Any) -> None:
        self.readers.append(reader)

    def removeReader(self, reader: Any) -> None:
        self.readers.remove(reader)


class CountingExecutor(ImmediateExecutor):
    def __init__(self) -> None:
        self.jobs: list[str] = []

    def run(self, job: Callable[..., _T], *args: Any) -> Deferred[_T]:
        self.jobs.append(job.__name__)
        return super().run(job, *args)


def outcome_of(rounds: NativeRounds, started: Deferred[_T]) -> _T:
    """Wait for the round's end on the thread's descriptor, take it as the reactor would."""
    readable, _, _ = select.select([rounds.fileno()], [], [], 10)
    assert readable, "the round did not end within 10 s"
    rounds.doRead()
    results: list[_T] = []
    started.addCallback(results.append)
    assert results, "the round's outcome was not given"
    return results[0]


@contextmanager
def running_rounds(
    fs: OsFileSystem, readers: Readers | None = None
) -> Iterator[tuple[NativeRounds, CountingExecutor]]:
    executor = CountingExecutor()
    native = NativeRounds(readers or Readers(), fs, executor)
    native.start()
    try:
        yield native, executor
    finally:
        native.stop()


@pytest.fixture
def rounds() -> Iterator[NativeRounds]:
    with running_rounds(OsFileSystem(shared_sync=True)) as (native, _):
        yield native


def append_file(fs: OsFileSystem, path: Path) -> AppendFile:
    return fs.create_append(str(path))


def test_a_round_writes_each_file_s_bytes_in_order_and_syncs_them_all(
    rounds: NativeRounds, tmp_path: Path
) -> None:
    fs = OsFileSystem(shared_sync=True)
    first, second = append_file(fs, tmp_path / "a"), append_file(fs, tmp_path / "b")
    files: list[Syncable] = [first, second, first]

    started = rounds.round([(first, [b"one", b"two"]), (second, [b"three"])], files)

    assert started is not None
    outcomes, seconds = outcome_of(rounds, started)
    assert outcomes == [None, None, None]
    assert seconds >= 0
    assert (tmp_path / "a").read_bytes() == b"onetwo"
    assert (tmp_path / "b").read_bytes() == b"three"


def test_rounds_follow_one_another_each_writing_after_the_last(
    rounds: NativeRounds, tmp_path: Path
) -> None:
    fs = OsFileSystem(shared_sync=True)
    log = append_file(fs, tmp_path / "log")
    for part in (b"a", b"b", b"c"):
        started = rounds.round([(log, [part])], [log])
        assert started is not None
        assert outcome_of(rounds, started)[0] == [None]

    assert (tmp_path / "log").read_bytes() == b"abc"


def test_a_failed_write_fails_its_file_only(rounds: NativeRounds, tmp_path: Path) -> None:
    fs = OsFileSystem(shared_sync=True)
    kept, broken = append_file(fs, tmp_path / "kept"), append_file(fs, tmp_path / "broken")
    # A read-only descriptor in place of the broken file's: its write fails with EBADF.
    read_only = os.open(tmp_path / "broken", os.O_RDONLY)
    os.dup2(read_only, broken.fileno())  # type: ignore[attr-defined]
    os.close(read_only)

    started = rounds.round([(kept, [b"kept"]), (broken, [b"lost"])], [kept, broken])

    assert started is not None
    outcomes, _ = outcome_of(rounds, started)
    assert outcomes[0] is None
    assert isinstance(outcomes[1], OSError)
    assert outcomes[1].errno == errno.EBADF
    assert (tmp_path / "kept").read_bytes() == b"kept"
    assert (tmp_path / "broken").read_bytes() == b""


def test_a_failed_syncfs_syncs_each_file_on_its_own_from_then_on(
    tmp_path: Path, logged_errors: list[dict[str, Any]]
) -> None:
    fs = OsFileSystem(shared_sync=True)
    with running_rounds(fs) as (native, executor):
        gone, kept = append_file(fs, tmp_path / "gone"), append_file(fs, tmp_path / "kept")
        # The round syncs through the first file's descriptor: closed, syncfs fails (EBADF).
        os.close(gone.fileno())  # type: ignore[attr-defined]

        started = native.round([(kept, [b"kept"])], [gone, kept])

        assert started is not None
        outcomes, _ = outcome_of(native, started)
        assert executor.jobs == ["sync_each"]
        assert isinstance(outcomes[0], OSError)  # its own fsync fails too
        assert outcomes[1] is None
        assert (tmp_path / "kept").read_bytes() == b"kept"
        assert any("each file is fsynced on its own" in e["log_format"] for e in logged_errors)
        logged_errors.clear()
        # The file system no longer syncs by syncfs: the executor runs the next rounds.
        assert native.round([(kept, [b"more"])], [kept]) is None


class _NotAnOsFile:
    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass

    def write(self, data: bytes) -> None:
        pass


def test_files_of_another_file_system_are_left_to_the_executor(
    rounds: NativeRounds, tmp_path: Path
) -> None:
    fs = OsFileSystem(shared_sync=True)
    real = append_file(fs, tmp_path / "real")
    other = _NotAnOsFile()

    assert rounds.round([(other, [b"x"])], [other]) is None
    assert rounds.round([(real, [b"x"])], [real, other]) is None
    assert rounds.round([], []) is None


def test_a_file_system_that_does_not_sync_by_syncfs_leaves_every_round_to_the_executor(
    tmp_path: Path,
) -> None:
    fs = OsFileSystem(shared_sync=False)
    with running_rounds(fs) as (native, _):
        log = append_file(fs, tmp_path / "log")
        assert native.round([(log, [b"x"])], [log]) is None


def test_one_round_at_a_time(rounds: NativeRounds, tmp_path: Path) -> None:
    fs = OsFileSystem(shared_sync=True)
    log = append_file(fs, tmp_path / "log")
    started = rounds.round([(log, [b"first"])], [log])
    assert started is not None

    assert rounds.round([(log, [b"second"])], [log]) is None

    outcome_of(rounds, started)
    assert (tmp_path / "log").read_bytes() == b"first"


def test_a_stop_fails_the_round_whose_outcome_was_not_taken(tmp_path: Path) -> None:
    fs = OsFileSystem(shared_sync=True)
    readers = Readers()
    native = NativeRounds(readers, fs, CountingExecutor())
    native.start()
    assert readers.readers == [native]
    log = append_file(fs, tmp_path / "log")
    started = native.round([(log, [b"x"])], [log])
    assert started is not None
    failures: list[Any] = []
    started.addErrback(failures.append)

    native.stop()

    assert readers.readers == []
    assert len(failures) == 1
    assert failures[0].check(OSError)
    assert native.round([(log, [b"y"])], [log]) is None


def test_the_shared_flush_runs_its_rounds_there_and_leaves_closes_to_its_executor(
    tmp_path: Path,
) -> None:
    fs = OsFileSystem(shared_sync=True)
    with running_rounds(fs) as (native, executor):
        flush = SharedFlush(fs, executor, Clock(), native)
        log = append_file(fs, tmp_path / "log")
        written = flush.write(log, b"appended")
        done: list[float] = []
        written.addCallback(done.append)

        outcome_of(native, succeed(None))
        assert executor.jobs == []
        assert len(done) == 1
        assert (tmp_path / "log").read_bytes() == b"appended"

        # A round that closes a file runs on the executor (closes are its thread's).
        directory = fs.open_dir(str(tmp_path))
        closed = flush.flush(directory, close=True)
        assert executor.jobs == ["_round"]
        assert closed.called


# -- the native type itself ------------------------------------------------------------


def wait_result(thread: SyncThread) -> tuple[list[int], int, float]:
    readable, _, _ = select.select([thread.fileno()], [], [], 10)
    assert readable
    result = thread.result()
    assert result is not None
    return result


def test_the_thread_takes_one_round_until_its_result_is_taken(tmp_path: Path) -> None:
    thread = SyncThread()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        assert thread.result() is None
        thread.start([(fd, b"abc")], fd)
        with pytest.raises(RuntimeError, match="under way"):
            thread.start([(fd, b"def")], fd)
        errors, sync_error, _ = wait_result(thread)
        assert (errors, sync_error) == ([0], 0)
        thread.start([(fd, b"def")], fd)
        assert wait_result(thread)[:2] == ([0], 0)
        assert (tmp_path / "f").read_bytes() == b"abcdef"
    finally:
        thread.close()
        os.close(fd)


def test_a_malformed_round_is_refused_and_leaves_the_thread_free(tmp_path: Path) -> None:
    thread = SyncThread()
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with pytest.raises(TypeError):
            thread.start([(fd, b"good"), ("not a descriptor", b"x")], fd)
        with pytest.raises(TypeError):
            thread.start([(fd, "not bytes")], fd)  # type: ignore[list-item]
        thread.start([(fd, b"good")], fd)
        assert wait_result(thread)[:2] == ([0], 0)
        assert (tmp_path / "f").read_bytes() == b"good"
    finally:
        thread.close()
        os.close(fd)


def test_a_closed_thread_refuses_rounds_and_closes_once() -> None:
    thread = SyncThread()
    thread.close()
    thread.close()

    with pytest.raises(ValueError, match="closed"):
        thread.start([], 0)
    with pytest.raises(ValueError, match="closed"):
        thread.fileno()
    assert thread.result() is None
