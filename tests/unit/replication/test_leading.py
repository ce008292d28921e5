"""``LeadRanges``: what opening ranges and preparing one do when a claim cannot succeed."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock

from logbroker.broker.errors import BrokerError
from logbroker.config import SpreadPolicy
from logbroker.controlplane import (
    EtcdControlPlane,
    Range,
    RangeState,
    SegmentMeta,
    SegmentState,
    Topic,
)
from logbroker.errors import Reason
from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.link import PeerError
from logbroker.peer.requester import Loopback
from logbroker.placement import PlacementNode, PlacementRule
from logbroker.replication.copies import CommittedCopies
from logbroker.replication.core.actions import ReplicationSettings
from logbroker.replication.leading import LeadRanges
from logbroker.replication.replica import ReplicaServer
from logbroker.replication.takeover import ClaimContext, SegmentClaims
from logbroker.storage import LogConfig
from logbroker.testing import MemoryKeyValueStore
from tests.unit.storage.helpers import MemoryLogs, failure_of, result_of

RANGES = ("r.0", "r.1")


class _Unreachable:
    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        return fail(PeerError(PeerReason.UNREACHABLE, f"no link to {node_id}"))


def _lead_ranges_without_replicas() -> LeadRanges:
    clock = Clock()
    control = EtcdControlPlane(MemoryKeyValueStore(clock), prefix="/c/", clock=clock)
    result_of(control.start())
    ranges = [
        Range(range_id, "r", index * 128, (index + 1) * 128, RangeState.ACTIVE)
        for index, range_id in enumerate(RANGES)
    ]
    result_of(control.create_topic(Topic("r", 8, 0, RANGES), ranges))
    for range_id in RANGES:
        meta = SegmentMeta(range_id, 0, SegmentState.ACTIVE, None, None, ("a", "b", "c"), 0)
        result_of(control.put_segment(meta))
    storage = MemoryLogs(config=LogConfig(replicated=True, auto_roll=False))
    own = ReplicaServer("a", storage, control).ops
    context = ClaimContext(
        node_id="a",
        control=control,
        storage=storage,
        requester=Loopback("a", _Unreachable(), own),
        clock=clock,
        settings=ReplicationSettings(replication_factor=3),
        rule=PlacementRule(3, None, 1, SpreadPolicy.SOFT),
        live_nodes=lambda: [PlacementNode(node, (), True) for node in "abc"],
        is_live=lambda node: True,
    )
    return LeadRanges(storage, SegmentClaims(context), CommittedCopies(context), 1 << 20)


def test_opening_ranges_that_cannot_be_claimed_yet_does_not_fail_start_up(
    logged_errors: list[dict[str, Any]],
) -> None:
    lead = _lead_ranges_without_replicas()

    assert result_of(lead.open(list(RANGES))) is None
    assert lead.leading() == [], "no quorum answered: nothing is led"
    assert logged_errors == []


def test_preparing_one_range_fails_with_why_it_cannot_be_led() -> None:
    lead = _lead_ranges_without_replicas()

    error = failure_of(lead.prepare("r.0")).value
    assert isinstance(error, BrokerError)
    assert error.reason is Reason.NO_QUORUM
    assert "1 of 3 replicas answered the fence" in str(error)
