"""What an operator sees of the cluster: every node, alive or not, and who does what.

``ClusterView.status()`` is read by the operator surfaces (``logbroker cluster status``, the
dashboard's page and ``/metrics``); it is computed from the member list and the control plane at
the moment it is asked for. A single node is a cluster of one (``SingleNodeView``).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Collection, Iterable, Mapping
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


class ActiveReplicaSets:
    """How many ranges' active segments each replica set holds, kept up to date from the
    control plane's segment changes (``watch_segments``): each status read looked at every
    range's records, and at 40,000 ranges a poll every two seconds took a fifteenth of a busy
    node's time. Only the ranges whose records changed since the last read are read again."""

    def __init__(self, control: ControlPlane) -> None:
        self._control = control
        #: Each range's active replica sets, and their counts over every range.
        self._by_range: dict[str, tuple[tuple[str, ...], ...]] = {}
        self._counts: collections.Counter[tuple[str, ...]] = collections.Counter()
        #: The ranges to read again; ``None``: every range (nothing read yet).
        self._stale: set[str] | None = None
        control.watch_segments(self._changed)

    def _changed(self, range_ids: Collection[str]) -> None:
        if self._stale is not None:
            self._stale.update(range_ids)

    def counts(self) -> Mapping[tuple[str, ...], int]:
        try:
            if self._stale is None:
                stale: Iterable[str] = self._control.range_ids()
                self._by_range.clear()
                self._counts.clear()
            else:
                stale = self._stale
            self._stale = set()
            for range_id in stale:
                self._read(range_id)
        except ControlPlaneClosedError:
            self._stale = None
            return {}
        return self._counts

    def _read(self, range_id: str) -> None:
        for replicas in self._by_range.pop(range_id, ()):
            self._counts[replicas] -= 1
            if not self._counts[replicas]:
                del self._counts[replicas]
        active = tuple(
            meta.replicas
            for meta in self._control.segments(range_id)
            if meta.state is SegmentState.ACTIVE
        )
        if active:
            self._by_range[range_id] = active
            self._counts.update(active)


def _led(counts: Mapping[tuple[str, ...], int]) -> dict[str, int]:
    led: dict[str, int] = {}
    for replicas, count in counts.items():
        led[replicas[0]] = led.get(replicas[0], 0) + count
    return led


@attrs.frozen
class SingleNodeView:
    """A node with the local control plane: alone, alive, and doing its own chores."""

    cluster_id: str
    record: NodeRecord
    control: ControlPlane
    replica_sets: ActiveReplicaSets = attrs.field(
        init=False, default=attrs.Factory(lambda view: ActiveReplicaSets(view.control), True)
    )

    def status(self) -> ClusterStatus:
        led = _led(self.replica_sets.counts())
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
    replica_sets: ActiveReplicaSets = attrs.field(
        init=False, default=attrs.Factory(lambda view: ActiveReplicaSets(view.control), True)
    )

    def status(self) -> ClusterStatus:
        counts = self.replica_sets.counts()
        led = _led(counts)
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
            domain_violations=domain_violations(
                itertools.chain.from_iterable(itertools.repeat(r, n) for r, n in counts.items()),
                placement_nodes,
                self.rule,
            ),
            lease_age_seconds=self.membership.lease_age(),
            under_replicated=0 if self.replication is None else self.replication.count,
            unavailable_ranges=0 if self.replication is None else self.replication.unavailable,
        )
