"""The file operations storage needs, behind one small interface.

Storage never calls ``os`` directly: it goes through a ``FileSystem`` so tests can run it on
``logbroker.testing.MemoryFileSystem``, which keeps written and fsynced bytes apart, simulates a
crash (power cut) at any point and injects fsync errors. ``OsFileSystem`` is the real one.

Every method may block; storage calls them from its writer thread, never from the reactor
(except short page-cache reads on the fetch path).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Protocol


class AppendFile(Protocol):
    """A file opened for appending."""

    def write(self, data: bytes) -> None:
        """Append all of ``data`` (to the page cache: not yet durable)."""

    def sync(self) -> None:
        """Make everything written so far durable; raise ``OSError`` if that failed."""

    def close(self) -> None: ...


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

    def open_append(self, path: str) -> AppendFile:
        """Open the existing file ``path`` for appending."""

    def create_append(self, path: str) -> AppendFile:
        """Create ``path`` for appending; fail if it exists (the caller syncs the directory)."""

    def write_atomic(self, path: str, data: bytes) -> None:
        """Replace ``path`` with ``data`` so that a crash leaves the old or the new content."""

    def truncate(self, path: str, size: int) -> None:
        """Cut ``path`` to ``size`` bytes, durably."""

    def remove(self, path: str) -> None:
        """Unlink ``path`` (the caller syncs the directory)."""

    def sync_dir(self, path: str) -> None:
        """Make the entries of directory ``path`` durable."""

    def lock(self, path: str) -> object:
        """Take an exclusive lock on ``path`` (created if missing) for as long as the returned
        object lives; raise ``BlockingIOError`` if another process holds it."""


class _OsAppendFile:
    def __init__(self, path: str, create: bool) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        self._fd = os.open(path, flags, 0o644)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


class _OsReadFile:
    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def read(self, position: int, length: int) -> bytes:
        return os.pread(self._fd, length, position)

    def close(self) -> None:
        os.close(self._fd)


class OsFileSystem:
    """The real file system, with fsync where durability needs it."""

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

    def open_append(self, path: str) -> AppendFile:
        return _OsAppendFile(path, create=False)

    def create_append(self, path: str) -> AppendFile:
        return _OsAppendFile(path, create=True)

    def write_atomic(self, path: str, data: bytes) -> None:
        temporary = path + ".tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
        self.sync_dir(os.path.dirname(path) or ".")

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

    def lock(self, path: str) -> object:
        held = open(path, "a+b")  # noqa: SIM115 - held open for the life of the lock
        try:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            held.close()
            raise
        return held
