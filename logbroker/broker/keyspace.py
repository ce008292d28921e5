"""Topics' keyspaces: names, the key hash, and how a keyspace is cut into ranges.

A record's key is hashed to a 32-bit position with CRC32C (the Castagnoli polynomial, as the
``crc32c`` package computes it with start value 0), and the position's top ``keyspace_bits``
bits pick its slot in the topic's keyspace of ``2 ** keyspace_bits`` slots. A range owns the
slots ``[start, end)``; taking the top bits keeps every range a contiguous run of hash values, so a
range can later be split in two without moving keys between unrelated ranges. Records with the
same key always land in the same range, which is what orders them. Keyless records are spread
round-robin over the topic's active ranges by the broker.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from crc32c import crc32c

from logbroker.controlplane import MAX_KEYSPACE_BITS, valid_name
from logbroker.records import Record, WireRecords
from logbroker.wire import decode_wire_records, encode_wire_records

_Shares = list[tuple[int, int, bytes, int]]
_split_native: Callable[[bytes, int, int, Sequence[int], int], _Shares | None] | None
try:
    # In the storage extension, beside the CRC32C it hashes keys with.
    from logbroker.storage._speedups import split_wire_records as _split_native
except ImportError:  # not built: no compiler where this was installed
    _split_native = None

DEFAULT_KEYSPACE_BITS = 8


def valid_topic_name(name: str | None) -> bool:
    """Whether a request's topic name is present and valid (the rule is the control plane's
    ``valid_name``: names become directory names)."""
    return name is not None and valid_name(name)


def keyspace_bits(requested: int) -> int | None:
    """The keyspace bits a ``create_topic`` asks for: 0 means the default (8), 1 to 32 are taken
    as given; anything else is ``None`` (the request is refused)."""
    if requested == 0:
        return DEFAULT_KEYSPACE_BITS
    if 1 <= requested <= MAX_KEYSPACE_BITS:
        return requested
    return None


def key_hash(key: bytes) -> int:
    """The key's 32-bit position: CRC32C of its bytes."""
    return int(crc32c(key))


def key_slot(key: bytes, bits: int) -> int:
    """The slot of ``key`` in a keyspace of ``2 ** bits`` slots: the hash's top ``bits`` bits."""
    return key_hash(key) >> (32 - bits)


def split_keyspace(bits: int, count: int) -> list[tuple[int, int]]:
    """Cut ``2 ** bits`` slots into ``min(count, 2 ** bits)`` contiguous ``[start, end)`` runs
    whose sizes differ by at most one slot."""
    if count < 1:
        raise ValueError(f"a keyspace is cut into at least one range, not {count}")
    slots = 1 << bits
    count = min(count, slots)
    return [(slots * index // count, slots * (index + 1) // count) for index in range(count)]


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
