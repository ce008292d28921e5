"""In-process nodes (``a``, ``b``, ``c`` unless told otherwise) replicating one range at
replication factor 3: each with its own log
storage on a ``MemoryFileSystem`` and a ``ManualExecutor``, one in-memory control plane, one
``Clock``, and requests between nodes answered in process by each node's ``ReplicaServer``. A
node marked dead answers nothing (``unreachable``) and is not live; a silent one is live and
never answers."""

from __future__ import annotations

import attrs
from twisted.internet.defer import Deferred, fail, maybeDeferred
from twisted.internet.task import Clock

from logbroker.config import SpreadPolicy
from logbroker.controlplane import (
    EtcdControlPlane,
    Range,
    RangeState,
    SegmentMeta,
    SegmentState,
    Topic,
)
from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.requester import LocalOps, Loopback
from logbroker.peer.window import PeerError
from logbroker.placement import PlacementNode, PlacementRule
from logbroker.replication.copies import CommittedCopies
from logbroker.replication.core.actions import ReplicationSettings
from logbroker.replication.leading import LeadRanges
from logbroker.replication.replica import ReplicaServer
from logbroker.replication.takeover import ClaimContext, SegmentClaims
from logbroker.storage import LogConfig
from logbroker.testing import ManualExecutor, MemoryKeyValueStore
from tests.unit.storage.helpers import MemoryLogs, result_of, run_until_idle

RANGE = "r.0"
CONFIG = LogConfig(replicated=True, auto_roll=False)


class Peers:
    """Requests between the nodes, answered in process; a dead node answers ``unreachable``,
    a silent one never answers (it is alive, and cut off)."""

    def __init__(self) -> None:
        self.ops: dict[str, LocalOps] = {}
        self.dead: set[str] = set()
        self.silent: set[str] = set()

    def sent_by(self, sender: str) -> _SentBy:
        return _SentBy(self, sender)

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        """A request from outside the nodes (the test itself)."""
        return self.sent_by("test").request(node_id, op, payload)


class _SentBy:
    """The requests one node sends."""

    def __init__(self, peers: Peers, sender: str) -> None:
        self._peers = peers
        self._sender = sender

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        if node_id in self._peers.dead:
            return fail(PeerError(PeerReason.UNREACHABLE, f"{node_id} is down"))
        if node_id in self._peers.silent:
            return Deferred()
        return maybeDeferred(self._peers.ops[node_id][op], self._sender, payload)


@attrs.define
class Cluster:
    control: EtcdControlPlane
    clock: Clock
    storages: dict[str, MemoryLogs]
    executors: dict[str, ManualExecutor]
    peers: Peers
    nodes: str
    #: The control plane's store: ``hold()`` keeps its changes waiting, as an etcd out of reach.
    store: MemoryKeyValueStore

    def settle(self) -> None:
        run_until_idle(self.clock, self.executors.values())

    def context(self, node: str) -> ClaimContext:
        return ClaimContext(
            node_id=node,
            control=self.control,
            storage=self.storages[node],
            requester=Loopback(node, self.peers.sent_by(node), self.peers.ops[node]),
            clock=self.clock,
            settings=ReplicationSettings(replication_factor=3),
            rule=PlacementRule(3, None, 1, SpreadPolicy.SOFT),
            live_nodes=lambda: [PlacementNode(n) for n in self.nodes if n not in self.peers.dead],
            is_live=lambda n: n not in self.peers.dead,
        )

    def lead(self, node: str, roll_bytes: int = CONFIG.roll_bytes) -> LeadRanges:
        """Node ``node`` claims the range, and leads it once the claim is done (rolling its
        segments at ``roll_bytes``)."""
        context = self.context(node)
        lead = LeadRanges(
            context.storage, SegmentClaims(context), CommittedCopies(context), roll_bytes
        )
        claiming = lead.open([RANGE])
        self.settle()
        result_of(claiming)
        return lead

    def stored(self, node: str) -> list[bytes]:
        return [stored.record.value for stored in self.storages[node].logs[RANGE].read(0)]


def cluster(nodes: str = "abc") -> Cluster:
    """The range with its first segment placed on ``a``, ``b``, ``c`` (``a`` first)."""
    clock = Clock()
    store = MemoryKeyValueStore(clock)
    control = EtcdControlPlane(store, prefix="/c/", clock=clock)
    result_of(control.start())
    topic = Topic("r", 8, 0, (RANGE,))
    result_of(control.create_topic(topic, [Range(RANGE, "r", 0, 256, RangeState.ACTIVE)]))
    result_of(
        control.put_segment(
            SegmentMeta(RANGE, 0, SegmentState.ACTIVE, None, None, ("a", "b", "c"), 0)
        )
    )
    executors = {node: ManualExecutor() for node in nodes}
    storages = {
        node: MemoryLogs(clock=clock, executor=executors[node], config=CONFIG) for node in nodes
    }
    peers = Peers()
    for node in nodes:
        peers.ops[node] = ReplicaServer(node, storages[node], control).ops
    return Cluster(control, clock, storages, executors, peers, nodes, store)
