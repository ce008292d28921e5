"""The bytes logbroker stores: record and batch frames, the sparse index, the seal marker and the
epoch marker.

CHANGING ANYTHING IN THIS MODULE BREAKS STORED DATA. Every layout here is pinned by golden-file
tests (``tests/unit/storage/test_format_golden.py``) and described in ``docs/storage-format.md``.
A new layout takes a new version number and code that still reads the old one.

This module is pure: it turns records into bytes and bytes back into records or findings. It never
touches a file, a clock or a reactor.

All integers are big-endian.

Batch frame (records appended together)::

    0   4  CRC32C of bytes [4, length)
    4   2  magic b"LB"
    6   1  version (1: unstamped; 2: stamped)
    7   1  flags (0; reserved)
    8   4  length of the whole batch frame, header included
    12  8  base offset (offset of the first record)
    20  4  record count (at least 1)
    24  .  record frames, exactly ``record count`` of them, filling the batch to ``length``

A stamped batch (version 2) holds the records of one ``produce_idempotent`` share and carries
its producer stamp between the header and the records, so that the dedupe table can be rebuilt
from the log; everything else is as in version 1::

    24  8  producer id
    32  8  sequence
    40  .  record frames

Record frame::

    0   4  CRC32C of bytes [4, length)
    4   2  magic b"LR"
    6   1  version (1)
    7   1  flags (0; reserved)
    8   4  length of the whole record frame, header included
    12  8  offset
    20  8  timestamp in milliseconds
    28  4  key length (0xFFFFFFFF: null key)
    32  4  value length (never null)
    36  .  key bytes, value bytes, header count (u32), then per header its name and its
           value (nbytes each)

The checksum comes first so that one CRC32C call covers the rest of the frame: encoding and
checking a record costs one C call, not two.

``nbytes`` is a u32 length followed by that many bytes; the length 0xFFFFFFFF stands for null, so a
null key and an empty key are distinct.

Both checksums cover every byte of their frame except the checksum field itself, so a change to
any single byte of a frame is detected. A frame of zero bytes, or of all-zero bytes, never verifies:
its magic is wrong.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum

import attrs
from crc32c import crc32c

from logbroker.records import ProducerStamp, Record, StoredRecord

FORMAT_VERSION = 1
#: The version byte of a batch that carries a producer stamp.
STAMPED_BATCH_VERSION = 2

BATCH_MAGIC = b"LB"
RECORD_MAGIC = b"LR"

_BATCH_HEADER = struct.Struct(">I2sBBIQI")
_RECORD_HEADER = struct.Struct(">I2sBBIQQ")
# A record header without its checksum, plus the key and value lengths that always follow it.
_RECORD_REST_HEAD = struct.Struct(">2sBBIQQII")
_LENGTHS = struct.Struct(">II")
_BATCH_REST_HEAD = struct.Struct(">2sBBIQI")
_U32 = struct.Struct(">I")
_STAMP = struct.Struct(">QQ")
# A record frame's length and timestamp, skipping the fields between them.
_LENGTH_AND_TIMESTAMP = struct.Struct(">8xI8xQ")
_NULL_LENGTH = 0xFFFFFFFF
_NULL_NBYTES = _U32.pack(_NULL_LENGTH)
_ZERO_HEADERS = _U32.pack(0)

BATCH_HEADER_SIZE = _BATCH_HEADER.size
STAMPED_BATCH_HEADER_SIZE = BATCH_HEADER_SIZE + _STAMP.size
RECORD_HEADER_SIZE = _RECORD_HEADER.size
# key (null) + value (empty) + header count
MIN_RECORD_SIZE = RECORD_HEADER_SIZE + 4 + 4 + 4
MIN_BATCH_SIZE = BATCH_HEADER_SIZE + MIN_RECORD_SIZE
MAX_FRAME_SIZE = 0xFFFFFFFF
_MAX_U64 = 0xFFFFFFFFFFFFFFFF

# The checksum field is bytes [0, 4) of every frame and covers all the bytes after it.
_CRC_SIZE = 4


def _frame_crc(frame: memoryview) -> int:
    return int(crc32c(frame[_CRC_SIZE:]))


def _encode_headers(headers: tuple[tuple[bytes | None, bytes | None], ...]) -> bytes:
    parts = [_U32.pack(len(headers))]
    for part in (part for header in headers for part in header):
        if part is None:
            parts.append(_NULL_NBYTES)
        else:
            parts.append(_U32.pack(len(part)))
            parts.append(part)
    return b"".join(parts)


def encode_batch_python(base_offset: int, records: Sequence[Record]) -> bytes:
    """Frame ``records`` as one batch whose first record takes ``base_offset``.

    This is the produce hot path: one ``struct`` call, one join and one CRC32C call per record.
    ``encode_batch`` is the native encoder (``_speedups.c``) where it was built, which returns
    the same bytes several times faster; this one is the fallback and its reference.
    """
    if not records:
        raise ValueError("a batch holds at least one record")
    if not 0 <= base_offset <= _MAX_U64 - len(records):
        raise ValueError(f"base offset {base_offset} is out of range")
    pack_head = _RECORD_REST_HEAD.pack
    pack_u32 = _U32.pack
    parts: list[bytes] = []
    append = parts.append
    offset = base_offset
    for record in records:
        key = record.key
        value = record.value
        headers = _encode_headers(record.headers) if record.headers else _ZERO_HEADERS
        if key is None:
            key, key_length = b"", _NULL_LENGTH
        else:
            key_length = len(key)
        value_length = len(value)
        length = RECORD_HEADER_SIZE + 8 + len(key) + value_length + len(headers)
        if length > MAX_FRAME_SIZE:
            raise ValueError(f"record of {length} bytes is too large to store")
        head = pack_head(
            RECORD_MAGIC,
            FORMAT_VERSION,
            0,
            length,
            offset,
            record.timestamp_ms,
            key_length,
            value_length,
        )
        rest = b"".join((head, key, value, headers))
        append(pack_u32(crc32c(rest)))
        append(rest)
        offset += 1
    body = b"".join(parts)
    length = BATCH_HEADER_SIZE + len(body)
    if length > MAX_FRAME_SIZE:
        raise ValueError(f"batch of {length} bytes is too large to store")
    head = _BATCH_REST_HEAD.pack(BATCH_MAGIC, FORMAT_VERSION, 0, length, base_offset, len(records))
    return b"".join((pack_u32(crc32c(body, crc32c(head))), head, body))


encode_batch: Callable[[int, Sequence[Record]], bytes]
try:
    from logbroker.storage._speedups import encode_batch
except ImportError:  # not built: no compiler where this was installed
    encode_batch = encode_batch_python
    BATCH_ENCODER = "python"
else:
    BATCH_ENCODER = "native"


def stamp_batch(batch: bytes, stamp: ProducerStamp) -> bytes:
    """The stamped (version 2) batch of the records of ``batch``, an unstamped batch as
    ``encode_batch`` returns it: its header with the new version and length, the stamp, then
    its record frames unchanged. One CRC32C call over the batch, as the record frames and
    their checksums stay as they are."""
    length = len(batch) + _STAMP.size
    if length > MAX_FRAME_SIZE:
        raise ValueError(f"batch of {length} bytes is too large to store")
    _, _, _, _, _, base_offset, count = _BATCH_HEADER.unpack_from(batch, 0)
    head = _BATCH_REST_HEAD.pack(BATCH_MAGIC, STAMPED_BATCH_VERSION, 0, length, base_offset, count)
    stamp_bytes = _STAMP.pack(stamp.producer_id, stamp.sequence)
    records = memoryview(batch)[BATCH_HEADER_SIZE:]
    crc = crc32c(records, crc32c(stamp_bytes, crc32c(head)))
    return b"".join((_U32.pack(crc), head, stamp_bytes, records))


class DamageReason(StrEnum):
    """Why stored bytes failed verification; the ``reason`` label of the integrity counter."""

    #: The data ends inside a frame. At the tail of an active segment this is an ordinary torn
    #: write from a crash; anywhere else it is damage.
    INCOMPLETE = "incomplete"
    #: A whole frame is present and its checksum does not match.
    CHECKSUM = "checksum"
    #: A frame header is mangled (magic, version, flags or length impossible) with bytes after it.
    HEADER = "header"
    #: A frame checks out but carries the wrong offset: bytes are misplaced.
    SEQUENCE = "sequence"
    #: A sealed copy's size on disk differs from the size its seal recorded.
    SIZE = "size"
    #: A seal marker is unreadable.
    METADATA = "metadata"
    #: A sealed segment's index sidecar is unreadable or unlike its log. Not data damage (the
    #: index is derived from the log): it is rebuilt from the intact log and written again.
    INDEX = "index"


@attrs.frozen
class Damage:
    """The first byte position at which stored data stops verifying, and why."""

    position: int
    reason: DamageReason

    @property
    def torn(self) -> bool:
        """True if this is only a partial write at the end of the data (crash, not rot)."""
        return self.reason is DamageReason.INCOMPLETE


@attrs.frozen
class BatchInfo:
    """Where a verified batch sits in a segment and which offsets it holds."""

    position: int
    length: int
    base_offset: int
    record_count: int
    #: The stamp of the produce that wrote it: set for a stamped (version 2) batch.
    stamp: ProducerStamp | None = None

    @property
    def end(self) -> int:
        return self.position + self.length

    @property
    def records_start(self) -> int:
        """Where its first record frame starts."""
        header = BATCH_HEADER_SIZE if self.stamp is None else STAMPED_BATCH_HEADER_SIZE
        return self.position + header

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count


@attrs.frozen
class Scan:
    """The verified batches found from a start position, and the damage that ended the scan."""

    batches: list[BatchInfo]
    end: int
    damage: Damage | None


def _batch_header_size(magic: bytes, version: int, flags: int, length: int, count: int) -> int:
    """The size of a sane batch header with these fields (the stamp included), or 0 when they
    are not sane."""
    if magic != BATCH_MAGIC or flags != 0 or count < 1:
        return 0
    if version == FORMAT_VERSION:
        header = BATCH_HEADER_SIZE
    elif version == STAMPED_BATCH_VERSION:
        header = STAMPED_BATCH_HEADER_SIZE
    else:
        return 0
    return header if length >= header + count * MIN_RECORD_SIZE else 0


def _record_header_is_sane(magic: bytes, version: int, flags: int, length: int) -> bool:
    return (
        magic == RECORD_MAGIC
        and version == FORMAT_VERSION
        and flags == 0
        and length >= MIN_RECORD_SIZE
    )


def _claimed_records_start(view: memoryview, position: int) -> int:
    """Where the records of a damaged batch at ``position`` start, as its version byte says:
    its checksum cannot vouch for the byte, and a wrong one makes its first record fail."""
    stamped = len(view) > position + 6 and view[position + 6] == STAMPED_BATCH_VERSION
    return position + (STAMPED_BATCH_HEADER_SIZE if stamped else BATCH_HEADER_SIZE)


def _all_zero(view: memoryview) -> bool:
    return view.tobytes().count(0) == len(view)


def _walk_records(
    view: memoryview, position: int, end: int, base_offset: int, count: int
) -> tuple[int, Damage | None]:
    """Check each record frame of a batch; return where the walk stopped and the damage found."""
    for index in range(count):
        if end - position < RECORD_HEADER_SIZE:
            return position, Damage(position, DamageReason.HEADER)
        crc, magic, version, flags, length, offset, _ = _RECORD_HEADER.unpack_from(view, position)
        if not _record_header_is_sane(magic, version, flags, length):
            return position, Damage(position, DamageReason.HEADER)
        if position + length > end:
            return position, Damage(position, DamageReason.HEADER)
        if _frame_crc(view[position : position + length]) != crc:
            return position, Damage(position, DamageReason.CHECKSUM)
        if offset != base_offset + index:
            return position, Damage(position, DamageReason.SEQUENCE)
        position += length
    return position, None


def _locate_damage(view: memoryview, batch: BatchInfo) -> Damage:
    """A batch failed its checksum: find the first record that is wrong, or blame its header."""
    stopped, damage = _walk_records(
        view, batch.records_start, batch.end, batch.base_offset, batch.record_count
    )
    if damage is not None and damage.position >= batch.end:
        # Every record there verifies, and the header claims more: its count is wrong (the
        # next batch, where the walk ran out, is not to blame).
        return Damage(batch.position, DamageReason.HEADER)
    if damage is not None:
        return damage
    if stopped != batch.end:
        return Damage(batch.position, DamageReason.HEADER)
    return Damage(batch.position, DamageReason.CHECKSUM)


def _overlong_batch_damage(view: memoryview, position: int) -> Damage:
    """A batch claims to run past the end of the data: a torn write, or rot?

    A torn write leaves a prefix of what was written, possibly followed by zeros where the file
    grew but its blocks were never written: every record frame before that point is whole and
    valid, and the first one that is not runs into the zeros or past the end of the data. Rot
    leaves evidence a torn write cannot: a whole record, clear of the zeros, that fails its
    checksum or carries the wrong offset; a mangled record header with other bytes after it; or
    (every record whole and valid) a rotted batch length. Only rot in the batch's length and
    also in its very last record can pass for a torn write.
    """
    _, magic, version, flags, length, base_offset, count = _BATCH_HEADER.unpack_from(view, position)
    size = len(view)
    zeros_from = position + len(bytes(view[position:]).rstrip(b"\0"))
    torn = Damage(position, DamageReason.INCOMPLETE)
    record = position + _batch_header_size(magic, version, flags, length, count)
    for index in range(count):
        if size - record < RECORD_HEADER_SIZE or record >= zeros_from:
            return torn
        crc, magic, version, flags, length, offset, _ = _RECORD_HEADER.unpack_from(view, record)
        if not _record_header_is_sane(magic, version, flags, length):
            return (
                torn
                if record + RECORD_HEADER_SIZE > zeros_from
                else Damage(record, DamageReason.HEADER)
            )
        if record + length > size:
            return torn
        if _frame_crc(view[record : record + length]) != crc:
            return torn if record + length > zeros_from else Damage(record, DamageReason.CHECKSUM)
        if offset != base_offset + index:
            return Damage(record, DamageReason.SEQUENCE)
        record += length
    return Damage(position, DamageReason.HEADER)


def scan_batches(
    data: bytes | memoryview, position: int = 0, expected_offset: int | None = None
) -> Scan:
    """Verify the batches in ``data`` from ``position`` on, stopping at the first damage.

    A whole batch is checked with one CRC32C call over all its bytes; only a batch that fails
    is walked record by record to locate the damage. ``expected_offset``, when given, is the
    offset the first batch must start at; each later batch must follow its predecessor.

    An unwritten tail (the rest of the data is zero bytes) and a frame cut short are reported
    as ``INCOMPLETE``; the caller decides whether that is a torn write or damage.
    """
    view = memoryview(data)
    size = len(view)
    batches: list[BatchInfo] = []
    while position < size:
        remaining = view[position:]
        if len(remaining) < BATCH_HEADER_SIZE:
            return Scan(batches, position, Damage(position, DamageReason.INCOMPLETE))
        crc, magic, version, flags, length, base_offset, count = _BATCH_HEADER.unpack_from(
            view, position
        )
        header_size = _batch_header_size(magic, version, flags, length, count)
        if not header_size:
            reason = DamageReason.INCOMPLETE if _all_zero(remaining) else DamageReason.HEADER
            return Scan(batches, position, Damage(position, reason))
        if position + length > size:
            return Scan(batches, position, _overlong_batch_damage(view, position))
        stamp = None
        if header_size != BATCH_HEADER_SIZE:
            stamp = ProducerStamp(*_STAMP.unpack_from(view, position + BATCH_HEADER_SIZE))
        batch = BatchInfo(position, length, base_offset, count, stamp)
        if _frame_crc(view[position : position + length]) != crc:
            return Scan(batches, position, _locate_damage(view, batch))
        if expected_offset is not None and base_offset != expected_offset:
            return Scan(batches, position, Damage(position, DamageReason.SEQUENCE))
        batches.append(batch)
        expected_offset = batch.next_offset
        position += length
    return Scan(batches, position, None)


def verify_records_only(data: bytes | memoryview, position: int = 0) -> Damage | None:
    """Verify every record checksum without using the batch checksums (for comparison and tools)."""
    view = memoryview(data)
    size = len(view)
    while position < size:
        if size - position < BATCH_HEADER_SIZE:
            return Damage(position, DamageReason.INCOMPLETE)
        _, magic, version, flags, length, base_offset, count = _BATCH_HEADER.unpack_from(
            view, position
        )
        header_size = _batch_header_size(magic, version, flags, length, count)
        if not header_size:
            return Damage(position, DamageReason.HEADER)
        if position + length > size:
            return Damage(position, DamageReason.INCOMPLETE)
        stopped, damage = _walk_records(
            view, position + header_size, position + length, base_offset, count
        )
        if damage is not None and damage.position >= position + length:
            return Damage(position, DamageReason.HEADER)  # a count claiming more than is there
        if damage is not None:
            return damage
        if stopped != position + length:
            return Damage(position, DamageReason.HEADER)
        position += length
    return None


def valid_record_offset(data: bytes, position: int) -> int | None:
    """The offset of the record frame at ``position`` if it is whole and passes its checksum."""
    if position < 0 or len(data) - position < RECORD_HEADER_SIZE:
        return None
    crc, magic, version, flags, length, offset, _ = _RECORD_HEADER.unpack_from(data, position)
    if not _record_header_is_sane(magic, version, flags, length):
        return None
    if position + length > len(data):
        return None
    if _frame_crc(memoryview(data)[position : position + length]) != crc:
        return None
    return int(offset)


def batch_claim(data: bytes, position: int, expected_offset: int) -> int | None:
    """The offset after the records a (damaged) batch header claims, if the header is plausible.

    Plausible: a sane header that starts at the offset the stream expects there. Its checksum
    cannot vouch for it (the batch is damaged), so this is only used to skip offsets, never to
    serve data.
    """
    if len(data) - position < BATCH_HEADER_SIZE:
        return None
    _, magic, version, flags, length, base_offset, count = _BATCH_HEADER.unpack_from(data, position)
    if not _batch_header_size(magic, version, flags, length, count):
        return None
    if base_offset != expected_offset:
        return None
    return int(base_offset + count)


def batch_length(data: bytes) -> int | None:
    """The length a batch header at the start of ``data`` claims, if the header is whole."""
    if len(data) < BATCH_HEADER_SIZE:
        return None
    return int(_BATCH_HEADER.unpack_from(data, 0)[4])


def check_batch_records_python(data: bytes, batch: BatchInfo) -> Damage | None:
    """Check every record of a batch on its own: checksum, offset, and fields that decode.

    The batch checksum already vouches for bytes this node wrote; bytes from a peer are checked
    record by record as well, so a buggy or hostile sender cannot plant a record that passes
    the batch checksum but is not what its place in the log says. ``check_batch_records`` is
    the native check (``_speedups.c``) where it was built, with the same result; this one is
    the fallback and its reference.
    """
    view = memoryview(data)
    start = batch.records_start
    stopped, damage = _walk_records(view, start, batch.end, batch.base_offset, batch.record_count)
    if damage is not None:
        return damage
    if stopped != batch.end:
        return Damage(batch.position, DamageReason.HEADER)
    position = start
    for _ in range(batch.record_count):
        (length,) = _U32.unpack_from(view, position + 8)
        try:
            decode_record(view[position : position + length])
        except (ValueError, struct.error):
            return Damage(position, DamageReason.HEADER)
        position += length
    return None


def _check_batch_records_native(data: bytes, batch: BatchInfo) -> Damage | None:
    found = check_records(
        data, batch.position, batch.records_start, batch.end, batch.base_offset, batch.record_count
    )
    if found is None:
        return None
    position, reason = found
    return Damage(position, DamageReason(reason))


check_batch_records: Callable[[bytes, BatchInfo], Damage | None]
try:
    from logbroker.storage._speedups import check_records
except ImportError:  # not built: no compiler where this was installed
    check_batch_records = check_batch_records_python
else:
    # Replicas check every record they receive: in Python this was a quarter of a
    # replicating cluster's reactor time (bench/RESULTS.md, replicated_produce.py).
    check_batch_records = _check_batch_records_native


def _read_nbytes(view: memoryview, position: int) -> tuple[bytes | None, int]:
    (length,) = _U32.unpack_from(view, position)
    position += 4
    if length == _NULL_LENGTH:
        return None, position
    end = position + length
    if end > len(view):
        raise ValueError("field runs past its frame")
    return bytes(view[position:end]), end


def decode_record(frame: memoryview) -> StoredRecord:
    """Decode one record frame whose checksum has already been verified."""
    _, _, _, _, _, offset, timestamp_ms = _RECORD_HEADER.unpack_from(frame, 0)
    key_length, value_length = _LENGTHS.unpack_from(frame, RECORD_HEADER_SIZE)
    position = RECORD_HEADER_SIZE + 8
    key = None
    if key_length != _NULL_LENGTH:
        key = bytes(frame[position : position + key_length])
        position += key_length
    if value_length == _NULL_LENGTH:
        raise ValueError("record value is null")
    value = bytes(frame[position : position + value_length])
    position += value_length
    if position + 4 > len(frame):
        raise ValueError("record fields run past the frame")
    (header_count,) = _U32.unpack_from(frame, position)
    position += 4
    headers = []
    for _ in range(header_count):
        name, position = _read_nbytes(frame, position)
        header_value, position = _read_nbytes(frame, position)
        headers.append((name, header_value))
    if position != len(frame):
        raise ValueError("record fields do not fill the frame")
    return StoredRecord(offset, Record(value, key, timestamp_ms, tuple(headers)))


def iter_batch_records(view: memoryview, batch: BatchInfo) -> Iterator[StoredRecord]:
    """Yield the records of a batch that passed its checksum in ``scan_batches``."""
    return iter_record_frames(view, batch.records_start, batch.end)


def iter_record_frames(view: memoryview, start: int, end: int) -> Iterator[StoredRecord]:
    """Yield the records of the verified record frames filling ``view[start:end]``."""
    position = start
    while position < end:
        (length,) = _U32.unpack_from(view, position + 8)
        yield decode_record(view[position : position + length])
        position += length


def max_record_timestamp(data: bytes | memoryview, batches: Sequence[BatchInfo]) -> int:
    """The largest timestamp among the records of ``batches`` (verified, as ``scan_batches``
    returns them), 0 when there are none."""
    view = memoryview(data)
    unpack = _LENGTH_AND_TIMESTAMP.unpack_from
    largest = 0
    for batch in batches:
        position, end = batch.records_start, batch.end
        while position < end:
            length, timestamp = unpack(view, position)
            if timestamp > largest:
                largest = timestamp
            position += length
    return largest


def iter_valid_records(
    view: memoryview, position: int, end: int, base_offset: int
) -> Iterator[StoredRecord]:
    """Yield the records of a damaged batch that still verify on their own, up to the damage.

    ``base_offset`` is where the batch must start (the batch header itself may be the damage);
    each record must carry the next offset from there and pass its own checksum, and the first
    one that does not ends the walk.
    """
    record_position = _claimed_records_start(view, position)
    index = 0
    while record_position < end:
        stopped, damage = _walk_records(view, record_position, end, base_offset + index, 1)
        if damage is not None:
            return
        yield decode_record(view[record_position:stopped])
        record_position = stopped
        index += 1


# -- sparse index ------------------------------------------------------------------------------
#
#   0  4  CRC32C of bytes [4, end)
#   4  2  magic b"LI"
#   6  1  version (1)
#   7  1  flags (0)
#   8  4  entry count
#   12 8  base offset of the segment
#   20 .  entries: (offset - base offset: u32, byte position of the batch: u32)

INDEX_MAGIC = b"LI"
INDEX_INTERVAL_BYTES = 4096
_INDEX_HEADER = struct.Struct(">I2sBBIQ")
_INDEX_ENTRY = struct.Struct(">II")


@attrs.frozen
class IndexEntry:
    offset: int
    position: int


def encode_index(base_offset: int, entries: Sequence[IndexEntry]) -> bytes:
    buf = bytearray(_INDEX_HEADER.size + _INDEX_ENTRY.size * len(entries))
    for slot, entry in enumerate(entries):
        _INDEX_ENTRY.pack_into(
            buf,
            _INDEX_HEADER.size + slot * _INDEX_ENTRY.size,
            entry.offset - base_offset,
            entry.position,
        )
    _INDEX_HEADER.pack_into(buf, 0, 0, INDEX_MAGIC, FORMAT_VERSION, 0, len(entries), base_offset)
    with memoryview(buf) as view:
        _U32.pack_into(buf, 0, _frame_crc(view))
    return bytes(buf)


def decode_index(data: bytes, base_offset: int) -> list[IndexEntry]:
    """Decode an index sidecar; raise ``ValueError`` if it is not the one for this segment."""
    if len(data) < _INDEX_HEADER.size:
        raise ValueError("index is shorter than its header")
    crc, magic, version, flags, count, stored_base = _INDEX_HEADER.unpack_from(data, 0)
    if magic != INDEX_MAGIC or version != FORMAT_VERSION or flags != 0:
        raise ValueError("index header is not an index header of this format")
    if len(data) != _INDEX_HEADER.size + count * _INDEX_ENTRY.size:
        raise ValueError("index size does not match its entry count")
    if _frame_crc(memoryview(data)) != crc:
        raise ValueError("index checksum does not match")
    if stored_base != base_offset:
        raise ValueError(f"index is for base offset {stored_base}, not {base_offset}")
    return [
        IndexEntry(base_offset + relative, position)
        for relative, position in _INDEX_ENTRY.iter_unpack(data[_INDEX_HEADER.size :])
    ]


# -- seal marker -------------------------------------------------------------------------------
#
#   0  4  CRC32C of bytes [4, 48)
#   4  2  magic b"LS"
#   6  1  version (2; 1 is still read)
#   7  1  flags (0)
#   8  4  reserved (0)
#   12 8  base offset
#   20 8  record count
#   28 8  byte size of the segment file
#   36 8  version 2: the largest record timestamp in the segment (ms)
#         version 1: when this node sealed it (ms since the epoch, node-local; no longer written)
#   44 4  reserved (0)
#
# Every field of a version 2 marker is a function of the sealed segment's bytes, so the marker
# is the same on every copy of it.

SEAL_MAGIC = b"LS"
#: The version of the seal markers this build writes; it reads ``LEGACY_SEAL_VERSION`` too.
SEAL_VERSION = 2
#: Markers of earlier builds, whose timestamp field held a node-local time.
LEGACY_SEAL_VERSION = 1
_SEAL = struct.Struct(">I2sBBIQQQQI")


@attrs.frozen
class Seal:
    """What a seal marker records about a segment that will never change again."""

    base_offset: int
    record_count: int
    byte_size: int
    #: The largest record timestamp in the segment (what retention by age goes by); ``None``
    #: for a version 1 marker, which recorded when this node sealed the segment instead.
    max_timestamp_ms: int | None

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count


def encode_seal(seal: Seal) -> bytes:
    """A version 2 seal marker; ``ValueError`` for a seal without its largest timestamp (only
    a version 1 marker lacks one, and version 1 is no longer written)."""
    if seal.max_timestamp_ms is None:
        raise ValueError("a seal marker records its segment's largest record timestamp")
    buf = bytearray(_SEAL.size)
    _SEAL.pack_into(
        buf,
        0,
        0,
        SEAL_MAGIC,
        SEAL_VERSION,
        0,
        0,
        seal.base_offset,
        seal.record_count,
        seal.byte_size,
        seal.max_timestamp_ms,
        0,
    )
    with memoryview(buf) as view:
        _U32.pack_into(buf, 0, _frame_crc(view))
    return bytes(buf)


def decode_seal(data: bytes) -> Seal:
    """Decode a seal marker of version 2 or 1; raise ``ValueError`` if it is damaged."""
    if len(data) != _SEAL.size:
        raise ValueError(f"seal marker is {len(data)} bytes, not {_SEAL.size}")
    crc, magic, version, flags, reserved, base, count, size, timestamp, tail = _SEAL.unpack(data)
    if (
        magic != SEAL_MAGIC
        or version not in (SEAL_VERSION, LEGACY_SEAL_VERSION)
        or flags != 0
        or reserved
        or tail
    ):
        raise ValueError("seal marker header is not a seal header of this format")
    if _frame_crc(memoryview(data)) != crc:
        raise ValueError("seal marker checksum does not match")
    return Seal(base, count, size, timestamp if version == SEAL_VERSION else None)


# -- epoch marker ------------------------------------------------------------------------------
#
#   0  4  CRC32C of bytes [4, size)
#   4  2  magic b"LE"
#   6  1  version (1 or 2)
#   7  1  flags (0)
#   8  4  reserved (0)
#   12 8  base offset
#   20 8  epoch
#   version 1 (32 bytes):
#   28 4  reserved (0)
#   version 2 (40 bytes):
#   28 8  data epoch
#   36 4  reserved (0)
#
# A marker whose data epoch is its epoch is written as version 1, as every earlier build wrote
# them all: a sealed copy's marker (always so) is then the same bytes whichever build wrote it.

EPOCH_MAGIC = b"LE"
#: The version of the markers whose data epoch differs from their epoch.
EPOCH_VERSION = 2
_EPOCH = struct.Struct(">I2sBBIQQI")
_EPOCH_WITH_DATA = struct.Struct(">I2sBBIQQQI")


@attrs.frozen
class EpochMarker:
    """The replication epoch a segment copy was last fenced or started at (``epoch``), and the
    epoch of the primary whose records its bytes are (``data_epoch``, the epoch itself unless
    given). A fence raises the first without touching the bytes, so the two differ when a copy
    holding an older primary's records is fenced; which records a copy holds is told by the
    second."""

    base_offset: int
    epoch: int
    data_epoch: int = attrs.field()

    @data_epoch.default
    def _same_as_epoch(self) -> int:
        return self.epoch


def encode_epoch(marker: EpochMarker) -> bytes:
    if marker.data_epoch == marker.epoch:
        buf = bytearray(_EPOCH.size)
        _EPOCH.pack_into(
            buf, 0, 0, EPOCH_MAGIC, FORMAT_VERSION, 0, 0, marker.base_offset, marker.epoch, 0
        )
    else:
        buf = bytearray(_EPOCH_WITH_DATA.size)
        _EPOCH_WITH_DATA.pack_into(
            buf,
            0,
            0,
            EPOCH_MAGIC,
            EPOCH_VERSION,
            0,
            0,
            marker.base_offset,
            marker.epoch,
            marker.data_epoch,
            0,
        )
    with memoryview(buf) as view:
        _U32.pack_into(buf, 0, _frame_crc(view))
    return bytes(buf)


def decode_epoch(data: bytes) -> EpochMarker:
    """Decode an epoch marker of version 1 or 2; raise ``ValueError`` if it is damaged."""
    if len(data) == _EPOCH.size:
        crc, magic, version, flags, reserved, base, epoch, tail = _EPOCH.unpack(data)
        data_epoch, expected = epoch, FORMAT_VERSION
    elif len(data) == _EPOCH_WITH_DATA.size:
        crc, magic, version, flags, reserved, base, epoch, data_epoch, tail = (
            _EPOCH_WITH_DATA.unpack(data)
        )
        expected = EPOCH_VERSION
    else:
        raise ValueError(
            f"epoch marker is {len(data)} bytes, not {_EPOCH.size} or {_EPOCH_WITH_DATA.size}"
        )
    if magic != EPOCH_MAGIC or version != expected or flags != 0 or reserved or tail:
        raise ValueError("epoch marker header is not an epoch header of this format")
    if _frame_crc(memoryview(data)) != crc:
        raise ValueError("epoch marker checksum does not match")
    return EpochMarker(base, epoch, data_epoch)
