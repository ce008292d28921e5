"""The bridge between the two codecs: stored records to the client protocol's record encoding,
without building record objects.

A fetch answers with records in the wire encoding (``logbroker.wire``); the log stores them in
its own frames (``logbroker.storage``). Neither codec knows the other, so the translation lives
here, on their public functions. ``wire_records`` turns the record frames of a verified batch
straight into wire records: the native version where it was built (compiled into the storage
extension, ``logbroker/storage/_speedups.c``, which already walks these frames), else
``wire_records_python``, its reference, which the tests hold it to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs

from logbroker.records import Record, Records, StoredRecord, WireRecords
from logbroker.storage import FramedRecords, encode_batch, iter_record_frames
from logbroker.wire import decode_wire_records, encode_record

#: ``(data, start, end, first_offset, max_records, max_bytes)`` ->
#: ``(wire bytes, records, last offset + 1 or first_offset, key and value bytes)``
Transcoder = Callable[[memoryview, int, int, int, int, int], tuple[bytes, int, int, int]]


def encode_stored(
    records: Iterable[StoredRecord], first_offset: int, max_records: int, max_bytes: int
) -> tuple[bytes, int, int, int]:
    """Wire-encode ``records`` from ``first_offset`` on, at most ``max_records``, stopping
    once ``max_bytes`` of keys and values are taken (at least one record)."""
    parts: list[bytes] = []
    taken = 0
    next_offset = first_offset
    for stored in records:
        if stored.offset < first_offset:
            continue
        if len(parts) >= max_records or (parts and taken >= max_bytes):
            break
        record = stored.record
        parts.append(encode_record(record))
        taken += len(record.value) + len(record.key or b"")
        next_offset = stored.offset + 1
    return b"".join(parts), len(parts), next_offset, taken


def wire_records_python(
    data: memoryview, start: int, end: int, first_offset: int, max_records: int, max_bytes: int
) -> tuple[bytes, int, int, int]:
    """The record frames in ``data[start:end]`` (a verified batch's) as wire records."""
    return encode_stored(iter_record_frames(data, start, end), first_offset, max_records, max_bytes)


wire_records: Transcoder
try:
    from logbroker.storage._speedups import wire_records
except ImportError:  # not built
    wire_records = wire_records_python


#: ``(base_offset, data, count)`` -> the batch frame, or None where ``data`` is not exactly
#: ``count`` valid records.
_Framer = Callable[[int, bytes, int], bytes | None]
_frame_native: _Framer | None
try:
    from logbroker.storage._speedups import frame_wire_records as _frame_native
except ImportError:  # not built
    _frame_native = None


def frame_wire_records(base_offset: int, records: WireRecords) -> bytes:
    """The batch frame of ``records``, the first taking ``base_offset``: the bytes
    ``encode_batch`` gives for the same records as objects, made straight from their wire
    bytes by the native framer where it was built."""
    if _frame_native is not None:
        framed = _frame_native(base_offset, records.data, records.count)
        if framed is not None:
            return framed
    return frame_wire_records_python(base_offset, records)


def frame_wire_records_python(base_offset: int, records: WireRecords) -> bytes:
    return encode_batch(base_offset, decode_wire_records(records))


@attrs.frozen
class WireBatch(FramedRecords):
    """A produce's records as the log takes them: framed from their wire bytes once the log
    gives them their offsets."""

    records: WireRecords

    def __len__(self) -> int:
        return self.records.count

    def frame(self, base_offset: int) -> bytes:
        return frame_wire_records(base_offset, self.records)


def storable(records: Records) -> Sequence[Record] | FramedRecords:
    """``records`` as ``RangeLog.write`` and ``append`` take them."""
    return WireBatch(records) if isinstance(records, WireRecords) else records
