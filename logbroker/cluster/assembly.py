"""How a cluster node serves ranges, assembled from its parts: one function for the running
node (``logbroker.cluster.node``) and the deterministic simulation alike, so that what the
simulation checks is the wiring the broker runs.

With replication factor 1 a range lives on one node (``LocalRanges``); above it, each range's
active segment is led by its primary and replicated to a quorum (``LeadRanges``). Either way
``ClusterRanges`` routes: a range led elsewhere is forwarded to its primary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorTime

from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import LocalRanges, RangeHandle
from logbroker.cluster.forwarding import ForwardedRange, RangeServer
from logbroker.cluster.ranges import ClusterRanges
from logbroker.cluster.remote_waits import RemoteWaits
from logbroker.controlplane import ControlPlane
from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.requester import Loopback, PeerRequester
from logbroker.peer.window import PeerError
from logbroker.placement import PlacementNode, PlacementRule
from logbroker.replication.balance import LeadershipBalance
from logbroker.replication.copies import CommittedCopies
from logbroker.replication.core.actions import ReplicationSettings
from logbroker.replication.healing import Healer
from logbroker.replication.health import ReplicationHealth
from logbroker.replication.leading import LeadRanges
from logbroker.replication.repair import RepairMetrics, SegmentRepairs
from logbroker.replication.replica import ReplicaOp, ReplicaServer
from logbroker.replication.replica_sets import ReplicaSets
from logbroker.replication.takeover import (
    ClaimContext,
    SegmentClaims,
    ignore_commit,
    ignore_leadership,
)
from logbroker.storage import OpenLogs

#: ``(peer node id, op, payload) -> ok payload``: what the peer port serves.
PeerHandler = Callable[[str, PeerOp, bytes], Deferred[bytes]]


@attrs.frozen
class Replication:
    """A node's replication, beside the ranges it serves."""

    #: The ranges this node leads.
    lead: LeadRanges
    #: Takes back the ranges this node is the preferred leader of, once all is quiet.
    balance: LeadershipBalance
    #: Brings this node's copies back to the control plane's word.
    healer: Healer
    #: Keeps the replica sets at the replication factor.
    replica_sets: ReplicaSets
    #: Counts the under-replicated segments of the cluster.
    health: ReplicationHealth
    #: Reads a range's committed records from its copies (when its primary cannot serve).
    copies: CommittedCopies
    #: Repairs this node's damaged sealed copies from intact ones (the scrub's findings).
    repairs: SegmentRepairs

    def sweep(self, range_ids: Sequence[str]) -> None:
        """Claim what this node should lead, check its leaders hear a quorum, and take back
        some of the ranges it is the preferred leader of (run every half second)."""
        self.lead.sweep(range_ids)
        self.balance.tick(range_ids)

    def heal(self, range_ids: Sequence[str]) -> Deferred[None]:
        """Heal this node's copies, then the replica sets, then count what is still short
        (run every second or so)."""
        healed = self.healer.tick(range_ids)
        healed.addCallback(lambda _: self.replica_sets.tick(range_ids))
        return healed.addCallback(lambda _: self.health.refresh(range_ids))


@attrs.frozen
class RangeParts:
    ranges: ClusterRanges
    #: Serves the range and replication ops of the peer port.
    serve: PeerHandler
    #: ``None`` at replication factor 1.
    replication: Replication | None


def assemble_ranges(
    *,
    node_id: str,
    control: ControlPlane,
    storage: OpenLogs,
    peers: PeerRequester,
    clock: IReactorTime,
    rule: PlacementRule,
    live_nodes: Callable[[], Iterable[PlacementNode]],
    holds_lease: Callable[[], bool],
    replication: ReplicationSettings,
    roll_bytes: int,
    is_live: Callable[[str], bool],
    repair_metrics: RepairMetrics,
    holds_chores: Callable[[], bool] = lambda: False,
    replace_after_seconds: float = 300.0,
    heard_at: Callable[[str], float | None] = lambda node: None,
    on_lead: Callable[[str, int, int, str], None] = ignore_leadership,
    on_commit: Callable[[str, int], None] = ignore_commit,
    control_follows: Callable[[], bool] = lambda: True,
    on_forwarded: Callable[[int], None] = lambda records: None,
) -> RangeParts:
    """``live_nodes`` lists the live members for placement; ``is_live`` answers for one node,
    cheaply (it is asked for every replica of every produce); ``heard_at`` says when the peer
    link last heard from a node; ``control_follows`` whether this node's view of the control
    plane follows etcd now (claims wait for it); ``on_lead`` is told of every leadership this
    node begins, and ``on_commit`` of every move of a commit index it leads;
    ``repair_metrics`` counts the outcomes of repairs; ``on_forwarded`` is told how many
    records each append forwarded to another node's primary carried, once it is acknowledged."""
    waits = RemoteWaits(peers)

    def forward(primary: str, range_id: str) -> RangeHandle:
        return ForwardedRange(range_id, primary, peers, waits, on_forwarded)

    if replication.replication_factor == 1:
        ranges = ClusterRanges(
            node_id, control, LocalRanges(storage), forward, live_nodes, rule, holds_lease
        )
        serve = _serve(RangeServer(ranges.led_here(), clock), {})
        return RangeParts(ranges, serve, None)
    replicas = ReplicaServer(node_id, storage, control)
    ops = replicas.ops
    context = ClaimContext(
        node_id=node_id,
        control=control,
        storage=storage,
        requester=Loopback(node_id, peers, ops),
        clock=clock,
        settings=replication,
        rule=rule,
        live_nodes=live_nodes,
        is_live=is_live,
        holds_lease=holds_lease,
        control_follows=control_follows,
        heard_at=heard_at,
        on_lead=on_lead,
        on_commit=on_commit,
    )
    copies = CommittedCopies(context)
    lead = LeadRanges(storage, SegmentClaims(context), copies, roll_bytes)
    ranges = ClusterRanges(
        node_id, control, lead, forward, live_nodes, rule, holds_lease, copies=copies
    )
    healer = Healer(context)
    health = ReplicationHealth(context, healer)
    ops[PeerOp.COPY_HEALTH] = health.serve
    parts = Replication(
        lead=lead,
        balance=LeadershipBalance(lead, context),
        healer=healer,
        replica_sets=ReplicaSets(context, lead, replace_after_seconds, holds_chores),
        health=health,
        copies=copies,
        repairs=SegmentRepairs(context, healer, repair_metrics),
    )
    serve = _serve(RangeServer(ranges.led_here(), clock), ops)
    return RangeParts(ranges, serve, parts)


def _serve(range_server: RangeServer, replica_ops: dict[PeerOp, ReplicaOp]) -> PeerHandler:
    def serve(peer: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        replica_op = replica_ops.get(op)
        if replica_op is None:
            return range_server(peer, op, payload)
        try:
            return replica_op(peer, payload)
        except BrokerError as error:
            return fail(error)
        except PeerError as error:
            return fail(error)
        except ValueError as error:
            return fail(PeerError(PeerReason.MALFORMED_MESSAGE, str(error)))

    return serve
