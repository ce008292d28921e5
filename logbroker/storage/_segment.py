"""Segment files on disk: names, recovery on open and verification.

Everything here runs in a writer thread (it reads and may truncate files) and returns plain
values; the range log applies them in the reactor thread.

Recovery follows the spec's integrity rules 7 and 8:

* a torn tail (the file ends inside a frame, or in zero bytes never written) on a file without
  its own seal marker is dropped: the file is cut back to its last CRC-valid frame. This is
  ordinary crash recovery: logged, not counted;
* rot (a whole frame with a bad checksum, or a mangled header with bytes after it) is never
  truncated. The frames after it stay on disk for salvage, the copy is marked damaged and closed
  to appends, and new writes go to a new segment;
* a file with its own seal marker is never truncated, whatever is wrong with it.

A segment's epoch marker (``.epoch``) records the replication epoch it was last fenced or started
at, and the epoch of the primary whose records it holds (its data epoch); a missing one means
epoch 0, and an unreadable one is reported like an unreadable seal marker
and leaves the epoch unknown (the range log then refuses appends to it until it is fenced again).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from enum import StrEnum

import attrs

from logbroker.storage._format import (
    FORMAT_VERSION,
    INDEX_INTERVAL_BYTES,
    MIN_RECORD_SIZE,
    RECORD_MAGIC,
    BatchInfo,
    Damage,
    DamageReason,
    EpochMarker,
    IndexEntry,
    Seal,
    batch_claim,
    check_batch_records,
    decode_epoch,
    decode_index,
    decode_seal,
    encode_index,
    max_record_timestamp,
    scan_batches,
    valid_record_offset,
)
from logbroker.storage._fs import TEMPORARY_SUFFIX, AppendFile, FileSystem, ReadFile
from logbroker.storage.errors import InvalidBatchError

LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".index"
SEAL_SUFFIX = ".sealed"
EPOCH_SUFFIX = ".epoch"
_MAGIC_AT = 4
_MAX_U64 = 2**64 - 1
_U32 = struct.Struct(">I")
_SEGMENT_FILE = re.compile(r"^(\d{20})\.(log|index|sealed|epoch)$")


def is_segment_file(name: str) -> bool:
    return _SEGMENT_FILE.match(name) is not None


def segment_stem(base_offset: int) -> str:
    """Segment files are named by their base offset, zero-padded to 20 digits."""
    return f"{base_offset:020d}"


class CopyState(StrEnum):
    """The state of this node's copy of a segment. The control plane's ``SegmentState`` is the
    segment's state in the cluster: a copy may be closed here while the segment is active, and a
    replica's copy of a sealed segment carries no local seal marker."""

    #: Being appended to; the last segment of a range.
    ACTIVE = "active"
    #: Carries its own seal marker: complete and immutable.
    SEALED = "sealed"
    #: No longer appended to and not sealed here: damaged, or a replica copy without a marker.
    CLOSED = "closed"


@attrs.frozen
class IntegrityEvent:
    """A finding about stored data, for the log and ``svc_storage_integrity_failures_total``."""

    reason: DamageReason
    segment: str
    base_offset: int
    position: int
    #: The segment carries its own seal marker (it was sealed on this node).
    sealed: bool

    @property
    def counted(self) -> bool:
        """Everything counts except a torn tail of an unsealed segment (ordinary recovery)."""
        return self.sealed or self.reason is not DamageReason.INCOMPLETE


@attrs.frozen
class Verification:
    """The outcome of checking every checksum of one segment."""

    base_offset: int
    damage: Damage | None
    record_count: int
    byte_size: int
    #: Of a sealed segment whose log is intact: its index sidecar rebuilt from the log, when
    #: the one on disk is missing, unreadable or unlike it (``None``: it is as it should be).
    rebuilt_index: bytes | None = None

    @property
    def verified(self) -> bool:
        return self.damage is None


def build_index(
    batches: list[BatchInfo], entries: list[IndexEntry] | None = None
) -> list[IndexEntry]:
    """Sparse index entries: the first batch, then the first batch starting 4096 bytes or more
    after the previous entry's batch. Given every batch of a log, in order, this is a function
    of the log's bytes; the active segment's in-memory index, extended as appends arrive (a
    replicated append may hold several batches), may have fewer entries."""
    entries = [] if entries is None else entries
    for batch in batches:
        if not entries or batch.position - entries[-1].position >= INDEX_INTERVAL_BYTES:
            entries.append(IndexEntry(batch.base_offset, batch.position))
    return entries


@attrs.frozen
class Sealed:
    """What a sealed segment's sidecars record: its seal marker and its index."""

    seal: Seal
    index: list[IndexEntry]


#: ``(index entries as (offset, position), next offset, largest record timestamp)``.
SealedScan = tuple[list[tuple[int, int]], int, int]


def scan_sealed_python(
    data: bytes | memoryview, base_offset: int, interval: int
) -> SealedScan | None:
    """What the sidecars of a sealed segment whose log is ``data`` record, when ``data`` is
    whole, verified batches from ``base_offset`` on (record frames filling each batch exactly);
    ``None`` otherwise. ``interval`` is the index's (``INDEX_INTERVAL_BYTES``). The native
    ``scan_sealed`` (``_speedups.c``) gives the same answer, faster: the sidecars are derived
    from a whole segment's bytes each time one seals."""
    scan = scan_batches(data, 0, base_offset)
    if scan.damage is not None or not scan.batches or scan.batches[-1].next_offset > _MAX_U64:
        return None
    view = memoryview(data)
    for batch in scan.batches:
        position = batch.records_start
        for _ in range(batch.record_count):
            if batch.end - position < MIN_RECORD_SIZE:
                return None
            (length,) = _U32.unpack_from(view, position + 8)
            if not MIN_RECORD_SIZE <= length <= batch.end - position:
                return None
            position += length
        if position != batch.end:
            return None
    entries: list[tuple[int, int]] = []
    for batch in scan.batches:
        if not entries or batch.position - entries[-1][1] >= interval:
            entries.append((batch.base_offset, batch.position))
    return entries, scan.batches[-1].next_offset, max_record_timestamp(view, scan.batches)


scan_sealed: Callable[[bytes | memoryview, int, int], SealedScan | None]
try:
    from logbroker.storage._speedups import scan_sealed
except ImportError:  # not built: no compiler where this was installed
    scan_sealed = scan_sealed_python


def sealed_files(data: bytes | memoryview, base_offset: int) -> Sealed | None:
    """The seal and the index of a sealed segment whose log is ``data``, if it is whole,
    verified batches from ``base_offset`` on: functions of the log's bytes alone, so that every
    copy of the segment writes the same sidecars, however its bytes arrived. The index follows
    ``build_index``'s rule over every batch."""
    scanned = scan_sealed(data, base_offset, INDEX_INTERVAL_BYTES)
    if scanned is None:
        return None
    entries, next_offset, largest = scanned
    seal = Seal(base_offset, next_offset - base_offset, len(data), largest)
    return Sealed(seal, [IndexEntry(offset, position) for offset, position in entries])


def verify_segment_bytes(
    data: bytes,
    base_offset: int,
    seal: Seal | None,
    *,
    check_index: bool = False,
    index: bytes | None = None,
) -> Verification:
    """Check every checksum of a segment's bytes and, when sealed, its recorded size and count;
    with ``check_index``, the bytes of its index sidecar too (``index``; ``None``: there is
    none).

    A sealed segment is checked first by ``scan_sealed``, which the native build runs without
    the GIL (a scrub's check of a large segment then costs the reactor nothing); only a segment
    it does not find whole is scanned again here to find where its damage starts."""
    if seal is not None:
        scanned = scan_sealed(data, base_offset, INDEX_INTERVAL_BYTES)
        if scanned is not None:
            entries, next_offset, _ = scanned
            count = next_offset - base_offset
            damage = None
            if len(data) != seal.byte_size or count != seal.record_count:
                damage = Damage(min(len(data), seal.byte_size), DamageReason.SIZE)
            rebuilt = None
            if damage is None and check_index:
                found = [IndexEntry(offset, position) for offset, position in entries]
                rebuilt = _index_unlike(base_offset, found, index)
            return Verification(base_offset, damage, count, len(data), rebuilt)
    scan = scan_batches(data, 0, base_offset)
    count = scan.batches[-1].next_offset - base_offset if scan.batches else 0
    damage = scan.damage
    if (
        damage is None
        and seal is not None
        and (len(data) != seal.byte_size or count != seal.record_count)
    ):
        damage = Damage(min(len(data), seal.byte_size), DamageReason.SIZE)
    rebuilt = None
    if damage is None and check_index:
        rebuilt = _index_unlike(base_offset, build_index(scan.batches), index)
    return Verification(base_offset, damage, count, scan.end, rebuilt)


def _index_unlike(base_offset: int, entries: list[IndexEntry], index: bytes | None) -> bytes | None:
    """The index sidecar ``entries`` make, if ``index`` (the one on disk) is not it."""
    expected = encode_index(base_offset, entries)
    return None if index == expected else expected


def verify_peer_batches(data: bytes, base_offset: int) -> list[BatchInfo]:
    """The batches of bytes a peer sent, starting at ``base_offset``; ``InvalidBatchError``
    unless they are whole batches that all verify.

    Bytes from a peer are not trusted on the batch checksum alone: every record must pass its
    own, carry its offset and decode exactly.
    """
    scan = scan_batches(data, 0, base_offset)
    damage = scan.damage
    if damage is None:
        damage = next(filter(None, (check_batch_records(data, b) for b in scan.batches)), None)
    if damage is not None or not scan.batches:
        where = damage.position if damage is not None else 0
        raise InvalidBatchError(f"replicated bytes fail verification at byte {where}")
    return scan.batches


def salvage_end_offset(data: bytes, batch_start: int, next_offset: int) -> int:
    """After rot in the batch at ``batch_start``, the offset past every record it may hold.

    New writes must never reuse an offset that an acknowledged record of the damaged copy holds,
    or a later salvage or repair would meet two records with one offset. The damaged batch held
    at least the record at ``next_offset``; when its header still agrees with the stream, all the
    records it claims; and every record frame after it that passes its own checksum holds the
    offset it names (records of later batches, and whole records of the damaged one).
    """
    end = next_offset + 1
    claimed = batch_claim(data, batch_start, next_offset)
    if claimed is not None:
        end = max(end, claimed)
    signature = RECORD_MAGIC + bytes([FORMAT_VERSION])
    found = data.find(signature, batch_start + _MAGIC_AT)
    while found != -1:
        offset = valid_record_offset(data, found - _MAGIC_AT)
        if offset is not None:
            end = max(end, offset + 1)
        found = data.find(signature, found + 1)
    return end


@attrs.frozen
class SegmentInfo:
    """A segment as ``RangeLog.segments`` lists it; sealing reports it to the control plane."""

    base_offset: int
    state: CopyState
    #: Readable records (for a sealed segment: the count its seal recorded).
    record_count: int
    #: Readable bytes (for a sealed segment: the size its seal recorded).
    byte_size: int
    damage: Damage | None = None
    #: The largest record timestamp its seal marker records (``None``: not sealed here, or a
    #: marker of an earlier build, which recorded when it was sealed instead).
    max_timestamp_ms: int | None = None

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count


@attrs.define(eq=False)
class Segment:
    """One segment file's state: found by recovery, then owned by its range log.

    Recovery builds it in a writer thread; after that only the reactor thread touches it.
    """

    base_offset: int
    path: str
    state: CopyState
    #: Bytes of the file that verify (or that the seal vouches for); reads stop here.
    readable_end: int
    #: The offset after the last readable record.
    next_offset: int
    #: The offset after the last record the file may hold, readable or not.
    end_offset: int
    index: list[IndexEntry]
    seal: Seal | None
    damage: Damage | None = None
    #: Whether the file has its own seal marker (even an unreadable one): then never truncate.
    has_marker: bool = False
    writer: AppendFile | None = None
    reader: ReadFile | None = None
    #: Counts the times bytes this copy already verified were cut (trimmed, or sealed shorter):
    #: a read that started before a cut must not report what it read as damage.
    generation: int = 0

    @property
    def stem(self) -> str:
        return self.path.removesuffix(LOG_SUFFIX)

    def info(self) -> SegmentInfo:
        max_timestamp = self.seal.max_timestamp_ms if self.seal is not None else None
        if self.seal is not None and self.damage is None:
            return SegmentInfo(
                self.base_offset,
                self.state,
                self.seal.record_count,
                self.seal.byte_size,
                None,
                max_timestamp,
            )
        return SegmentInfo(
            self.base_offset,
            self.state,
            self.next_offset - self.base_offset,
            self.readable_end,
            self.damage,
            max_timestamp,
        )


@attrs.frozen
class RecoveredLog:
    segments: list[Segment]
    events: list[IntegrityEvent]
    removed: list[str]
    truncated: list[tuple[str, int, int]]
    #: Things recovery worked around that an operator should hear about.
    notes: list[str]
    #: The epoch of each segment with an epoch marker (``None``: the marker is unreadable);
    #: a segment without one is at epoch 0.
    epochs: dict[int, int | None]
    #: The data epoch of each segment whose marker records one other than its epoch.
    data_epochs: dict[int, int] = attrs.field(factory=dict)


def group_segment_files(fs: FileSystem, directory: str) -> tuple[dict[int, set[str]], list[str]]:
    groups: dict[int, set[str]] = {}
    strays: list[str] = []
    for name in fs.list_dir(directory):
        match = _SEGMENT_FILE.match(name)
        if match is None:
            if name.endswith(TEMPORARY_SUFFIX):
                strays.append(name)
            continue
        groups.setdefault(int(match.group(1)), set()).add(match.group(2))
    return groups, strays


def _recover_sealed(
    fs: FileSystem,
    path: str,
    base: int,
    seal: Seal,
    stem_path: str,
    has_index: bool,
    notes: list[str],
) -> tuple[Segment, list[IntegrityEvent]]:
    size = fs.size(path)
    events = []
    damage = None
    readable_end = seal.byte_size
    if size != seal.byte_size:
        readable_end = min(size, seal.byte_size)
        damage = Damage(readable_end, DamageReason.SIZE)
        events.append(IntegrityEvent(DamageReason.SIZE, path, base, readable_end, True))
    index = None
    if has_index:
        try:
            index = decode_index(fs.read_file(stem_path + INDEX_SUFFIX), base)
        except ValueError:
            index = None
            events.append(
                IntegrityEvent(DamageReason.INDEX, stem_path + INDEX_SUFFIX, base, 0, True)
            )
    if index is None:
        # Not data damage: the index is derived. Rebuild it from the log and try to put it back
        # (a full disk must not stop recovery for want of a file it can do without).
        index = build_index(scan_batches(fs.read_file(path)[:readable_end], 0, base).batches)
        try:
            fs.write_atomic(stem_path + INDEX_SUFFIX, encode_index(base, index))
        except OSError as error:
            notes.append(f"could not write the rebuilt index of {path}: {error}")
    # A short sealed copy's readable next offset is only known once it is scanned; reads find out.
    next_offset = seal.next_offset if damage is None else base
    segment = Segment(
        base,
        path,
        CopyState.SEALED,
        readable_end,
        next_offset,
        seal.next_offset,
        index,
        seal,
        damage,
        has_marker=True,
    )
    return segment, events


def recover_unsealed(
    fs: FileSystem, path: str, base: int, has_marker: bool
) -> tuple[Segment, list[IntegrityEvent], tuple[str, int, int] | None]:
    data = fs.read_file(path)
    scan = scan_batches(data, 0, base)
    next_offset = scan.batches[-1].next_offset if scan.batches else base
    index = build_index(scan.batches)
    events: list[IntegrityEvent] = []
    truncated = None
    damage = scan.damage
    end_offset = next_offset
    state = CopyState.ACTIVE
    if damage is not None:
        events.append(IntegrityEvent(damage.reason, path, base, damage.position, has_marker))
        if damage.torn and not has_marker:
            fs.truncate(path, damage.position)
            truncated = (path, len(data), damage.position)
            damage = None
        else:
            state = CopyState.CLOSED
            end_offset = salvage_end_offset(data, scan.end, next_offset)
    segment = Segment(
        base,
        path,
        state,
        scan.end,
        next_offset,
        end_offset,
        index,
        None,
        damage,
        has_marker=has_marker,
    )
    return segment, events, truncated


def recover_log(fs: FileSystem, directory: str) -> RecoveredLog:
    """Open every segment of a range directory, applying the recovery rules. Blocking."""
    fs.make_dirs(directory)
    groups, strays = group_segment_files(fs, directory)
    removed = []
    for name in strays:
        fs.remove(f"{directory}/{name}")
        removed.append(name)
    segments: list[Segment] = []
    events: list[IntegrityEvent] = []
    truncated = []
    notes: list[str] = []
    epochs: dict[int, int | None] = {}
    data_epochs: dict[int, int] = {}
    for base in sorted(groups):
        kinds = groups[base]
        stem_path = f"{directory}/{segment_stem(base)}"
        path = stem_path + LOG_SUFFIX
        if "log" not in kinds:
            # A delete removes the log first; its sidecars are leftovers of an interrupted delete.
            for kind in sorted(kinds):
                fs.remove(f"{stem_path}.{kind}")
                removed.append(f"{segment_stem(base)}.{kind}")
            continue
        seal = None
        if "sealed" in kinds:
            try:
                seal = decode_seal(fs.read_file(stem_path + SEAL_SUFFIX))
                if seal.base_offset != base:
                    raise ValueError(f"seal marker names base offset {seal.base_offset}")
            except ValueError:
                events.append(IntegrityEvent(DamageReason.METADATA, path, base, 0, True))
        if seal is not None:
            segment, found = _recover_sealed(
                fs, path, base, seal, stem_path, "index" in kinds, notes
            )
        else:
            segment, found, cut = recover_unsealed(fs, path, base, "sealed" in kinds)
            if cut is not None:
                truncated.append(cut)
        events.extend(found)
        segments.append(segment)
        if "epoch" in kinds:
            marker = _recover_epoch(fs, stem_path + EPOCH_SUFFIX, base)
            epochs[base] = None if marker is None else marker.epoch
            if marker is not None and marker.data_epoch != marker.epoch:
                data_epochs[base] = marker.data_epoch
            if marker is None:
                event = IntegrityEvent(
                    DamageReason.METADATA, stem_path + EPOCH_SUFFIX, base, 0, segment.has_marker
                )
                events.append(event)
    if removed:
        fs.sync_dir(directory)
    # Only the last segment may take appends; an earlier unsealed one is a closed copy.
    for segment in segments[:-1]:
        if segment.state is CopyState.ACTIVE:
            segment.state = CopyState.CLOSED
    if segments and segments[-1].has_marker and segments[-1].state is CopyState.ACTIVE:
        segments[-1].state = CopyState.CLOSED
    if segments and segments[-1].state is not CopyState.ACTIVE:
        # The next segment starts where this one ends, and must never take its file name: a
        # closed copy that holds no readable record (say, an empty file beside an unreadable
        # marker) still gives up one offset.
        last = segments[-1]
        last.end_offset = max(last.end_offset, last.base_offset + 1)
    return RecoveredLog(segments, events, removed, truncated, notes, epochs, data_epochs)


def _recover_epoch(fs: FileSystem, path: str, base: int) -> EpochMarker | None:
    """What an epoch marker records, or ``None`` when it is unreadable."""
    try:
        marker = decode_epoch(fs.read_file(path))
    except ValueError:
        return None
    return marker if marker.base_offset == base else None
