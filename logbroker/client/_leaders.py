"""Where a client sends a produce's records: to the node leading each range, as ``topic_leaders``
named it, so that no node forwards them. Pure: it cuts records into one share per leader with
the broker's own routing (``logbroker.key_routing``); the clients send the shares."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import attrs

from logbroker import wire
from logbroker.client._errors import BrokerRefused, ConnectionClosed
from logbroker.client._retry import RETRIED_REASONS
from logbroker.errors import Reason
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


#: A share not acknowledged: its records, the error, and whether a retry may cure it.
ShareFailure = tuple[WireRecords, Exception, bool]


def share_failure(share: WireRecords, error: Exception) -> ShareFailure:
    """``share`` failed with ``error``: a refusal a retry with the same stamp may cure
    (``not_primary``...), or a connection's failure (the next try goes elsewhere)."""
    if isinstance(error, BrokerRefused):
        return share, error, error.reason in RETRIED_REASONS
    return share, error, True


class SharesFailed(Exception):
    """Some shares of a produce were not acknowledged: ``records`` are theirs, ``error`` the
    one to raise (one no retry cures, if there is one), ``retried`` whether a retry may cure
    every failure."""

    def __init__(self, failures: Sequence[ShareFailure]) -> None:
        error, _ = min(((error, cured) for _, error, cured in failures), key=lambda f: f[1])
        super().__init__(str(error))
        self.records = joined_records([records for records, _, _ in failures])
        self.error = error
        self.retried = all(cured for _, _, cured in failures)


class Routes:
    """What a cluster client knows of where to send, with no I/O: its servers, taken in turn
    for the connection used for everything but produces, and each topic's leaders."""

    def __init__(self, servers: Sequence[tuple[str, int]]) -> None:
        if not servers:
            raise ValueError("a cluster client needs at least one server")
        self._servers = list(servers)
        #: The server to try next.
        self._next = 0
        #: The last ``topic_leaders`` answer of each topic produced to.
        self._maps: dict[str, LeaderMap] = {}
        #: False once a broker said it does not know ``topic_leaders``.
        self.routes = True
        self._keyless_turns = itertools.count()

    def servers_in_turn(self) -> Iterator[tuple[str, int]]:
        """Every server once, from the one after the last taken: stopping at one that answers
        leaves the next connection to start after it."""
        for _ in self._servers:
            server = self._servers[self._next]
            self._next = (self._next + 1) % len(self._servers)
            yield server

    @staticmethod
    def none_answered(failures: Sequence[str]) -> ConnectionClosed:
        return ConnectionClosed(f"no server of the cluster answered ({'; '.join(failures)})")

    def known(self, topic: str) -> LeaderMap | None:
        return self._maps.get(topic)

    def learned(self, topic: str, info: wire.LeadersInfo) -> LeaderMap:
        leader_map = self._maps[topic] = LeaderMap.of(info)
        return leader_map

    def forget(self, topic: str) -> None:
        """Ask the topic's leaders again before its next produce."""
        self._maps.pop(topic, None)

    def refused(self, refusal: BrokerRefused) -> None:
        """``topic_leaders`` was refused: raise it, unless the broker does not know the
        request (older than the client), after which every produce goes whole to the node."""
        if refusal.reason != Reason.UNKNOWN_API_KEY:
            raise refusal
        self.routes = False

    def keyless_turn(self) -> int:
        """The next produce's turn: where its keyless records go without a stamp."""
        return next(self._keyless_turns)

    @staticmethod
    def shares(
        leader_map: LeaderMap | None, records: WireRecords, stamp: ProducerStamp, turn: int
    ) -> list[tuple[str | None, WireRecords]]:
        """The shares to send, by leader: all of ``records`` to the node (None) without a map."""
        if leader_map is None:
            return [(None, records)]
        return leader_map.shares(records, stamp, turn)
