"""Test doubles for code built on logbroker storage: no threads, no disk, no waiting.

* ``MemoryFileSystem`` keeps what was written (the page cache) apart from what was fsynced (the
  disk), can simulate a power cut that keeps any prefix of the unsynced bytes, fails fsyncs on
  demand, and journals every write and sync so a test can check that nothing was acknowledged
  before the fsync that covers it. An atomic replace goes through the same steps as on a real
  disk (temporary file, fsync, rename, directory fsync), and a test can take a crash image or
  inject an error before any of them.
* ``ImmediateExecutor`` runs storage jobs inline; ``ManualExecutor`` holds them until the test
  runs them, so a test decides exactly what is in flight.
* ``MemoryKeyValueStore`` is an etcd in memory for the etcd control plane: revisions,
  transactions, watches, compaction and leases on an injected clock, with hooks that make it
  unavailable, hold requests so that clients race, or drop watches.
"""

from __future__ import annotations

import contextlib
import errno
import posixpath
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs
from twisted.internet.defer import Deferred, fail, succeed

from logbroker.controlplane._memory_kv import MemoryKeyValueStore
from logbroker.storage._fs import TEMPORARY_SUFFIX, Syncable, sync_each

_T = TypeVar("_T")


@attrs.define
class _File:
    data: bytearray = attrs.Factory(bytearray)
    durable: bytes = b""
    #: Whether the file's directory entry survives a crash.
    linked: bool = False
    #: The linked file a rename not yet made durable replaced: a crash may bring it back.
    replaced: _File | None = None


@attrs.frozen
class JournalEntry:
    """One operation on a ``MemoryFileSystem``: ``write``, ``sync``, ``truncate``, ``remove``."""

    operation: str
    path: str
    size: int


class _MemoryAppendFile:
    def __init__(self, fs: MemoryFileSystem, path: str) -> None:
        self._fs = fs
        self._path = path
        self.closed = False
        fs.open_handles.add(self)

    def write(self, data: bytes) -> None:
        self._check_open()
        self._fs._file(self._path).data += data
        self._fs.journal.append(JournalEntry("write", self._path, len(data)))

    def sync(self) -> None:
        self._check_open()
        self._fs._sync(self._path)

    def _check_open(self) -> None:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor (file closed)", self._path)

    def close(self) -> None:
        self._check_open()
        self.closed = True
        self._fs.open_handles.discard(self)


class _MemoryStep:
    """A staged temporary file or a directory, open to be synced: syncing it is a step of an
    atomic replace (``MemoryFileSystem.on_atomic_step`` hears of it first)."""

    def __init__(
        self, fs: MemoryFileSystem, step: str, path: str, sync: Callable[[], None]
    ) -> None:
        self._fs = fs
        self._step = step
        self._path = path
        self._sync = sync

    def sync(self) -> None:
        self._fs._atomic_step(self._step, self._path)
        self._sync()

    def close(self) -> None:
        pass


class _MemoryReadFile:
    def __init__(self, fs: MemoryFileSystem, path: str) -> None:
        self._fs = fs
        self._path = path
        self.closed = False
        fs.open_handles.add(self)

    def read(self, position: int, length: int) -> bytes:
        if self.closed:
            raise OSError(errno.EBADF, "Bad file descriptor (file closed)", self._path)
        return bytes(self._fs._file(self._path).data[position : position + length])

    def close(self) -> None:
        self.closed = True
        self._fs.open_handles.discard(self)


class _MemoryLock:
    """Released when dropped, as an flock is when its file is closed."""

    def __init__(self, held: set[str], path: str) -> None:
        self._held = held
        self._path = path

    def __del__(self) -> None:
        self._held.discard(self._path)


class MemoryFileSystem:
    """An in-memory file system with crash semantics (see the module docstring)."""

    def __init__(self) -> None:
        self._files: dict[str, _File] = {}
        self._dirs: set[str] = {"/"}
        #: Each directory's entries (files and directories) by path, so that listing or syncing
        #: a directory costs what it holds, not what the whole file system holds.
        self._entries: dict[str, set[str]] = {"/": set()}
        self.journal: list[JournalEntry] = []
        self._locks: set[str] = set()
        #: The append and read handles open now (not the temporary ones of atomic writes).
        self.open_handles: set[_MemoryAppendFile | _MemoryReadFile] = set()
        #: While positive, each fsync fails with EIO and counts this down.
        self.failing_syncs = 0
        #: While positive, each atomic replace (seal marker, index) fails with ENOSPC.
        self.failing_atomic_writes = 0
        #: Called as ``(step, path)`` before each step of an atomic replace: ``write`` and
        #: ``sync`` of the temporary file, ``rename`` onto the target, ``sync-dir``. It may take
        #: a ``crash()`` image there, or raise ``OSError`` to fail the replace at that step.
        self.on_atomic_step: Callable[[str, str], None] | None = None

    @staticmethod
    def _norm(path: str) -> str:
        return posixpath.normpath(posixpath.join("/", path))

    def _file(self, path: str) -> _File:
        try:
            return self._files[self._norm(path)]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, "No such file", path) from None

    def _link(self, path: str, entry: _File) -> None:
        self._files[path] = entry
        self._entries.setdefault(posixpath.dirname(path), set()).add(path)

    def _unlink(self, path: str) -> _File:
        self._entries[posixpath.dirname(path)].discard(path)
        return self._files.pop(path)

    def _sync(self, path: str) -> None:
        if self.failing_syncs > 0:
            self.failing_syncs -= 1
            self.journal.append(JournalEntry("sync-failed", self._norm(path), 0))
            raise OSError(errno.EIO, "Input/output error (injected)", path)
        entry = self._file(path)
        entry.durable = bytes(entry.data)
        self.journal.append(JournalEntry("sync", self._norm(path), len(entry.data)))

    # -- FileSystem ----------------------------------------------------------------------------

    def list_dir(self, path: str) -> list[str]:
        path = self._norm(path)
        if path not in self._dirs:
            raise FileNotFoundError(errno.ENOENT, "No such directory", path)
        return sorted(posixpath.basename(name) for name in self._entries[path])

    def is_dir(self, path: str) -> bool:
        return self._norm(path) in self._dirs

    def make_dirs(self, path: str) -> None:
        path = self._norm(path)
        while path not in self._dirs:
            self._dirs.add(path)
            self._entries.setdefault(path, set())
            parent = posixpath.dirname(path)
            self._entries.setdefault(parent, set()).add(path)
            path = parent

    def exists(self, path: str) -> bool:
        path = self._norm(path)
        return path in self._files or path in self._dirs

    def size(self, path: str) -> int:
        return len(self._file(path).data)

    def read_file(self, path: str) -> bytes:
        return bytes(self._file(path).data)

    def open_read(self, path: str) -> _MemoryReadFile:
        self._file(path)
        return _MemoryReadFile(self, path)

    @contextlib.contextmanager
    def read_mapped(self, path: str, length: int) -> Iterator[memoryview]:
        # A copy, released at the end of the block as a mapping is (a view kept past it
        # raises when used, as one of an unmapped file would fail).
        with memoryview(bytes(self._file(path).data[:length])) as view:
            yield view

    def open_append(self, path: str) -> _MemoryAppendFile:
        self._file(path)
        return _MemoryAppendFile(self, self._norm(path))

    def create_append(self, path: str) -> _MemoryAppendFile:
        path = self._norm(path)
        if posixpath.dirname(path) not in self._dirs:
            raise FileNotFoundError(errno.ENOENT, "No such directory", path)
        if path in self._files or path in self._dirs:
            raise FileExistsError(errno.EEXIST, "File exists", path)
        self._link(path, _File())
        return _MemoryAppendFile(self, path)

    def write_atomic(self, path: str, data: bytes) -> None:
        # The steps of OsFileSystem.write_atomic, each one a point a crash can hit.
        staged = self.stage_atomic(path, data)
        staged.sync()
        staged.close()
        self.publish_atomic(path)
        self.open_dir(posixpath.dirname(self._norm(path))).sync()

    def stage_atomic(self, path: str, data: bytes) -> Syncable:
        path = self._norm(path)
        if self.failing_atomic_writes > 0:
            self.failing_atomic_writes -= 1
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        temporary = path + TEMPORARY_SUFFIX
        self._atomic_step("write", temporary)
        self._link(temporary, _File(bytearray(data)))
        return _MemoryStep(self, "sync", temporary, lambda: self._sync_staged(temporary))

    def _sync_staged(self, temporary: str) -> None:
        entry = self._file(temporary)
        entry.durable = bytes(entry.data)

    def publish_atomic(self, path: str) -> None:
        path = self._norm(path)
        self._atomic_step("rename", path)
        entry = self._unlink(path + TEMPORARY_SUFFIX)
        old = self._files.get(path)
        if old is not None:
            entry.replaced = old if old.linked else old.replaced
        self._link(path, entry)
        self.journal.append(JournalEntry("write-atomic", path, len(entry.data)))

    def open_dir(self, path: str) -> Syncable:
        path = self._norm(path)
        return _MemoryStep(self, "sync-dir", path, lambda: self.sync_dir(path))

    def _atomic_step(self, step: str, path: str) -> None:
        if self.on_atomic_step is not None:
            self.on_atomic_step(step, path)

    def truncate(self, path: str, size: int) -> None:
        entry = self._file(path)
        del entry.data[size:]
        entry.durable = bytes(entry.data)
        self.journal.append(JournalEntry("truncate", self._norm(path), size))

    def remove(self, path: str) -> None:
        self._file(path)
        self._unlink(self._norm(path))
        self.journal.append(JournalEntry("remove", self._norm(path), 0))

    def sync_dir(self, path: str) -> None:
        path = self._norm(path)
        for name in self._entries.get(path, ()):
            entry = self._files.get(name)
            if entry is not None:
                entry.linked = True
                entry.replaced = None

    def sync_files(self, files: Sequence[Syncable]) -> list[OSError | None]:
        return sync_each(files)

    def lock(self, path: str) -> object:
        path = self._norm(path)
        if path in self._locks:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable", path)
        self._locks.add(path)
        if path not in self._files:
            self._link(path, _File(linked=True))
        return _MemoryLock(self._locks, path)

    # -- faults --------------------------------------------------------------------------------

    def durable_size(self, path: str) -> int:
        return len(self._file(path).durable)

    def files(self) -> list[str]:
        return sorted(self._files)

    def corrupt(self, path: str, position: int, xor: int = 0xFF) -> None:
        """Flip bits of one byte, on disk and in the page cache alike (rot)."""
        entry = self._file(path)
        entry.data[position] ^= xor
        durable = bytearray(entry.durable)
        if position < len(durable):
            durable[position] ^= xor
            entry.durable = bytes(durable)

    def crash(
        self,
        keep: Callable[[str, int], int] = lambda path, unsynced: 0,
        entries: Callable[[str], bool] = lambda path: False,
    ) -> MemoryFileSystem:
        """A power cut: the file system as the disk holds it afterwards.

        Each file keeps its fsynced bytes plus ``keep(path, unsynced)`` of the bytes written
        after them (the kernel may have written back any prefix). A file whose directory entry
        was never synced is gone, or back to the file a rename replaced, unless
        ``entries(path)`` says the kernel wrote that entry back anyway.
        """
        after = MemoryFileSystem()
        for directory in self._dirs:
            after.make_dirs(directory)
        for path, found in self._files.items():
            entry: _File | None = found
            if not found.linked and not entries(path):
                entry = found.replaced
            if entry is None:
                continue
            unsynced = len(entry.data) - len(entry.durable)
            kept = max(0, min(unsynced, keep(path, unsynced)))
            data = bytes(entry.data[: len(entry.durable) + kept])
            after._link(path, _File(bytearray(data), data, linked=True))
        return after


class ImmediateExecutor:
    """Runs each storage job at once, in the calling thread."""

    def run(self, job: Callable[..., _T], *args: Any) -> Deferred[_T]:
        try:
            return succeed(job(*args))
        except Exception:
            return fail()


class ManualExecutor:
    """Holds storage jobs until the test runs them, in order."""

    def __init__(self) -> None:
        self.pending: list[tuple[Callable[..., Any], tuple[Any, ...], Deferred[Any]]] = []

    def run(self, job: Callable[..., _T], *args: Any) -> Deferred[_T]:
        done: Deferred[_T] = Deferred()
        self.pending.append((job, args, done))
        return done

    def run_next(self) -> None:
        job, args, done = self.pending.pop(0)
        try:
            result = job(*args)
        except Exception:
            done.errback()
        else:
            done.callback(result)

    def run_all(self) -> None:
        while self.pending:
            self.run_next()


__all__ = [
    "ImmediateExecutor",
    "JournalEntry",
    "ManualExecutor",
    "MemoryFileSystem",
    "MemoryKeyValueStore",
]
