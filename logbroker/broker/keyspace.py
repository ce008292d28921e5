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

from crc32c import crc32c

from logbroker.controlplane import MAX_KEYSPACE_BITS, valid_name

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
