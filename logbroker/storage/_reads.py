"""The range log's read path: finding, reading and checking the batches from an offset on.

Reads work on ``SegmentView``s, snapshots of the segments' metadata taken in the reactor thread,
so that the file reads and checksum scans can run in a reader thread (``read_chunks``,
``read_raw_async``) while the log goes on changing. Damage such a read finds comes back as
findings, which the reactor thread applies only to a segment that is still the one the read saw
(not deleted, nor cut by a trim or a seal since). The synchronous reads (``read``, ``read_raw``)
run the same code in the reactor thread and apply damage at once.

Every byte below a segment's readable end was verified when it was written or recovered, so
anything that fails a check there is rot (or a file that shrank under the broker), reported once
per copy; reads stop before it and return the records of the damaged batch that still verify on
their own.

A read at an offset no local segment holds (a gap: the segments between are on other nodes)
starts at the next segment that holds later offsets; a read never waits for or fills a gap.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

import attrs
from twisted.internet.defer import Deferred, fail, succeed

from logbroker.records import ProducerStamp, StoredRecord
from logbroker.storage._executor import Executor
from logbroker.storage._format import (
    BATCH_HEADER_SIZE,
    BatchInfo,
    Damage,
    DamageReason,
    IndexEntry,
    batch_length,
    scan_batches,
)
from logbroker.storage._fs import FileSystem, ReadFile
from logbroker.storage._segment import Segment
from logbroker.storage._state import LogState
from logbroker.storage._values import BatchSlice
from logbroker.storage.errors import OffsetOutOfRangeError

_FIRST_READ_WINDOW = 16 * 1024
_READ_WINDOW = 64 * 1024
#: The most a read of stamps holds at once: it goes through many bytes and keeps only stamps.
_STAMPS_READ_WINDOW = 1024 * 1024


@attrs.define
class SegmentView:
    """What a read knows of one segment, taken in the reactor thread. A read narrows its own
    ``readable_end`` and ``damage`` as it finds damage; ``segment`` is only compared, never
    read, outside the reactor thread."""

    segment: Segment
    path: str
    base_offset: int
    readable_end: int
    next_offset: int
    end_offset: int
    damage: Damage | None
    generation: int
    #: Where a read from the offset asked for starts scanning this segment.
    start: IndexEntry

    def found(self, damage: Damage) -> None:
        self.readable_end = min(self.readable_end, damage.position)
        if self.damage is None:
            self.damage = damage


Finding = tuple[SegmentView, Damage]


@attrs.frozen
class ChunksRead:
    """What a reader thread read, and the damage it found on the way."""

    slices: list[BatchSlice]
    findings: list[Finding]


def _index_entry(segment: Segment, offset: int) -> IndexEntry:
    entries = segment.index
    slot = bisect.bisect_right(entries, offset, key=lambda entry: entry.offset) - 1
    return entries[slot] if slot >= 0 else IndexEntry(segment.base_offset, 0)


def _index_entry_before(segment: Segment, position: int) -> IndexEntry:
    """The last index entry of ``segment`` at or before byte ``position``."""
    entries = segment.index
    slot = bisect.bisect_right(entries, position, key=lambda entry: entry.position) - 1
    return entries[slot] if slot >= 0 else IndexEntry(segment.base_offset, 0)


def _view(segment: Segment, start: IndexEntry) -> SegmentView:
    return SegmentView(
        segment,
        segment.path,
        segment.base_offset,
        segment.readable_end,
        segment.next_offset,
        segment.end_offset,
        segment.damage,
        segment.generation,
        start,
    )


def plan_views(
    segments: list[Segment], offset: int, max_bytes: int | None = None
) -> list[SegmentView]:
    """Views of the segments a read from ``offset`` may reach, in order: from the one holding
    ``offset`` (or the next one, past a gap) until about ``max_bytes`` of them."""
    slot = max(0, bisect.bisect_right(segments, offset, key=lambda s: s.base_offset) - 1)
    views = []
    budget = max_bytes
    for segment in segments[slot:]:
        if segment.next_offset <= offset and segment.damage is None:
            continue
        start = _index_entry(segment, offset)
        views.append(_view(segment, start))
        if segment.damage is not None or segment.next_offset < segment.end_offset:
            break
        if budget is not None:
            budget -= segment.readable_end - start.position
            if budget <= 0:
                break
    return views


def plan_tail_views(segments: list[Segment], max_bytes: int) -> list[SegmentView]:
    """Views of the newest segments, in order, that hold the last ``max_bytes`` readable bytes
    of the log, each from the index entry at or before where those bytes start in it (so a
    little more is read, from a batch start)."""
    views = []
    budget = max_bytes
    for segment in reversed(segments):
        if budget <= 0:
            break
        start = _index_entry_before(segment, segment.readable_end - budget)
        views.append(_view(segment, start))
        budget -= segment.readable_end - start.position
    views.reverse()
    return views


def _segment_slices(
    reader: ReadFile,
    view: SegmentView,
    offset: int,
    want_bytes: int,
    on_damage: Callable[[SegmentView, Damage], None],
) -> Iterator[BatchSlice]:
    """Verified batches of one segment that hold ``offset`` or later.

    A batch found damaged is yielded once as an unverified slice (its records before the damage
    still verify on their own), then iteration stops.
    """

    def found(damage: Damage) -> None:
        view.found(damage)
        on_damage(view, damage)

    position, expected = view.start.position, view.start.offset
    # Start small (a read often wants a few records) and grow towards what was asked for.
    window = _FIRST_READ_WINDOW
    while position < view.readable_end:
        wanted = min(window, view.readable_end - position)
        data = reader.read(position, wanted)
        if len(data) < wanted:
            # The file is shorter than the bytes it verified or was sealed with: acknowledged
            # bytes are gone (truncated or deleted under the broker).
            found(Damage(position + len(data), DamageReason.SIZE))
            data = data[: view.readable_end - position]
        window = min(2 * window, max(want_bytes, _READ_WINDOW))
        chunk = memoryview(data)
        scan = scan_batches(chunk, 0, expected)
        for batch in scan.batches:
            if batch.next_offset > offset:
                yield BatchSlice(chunk, batch, True)
        if scan.batches:
            expected = scan.batches[-1].next_offset
        damage = scan.damage
        window_start, position = position, position + scan.end
        if damage is None:
            continue
        if damage.torn:
            needed = batch_length(data[scan.end :]) or BATCH_HEADER_SIZE
            if needed > len(data) - scan.end and window_start + len(data) < view.readable_end:
                # The read window ended inside a batch; read that batch whole next time.
                window = max(window, needed)
                continue
            # Every byte below the readable end was verified when it was written or
            # recovered, so a frame that now looks cut short, or zeros, is rot: unless it
            # is only the known damage of this copy, seen again at its readable end.
            if view.damage is None:
                damage = Damage(damage.position, DamageReason.HEADER)
        if not damage.torn:
            found(Damage(window_start + damage.position, damage.reason))
        # Records of the damaged batch that end before the damage still verify on their own.
        stop = min(len(data), view.readable_end - window_start)
        if stop - scan.end > BATCH_HEADER_SIZE:
            damaged = BatchInfo(0, stop - scan.end, expected, 0)
            yield BatchSlice(chunk[scan.end : stop], damaged, False)
        return


def iter_slices(
    views: list[SegmentView],
    offset: int,
    want_bytes: int,
    limit: int | None,
    open_file: Callable[[SegmentView], ReadFile | None],
    on_damage: Callable[[SegmentView, Damage], None],
) -> Iterator[BatchSlice]:
    """The readable batches from the one holding ``offset`` on, across segments and gaps,
    reading about ``want_bytes`` at a time; nothing at or past ``limit`` (an offset), nothing
    after damage, and nothing past a segment whose file ``open_file`` no longer finds."""
    for view in views:
        if view.next_offset <= offset and view.damage is None:
            continue
        reader = open_file(view)
        if reader is None:
            return
        for piece in _segment_slices(reader, view, offset, want_bytes, on_damage):
            batch = piece.batch
            if limit is None:
                yield piece
                continue
            if batch.base_offset >= limit:
                return
            if piece.verified and batch.next_offset <= limit:
                yield piece
                continue
            # Only part of it is readable: its records are checked one by one up to the limit.
            whole = piece.view[batch.position : batch.end] if piece.verified else piece.view
            info = BatchInfo(0, len(whole), batch.base_offset, 0)
            yield BatchSlice(whole, info, False, limit)
            return
        if view.damage is not None or view.next_offset < view.end_offset:
            return
        offset = view.next_offset


def _raw_batches(
    reader: ReadFile,
    view: SegmentView,
    offset: int,
    max_bytes: int,
    on_damage: Callable[[SegmentView, Damage], None],
) -> bytes:
    parts: list[bytes] = []
    size = 0
    for piece in _segment_slices(reader, view, offset, max_bytes, on_damage):
        batch = piece.batch
        if not piece.verified or (parts and size + batch.length > max_bytes):
            break
        parts.append(bytes(piece.view[batch.position : batch.end]))
        size += batch.length
    return b"".join(parts)


def _open_or_none(fs: FileSystem, path: str, opened: list[ReadFile]) -> ReadFile | None:
    try:
        reader = fs.open_read(path)
    except FileNotFoundError:
        # Deleted since the read was planned (retention, or a trim to nothing).
        return None
    opened.append(reader)
    return reader


def read_chunks_job(
    fs: FileSystem, views: list[SegmentView], offset: int, max_bytes: int, limit: int
) -> ChunksRead:
    """Read the batches from ``offset`` on until about ``max_bytes`` (at least one batch, when
    there is one). Blocking: runs in a reader thread, on its own file handles."""
    findings: list[Finding] = []
    opened: list[ReadFile] = []
    slices: list[BatchSlice] = []
    size = 0
    try:
        pieces = iter_slices(
            views,
            offset,
            max_bytes,
            limit,
            lambda view: _open_or_none(fs, view.path, opened),
            lambda view, damage: findings.append((view, damage)),
        )
        for piece in pieces:
            slices.append(piece)
            size += len(piece.view) if not piece.verified else piece.batch.length
            if size >= max_bytes:
                break
    finally:
        for reader in opened:
            reader.close()
    return ChunksRead(slices, findings)


def read_raw_job(
    fs: FileSystem, view: SegmentView, offset: int, max_bytes: int
) -> tuple[bytes, list[Finding]]:
    """Whole verified batches of one segment from the one holding ``offset`` on. Blocking."""
    findings: list[Finding] = []
    opened: list[ReadFile] = []
    try:
        reader = _open_or_none(fs, view.path, opened)
        if reader is None:
            return b"", findings
        data = _raw_batches(
            reader, view, offset, max_bytes, lambda v, damage: findings.append((v, damage))
        )
    finally:
        for opened_reader in opened:
            opened_reader.close()
    return data, findings


def recent_stamps_job(
    fs: FileSystem, views: list[SegmentView]
) -> tuple[list[tuple[ProducerStamp, int, int]], list[Finding]]:
    """The stamps of the verified stamped batches of ``views``, each with its base offset and
    record count, in offset order. Blocking: runs in a reader thread, on its own file handles."""
    findings: list[Finding] = []
    opened: list[ReadFile] = []
    stamps: list[tuple[ProducerStamp, int, int]] = []
    try:
        for view in views:
            reader = _open_or_none(fs, view.path, opened)
            if reader is None:
                continue
            pieces = _segment_slices(
                reader,
                view,
                view.start.offset,
                _STAMPS_READ_WINDOW,
                lambda v, damage: findings.append((v, damage)),
            )
            for piece in pieces:
                batch = piece.batch
                # A damaged batch (not verified) is left out: no checksum vouches for its stamp.
                if piece.verified and batch.stamp is not None:
                    stamps.append((batch.stamp, batch.base_offset, batch.record_count))
    finally:
        for reader in opened:
            reader.close()
    return stamps, findings


class LogReader:
    """Reads of one range log, synchronous (in the reactor thread) and in a reader thread."""

    def __init__(self, state: LogState, fs: FileSystem, executor: Executor) -> None:
        self._state = state
        self._fs = fs
        self._executor = executor

    def _check(self, offset: int) -> None:
        state = self._state
        if offset < state.start_offset:
            raise OffsetOutOfRangeError(offset, state.start_offset, state.end_offset)

    # -- in the reactor thread ---------------------------------------------------------------

    def _cached_reader(self, view: SegmentView) -> ReadFile:
        return self._state.files.reader(view.segment, self._fs.open_read)

    def _found_now(self, view: SegmentView, damage: Damage) -> None:
        self._state.found_damage(view.segment, damage)

    def _read_batches(self, offset: int, max_bytes: int) -> Iterator[BatchSlice]:
        self._check(offset)
        views = plan_views(self._state.segments, offset)
        return iter_slices(
            views, offset, max_bytes, self._state.end_offset, self._cached_reader, self._found_now
        )

    def read(self, offset: int, max_records: int, max_bytes: int) -> list[StoredRecord]:
        records: list[StoredRecord] = []
        budget = max_bytes
        for chunk in self._read_batches(offset, max_bytes):
            for stored in chunk.records():
                if stored.offset < offset:
                    continue
                records.append(stored)
                budget -= len(stored.record.value) + len(stored.record.key or b"")
                if len(records) >= max_records or budget <= 0:
                    return records
        return records

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        self._check(offset)
        views = plan_views(self._state.segments, offset, max_bytes)
        if not views:
            return b""
        view = views[0]
        return _raw_batches(self._cached_reader(view), view, offset, max_bytes, self._found_now)

    # -- in a reader thread ------------------------------------------------------------------

    def read_chunks(self, offset: int, max_bytes: int) -> Deferred[list[BatchSlice]]:
        try:
            self._check(offset)
        except OffsetOutOfRangeError as error:
            return fail(error)
        views = plan_views(self._state.segments, offset, max_bytes)
        limit = self._state.end_offset
        reading = self._executor.run(read_chunks_job, self._fs, views, offset, max_bytes, limit)
        return reading.addCallback(self._chunks_read)

    def _chunks_read(self, read: ChunksRead) -> list[BatchSlice]:
        self._apply(read.findings)
        return read.slices

    def read_raw_async(self, offset: int, max_bytes: int) -> Deferred[bytes]:
        try:
            self._check(offset)
        except OffsetOutOfRangeError as error:
            return fail(error)
        views = plan_views(self._state.segments, offset, max_bytes)
        if not views:
            return succeed(b"")
        reading = self._executor.run(read_raw_job, self._fs, views[0], offset, max_bytes)
        return reading.addCallback(self._raw_read)

    def _raw_read(self, read: tuple[bytes, list[Finding]]) -> bytes:
        data, findings = read
        self._apply(findings)
        return data

    def recent_stamps(self, max_bytes: int) -> Deferred[list[tuple[ProducerStamp, int, int]]]:
        views = plan_tail_views(self._state.segments, max_bytes)
        reading = self._executor.run(recent_stamps_job, self._fs, views)
        return reading.addCallback(self._stamps_read)

    def _stamps_read(
        self, read: tuple[list[tuple[ProducerStamp, int, int]], list[Finding]]
    ) -> list[tuple[ProducerStamp, int, int]]:
        stamps, findings = read
        self._apply(findings)
        return stamps

    def _apply(self, findings: list[Finding]) -> None:
        for view, damage in findings:
            segment = view.segment
            if self._state.holds(segment) and segment.generation == view.generation:
                self._state.found_damage(segment, damage)
