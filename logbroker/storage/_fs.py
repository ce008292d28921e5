"""The file operations storage needs, behind one small interface.

Storage never calls ``os`` directly: it goes through a ``FileSystem`` so tests can run it on
``logbroker.testing.MemoryFileSystem``, which keeps written and fsynced bytes apart, simulates a
crash (power cut) at any point and injects fsync errors. ``OsFileSystem`` is the real one.

Every method may block; storage calls them from its writer thread, never from the reactor
(except short page-cache reads on the fetch path).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from twisted.logger import Logger

log = Logger()

#: What ``write_atomic`` writes first, beside its target; recovery removes any left by a crash.
TEMPORARY_SUFFIX = ".tmp"


class Syncable(Protocol):
    """An open file or directory whose changes can be made durable."""

    def sync(self) -> None:
        """Make everything written so far durable (for a directory: its entries); raise
        ``OSError`` if that failed."""

    def close(self) -> None: ...


class AppendFile(Syncable, Protocol):
    """A file opened for appending."""

    def write(self, data: bytes) -> None:
        """Append all of ``data`` (to the page cache: not yet durable)."""


class ReadFile(Protocol):
    """A file opened for positional reads."""

    def read(self, position: int, length: int) -> bytes:
        """Read up to ``length`` bytes at ``position`` (fewer at the end of the file)."""

    def close(self) -> None: ...


class FileSystem(Protocol):
    def list_dir(self, path: str) -> list[str]: ...

    def is_dir(self, path: str) -> bool: ...

    def make_dirs(self, path: str) -> None:
        """Create ``path`` and missing parents, each durably linked into its parent."""

    def exists(self, path: str) -> bool: ...

    def size(self, path: str) -> int: ...

    def read_file(self, path: str) -> bytes: ...

    def open_read(self, path: str) -> ReadFile: ...

    def read_mapped(self, path: str, length: int) -> contextlib.AbstractContextManager[memoryview]:
        """A read-only view of the first ``length`` bytes of the file at ``path`` (fewer if it
        is shorter) for the ``with`` block, not copied: a seal reads a whole segment back, and
        a copy of 64 MiB into a fresh buffer costs more than the checks (the kernel zeroes
        every page of a new buffer first, which on a virtual machine took 40% of both cores
        while the ranges of three nodes sealed). Nothing may truncate the file meanwhile, and
        nothing may keep a view of it past the block."""

    def open_append(self, path: str) -> AppendFile:
        """Open the existing file ``path`` for appending."""

    def create_append(self, path: str) -> AppendFile:
        """Create ``path`` for appending; fail if it exists (the caller syncs the directory)."""

    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace ``path`` with ``data`` so that a crash leaves the old or the new content."""

    def stage_atomic(self, path: str, data: bytes) -> Syncable:
        """``write_atomic`` in steps, for callers that share its syncs (``AtomicWrites``):
        write ``data`` to the temporary file beside ``path`` and return it open, not synced.
        The caller syncs and closes it, then calls ``publish_atomic``."""

    def publish_atomic(self, path: str) -> None:
        """Rename the synced temporary file ``stage_atomic`` wrote over ``path``; durable once
        the directory is synced (``open_dir``)."""

    def open_dir(self, path: str) -> Syncable:
        """The directory ``path``, opened to sync its entries."""

    def truncate(self, path: str, size: int) -> None:
        """Cut ``path`` to ``size`` bytes, durably."""

    def remove(self, path: str) -> None:
        """Unlink ``path`` (the caller syncs the directory)."""

    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` durable."""

    def sync_files(self, files: Sequence[Syncable]) -> list[OSError | None]:
        """Make everything written to each of ``files`` durable, perhaps by one sync that covers
        them all (and more); return each file's outcome, in order: ``None`` or the error that
        leaves its writes in doubt."""

    def lock(self, path: str) -> object:
        """Take an exclusive lock on ``path`` (created if missing) for as long as the returned
        object lives; raise ``BlockingIOError`` if another process holds it."""


class Closable(Protocol):
    def close(self) -> None: ...


def close_each(files: Sequence[Closable]) -> None:
    """Close each of ``files`` (blocking: on a writer thread), whose writes were synced or are
    in doubt already: a failing close loses nothing more, and stops none of the others."""
    for file in files:
        with contextlib.suppress(OSError):
            file.close()


def sync_each(files: Sequence[Syncable]) -> list[OSError | None]:
    """``FileSystem.sync_files`` by one fsync per file."""
    outcomes: list[OSError | None] = []
    for file in files:
        try:
            file.sync()
        except OSError as error:
            outcomes.append(error)
        else:
            outcomes.append(None)
    return outcomes


class _OsHandle:
    """An open file descriptor that ``OsFileSystem.sync_files`` can sync."""

    def __init__(self, path: str, flags: int) -> None:
        self._fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
        self.path = path
        #: The file system it is on: one ``syncfs`` covers every file of one device.
        self.device = os.fstat(self._fd).st_dev

    def fileno(self) -> int:
        return self._fd

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


class _OsAppendFile(_OsHandle):
    def __init__(self, path: str, flags: int) -> None:
        super().__init__(path, os.O_WRONLY | os.O_APPEND | flags)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def sync(self) -> None:
        os.fdatasync(self._fd)


class _OsReadFile:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def read(self, position: int, length: int) -> bytes:
        return os.pread(self._fd, length, position)

    def close(self) -> None:
        os.close(self._fd)


#: The first Linux whose ``syncfs`` reports write-back errors (before, it always succeeded).
SYNCFS_REPORTS_ERRORS_SINCE = (5, 8)


def _load_syncfs() -> Callable[[int], None] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int

    def syncfs(fd: int) -> None:
        # ctypes lets go of the GIL for the call: other threads run while the disk flushes.
        if function(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    return syncfs


def shared_sync_refusal(release: str | None = None) -> str | None:
    """Why this machine cannot make many files durable by one ``syncfs``, or ``None`` if it
    can. ``release`` is the kernel's (``os.uname().release`` by default)."""
    release = os.uname().release if release is None else release
    numbers = release.split("-", 1)[0].split(".")
    try:
        version = (int(numbers[0]), int(numbers[1]))
    except (IndexError, ValueError):
        return f"the kernel release {release!r} does not say its version"
    if version < SYNCFS_REPORTS_ERRORS_SINCE:
        since = ".".join(map(str, SYNCFS_REPORTS_ERRORS_SINCE))
        return f"Linux {release} is older than {since}, whose syncfs reports write errors"
    if _load_syncfs() is None:
        return "the C library has no syncfs"
    return None


class OsFileSystem:
    """The real file system, with fsync where durability needs it.

    With ``shared_sync``, ``sync_files`` makes its files durable by one ``syncfs`` per file
    system they are on (see ``logbroker.storage._flush``); the caller checked
    ``shared_sync_refusal`` first. After a ``syncfs`` fails, every file is synced on its own
    from then on: the kernel reports a write-back error to one ``syncfs`` call, but to each
    file's next ``fdatasync`` on every descriptor that has not seen it, so only per-file syncs
    still tell which writes it hit.
    """

    def __init__(self, shared_sync: bool = False) -> None:
        self._syncfs = _load_syncfs() if shared_sync else None

    def list_dir(self, path: str) -> list[str]:
        return os.listdir(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def make_dirs(self, path: str) -> None:
        path = os.path.abspath(path)
        if os.path.isdir(path):
            return
        parent = os.path.dirname(path)
        self.make_dirs(parent)
        # Another writer thread may be creating the same parent for a sibling range.
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o750)
        self.sync_dir(parent)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def read_file(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def open_read(self, path: str) -> ReadFile:
        return _OsReadFile(path)

    @contextlib.contextmanager
    def read_mapped(self, path: str, length: int) -> Iterator[memoryview]:
        with open(path, "rb") as file:
            size = min(length, os.fstat(file.fileno()).st_size)
            if size == 0:
                # An empty file cannot be mapped.
                yield memoryview(b"")
                return
            # Populated at once: the pages are in the page cache (the segment was just
            # written), so this maps them without a fault per page.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(file.fileno(), size, flags=flags, prot=mmap.PROT_READ)
            with mapping, memoryview(mapping) as view:
                yield view

    def open_append(self, path: str) -> AppendFile:
        return _OsAppendFile(path, 0)

    def create_append(self, path: str) -> AppendFile:
        return _OsAppendFile(path, os.O_CREAT | os.O_EXCL)

    def write_atomic(self, path: str, data: bytes) -> None:
        staged = self.stage_atomic(path, data)
        try:
            staged.sync()
        finally:
            staged.close()
        self.publish_atomic(path)
        self.sync_dir(os.path.dirname(path) or ".")

    def stage_atomic(self, path: str, data: bytes) -> Syncable:
        staged = _OsAppendFile(path + TEMPORARY_SUFFIX, os.O_CREAT | os.O_TRUNC)
        try:
            staged.write(data)
        except BaseException:
            staged.close()
            raise
        return staged

    def publish_atomic(self, path: str) -> None:
        os.replace(path + TEMPORARY_SUFFIX, path)

    def open_dir(self, path: str) -> Syncable:
        return _OsHandle(path or ".", os.O_RDONLY | os.O_DIRECTORY)

    def truncate(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        os.unlink(path)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_files(self, files: Sequence[Syncable]) -> list[OSError | None]:
        if self._syncfs is None:
            return sync_each(files)
        outcomes: list[OSError | None] = [None] * len(files)
        by_device: dict[int, list[int]] = {}
        for index, file in enumerate(files):
            assert isinstance(file, _OsHandle), "files of this file system"
            by_device.setdefault(file.device, []).append(index)
        for indices in by_device.values():
            synced = self._sync_device([files[index] for index in indices])
            for index, outcome in zip(indices, synced, strict=True):
                outcomes[index] = outcome
        return outcomes

    def _sync_device(self, files: list[Syncable]) -> list[OSError | None]:
        syncfs = self._syncfs
        if syncfs is not None:
            first = files[0]
            assert isinstance(first, _OsHandle)
            try:
                syncfs(first.fileno())
            except OSError as error:
                self.shared_sync_failed(first, error)
            else:
                return [None] * len(files)
        return sync_each(files)

    def shared_sync_fd(self, files: Sequence[Syncable]) -> int | None:
        """The descriptor whose ``syncfs`` makes all of ``files`` durable (the first one's),
        for a sync made elsewhere (``logbroker.storage._native_rounds``): ``None`` unless this
        file system syncs by ``syncfs`` (still) and the files are all its own, on one device."""
        if self._syncfs is None or not files:
            return None
        first = files[0]
        if not isinstance(first, _OsHandle):
            return None
        for file in files:
            if not isinstance(file, _OsHandle) or file.device != first.device:
                return None
        return first.fileno()

    def shared_sync_failed(self, file: Syncable, error: OSError) -> None:
        """A ``syncfs`` through ``file`` failed: every file is fsynced on its own from now on
        (the caller syncs the files it covered so, see the class docstring)."""
        self._syncfs = None
        log.error(
            "syncfs failed on the file system of {path} ({error}): each file is fsynced "
            "on its own from now on",
            path=getattr(file, "path", "?"),
            error=error,
        )

    def lock(self, path: str) -> object:
        held = open(path, "a+b")  # noqa: SIM115 - held open for the life of the lock
        try:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            held.close()
            raise
        return held
