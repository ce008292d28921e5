"""The data directory: its format marker and where each range's log lives.

Layout::

    <data dir>/FORMAT                       "logbroker storage format 1\\n"
    <data dir>/LOCK                         held (flock) by the broker using the directory
    <data dir>/NODE_ID                      the id of the node this directory belongs to
    <data dir>/ranges/<range name>/         one directory per range (names may nest: topic/range)
        00000000000000000000.log            segment files, named by zero-padded base offset
        00000000000000000000.index          sparse index, written at seal
        00000000000000000000.sealed         seal marker
        00000000000000000000.epoch          replication epoch marker

A directory written by a newer format than this build reads is refused (``FormatTooNewError``);
the command line turns that into exit status 3 (see ``logbroker.exitcodes``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.storage._format import FORMAT_VERSION
from logbroker.storage._fs import FileSystem
from logbroker.storage._segment import is_segment_file
from logbroker.storage.errors import (
    FormatTooNewError,
    NotADataDirectoryError,
    StorageError,
)

FORMAT_FILE = "FORMAT"
NODE_ID_FILE = "NODE_ID"
LOCK_FILE = "LOCK"
RANGES_DIR = "ranges"
_MARKER = re.compile(rb"^logbroker storage format (\d+)\n$")
#: A directory name: at most 255 characters, the file system's limit.
_NAME_PART = re.compile(r"^[A-Za-z0-9._-]{1,255}$")

log = Logger()

if TYPE_CHECKING:
    from logbroker.storage.log import RangeLog


class OpenLogs(Protocol):
    """The range logs open on this node, and a way to open another (created if new);
    ``logbroker.service.StorageService`` in the broker."""

    @property
    def logs(self) -> Mapping[str, RangeLog]: ...

    def open_range(self, name: str) -> Deferred[RangeLog]: ...


class OpenOnce:
    """Opens each range's log at most once, however many ask for it at once: two logs on one
    directory would each write as if it were alone. Every ``OpenLogs`` opens through one.
    ``logs`` gets each log once it is open; ``open_log`` opens one."""

    def __init__(
        self,
        logs: dict[str, RangeLog],
        open_log: Callable[[str], Deferred[RangeLog]],
    ) -> None:
        self._logs = logs
        self._open_log = open_log
        self._opening: dict[str, list[Deferred[RangeLog]]] = {}

    def open_range(self, name: str) -> Deferred[RangeLog]:
        opened = self._logs.get(name)
        if opened is not None:
            return succeed(opened)
        waiter: Deferred[RangeLog] = Deferred()
        waiting = self._opening.get(name)
        if waiting is not None:
            waiting.append(waiter)
            return waiter
        self._opening[name] = [waiter]

        def done(outcome: RangeLog | Failure) -> None:
            if not isinstance(outcome, Failure):
                self._logs[name] = outcome
            for waiting_one in self._opening.pop(name):
                if isinstance(outcome, Failure):
                    waiting_one.errback(outcome)
                else:
                    waiting_one.callback(outcome)

        self._open_log(name).addBoth(done)
        return waiter


def _marker(version: int) -> bytes:
    return f"logbroker storage format {version}\n".encode()


def check_range_name(name: str) -> str:
    """A range name: one or more ``/``-separated parts of ``[A-Za-z0-9._-]``, never . or .."""
    parts = name.split("/")
    for part in parts:
        if not _NAME_PART.match(part) or part in (".", ".."):
            raise ValueError(f"invalid range name {name!r}: bad part {part!r}")
    return name


class DataDirectory:
    """A data directory whose format this build reads; open with ``DataDirectory.open``."""

    def __init__(self, path: str, fs: FileSystem, lock: object | None = None) -> None:
        self.path = path
        self._fs = fs
        #: Held while this object lives, when opened for writing.
        self._lock = lock

    @classmethod
    def open(cls, path: str, fs: FileSystem, *, create: bool = True) -> DataDirectory:
        """Check the format marker; write it into a new or empty directory if ``create``.

        Opened with ``create`` (for writing), the directory is locked against a second broker.
        Blocking: call it at startup, before anything serves.
        """
        marker_path = f"{path}/{FORMAT_FILE}"
        if fs.exists(marker_path):
            content = fs.read_file(marker_path)
            match = _MARKER.match(content)
            if match is None:
                raise StorageError(
                    f"{marker_path} is not a logbroker format marker ({content[:40]!r}); "
                    "refusing to use this data directory"
                )
            found = int(match.group(1))
            if found < 1:
                raise StorageError(
                    f"{marker_path} names storage format {found}, which never existed"
                )
            if found > FORMAT_VERSION:
                raise FormatTooNewError(path, found, FORMAT_VERSION)
            return cls(path, fs, cls._lock_for_writing(path, fs) if create else None)
        # A LOCK alone is left by a first start that stopped before writing the marker.
        if not create or (fs.exists(path) and set(fs.list_dir(path)) - {LOCK_FILE}):
            raise NotADataDirectoryError(
                f"{path} holds files but no {FORMAT_FILE} marker: it is not a logbroker data "
                "directory; refusing to write into it"
            )
        fs.make_dirs(path)
        lock = cls._lock_for_writing(path, fs)
        fs.write_atomic(marker_path, _marker(FORMAT_VERSION))
        return cls(path, fs, lock)

    @staticmethod
    def _lock_for_writing(path: str, fs: FileSystem) -> object:
        try:
            return fs.lock(f"{path}/{LOCK_FILE}")
        except BlockingIOError:
            raise StorageError(
                f"data directory {path} is in use by another logbroker process; stop it, or "
                "point SVC_DATA_DIR elsewhere"
            ) from None

    def node_id(self, new: Callable[[], str]) -> str:
        """The id of the node this directory belongs to: kept in ``NODE_ID``, written once (from
        ``new()``) by the first start. Blocking: call it at startup."""
        path = f"{self.path}/{NODE_ID_FILE}"
        if self._fs.exists(path):
            return self._fs.read_file(path).decode("ascii").strip()
        node_id = new()
        self._fs.write_atomic(path, f"{node_id}\n".encode("ascii"))
        log.info("This node's id is {node_id}, kept in {path}", node_id=node_id, path=path)
        return node_id

    def range_path(self, name: str) -> str:
        return f"{self.path}/{RANGES_DIR}/{check_range_name(name)}"

    def range_names(self) -> list[str]:
        """Every range directory present under ``ranges/``: one holding segment files, or one
        with no subdirectory. A directory whose name is not a valid range name part (say,
        ``lost+found``) is skipped with a warning, not taken for a range."""
        root = f"{self.path}/{RANGES_DIR}"
        if not self._fs.exists(root):
            return []
        found: list[str] = []

        def walk(relative: str) -> None:
            directory = f"{root}/{relative}" if relative else root
            children = []
            has_segments = False
            for name in self._fs.list_dir(directory):
                if self._fs.is_dir(f"{directory}/{name}"):
                    children.append(name)
                elif is_segment_file(name):
                    has_segments = True
            if relative and (has_segments or not children):
                found.append(relative)
            for child in sorted(children):
                if not _NAME_PART.match(child) or child in (".", ".."):
                    log.warn(
                        "Ignoring {path}: not a valid range name",
                        path=f"{directory}/{child}",
                    )
                    continue
                walk(f"{relative}/{child}" if relative else child)

        walk("")
        return found
