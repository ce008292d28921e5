"""Which range a record goes to, as the broker routes it and as a client that sends each range's
records to its leader routes them too.

A record's key is hashed to a 32-bit position with CRC32C (the Castagnoli polynomial, as the
``crc32c`` package computes it with start value 0), and the position's top ``keyspace_bits``
bits pick its slot in the topic's keyspace of ``2 ** keyspace_bits`` slots. A range owns the
slots ``[start, end)``; taking the top bits keeps every range a contiguous run of hash values, so a
range can later be split in two without moving keys between unrelated ranges. Records with the
same key always land in the same range, which is what orders them. Keyless records are spread
round-robin over the topic's active ranges by the broker (those of a stamped produce go to the
range of the stamp's slot).
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Sequence

from crc32c import crc32c

from logbroker.records import ProducerStamp, Record, WireRecords
from logbroker.wire import decode_wire_records, encode_wire_records

_STAMP = struct.Struct(">QQ")
_Shares = list[tuple[int, int, bytes, int]]
_split_native: Callable[[bytes, int, int, Sequence[int], int], _Shares | None] | None
try:
    # In the storage extension, beside the CRC32C it hashes keys with.
    from logbroker.storage._speedups import split_wire_records as _split_native
except ImportError:  # not built: no compiler where this was installed
    _split_native = None


def key_hash(key: bytes) -> int:
    """The key's 32-bit position: CRC32C of its bytes."""
    return int(crc32c(key))


def key_slot(key: bytes, bits: int) -> int:
    """The slot of ``key`` in a keyspace of ``2 ** bits`` slots: the hash's top ``bits`` bits."""
    return key_hash(key) >> (32 - bits)


def stamp_range(stamp: ProducerStamp, bits: int, starts: Sequence[int]) -> int:
    """The range number (of ``starts``, as ``split_records`` takes them) that the keyless
    records of a produce stamped ``stamp`` go to: the range of the slot of the stamp's 16 bytes
    taken as a key, so that a retry of the produce sends them to the same range as its first
    try, which knows the stamp."""
    slot = key_slot(_STAMP.pack(stamp.producer_id, stamp.sequence), bits)
    return bisect.bisect_right(starts, slot) - 1


def split_records(
    records: WireRecords, bits: int, starts: Sequence[int], keyless: int
) -> list[tuple[int, WireRecords]]:
    """Cut a produce's records into their ranges' shares: a keyed record goes to the range
    whose first slot (``starts``: the topic's active ranges', ascending from 0) is the last at
    or below its key's slot, a keyless one to range number ``keyless``. Each range that takes
    records comes with its number, in range order, and its records in the order they came.

    Done in one native pass over the bytes where the extension was built
    (``split_wire_records``), else by ``split_records_python``, its reference."""
    if _split_native is not None:
        shares = _split_native(records.data, records.count, bits, starts, keyless)
        if shares is not None:
            return [(index, WireRecords(count, data, size)) for index, count, data, size in shares]
    return split_records_python(records, bits, starts, keyless)


def split_records_python(
    records: WireRecords, bits: int, starts: Sequence[int], keyless: int
) -> list[tuple[int, WireRecords]]:
    shares: dict[int, list[Record]] = {}
    for record in decode_wire_records(records):
        if record.key is None:
            owner = keyless
        else:
            owner = bisect.bisect_right(starts, key_slot(record.key, bits)) - 1
        shares.setdefault(owner, []).append(record)
    return [(index, encode_wire_records(shares[index])) for index in sorted(shares)]
