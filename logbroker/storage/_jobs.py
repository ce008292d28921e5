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
    IndexEntry,
    Seal,
    encode_index,
    encode_seal,
    scan_batches,
)
from logbroker.storage._fs import AppendFile, FileSystem
from logbroker.storage._segment import (
    EPOCH_SUFFIX,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    SEAL_SUFFIX,
    Segment,
    Verification,
    build_index,
    verify_peer_batches,
    verify_segment_bytes,
)
from logbroker.storage.errors import InvalidBatchError, SegmentStateError


@attrs.frozen
class SealPlan:
    """Files to write when a segment seals."""

    stem: str
    index: bytes
    seal: bytes


def plan_seal(segment: Segment, sealed_at_ms: int) -> tuple[SealPlan, Seal]:
    """The seal of a segment at its verified length, with the index it holds in memory."""
    seal = Seal(
        segment.base_offset,
        segment.next_offset - segment.base_offset,
        segment.readable_end,
        sealed_at_ms,
    )
    plan = SealPlan(
        segment.stem, encode_index(segment.base_offset, segment.index), encode_seal(seal)
    )
    return plan, seal


def _create_segment(fs: FileSystem, directory: str, path: str) -> AppendFile:
    """Create a new segment file; it is not durable until its directory entry is."""
    writer = fs.create_append(path)
    try:
        fs.sync_dir(directory)
    except BaseException:
        writer.close()
        raise
    return writer


def _seal_files(fs: FileSystem, plan: SealPlan) -> None:
    # Index first, then the marker: a marker on disk always has its index beside it.
    fs.write_atomic(plan.stem + INDEX_SUFFIX, plan.index)
    fs.write_atomic(plan.stem + SEAL_SUFFIX, plan.seal)


def _roll_job(fs: FileSystem, directory: str, plan: SealPlan, next_path: str) -> AppendFile:
    """Seal a segment and create the next one.

    The next segment's file is created at once, so the range's end offset stays on disk (in that
    file's name) even if retention later deletes every sealed segment.
    """
    _seal_files(fs, plan)
    return _create_segment(fs, directory, next_path)


def _write_job(
    fs: FileSystem,
    directory: str,
    seal_plan: SealPlan | None,
    path: str,
    writer: AppendFile | None,
    new_segment: bool,
    data: bytes,
) -> tuple[AppendFile, float]:
    """Append ``data`` to the segment at ``path`` (sealing the previous one first, if planned)
    and fsync it; return the file and the seconds it all took. ``writer`` is the segment's open
    file; without one, a new segment's file is created (never an existing one reused) and a
    recovered segment's file is opened."""
    started = time.monotonic()
    opened = writer is None
    if seal_plan is not None:
        writer = _roll_job(fs, directory, seal_plan, path)
    elif writer is None:
        writer = _create_segment(fs, directory, path) if new_segment else fs.open_append(path)
    try:
        writer.write(data)
        writer.sync()
    except BaseException:
        if opened:
            writer.close()
        raise
    return writer, time.monotonic() - started


def _delete_files(fs: FileSystem, directory: str, stem: str) -> None:
    # The log goes first: recovery removes sidecars whose log is gone.
    for suffix in (LOG_SUFFIX, INDEX_SUFFIX, SEAL_SUFFIX, EPOCH_SUFFIX):
        if fs.exists(stem + suffix):
            fs.remove(stem + suffix)
    fs.sync_dir(directory)


def _whole_batches(fs: FileSystem, path: str, base_offset: int, byte_size: int) -> list[BatchInfo]:
    """The batches of the first ``byte_size`` bytes of a segment, which must all verify and
    end exactly there; ``SegmentStateError`` (nothing changed) otherwise."""
    reader = fs.open_read(path)
    try:
        data = reader.read(0, byte_size)
    finally:
        reader.close()
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


def _start_segment_job(fs: FileSystem, directory: str, path: str, epoch: bytes) -> AppendFile:
    """Create a segment's epoch marker, then its file.

    In that order: a crash between them leaves a marker without its log, which recovery
    removes, so the segment either does not exist or exists at its epoch.
    """
    fs.write_atomic(path.removesuffix(LOG_SUFFIX) + EPOCH_SUFFIX, epoch)
    return _create_segment(fs, directory, path)


def _seal_copy_job(
    fs: FileSystem, path: str, seal: Seal, index: list[IndexEntry] | None
) -> list[IndexEntry]:
    """Seal a copy at ``seal.byte_size``, cutting it back there first unless ``index`` (the
    copy's own, when it already ends there) is given; return the index written.

    The cut comes first: a crash before the marker leaves an unsealed copy of the sealed
    length, which sealing again completes. Bytes past that length were never acknowledged by
    a quorum, and every byte before it stays.
    """
    if index is None:
        batches = _whole_batches(fs, path, seal.base_offset, seal.byte_size)
        count = batches[-1].next_offset - seal.base_offset if batches else 0
        if count != seal.record_count:
            raise SegmentStateError(
                f"{path}: the first {seal.byte_size} bytes hold {count} records, not the "
                f"{seal.record_count} of the seal; fetch the segment whole instead"
            )
        fs.truncate(path, seal.byte_size)
        index = build_index(batches)
    stem = path.removesuffix(LOG_SUFFIX)
    _seal_files(fs, SealPlan(stem, encode_index(seal.base_offset, index), encode_seal(seal)))
    return index


def check_install(data: bytes, base_offset: int, record_count: int) -> list[IndexEntry]:
    """Verify a whole sealed segment from a peer (every batch and every record); return its
    index, or raise ``InvalidBatchError``. Pure: it reads no file."""
    batches = verify_peer_batches(data, base_offset)
    count = batches[-1].next_offset - base_offset
    if count != record_count:
        raise InvalidBatchError(
            f"the segment at offset {base_offset} holds {count} records, not {record_count}"
        )
    return build_index(batches)


def _install_job(
    fs: FileSystem, path: str, data: bytes, seal: Seal, index: list[IndexEntry]
) -> None:
    """Write a verified sealed segment with its index and marker.

    The sidecars go first and the log last, each atomically: a crash before the log's rename
    leaves sidecars without a log (and a temporary file), which recovery removes, so the segment
    is either missing or whole and sealed.
    """
    stem = path.removesuffix(LOG_SUFFIX)
    _seal_files(fs, SealPlan(stem, encode_index(seal.base_offset, index), encode_seal(seal)))
    fs.write_atomic(path, data)
