"""Cursors: where a consumer is, as an opaque string it hands back.

A cursor is the base64url (no padding) of a versioned binary::

    version:u8 (1)  count:u16  (range_id_len:u16 range_id[range_id_len] next_offset:u64)*

one entry per range of the topic the consumer has a position in, in range id order. Decoding is
strict and size-capped: anything but a cursor this build writes (wrong version, bad base64,
duplicated or unordered ranges, bytes left over, longer than ``MAX_CURSOR_LENGTH``) is refused, and
the broker answers ``invalid_cursor``. Offsets are range-relative and stored with the data, so a
cursor stays valid across restarts.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from collections.abc import Mapping

import attrs

CURSOR_VERSION = 1
#: Characters of an encoded cursor: enough for the most a topic can have, 64 ranges with ids of
#: 254 characters (a 249-character topic name, a dot and a range number), about 22,600.
MAX_CURSOR_LENGTH = 32768
_HEAD = struct.Struct(">BH")
_OFFSET = struct.Struct(">Q")
_NAME_LENGTH = struct.Struct(">H")
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")


class InvalidCursorError(ValueError):
    """The string is not a cursor this broker wrote."""


def _sorted_positions(positions: Mapping[str, int]) -> dict[str, int]:
    return dict(sorted(positions.items()))


@attrs.frozen
class Cursor:
    """The next offset to read in each range (ranges missing from it start at their start)."""

    positions: Mapping[str, int] = attrs.field(converter=_sorted_positions)

    def encode(self) -> str:
        parts = [_HEAD.pack(CURSOR_VERSION, len(self.positions))]
        for range_id, offset in self.positions.items():
            name = range_id.encode("ascii")
            parts.append(_NAME_LENGTH.pack(len(name)) + name + _OFFSET.pack(offset))
        return base64.urlsafe_b64encode(b"".join(parts)).rstrip(b"=").decode("ascii")

    @classmethod
    def decode(cls, text: str) -> Cursor:
        if len(text) > MAX_CURSOR_LENGTH:
            raise InvalidCursorError(f"cursor of {len(text)} characters is too long")
        if not _BASE64URL.fullmatch(text):
            raise InvalidCursorError("cursor is not base64url")
        try:
            data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            raise InvalidCursorError("cursor is not base64url") from None
        if len(data) < _HEAD.size:
            raise InvalidCursorError("cursor is too short")
        version, count = _HEAD.unpack_from(data, 0)
        if version != CURSOR_VERSION:
            raise InvalidCursorError(f"cursor version {version} is not {CURSOR_VERSION}")
        position = _HEAD.size
        positions: dict[str, int] = {}
        previous = ""
        for _ in range(count):
            if position + _NAME_LENGTH.size > len(data):
                raise InvalidCursorError("cursor is cut short")
            (size,) = _NAME_LENGTH.unpack_from(data, position)
            name_start = position + _NAME_LENGTH.size
            end = name_start + size + _OFFSET.size
            if size == 0 or end > len(data):
                raise InvalidCursorError("cursor is cut short")
            try:
                range_id = data[name_start : name_start + size].decode("ascii")
            except UnicodeDecodeError:
                raise InvalidCursorError("cursor names a range that is not ASCII") from None
            if range_id <= previous:
                raise InvalidCursorError("cursor ranges are repeated or out of order")
            (offset,) = _OFFSET.unpack_from(data, end - _OFFSET.size)
            positions[range_id] = offset
            previous = range_id
            position = end
        if position != len(data):
            raise InvalidCursorError("cursor has bytes left over")
        cursor = cls(positions)
        if cursor.encode() != text:
            # Base64 has more than one spelling of some bytes; only the one this code writes is a
            # cursor, so every cursor has exactly one form (and compares equal as a string).
            raise InvalidCursorError("cursor is not in its canonical form")
        return cursor
