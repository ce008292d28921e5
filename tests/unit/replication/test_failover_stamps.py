"""Stamped produces across a failover: the primary's stamped batches reach the replicas as they
are, and a node that takes the range over rebuilds its dedupe table from its copy before it
takes appends, so a retry of a produce the old primary stored is not stored again."""

from __future__ import annotations

import attrs
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.task import Clock

from logbroker.cluster.placement import PlacementNode, PlacementRule
from logbroker.config import SpreadPolicy
from logbroker.controlplane import (
    EtcdControlPlane,
    Range,
    RangeState,
    SegmentMeta,
    SegmentState,
    Topic,
)
from logbroker.records import ProducerStamp, Record
from logbroker.replication.codec import PeerOp
from logbroker.replication.leading import LeadRanges
from logbroker.replication.primary import ReplicationSettings
from logbroker.replication.replica import ReplicaServer
from logbroker.replication.requester import LocalOps, Loopback
from logbroker.replication.takeover import ClaimContext, SegmentClaims
from logbroker.storage import LogConfig, RangeLog
from logbroker.testing import ManualExecutor, MemoryFileSystem, MemoryKeyValueStore
from tests.unit.storage.helpers import result_of, run_until_idle

RANGE = "r.0"
NODES = "abc"
STAMP = ProducerStamp(0x5EED, 3)
CONFIG = LogConfig(replicated=True, auto_roll=False)


class _Logs:
    def __init__(self, fs: MemoryFileSystem, executor: ManualExecutor) -> None:
        self._fs = fs
        self._executor = executor
        self.logs: dict[str, RangeLog] = {}

    def open_range(self, name: str) -> Deferred[RangeLog]:
        def opened(range_log: RangeLog) -> RangeLog:
            self.logs[name] = range_log
            return range_log

        return RangeLog.open(
            f"/data/ranges/{name}",
            fs=self._fs,
            clock=Clock(),
            executor=self._executor,
            config=CONFIG,
        ).addCallback(opened)


class _Peers:
    def __init__(self) -> None:
        self.ops: dict[str, LocalOps] = {}

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        return maybeDeferred(self.ops[node_id][op], payload)


@attrs.define
class Cluster:
    control: EtcdControlPlane
    clock: Clock
    storages: dict[str, _Logs]
    executors: dict[str, ManualExecutor]
    peers: _Peers

    def settle(self) -> None:
        run_until_idle(self.clock, self.executors.values())

    def lead(self, node: str) -> LeadRanges:
        """Node ``node`` claims the range, and leads it once the claim is done."""
        context = ClaimContext(
            node_id=node,
            control=self.control,
            storage=self.storages[node],
            requester=Loopback(node, self.peers, self.peers.ops[node]),
            clock=self.clock,
            settings=ReplicationSettings(replication_factor=3),
            rule=PlacementRule(3, None, 1, SpreadPolicy.SOFT),
            live_nodes=lambda: [PlacementNode(n) for n in NODES],
            is_live=lambda _: True,
        )
        lead = LeadRanges(context.storage, SegmentClaims(context), CONFIG.roll_bytes)
        claiming = lead.open([RANGE])
        self.settle()
        result_of(claiming)
        return lead

    def stored(self, node: str) -> list[bytes]:
        return [stored.record.value for stored in self.storages[node].logs[RANGE].read(0)]


def cluster() -> Cluster:
    clock = Clock()
    control = EtcdControlPlane(MemoryKeyValueStore(clock), prefix="/c/", clock=clock)
    result_of(control.start())
    topic = Topic("r", 8, 0, (RANGE,))
    result_of(control.create_topic(topic, [Range(RANGE, "r", 0, 256, RangeState.ACTIVE)]))
    result_of(
        control.put_segment(
            SegmentMeta(RANGE, 0, SegmentState.ACTIVE, None, None, ("a", "b", "c"), 0)
        )
    )
    executors = {node: ManualExecutor() for node in NODES}
    storages = {node: _Logs(MemoryFileSystem(), executors[node]) for node in NODES}
    peers = _Peers()
    for node in NODES:
        peers.ops[node] = ReplicaServer(storages[node], control).ops
    return Cluster(control, clock, storages, executors, peers)


def test_a_retry_after_a_failover_is_answered_without_being_stored_again() -> None:
    world = cluster()
    first = world.lead("a")
    sent = first.handle(RANGE).append([Record(b"x"), Record(b"y")], STAMP)
    world.settle()
    assert result_of(sent) is None
    # The replicas hold the primary's stamped batch as it wrote it.
    found = world.storages["b"].logs[RANGE].recent_stamps()
    world.settle()
    assert result_of(found) == [(STAMP, 0, 2)]

    second = world.lead("b")  # a failover: b claims the range at a newer epoch
    retry = second.handle(RANGE).append([Record(b"x"), Record(b"y")], STAMP)
    world.settle()

    assert result_of(retry) is None
    assert world.stored("b") == [b"x", b"y"]
    new = second.handle(RANGE).append([Record(b"z")], ProducerStamp(0x5EED, 4))
    world.settle()
    assert result_of(new) is None
    assert world.stored("b") == [b"x", b"y", b"z"]
    second.stop()
