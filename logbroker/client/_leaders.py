"""Where a client sends a produce's records: to the node leading each range, as ``topic_leaders``
named it, so that no node forwards them. Pure: it cuts records into one share per leader with
the broker's own routing (``logbroker.key_routing``); the clients send the shares."""

from __future__ import annotations

import itertools

import attrs

from logbroker import wire
from logbroker.key_routing import split_records, stamp_range
from logbroker.records import ProducerStamp, WireRecords


@attrs.frozen
class LeaderMap:
    """A topic's active ranges and their leaders, as one ``topic_leaders`` answer gave them."""

    keyspace_bits: int
    #: Each active range's first slot, ascending from 0.
    starts: tuple[int, ...]
    #: Each range's leader, by its number in ``starts``; None where the answer named none.
    leaders: tuple[str | None, ...]
    #: Where each leader takes clients: ``(host, client port)``.
    addresses: dict[str, tuple[str, int]] = attrs.field(eq=False)

    @classmethod
    def of(cls, info: wire.LeadersInfo) -> LeaderMap:
        """The map of an answer; ``wire.ProtocolViolation`` if its ranges do not tile the
        keyspace from slot 0 in order, or name a leader with no address."""
        ranges = info.ranges
        slots = 1 << info.keyspace_bits if 1 <= info.keyspace_bits <= 32 else 0
        if not ranges or ranges[0].start != 0 or ranges[-1].end != slots:
            raise wire.ProtocolViolation(
                f"topic_leaders: {len(ranges)} ranges do not cover a keyspace of"
                f" {info.keyspace_bits} bits"
            )
        for before, after in itertools.pairwise(ranges):
            if before.end != after.start or after.start <= before.start:
                raise wire.ProtocolViolation(
                    f"topic_leaders: range {after.range_id} does not follow {before.range_id}"
                )
        addresses = {node.node_id: (node.host, node.client_port) for node in info.nodes}
        missing = {entry.leader for entry in ranges if entry.leader is not None} - set(addresses)
        if missing:
            raise wire.ProtocolViolation(f"topic_leaders: no address for {sorted(missing)}")
        return cls(
            info.keyspace_bits,
            tuple(entry.start for entry in ranges),
            tuple(entry.leader for entry in ranges),
            addresses,
        )

    def shares(
        self, records: WireRecords, stamp: ProducerStamp | None, keyless_turn: int = 0
    ) -> list[tuple[str | None, WireRecords]]:
        """``records`` cut into one share per leader (None: the ranges no node leads now, for
        any node to take), each holding its ranges' records in the order they came. Keyless
        records go where the broker would send them: with ``stamp``, to the range of the
        stamp's slot; without, to range ``keyless_turn`` (modulo the ranges), which the caller
        turns from produce to produce."""
        if stamp is None:
            keyless = keyless_turn % len(self.starts)
        else:
            keyless = stamp_range(stamp, self.keyspace_bits, self.starts)
        by_leader: dict[str | None, list[WireRecords]] = {}
        for index, share in split_records(records, self.keyspace_bits, self.starts, keyless):
            by_leader.setdefault(self.leaders[index], []).append(share)
        return [(leader, joined_records(parts)) for leader, parts in by_leader.items()]


def joined_records(parts: list[WireRecords]) -> WireRecords:
    """The records of ``parts``, one after the other."""
    if len(parts) == 1:
        return parts[0]
    return WireRecords(
        sum(part.count for part in parts),
        b"".join(part.data for part in parts),
        sum(part.size for part in parts),
    )
