"""What ``topic_leaders`` answers: a topic's active ranges in slot order, the node leading each
one now, and where clients reach those nodes, so that a client sends each range's records
straight to its leader instead of through a node that forwards them (docs/protocol.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from logbroker import wire
from logbroker.controlplane import Range

if TYPE_CHECKING:
    from logbroker.cluster.view import ClusterStatus


def leaders_info(
    keyspace_bits: int,
    active: Sequence[Range],
    leader_of: Callable[[str], str | None],
    status: ClusterStatus | None,
) -> wire.LeadersInfo:
    """``active`` (the topic's active ranges, in slot order) with their leaders as
    ``leader_of`` names them. A leader this node does not see alive, or whose address it does
    not know, is left out (``None``): the client sends that range's records to any node, which
    forwards them once a node leads the range again."""
    alive = {} if status is None else {node.node_id: node for node in status.nodes if node.alive}
    ranges = []
    for range_ in active:
        leader = leader_of(range_.range_id)
        ranges.append(
            wire.RangeLeader(
                range_.range_id, range_.start, range_.end, leader if leader in alive else None
            )
        )
    leading = sorted({entry.leader for entry in ranges if entry.leader is not None})
    nodes = tuple(
        wire.LeaderAddress(node_id, alive[node_id].record.host, alive[node_id].record.client_port)
        for node_id in leading
    )
    return wire.LeadersInfo(keyspace_bits, tuple(ranges), nodes)
