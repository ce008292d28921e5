"""What an operator sees of the cluster: every node, alive or not, and who does what.

``ClusterView.status()`` is read by the operator surfaces (``logbroker cluster status``, the
dashboard's page and ``/metrics``); it is computed from the member list and the control plane at
the moment it is asked for. A single node is a cluster of one (``SingleNodeView``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

import attrs

from logbroker.cluster.membership import Membership, NodeRecord
from logbroker.controlplane import ControlPlane, ControlPlaneClosedError, SegmentState
from logbroker.placement import PlacementNode, PlacementRule, domain_violations


class ControlPlaneKind(StrEnum):
    LOCAL = "local"
    ETCD = "etcd"


@attrs.frozen
class ClusterNode:
    record: NodeRecord
    alive: bool
    #: Active segments whose primary this node is.
    segments_led: int

    @property
    def node_id(self) -> str:
        return self.record.node_id


@attrs.frozen
class ClusterStatus:
    cluster_id: str
    #: The node answering.
    node_id: str
    control_plane: ControlPlaneKind
    nodes: tuple[ClusterNode, ...]
    #: The node holding the cluster-chores lease, if one does.
    chores_holder: str | None
    #: Segments whose replica set misses its spread (``svc_domain_violations``).
    domain_violations: int
    #: Seconds since etcd last renewed this node's lease; None on one node or without a lease.
    lease_age_seconds: float | None
    #: Segments with fewer whole copies on live nodes than the replication factor
    #: (``svc_under_replicated_segments``); 0 without replication, None until this node has
    #: first counted them (it asks every live node what it lacks).
    under_replicated: int | None = 0
    #: Ranges whose active segment has too few live replicas for a quorum, so that no node
    #: leads them (``svc_unavailable_ranges``); like ``under_replicated``, None until counted.
    unavailable_ranges: int | None = 0


class ClusterView(Protocol):
    def status(self) -> ClusterStatus: ...


def _replica_sets(control: ControlPlane) -> list[tuple[str, ...]]:
    """The replica set of every active segment the control plane records."""
    try:
        topics = control.topics()
    except ControlPlaneClosedError:
        return []
    return [
        meta.replicas
        for topic in topics
        for range_ in control.ranges(topic.name)
        for meta in control.segments(range_.range_id)
        if meta.state is SegmentState.ACTIVE
    ]


def _led(replica_sets: list[tuple[str, ...]]) -> dict[str, int]:
    led: dict[str, int] = {}
    for replicas in replica_sets:
        led[replicas[0]] = led.get(replicas[0], 0) + 1
    return led


@attrs.frozen
class SingleNodeView:
    """A node with the local control plane: alone, alive, and doing its own chores."""

    cluster_id: str
    record: NodeRecord
    control: ControlPlane

    def status(self) -> ClusterStatus:
        led = _led(_replica_sets(self.control))
        return ClusterStatus(
            cluster_id=self.cluster_id,
            node_id=self.record.node_id,
            control_plane=ControlPlaneKind.LOCAL,
            nodes=(ClusterNode(self.record, True, led.get(self.record.node_id, 0)),),
            chores_holder=self.record.node_id,
            domain_violations=0,
            lease_age_seconds=None,
        )


class ReplicationCount(Protocol):
    """The under-replicated and unavailable counts, as last counted (``ReplicationHealth``;
    None before the first count)."""

    @property
    def count(self) -> int | None: ...

    @property
    def unavailable(self) -> int | None: ...


@attrs.frozen
class MembershipView:
    """A node of an etcd cluster: the member list from ``membership``."""

    cluster_id: str
    membership: Membership
    control: ControlPlane
    rule: PlacementRule
    #: ``None`` at replication factor 1.
    replication: ReplicationCount | None = None

    def status(self) -> ClusterStatus:
        replica_sets = _replica_sets(self.control)
        led = _led(replica_sets)
        views = self.membership.nodes()
        placement_nodes = [
            PlacementNode(view.record.node_id, view.record.attributes, view.alive) for view in views
        ]
        return ClusterStatus(
            cluster_id=self.cluster_id,
            node_id=self.membership.record.node_id,
            control_plane=ControlPlaneKind.ETCD,
            nodes=tuple(
                ClusterNode(view.record, view.alive, led.get(view.record.node_id, 0))
                for view in views
            ),
            chores_holder=self.membership.chores_holder,
            domain_violations=domain_violations(replica_sets, placement_nodes, self.rule),
            lease_age_seconds=self.membership.lease_age(),
            under_replicated=0 if self.replication is None else self.replication.count,
            unavailable_ranges=0 if self.replication is None else self.replication.unavailable,
        )
