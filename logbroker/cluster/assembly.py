"""How a cluster node serves ranges, assembled from its parts: one function for the running
node (``logbroker.cluster.node``) and the deterministic simulation alike, so that what the
simulation checks is the wiring the broker runs.

With replication factor 1 a range lives on one node (``LocalRanges``); above it, each range's
active segment is led by its primary and replicated to a quorum (``LeadRanges``). Either way
``ClusterRanges`` routes: a range led elsewhere is forwarded to its primary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorTime

from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import LocalRanges, RangeHandle
from logbroker.cluster.forwarding import ForwardedRange, RangeServer, RemoteWaits
from logbroker.cluster.ranges import ClusterRanges
from logbroker.controlplane import ControlPlane
from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.link import PeerError
from logbroker.peer.requester import Loopback, PeerRequester
from logbroker.placement import PlacementNode, PlacementRule
from logbroker.replication.copies import CommittedCopies
from logbroker.replication.core.leader import ReplicationSettings
from logbroker.replication.healing import Healer
from logbroker.replication.leading import LeadRanges
from logbroker.replication.replica import ReplicaServer
from logbroker.replication.takeover import ClaimContext, SegmentClaims
from logbroker.storage import OpenLogs

#: ``(peer node id, op, payload) -> ok payload``: what the peer port serves.
PeerHandler = Callable[[str, PeerOp, bytes], Deferred[bytes]]


@attrs.frozen
class RangeParts:
    ranges: ClusterRanges
    #: Serves the range and replication ops of the peer port.
    serve: PeerHandler
    #: The ranges this node leads, with replication (``None`` at replication factor 1).
    lead: LeadRanges | None
    #: Brings this node's copies and the replica sets back to the control plane's word, run
    #: periodically (``None`` at replication factor 1).
    healer: Healer | None


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
    holds_chores: Callable[[], bool] = lambda: False,
    replace_after_seconds: float = 300.0,
) -> RangeParts:
    """``live_nodes`` lists the live members for placement; ``is_live`` answers for one node,
    cheaply (it is asked for every replica of every produce)."""
    waits = RemoteWaits(peers)

    def forward(primary: str, range_id: str) -> RangeHandle:
        return ForwardedRange(range_id, primary, peers, waits)

    if replication.replication_factor == 1:
        ranges = ClusterRanges(
            node_id, control, LocalRanges(storage), forward, live_nodes, rule, holds_lease
        )
        serve = _serve(RangeServer(ranges.led_here(), clock), {})
        return RangeParts(ranges, serve, None, None)
    replicas = ReplicaServer(storage, control)
    context = ClaimContext(
        node_id=node_id,
        control=control,
        storage=storage,
        requester=Loopback(node_id, peers, replicas.ops),
        clock=clock,
        settings=replication,
        rule=rule,
        live_nodes=live_nodes,
        is_live=is_live,
    )
    lead = LeadRanges(storage, SegmentClaims(context), roll_bytes)
    ranges = ClusterRanges(
        node_id,
        control,
        lead,
        forward,
        live_nodes,
        rule,
        holds_lease,
        copies=CommittedCopies(context),
    )
    healer = Healer(context, lead, replace_after_seconds, holds_chores)
    serve = _serve(RangeServer(ranges.led_here(), clock), replicas.ops)
    return RangeParts(ranges, serve, lead, healer)


def _serve(
    range_server: RangeServer, replica_ops: dict[PeerOp, Callable[[bytes], Deferred[bytes]]]
) -> PeerHandler:
    def serve(peer: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        replica_op = replica_ops.get(op)
        if replica_op is None:
            return range_server(peer, op, payload)
        try:
            return replica_op(payload)
        except BrokerError as error:
            return fail(error)
        except PeerError as error:
            return fail(error)
        except ValueError as error:
            return fail(PeerError(PeerReason.MALFORMED_MESSAGE, str(error)))

    return serve
