"""Topics' keyspaces: names, and how a keyspace is cut into ranges.

A range owns the slots ``[start, end)`` of its topic's keyspace of ``2 ** keyspace_bits``
slots; which slot a record's key takes, and so its range, is ``logbroker.key_routing``'s.
"""

from __future__ import annotations

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


def split_keyspace(bits: int, count: int) -> list[tuple[int, int]]:
    """Cut ``2 ** bits`` slots into ``min(count, 2 ** bits)`` contiguous ``[start, end)`` runs
    whose sizes differ by at most one slot."""
    if count < 1:
        raise ValueError(f"a keyspace is cut into at least one range, not {count}")
    slots = 1 << bits
    count = min(count, slots)
    return [(slots * index // count, slots * (index + 1) // count) for index in range(count)]
