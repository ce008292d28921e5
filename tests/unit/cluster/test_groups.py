"""Consumer groups in a cluster: one coordinator per group, whichever node a member uses."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock

from logbroker.broker.errors import BrokerError
from logbroker.broker.groups import LocalGroups
from logbroker.cluster.groups import ClusterGroups, group_handler
from logbroker.errors import Reason
from logbroker.peer.frames import PeerOp
from logbroker.peer.window import PeerError
from logbroker.placement import PlacementNode
from tests.unit.storage.helpers import failure_of, result_of

RANGES = [f"t.{i}" for i in range(8)]
NODES = ["n1", "n2", "n3"]


class Network:
    """Peer requests handed straight to the addressed node's GROUP handler."""

    def __init__(self, clock: Clock) -> None:
        self.down: set[str] = set()
        self.local = {node: LocalGroups(clock, 30_000) for node in NODES}
        self.handlers = {node: group_handler(groups) for node, groups in self.local.items()}

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        assert op is PeerOp.GROUP
        if node_id in self.down:
            return fail(PeerError("unreachable", f"{node_id} is down"))
        return self.handlers[node_id](payload)

    def node(self, node_id: str) -> ClusterGroups:
        def live() -> list[PlacementNode]:
            return [PlacementNode(n) for n in NODES]

        return ClusterGroups(node_id, self.local[node_id], live, self)


def test_members_on_different_nodes_get_disjoint_shares_covering_every_range() -> None:
    network = Network(Clock())
    nodes = {node: network.node(node) for node in NODES}
    members = {"m1": "n1", "m2": "n2", "m3": "n3"}
    for member, node in members.items():
        result_of(nodes[node].share("t", "g", member, RANGES))

    shares = {m: result_of(nodes[n].share("t", "g", m, RANGES)) for m, n in members.items()}

    assert sorted(r for share in shares.values() for r in share) == RANGES
    assert all(share for share in shares.values())
    coordinator = nodes["n1"].coordinator("t", "g")
    assert all(node.coordinator("t", "g") == coordinator for node in nodes.values())
    assert sum(1 for groups in network.local.values() if groups._groups) == 1


def test_a_member_that_leaves_through_any_node_gives_its_ranges_back() -> None:
    network = Network(Clock())
    n1, n2 = network.node("n1"), network.node("n2")
    result_of(n1.share("t", "g", "m1", RANGES))
    result_of(n2.share("t", "g", "m2", RANGES))

    n2.leave("t", "g", "m2")

    assert result_of(n1.share("t", "g", "m1", RANGES)) == RANGES


def test_an_unreachable_coordinator_makes_a_group_fetch_unreachable() -> None:
    network = Network(Clock())
    nodes = {node: network.node(node) for node in NODES}
    coordinator = nodes["n1"].coordinator("t", "g")
    other = next(node for node in NODES if node != coordinator)
    network.down.add(coordinator)

    error: Any = failure_of(nodes[other].share("t", "g", "m1", RANGES)).value

    assert isinstance(error, BrokerError)
    assert error.reason is Reason.UNREACHABLE
    assert coordinator in error.detail
    nodes[other].touch("t", "g", "m1")  # told later; never fails the caller
