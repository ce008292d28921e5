"""The range log's blocking jobs: each runs in a writer thread through the injected executor.

A job touches files and returns plain values; the range log applies them in the reactor thread.
The order of writes and fsyncs inside each job is what makes it crash-safe (see "Durability
ordering" in ``docs/storage-format.md``): a crash at any point leaves what was there before or
the whole result, and never loses an fsynced record below a length the job was told to keep.
"""

from __future__ import annotations

import posixpath
import time

import attrs

from logbroker.storage._format import (
    BatchInfo,
    Damage,
    DamageReason,
    EpochMarker,
    IndexEntry,
    Seal,
    encode_epoch,
    encode_index,
    encode_seal,
    max_record_timestamp,
    scan_batches,
)
from logbroker.storage._fs import AppendFile, FileSystem
from logbroker.storage._segment import (
    EPOCH_SUFFIX,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    SEAL_SUFFIX,
    Sealed,
    Segment,
    Verification,
    build_index,
    recover_unsealed,
    sealed_files,
    verify_peer_batches,
    verify_segment_bytes,
)
from logbroker.storage.errors import InvalidBatchError, SegmentStateError


@attrs.frozen
class SealPlan:
    """A segment a roll seals, at its verified length."""

    path: str
    base_offset: int
    record_count: int
    byte_size: int


def plan_seal(segment: Segment) -> SealPlan:
    return SealPlan(
        segment.path,
        segment.base_offset,
        segment.next_offset - segment.base_offset,
        segment.readable_end,
    )


def create_segment(fs: FileSystem, directory: str, path: str) -> AppendFile:
    """Create a new segment file; it is not durable until its directory entry is."""
    writer = fs.create_append(path)
    try:
        fs.sync_dir(directory)
    except BaseException:
        writer.close()
        raise
    return writer


def _read_prefix(fs: FileSystem, path: str, byte_size: int) -> bytes:
    """The first ``byte_size`` bytes of the file at ``path`` (fewer if it is shorter)."""
    reader = fs.open_read(path)
    try:
        return reader.read(0, byte_size)
    finally:
        reader.close()


def sidecar_writes(
    fs: FileSystem, path: str, seal: Seal, index: list[IndexEntry], epoch: int | None
) -> list[tuple[str, bytes]]:
    """The sidecars of a sealed segment whose log is at ``path``, in the order they must become
    durable: its epoch marker (with ``epoch``; none on a single node), its index, then its seal
    marker. The marker goes last: a marker on disk always has its sidecars beside it."""
    stem = path.removesuffix(LOG_SUFFIX)
    writes: list[tuple[str, bytes]] = []
    if epoch is not None:
        marker = encode_epoch(EpochMarker(seal.base_offset, epoch))
        # Usually the copy's fence wrote this very marker, durably, before the seal: written
        # again, it would cost two syncs for nothing (at every seal of every copy).
        held = stem + EPOCH_SUFFIX
        if not fs.exists(held) or fs.read_file(held) != marker:
            writes.append((held, marker))
    writes.append((stem + INDEX_SUFFIX, encode_index(seal.base_offset, index)))
    writes.append((stem + SEAL_SUFFIX, encode_seal(seal)))
    return writes


def _seal_files(
    fs: FileSystem, path: str, seal: Seal, index: list[IndexEntry], epoch: int | None
) -> None:
    """Write the sidecars of a sealed segment (``sidecar_writes``), each durable in turn."""
    for sidecar, data in sidecar_writes(fs, path, seal, index, epoch):
        fs.write_atomic(sidecar, data)


def cut_to_seal(
    fs: FileSystem,
    path: str,
    base_offset: int,
    record_count: int,
    byte_size: int,
    epoch: int,
) -> tuple[Sealed, list[tuple[str, bytes]]]:
    """Cut the segment at ``path`` to ``byte_size`` for its seal: its first ``byte_size`` bytes
    are read back and must be whole, verified batches of ``record_count`` records
    (``SegmentStateError``, nothing changed, otherwise); bytes past them are cut. Return the
    seal and the sidecars to write (``sidecar_writes``), derived from those bytes alone.

    The cut comes before the sidecars: a crash before the marker leaves an unsealed copy of the
    sealed length, which sealing again completes. Bytes past that length were never
    acknowledged by a quorum, and every byte before it stays.
    """
    with fs.read_mapped(path, byte_size) as data:
        sealed = sealed_files(data, base_offset) if len(data) == byte_size else None
    if sealed is None:
        raise SegmentStateError(
            f"{path}: the first {byte_size} bytes are not whole, verified batches; refusing to "
            "seal there"
        )
    if sealed.seal.record_count != record_count:
        raise SegmentStateError(
            f"{path}: the first {byte_size} bytes hold {sealed.seal.record_count} records, not "
            f"the {record_count} of the seal; fetch the segment whole instead"
        )
    if fs.size(path) != byte_size:
        fs.truncate(path, byte_size)
    return sealed, sidecar_writes(fs, path, sealed.seal, sealed.index, epoch)


@attrs.frozen
class Rolled:
    """What a roll sealed, and the rot it found reading the segment back, if any."""

    sealed: Sealed
    damage: Damage | None


def _seal_rolled(fs: FileSystem, plan: SealPlan) -> Rolled:
    """Seal a segment this node rolls, at its verified length.

    Its bytes are read back first, for the sidecars to be derived from them alone. Rot found
    there (bytes changed since they were written) does not stop the roll: the segment is sealed
    as the log holds it, never cut, as it was before the roll, its sidecars derived from the
    batches before the rot, and the rot is reported like any other.
    """
    with fs.read_mapped(plan.path, plan.byte_size) as data:
        sealed = sealed_files(data, plan.base_offset) if len(data) == plan.byte_size else None
        damage = None
        if sealed is None or sealed.seal.record_count != plan.record_count:
            scan = scan_batches(data, 0, plan.base_offset)
            damage = scan.damage or Damage(len(data), DamageReason.SIZE)
            seal = Seal(
                plan.base_offset,
                plan.record_count,
                plan.byte_size,
                max_record_timestamp(data, scan.batches),
            )
            sealed = Sealed(seal, build_index(scan.batches))
    _seal_files(fs, plan.path, sealed.seal, sealed.index, None)
    return Rolled(sealed, damage)


def _roll_job(
    fs: FileSystem, directory: str, plan: SealPlan, next_path: str
) -> tuple[AppendFile, Rolled]:
    """Seal a segment and create the next one.

    The next segment's file is created at once, so the range's end offset stays on disk (in that
    file's name) even if retention later deletes every sealed segment.
    """
    rolled = _seal_rolled(fs, plan)
    return create_segment(fs, directory, next_path), rolled


def _write_job(
    fs: FileSystem,
    directory: str,
    path: str,
    writer: AppendFile | None,
    new_segment: bool,
    data: bytes,
    sync: bool = True,
) -> tuple[AppendFile, float]:
    """Append ``data`` to the segment at ``path`` and fsync it (unless ``sync`` is false: the
    caller has it flushed, see ``_flush``); return the file and the seconds it all took.
    ``writer`` is the segment's open file; without one, a new segment's file is created (never
    an existing one reused) and a recovered segment's file is opened."""
    started = time.monotonic()
    opened = writer is None
    if writer is None:
        writer = create_segment(fs, directory, path) if new_segment else fs.open_append(path)
    try:
        writer.write(data)
        if sync:
            writer.sync()
    except BaseException:
        if opened:
            writer.close()
        raise
    return writer, time.monotonic() - started


#: What the probe of a storage failure writes and syncs before a range takes appends again.
PROBE_BYTES = 64 * 1024
PROBE_FILE = ".probe"


def _back_in_service_job(
    fs: FileSystem, directory: str, path: str, size: int, rolled_to: str | None
) -> bool:
    """After a failed write or fsync to the active segment at ``path``: whether it can take
    appends again, with what was acknowledged (its first ``size`` bytes) all it holds.

    A probe of ``PROBE_BYTES`` is written and synced beside it, then removed (the disk has room
    and syncs again); the segment is cut back to ``size`` (bytes written past it were never
    acknowledged, and after a failed fsync the kernel may have dropped them unwritten) and
    synced. When the failed write was rolling over to a new segment, ``rolled_to``, that file
    is removed first: nothing in it was acknowledged. ``False`` if the failure left more than
    that segment in doubt: a seal marker or index beside it, or another newer segment file."""
    stem = path.removesuffix(LOG_SUFFIX)
    if fs.exists(stem + INDEX_SUFFIX):
        return False
    _probe(fs, directory)
    if rolled_to is not None and fs.exists(rolled_to):
        fs.remove(rolled_to)
        fs.sync_dir(directory)
    if not _alone_at_the_end(fs, directory, path):
        return False
    if fs.size(path) > size:
        fs.truncate(path, size)
    _sync(fs, path)
    return True


def _reopen_job(fs: FileSystem, directory: str, path: str, base_offset: int) -> Segment | None:
    """After a seal or trim of the last segment (at ``path``) failed midway, its file as it
    now is, to take appends again: its batches up to the last that verifies (a torn tail
    cut off, as recovery does), durably; the index the failed seal may have left beside it
    removed (an unsealed copy's index lives in memory). ``None`` when more is in doubt: a seal
    marker beside it, a newer segment file, or rot in it.

    Its bytes past the seal or trim were never committed (a seal or trim cuts only what no
    quorum holds), so whether the cut reached the file or not, the primary brings the copy in
    step again as after any gap."""
    stem = path.removesuffix(LOG_SUFFIX)
    if not _alone_at_the_end(fs, directory, path):
        return None
    _probe(fs, directory)
    if fs.exists(stem + INDEX_SUFFIX):
        fs.remove(stem + INDEX_SUFFIX)
        fs.sync_dir(directory)
    segment, _, _ = recover_unsealed(fs, path, base_offset, has_marker=False)
    if segment.damage is not None:
        return None
    _sync(fs, path)
    return segment


def _finish_start_job(
    fs: FileSystem, directory: str, path: str, marker: EpochMarker
) -> AppendFile | None:
    """After ``start_segment`` of the segment at ``path`` failed midway (its marker or its
    file could not be made durable), the same start again once a probe succeeds: the marker
    written (a replace, so a marker the failed start published is simply written again), then
    the file made or, if the failed start made it, opened, its directory entry durable. The
    result is what a start that had succeeded leaves, so appends go on from ``marker``'s base.
    ``None`` when more is in doubt: a newer segment file, or bytes in this one (nothing can
    have been appended to a segment whose start never finished)."""
    if _newer_segment_beside(fs, directory, path):
        return None
    _probe(fs, directory)
    if fs.exists(path) and fs.size(path) > 0:
        return None
    fs.write_atomic(path.removesuffix(LOG_SUFFIX) + EPOCH_SUFFIX, encode_epoch(marker))
    if not fs.exists(path):
        return create_segment(fs, directory, path)
    fs.sync_dir(directory)
    return fs.open_append(path)


def _alone_at_the_end(fs: FileSystem, directory: str, path: str) -> bool:
    """Whether the segment at ``path`` has no seal marker and no newer segment beside it."""
    if fs.exists(path.removesuffix(LOG_SUFFIX) + SEAL_SUFFIX):
        return False
    return not _newer_segment_beside(fs, directory, path)


def _newer_segment_beside(fs: FileSystem, directory: str, path: str) -> bool:
    """Whether a segment file newer than the one at ``path`` is in ``directory``."""
    name = posixpath.basename(path)
    return any(e > name for e in fs.list_dir(directory) if e.endswith(LOG_SUFFIX))


def _probe(fs: FileSystem, directory: str) -> None:
    """Write and sync ``PROBE_BYTES`` beside the segments, then remove them: raises while the
    disk has no room or fails to sync."""
    probe = f"{directory}/{PROBE_FILE}"
    fs.write_atomic(probe, bytes(PROBE_BYTES))
    fs.remove(probe)


def _sync(fs: FileSystem, path: str) -> None:
    writer = fs.open_append(path)
    try:
        writer.sync()
    finally:
        writer.close()


def _delete_files(fs: FileSystem, directory: str, stem: str) -> None:
    # The log goes first: recovery removes sidecars whose log is gone.
    for suffix in (LOG_SUFFIX, INDEX_SUFFIX, SEAL_SUFFIX, EPOCH_SUFFIX):
        if fs.exists(stem + suffix):
            fs.remove(stem + suffix)
    fs.sync_dir(directory)


def _whole_batches(fs: FileSystem, path: str, base_offset: int, byte_size: int) -> list[BatchInfo]:
    """The batches of the first ``byte_size`` bytes of a segment, which must all verify and
    end exactly there; ``SegmentStateError`` (nothing changed) otherwise."""
    data = _read_prefix(fs, path, byte_size)
    scan = scan_batches(data, 0, base_offset)
    if len(data) != byte_size or scan.damage is not None:
        raise SegmentStateError(
            f"{path}: the first {byte_size} bytes are not whole, verified batches; refusing to cut"
        )
    return scan.batches


def _trim_job(
    fs: FileSystem, path: str, base_offset: int, byte_size: int, last: bool
) -> list[BatchInfo]:
    if byte_size == 0 and not last:
        # A copy that holds nothing committed is removed, not left as an empty file; the
        # range's last segment is kept (empty), for its name records where the range ends.
        _delete_files(fs, posixpath.dirname(path), path.removesuffix(LOG_SUFFIX))
        return []
    batches = _whole_batches(fs, path, base_offset, byte_size) if byte_size else []
    fs.truncate(path, byte_size)
    return batches


def _verify_job(
    fs: FileSystem, path: str, limit: int | None, base: int, seal: Seal | None
) -> Verification:
    data = fs.read_file(path)
    if limit is not None:
        data = data[:limit]
    return verify_segment_bytes(data, base, seal)


def _verify_sealed_job(fs: FileSystem, path: str, base: int, seal: Seal | None) -> Verification:
    """``_verify_job`` of a sealed copy, its index sidecar included."""
    data = fs.read_file(path)
    try:
        index: bytes | None = fs.read_file(path.removesuffix(LOG_SUFFIX) + INDEX_SUFFIX)
    except FileNotFoundError:
        index = None
    return verify_segment_bytes(data, base, seal, check_index=True, index=index)


def _files_on_disk_job(fs: FileSystem, paths: list[str]) -> list[tuple[int | None, bool]]:
    """For each segment's ``.log`` path: its size on disk (``None``: it is gone), and whether
    its seal marker is there."""
    found: list[tuple[int | None, bool]] = []
    for path in paths:
        try:
            size: int | None = fs.size(path)
        except FileNotFoundError:
            size = None
        found.append((size, fs.exists(path.removesuffix(LOG_SUFFIX) + SEAL_SUFFIX)))
    return found


def _write_index_job(fs: FileSystem, path: str, index: bytes) -> None:
    """Put a sealed copy's rebuilt index sidecar in place of the one on disk."""
    fs.write_atomic(path.removesuffix(LOG_SUFFIX) + INDEX_SUFFIX, index)


def check_install(data: bytes, base_offset: int, record_count: int) -> Sealed:
    """Verify a whole sealed segment from a peer (every batch and every record); return the
    sidecars to write beside it, or raise ``InvalidBatchError``. Pure: it reads no file."""
    batches = verify_peer_batches(data, base_offset)
    count = batches[-1].next_offset - base_offset
    if count != record_count:
        raise InvalidBatchError(
            f"the segment at offset {base_offset} holds {count} records, not {record_count}"
        )
    sealed = sealed_files(data, base_offset)
    assert sealed is not None, "verify_peer_batches checked them whole"
    return sealed


def _install_job(fs: FileSystem, path: str, data: bytes, sealed: Sealed, epoch: int) -> None:
    """Write a verified sealed segment with its epoch marker, index and seal marker.

    The sidecars go first and the log last, each atomically: a crash before the log's rename
    leaves sidecars without a log (and a temporary file), which recovery removes, so the segment
    is either missing or whole and sealed.
    """
    _seal_files(fs, path, sealed.seal, sealed.index, epoch)
    fs.write_atomic(path, data)
