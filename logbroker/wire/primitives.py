"""The protocol's primitive fields: big-endian integers, nullable strings and records; shared
with the peer codec (``logbroker.peer.frames``), which frames its own messages from them.

``str = 0x00 (null) | 0x01 len:u32 bytes``: null and empty are distinct.
``record = str(key) value_len:u32 value timestamp_ms:u64 header_count:u32 (str(k) str(v))*``.

``Reader`` raises ``Truncated`` when a field runs past the payload or is invalid; the message
decoders turn that into a ``malformed_request`` (or, on the client side, a protocol error).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

from logbroker.records import Record, Records, WireRecords

_read_records_native: Callable[..., tuple[tuple[Record, ...], int] | None] | None
_scan_wire_records_native: Callable[[bytes, int, int], tuple[int, int] | None] | None
try:
    from logbroker.wire._speedups import read_records as _read_records_native
    from logbroker.wire._speedups import scan_wire_records as _scan_wire_records_native
except ImportError:  # not built: no compiler where this was installed
    _read_records_native = _scan_wire_records_native = None
    RECORD_DECODER = "python"
else:
    RECORD_DECODER = "native"

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_TIMESTAMP_COUNT = struct.Struct(">QI")
_VALUE_HEAD = struct.Struct(">I")
_NULL = b"\x00"
_PRESENT = 0x01
MAX_U32 = 0xFFFFFFFF


class Truncated(ValueError):
    """A field runs past the end of the payload, or its bytes are not a valid encoding."""


class Reader:
    """Reads fields from one payload, front to back."""

    __slots__ = ("_data", "_position")

    def __init__(self, data: bytes, position: int = 0) -> None:
        self._data = data
        self._position = position

    @property
    def remaining(self) -> int:
        return len(self._data) - self._position

    def _take(self, size: int) -> int:
        start = self._position
        if len(self._data) - start < size:
            raise Truncated(f"needs {size} bytes at byte {start}, has {len(self._data) - start}")
        self._position = start + size
        return start

    def u8(self) -> int:
        return int(_U8.unpack_from(self._data, self._take(1))[0])

    def u16(self) -> int:
        return int(_U16.unpack_from(self._data, self._take(2))[0])

    def u32(self) -> int:
        return int(_U32.unpack_from(self._data, self._take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack_from(self._data, self._take(8))[0])

    def raw(self, size: int) -> bytes:
        start = self._take(size)
        return self._data[start : start + size]

    def string(self) -> bytes | None:
        """A nullable byte string."""
        data = self._data
        start = self._position
        # The usual case (a present string that fits) in one ``struct`` call; anything else,
        # and every error, by the field-by-field path below.
        if len(data) - start >= 5 and data[start] == _PRESENT:
            end = start + 5 + _U32.unpack_from(data, start + 1)[0]
            if end <= len(data):
                self._position = end
                return data[start + 5 : end]
        marker = self.u8()
        if marker == 0:
            return None
        if marker != _PRESENT:
            raise Truncated(f"string marker {marker:#04x} is neither 0x00 (null) nor 0x01")
        return self.raw(self.u32())

    def text(self) -> str | None:
        """A nullable string that names something (a topic, a user, a cursor...), as text.

        The protocol's strings are bytes: bytes that are not UTF-8 are kept (as lone
        surrogates, ``surrogateescape``) rather than refused here, so that whoever checks the
        name refuses it for what it is (``invalid_topic_name``, ``invalid_cursor``...), and
        ``text`` writes the same bytes back."""
        data = self.string()
        if data is None:
            return None
        return data.decode("utf-8", "surrogateescape")

    def record(self) -> Record:
        """One record. The produce hot path: the common shape (a key or none, no headers) is
        read with two ``struct`` calls and no method calls; anything else takes the general
        field-by-field path."""
        data = self._data
        start = self._position
        size = len(data)
        if start < size and data[start] == 0x00:
            key = None
            position = start + 1
        elif start + 5 <= size and data[start] == _PRESENT:
            (key_length,) = _U32.unpack_from(data, start + 1)
            position = start + 5 + key_length
            if position > size:
                return self._record_slowly()
            key = data[start + 5 : position]
        else:
            return self._record_slowly()
        if position + 4 > size:
            return self._record_slowly()
        (value_length,) = _U32.unpack_from(data, position)
        value_end = position + 4 + value_length
        if value_end + 12 > size:
            return self._record_slowly()
        timestamp_ms, count = _TIMESTAMP_COUNT.unpack_from(data, value_end)
        if count:
            return self._record_slowly()
        self._position = value_end + 12
        return Record(data[position + 4 : value_end], key, timestamp_ms)

    def records(self, count: int) -> tuple[Record, ...]:
        """``count`` records, one after the other: decoded by the native decoder
        (``_speedups.c``) where it was built, which reads the same records as ``record`` (its
        reference) does; an encoding it does not take is read again by ``record``, which says
        what is wrong with it."""
        if _read_records_native is not None:
            found = _read_records_native(Record, self._data, self._position, count)
            if found is not None:
                records, self._position = found
                return records
        return tuple(self.record() for _ in range(count))

    def wire_records(self, count: int) -> WireRecords:
        """``count`` records, checked as ``records`` reads them, but kept as the bytes they
        are (the produce path): checked by the native scan (``_speedups.c``) where it was
        built; bytes it does not take are read by ``records``, which says what is wrong."""
        start = self._position
        if _scan_wire_records_native is not None:
            found = _scan_wire_records_native(self._data, start, count)
            if found is not None:
                self._position, size = found
                return WireRecords(count, bytes(self._data[start : self._position]), size)
        size = sum(len(record.value) + len(record.key or b"") for record in self.records(count))
        return WireRecords(count, bytes(self._data[start : self._position]), size)

    def _record_slowly(self) -> Record:
        key = self.string()
        value = self.raw(self.u32())
        timestamp_ms = self.u64()
        count = self.u32()
        # Every header takes at least two bytes (two null strings): a count the payload cannot
        # hold is refused before any list is built for it.
        if count * 2 > self.remaining:
            raise Truncated(f"{count} headers cannot fit in {self.remaining} bytes")
        headers = tuple((self.string(), self.string()) for _ in range(count))
        return Record(value, key, timestamp_ms, headers)

    def end(self) -> None:
        """The payload must be read exactly to its end."""
        if self._position != len(self._data):
            raise Truncated(f"{len(self._data) - self._position} bytes left after the payload")


def u8(value: int) -> bytes:
    return _U8.pack(value)


def u16(value: int) -> bytes:
    return _U16.pack(value)


def u32(value: int) -> bytes:
    return _U32.pack(value)


def u64(value: int) -> bytes:
    return _U64.pack(value)


def string(value: bytes | None) -> bytes:
    if value is None:
        return _NULL
    return b"\x01" + _U32.pack(len(value)) + value


def text(value: str | None) -> bytes:
    return string(None if value is None else value.encode("utf-8", "surrogateescape"))


def wire_records(records: Records) -> WireRecords:
    """``records`` in the client protocol's encoding: encoded, if they are objects."""
    if isinstance(records, WireRecords):
        return records
    return encode_wire_records(records)


def encode_wire_records(records: Sequence[Record]) -> WireRecords:
    size = sum(len(record.value) + len(record.key or b"") for record in records)
    return WireRecords(len(records), b"".join([record(each) for each in records]), size)


def decode_wire_records(records: WireRecords) -> tuple[Record, ...]:
    """The records ``records`` holds, as objects."""
    reader = Reader(records.data)
    decoded = reader.records(records.count)
    reader.end()
    return decoded


def record(value: Record) -> bytes:
    parts = [
        string(value.key),
        _VALUE_HEAD.pack(len(value.value)),
        value.value,
        _U64.pack(value.timestamp_ms),
        _U32.pack(len(value.headers)),
    ]
    for name, header_value in value.headers:
        parts.append(string(name))
        parts.append(string(header_value))
    return b"".join(parts)
