"""What a range log knows about its segments, its offsets and its epochs.

``LogState`` is the range log's table, owned by the reactor thread: the segments in base-offset
order, the active one, the offsets appends take and readers see, and each segment's replication
epoch. The write pipeline, the segment operations and the reads all work on it; it does no I/O
itself (closing an open file handle aside: ``files`` counts each in the node's budget).

Offsets, lowest first::

    start_offset <= end_offset = min(committed, durable) <= durable_offset <= next_offset

``next_offset`` counts appends in flight, ``durable_offset`` only what is fsynced here. Without
replication the committed offset is the durable one. With it (``replicated``), the replication
layer moves it forward with ``commit`` (never back, possibly past what this copy holds yet), and
readers see only what it covers; every record of a sealed segment is committed (the seal is the
control plane's final word on it), so recovery, ``seal_copy`` and ``install_segment`` raise the
committed offset to the end of the segment they seal.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TypeVar

from twisted.logger import Logger

from logbroker.storage._format import Damage, DamageReason
from logbroker.storage._fs import AppendFile
from logbroker.storage._handles import LogFiles, OpenFiles
from logbroker.storage._segment import (
    LOG_SUFFIX,
    CopyState,
    IntegrityEvent,
    RecoveredLog,
    Sealed,
    Segment,
    SegmentInfo,
    segment_stem,
)
from logbroker.storage.errors import SegmentNotFoundError

_T = TypeVar("_T")

log = Logger()


def _base(segment: Segment) -> int:
    return segment.base_offset


def call_hook(directory: str, hook: Callable[[_T], None], value: _T) -> None:
    """Tell the owner of a log something; a failing hook is logged, never fatal here."""
    try:
        hook(value)
    except Exception:
        log.failure("A storage hook failed in {directory}", directory=directory)


class LogState:
    """The segment table and offsets of one range log (see the module docstring)."""

    def __init__(
        self,
        directory: str,
        recovered: RecoveredLog,
        *,
        replicated: bool,
        start_offset: int,
        on_integrity_event: Callable[[IntegrityEvent], None],
        on_sealed: Callable[[SegmentInfo], None],
        open_files: OpenFiles | None = None,
    ) -> None:
        self.directory = directory
        #: Every segment file this log opens or closes, counted in the node's budget.
        self.files = LogFiles(open_files)
        self._on_integrity_event = on_integrity_event
        self._on_sealed = on_sealed
        #: In base-offset order, with gaps where segments are held by other nodes.
        self.segments = recovered.segments
        last = self.segments[-1] if self.segments else None
        self.active = last if last is not None and last.state is CopyState.ACTIVE else None
        #: The offset the next append takes (appends in flight included).
        self.next_offset = last.end_offset if last is not None else start_offset
        #: The offset after the last record fsynced here.
        self.durable_offset = self.next_offset
        self.replicated = replicated
        sealed = [s.seal.next_offset for s in self.segments if s.seal is not None]
        first = self.segments[0].base_offset if self.segments else start_offset
        #: The offset below which records are committed (replicated logs only).
        self.committed = max(sealed, default=first)
        #: Epochs recorded (fenced, started, or read from markers), by base offset: ``None``
        #: where the epoch is unknown; a segment missing here is at epoch 0.
        self.epochs: dict[int, int | None] = dict(recovered.epochs)
        #: Data epochs other than the segment's epoch, by base offset (``data_epoch_of``).
        self.data_epochs: dict[int, int] = dict(recovered.data_epochs)
        #: The base of a segment ``start_segment`` is creating: appends made meanwhile go there.
        self.starting: int | None = None
        #: Whether that start has begun its changes on disk (it closed the active segment):
        #: one that failed before, queued behind a failure, never did.
        self.start_on_disk = False
        #: The base of the segment a write that rolls is creating (the active one is full).
        self.rolling_to: int | None = None

    # -- positions ---------------------------------------------------------------------------

    @property
    def start_offset(self) -> int:
        return self.segments[0].base_offset if self.segments else self.durable_offset

    @property
    def committed_offset(self) -> int:
        return self.committed if self.replicated else self.durable_offset

    @property
    def end_offset(self) -> int:
        return min(self.committed_offset, self.durable_offset)

    # -- lookups -----------------------------------------------------------------------------

    def find(self, base_offset: int) -> Segment:
        slot = bisect.bisect_left(self.segments, base_offset, key=_base)
        if slot == len(self.segments) or self.segments[slot].base_offset != base_offset:
            raise SegmentNotFoundError(f"{self.directory} has no segment at offset {base_offset}")
        return self.segments[slot]

    def holds(self, segment: Segment) -> bool:
        """Whether ``segment`` is still one of this log's segments (not deleted or replaced)."""
        slot = bisect.bisect_left(self.segments, segment.base_offset, key=_base)
        return slot < len(self.segments) and self.segments[slot] is segment

    def following(self, segment: Segment) -> Segment | None:
        """The segment after ``segment`` (one of this log's), if any."""
        slot = bisect.bisect_right(self.segments, segment.base_offset, key=_base)
        return self.segments[slot] if slot < len(self.segments) else None

    def segment_path(self, base_offset: int) -> str:
        return f"{self.directory}/{segment_stem(base_offset)}{LOG_SUFFIX}"

    def appending_base(self) -> int | None:
        """The base of the segment the next append goes to, when it exists or is being
        created; ``None`` when the next append starts a new segment of its own."""
        if self.starting is not None:
            return self.starting
        return self.active.base_offset if self.active is not None else None

    def epoch_of(self, base_offset: int) -> int | None:
        """A segment's epoch (``None``: unknown); ``SegmentNotFoundError`` if there is none."""
        if base_offset in self.epochs:
            return self.epochs[base_offset]
        self.find(base_offset)
        return 0

    def data_epoch_of(self, base_offset: int) -> int | None:
        """The epoch of the primary whose records a segment holds: its epoch unless its marker
        records another (``None``: unknown); ``SegmentNotFoundError`` if there is none."""
        if base_offset in self.data_epochs:
            return self.data_epochs[base_offset]
        return self.epoch_of(base_offset)

    def set_epochs(self, base_offset: int, epoch: int, data_epoch: int) -> None:
        self.epochs[base_offset] = epoch
        if data_epoch == epoch:
            self.data_epochs.pop(base_offset, None)
        else:
            self.data_epochs[base_offset] = data_epoch

    # -- changes -----------------------------------------------------------------------------

    def forget_start(self) -> None:
        """The segment ``start_segment`` was creating will not be: appends go on in the
        active segment (its offsets are set again by whoever takes it back)."""
        if self.starting is not None:
            self.epochs.pop(self.starting, None)
            self.data_epochs.pop(self.starting, None)
            self.starting = None
            self.start_on_disk = False

    def add_active(self, base_offset: int, writer: AppendFile) -> Segment:
        """A new segment's file exists: it becomes the last segment and takes the appends."""
        segment = Segment(
            base_offset,
            self.segment_path(base_offset),
            CopyState.ACTIVE,
            0,
            base_offset,
            base_offset,
            [],
            None,
        )
        self.files.attach_writer(segment, writer)
        self.segments.append(segment)
        self.active = segment
        return segment

    def insert(self, segment: Segment) -> None:
        bisect.insort(self.segments, segment, key=_base)

    def remove(self, segment: Segment) -> None:
        self.segments.remove(segment)
        self.epochs.pop(segment.base_offset, None)
        self.data_epochs.pop(segment.base_offset, None)

    def sealed_through(self, offset: int) -> None:
        """A segment ending at ``offset`` is sealed: its records are committed."""
        self.committed = max(self.committed, offset)

    def close_active(self) -> None:
        """The active segment takes no more appends (it stays readable)."""
        active = self.active
        if active is None:
            return
        active.state = CopyState.CLOSED
        self.files.close_writer(active)
        self.active = None

    def roll_over(self, segment: Segment, next_writer: AppendFile) -> Segment:
        """A write that rolls is durable in the next segment's new file: ``segment``, full,
        takes no more appends and waits for its seal (``mark_sealed``); the next one becomes
        the active segment."""
        self.files.close_writer(segment)
        segment.state = CopyState.CLOSED
        self.rolling_to = None
        return self.add_active(segment.next_offset, next_writer)

    def apply_seal(
        self, segment: Segment, sealed: Sealed, damage: Damage | None, next_writer: AppendFile
    ) -> SegmentInfo:
        """A roll is durable and the next segment's file exists: switch to it. ``damage`` is
        rot the roll found reading the segment back."""
        self.files.close_writer(segment)
        self._take_seal(segment, sealed, damage)
        self.add_active(sealed.seal.next_offset, next_writer)
        return self._announce_seal(segment)

    def mark_sealed(self, segment: Segment, sealed: Sealed, damage: Damage | None) -> SegmentInfo:
        """The seal of a segment that rolled over (``roll_over``) is durable."""
        self._take_seal(segment, sealed, damage)
        return self._announce_seal(segment)

    def _take_seal(self, segment: Segment, sealed: Sealed, damage: Damage | None) -> None:
        segment.state = CopyState.SEALED
        segment.seal = sealed.seal
        segment.index = sealed.index
        segment.has_marker = True
        if damage is not None:
            self.found_damage(segment, damage)

    def _announce_seal(self, segment: Segment) -> SegmentInfo:
        seal = segment.seal
        assert seal is not None
        log.info(
            "Sealed segment {path}: {records} records, {size} bytes",
            path=segment.path,
            records=seal.record_count,
            size=seal.byte_size,
        )
        info = segment.info()
        call_hook(self.directory, self._on_sealed, info)
        return info

    def found_damage(self, segment: Segment, damage: Damage) -> None:
        segment.readable_end = min(segment.readable_end, damage.position)
        if segment.damage is not None:
            # Already reported and counted for this copy; only narrow what reads may reach.
            return
        segment.damage = damage
        self.report(
            IntegrityEvent(
                damage.reason,
                segment.path,
                segment.base_offset,
                damage.position,
                segment.has_marker,
            )
        )

    def report(self, event: IntegrityEvent) -> None:
        if event.reason is DamageReason.INDEX:
            log.warn(
                "Integrity failure in {segment}: the index is unreadable or unlike its log;"
                " rebuilt from the log, whose records are intact",
                segment=event.segment,
                reason=event.reason.value,
                base_offset=event.base_offset,
            )
        elif event.reason is DamageReason.METADATA:
            log.error(
                "Integrity failure in {segment}: the marker is unreadable ({reason}). An "
                "unreadable seal marker closes the copy to appends; an unreadable epoch marker "
                "refuses appends until the segment is fenced again.",
                segment=event.segment,
                position=event.position,
                reason=event.reason.value,
                base_offset=event.base_offset,
                sealed=event.sealed,
            )
        elif event.counted:
            log.error(
                "Integrity failure in {segment} at byte {position}: {reason}; the copy is "
                "damaged and reads stop before that byte. Frames after it are kept for salvage.",
                segment=event.segment,
                position=event.position,
                reason=event.reason.value,
                base_offset=event.base_offset,
                sealed=event.sealed,
            )
        else:
            log.info(
                "Torn tail in {segment} at byte {position} (crash recovery; never acknowledged)",
                segment=event.segment,
                position=event.position,
            )
        call_hook(self.directory, self._on_integrity_event, event)
