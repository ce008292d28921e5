"""The segment files the range logs keep open, under one budget for the node.

A range log keeps its active segment's file open for appends, and the file of a segment read in
the reactor thread open for the next read. With one descriptor each, a node holding tens of
thousands of ranges needs tens of thousands of descriptors: more than many machines allow a
process (and a container may not raise its hard limit). ``OpenFiles`` counts every such handle
of every log of the node and, past its budget, closes the least recently used ones that nothing
is using at that moment. A log whose file was closed opens it again at its next append or read
(the write job and the reads already open a file they find closed), so an idle range costs no
descriptor.

Why closing is safe: a log's writer is released only while its write pipeline is idle (no job
running, nothing queued), so no writer thread holds it and every byte written through it is
already durable (its write job ended with the fsync, or the shared flush round, that covered
it). A reader is used only in the reactor thread, so it is never in use when this runs.

The budget bounds the handles nothing is using; a writer whose log is writing stays open until
its job ends, so the count may pass the budget by the logs writing at that moment, which the
descriptors kept for connections absorb (see ``file_limit``). The released handles are closed
on the executor given, in one job per pass, off the reactor thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from logbroker.storage._fs import AppendFile, Closable, ReadFile
from logbroker.storage._segment import Segment

#: A handle's key: its segment and which of its two handles (``writer`` or ``reader``).
_Key = tuple[Segment, str]


class OpenFiles:
    """The open segment files of a node's range logs, least recently used first."""

    def __init__(self, budget: int, close: Callable[[list[Closable]], object]) -> None:
        if budget < 1:
            raise ValueError(f"the budget of open files must be at least 1, not {budget}")
        self.budget = budget
        self._close = close
        #: Each open handle's key, and how to take the handle from its log (``None``: in use).
        self._open: OrderedDict[_Key, Callable[[], Closable | None]] = OrderedDict()
        #: Handles closed to stay within the budget, since start.
        self.closed_for_budget = 0

    def __len__(self) -> int:
        return len(self._open)

    def opened(self, key: _Key, release: Callable[[], Closable | None]) -> None:
        """A handle was opened: the most recently used now. ``release`` takes it from its log
        if nothing is using it (and returns it, to be closed), else returns ``None``."""
        self._open[key] = release
        self._open.move_to_end(key)
        self._trim(key)

    def used(self, key: _Key) -> None:
        if key in self._open:
            self._open.move_to_end(key)

    def forget(self, key: _Key) -> None:
        """Its log closed the handle itself."""
        self._open.pop(key, None)

    def _trim(self, opened: _Key) -> None:
        over = len(self._open) - self.budget
        if over <= 0:
            return
        closing: list[Closable] = []
        # Each handle is looked at once per pass: one in use goes to the back of the line, as
        # does the one just opened, which its opener is about to use.
        for _ in range(len(self._open)):
            if over <= 0:
                break
            key, release = next(iter(self._open.items()))
            handle = None if key == opened else release()
            if handle is None:
                self._open.move_to_end(key)
                continue
            del self._open[key]
            closing.append(handle)
            over -= 1
        if closing:
            self.closed_for_budget += len(closing)
            self._close(closing)


class LogFiles:
    """One range log's open segment files, counted in the node's ``OpenFiles`` (if any).

    Every handle a log opens or closes goes through here, in the reactor thread.
    ``writer_in_use`` says whether the log's write pipeline may be using its writer now."""

    def __init__(self, open_files: OpenFiles | None) -> None:
        self._open_files = open_files
        self.writer_in_use: Callable[[], bool] = lambda: True

    def attach_writer(self, segment: Segment, writer: AppendFile) -> None:
        """``writer`` is ``segment``'s open file for appends (it may be the one it had)."""
        if segment.writer is writer:
            if self._open_files is not None:
                self._open_files.used((segment, "writer"))
            return
        assert segment.writer is None, f"{segment.path} has a writer open already"
        segment.writer = writer
        if self._open_files is not None:
            self._open_files.opened((segment, "writer"), lambda: self._release_writer(segment))

    def reader(self, segment: Segment, open_read: Callable[[str], ReadFile]) -> ReadFile:
        """``segment``'s open file for reads in the reactor thread, opened if it has none."""
        reader = segment.reader
        if reader is not None:
            if self._open_files is not None:
                self._open_files.used((segment, "reader"))
            return reader
        reader = segment.reader = open_read(segment.path)
        if self._open_files is not None:
            self._open_files.opened((segment, "reader"), lambda: self._release_reader(segment))
        return reader

    def close_writer(self, segment: Segment) -> None:
        self._close(segment, "writer")

    def close_all(self, segment: Segment) -> None:
        self._close(segment, "writer")
        self._close(segment, "reader")

    def _close(self, segment: Segment, kind: str) -> None:
        handle: Closable | None = getattr(segment, kind)
        if handle is not None:
            setattr(segment, kind, None)
            if self._open_files is not None:
                self._open_files.forget((segment, kind))
            handle.close()

    def _release_writer(self, segment: Segment) -> AppendFile | None:
        if self.writer_in_use():
            return None
        writer, segment.writer = segment.writer, None
        return writer

    def _release_reader(self, segment: Segment) -> ReadFile | None:
        reader, segment.reader = segment.reader, None
        return reader
