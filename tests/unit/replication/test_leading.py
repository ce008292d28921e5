"""``LeadRanges``: what opening ranges and preparing one do when a claim cannot succeed."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock
from twisted.logger import LogLevel, formatEvent, globalLogPublisher

from logbroker.broker.errors import BrokerError
from logbroker.broker.keyspace import split_keyspace
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
from logbroker.peer.requester import Loopback
from logbroker.peer.window import PeerError
from logbroker.placement import PlacementNode, PlacementRule
from logbroker.replication import leading
from logbroker.replication.copies import CommittedCopies
from logbroker.replication.core.actions import ReplicationSettings
from logbroker.replication.leading import CLAIMS_PER_TURN, MAX_SWEEP_CLAIMS, LeadRanges
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


class _Silent:
    """Peers that never answer: a claim's fence waits for them until it times out."""

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        return Deferred()


def _first_for_many(
    count: int, live: set[str], peers: Any, replicas: tuple[str, ...] = ("a", "b", "c")
) -> tuple[LeadRanges, EtcdControlPlane, Clock, list[str]]:
    """A LeadRanges on node a, in the replica set ``replicas`` (first in it unless told
    otherwise) of ``count`` ranges' segments."""
    clock = Clock()
    control = EtcdControlPlane(MemoryKeyValueStore(clock), prefix="/c/", clock=clock)
    result_of(control.start())
    range_ids = []
    # Topics of 50 ranges at most: a topic is created in one etcd transaction.
    for topic in range(0, count, 50):
        names = tuple(f"t{topic}.{index}" for index in range(min(50, count - topic)))
        cuts = split_keyspace(8, len(names))
        ranges = [
            Range(name, f"t{topic}", start, end, RangeState.ACTIVE)
            for name, (start, end) in zip(names, cuts, strict=True)
        ]
        result_of(control.create_topic(Topic(f"t{topic}", 8, 0, names), ranges))
        range_ids.extend(names)
    for range_id in range_ids:
        meta = SegmentMeta(range_id, 0, SegmentState.ACTIVE, None, None, replicas, 0)
        result_of(control.put_segment(meta))
    storage = MemoryLogs(config=LogConfig(replicated=True, auto_roll=False))
    context = ClaimContext(
        node_id="a",
        control=control,
        storage=storage,
        requester=Loopback("a", peers, ReplicaServer("a", storage, control).ops),
        clock=clock,
        settings=ReplicationSettings(replication_factor=3),
        rule=PlacementRule(3, None, 1, SpreadPolicy.SOFT),
        live_nodes=lambda: [PlacementNode(node, (), node in live) for node in "abc"],
        is_live=lambda node: node in live,
    )
    lead = LeadRanges(storage, SegmentClaims(context), CommittedCopies(context), 1 << 20)
    return lead, control, clock, range_ids


def _claimed(control: EtcdControlPlane, range_ids: list[str]) -> int:
    """How many of the ranges' segments a claim has bumped past epoch 0."""
    return sum(1 for range_id in range_ids if control.segments(range_id)[-1].epoch > 0)


def test_the_sweep_claims_a_bounded_number_at_once_and_the_next_as_each_ends() -> None:
    count = 2 * MAX_SWEEP_CLAIMS + 50
    lead, control, clock, range_ids = _first_for_many(count, {"a", "b", "c"}, _Silent())

    lead.sweep(range_ids)
    # CLAIMS_PER_TURN in the sweep's own reactor turn, and the rest of the first wave in the
    # turns after it: one pass over thousands of ranges never holds the reactor.
    assert _claimed(control, range_ids) == CLAIMS_PER_TURN
    clock.advance(0)
    assert _claimed(control, range_ids) == MAX_SWEEP_CLAIMS
    # Swept again meanwhile: nothing more starts while the first claims are under way.
    clock.advance(1)
    lead.sweep(range_ids)
    assert _claimed(control, range_ids) == MAX_SWEEP_CLAIMS

    # The fences time out (the peers stay silent): as those claims end, the next ones start.
    clock.advance(ReplicationSettings(replication_factor=3).ack_timeout_seconds)
    assert _claimed(control, range_ids) == 2 * MAX_SWEEP_CLAIMS
    clock.advance(ReplicationSettings(replication_factor=3).ack_timeout_seconds)
    assert _claimed(control, range_ids) == count


class _HeldThenLost:
    """Peers whose answers are held until their link is lost: then every request fails in one
    reactor turn, as a peer link's window fails all it has in flight."""

    def __init__(self) -> None:
        self.asked: list[Deferred[bytes]] = []

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        self.asked.append(Deferred())
        return self.asked[-1]

    def lose_link(self) -> None:
        asked, self.asked = self.asked, []
        for request in asked:
            request.errback(PeerError(PeerReason.UNREACHABLE, "the link was lost"))


def test_claims_failing_together_start_the_next_at_the_next_turn_and_log_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The bounds made small, so that the test runs in a moment.
    at_once, per_turn = 64, 16
    monkeypatch.setattr(leading, "MAX_SWEEP_CLAIMS", at_once)
    monkeypatch.setattr(leading, "CLAIMS_PER_TURN", per_turn)
    count = at_once + 4 * per_turn
    peers = _HeldThenLost()
    lead, control, clock, range_ids = _first_for_many(count, {"a", "b", "c"}, peers)
    lead.sweep(range_ids)
    assert _claimed(control, range_ids) == per_turn
    clock.advance(0)
    assert _claimed(control, range_ids) == at_once
    warned: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        text = formatEvent(event)
        if event.get("log_level") is LogLevel.warn and text.startswith("Claiming"):
            warned.append(text)

    globalLogPublisher.addObserver(observe)
    try:
        # Each of the thousand claims failing started up to a turn's worth of others, which
        # failed too, all in the same turn: a restarted node spent seconds in it.
        peers.lose_link()
        assert _claimed(control, range_ids) == at_once
        clock.advance(0)
    finally:
        globalLogPublisher.removeObserver(observe)
    assert _claimed(control, range_ids) == count
    assert warned == [
        f"Claiming {at_once} ranges failed, {range_ids[0]} first: {range_ids[0]}@0:"
        " 1 of 3 replicas answered the fence, fewer than the quorum of 2"
    ]


def test_a_range_without_live_quorum_is_not_claimed_until_members_come_back() -> None:
    live = {"a"}
    lead, control, clock, range_ids = _first_for_many(3, live, _Unreachable())

    for _ in range(5):
        lead.sweep(range_ids)
        clock.advance(10)
    # No claim was recorded: no epoch bumped again and again for nothing.
    assert _claimed(control, range_ids) == 0
    error = failure_of(lead.prepare(range_ids[0])).value
    assert isinstance(error, BrokerError)
    assert error.reason is Reason.NO_QUORUM
    assert "too few members of its replica set are alive" in str(error)

    # b is back: claimed at the next sweep, whatever the back-off had left to wait.
    live.add("b")
    lead.sweep(range_ids)
    assert _claimed(control, range_ids) == 3


def test_between_full_sweeps_the_sweep_looks_only_at_ranges_that_changed() -> None:
    live = {"a", "b", "c"}
    lead, control, clock, range_ids = _first_for_many(200, live, _Silent(), ("b", "a", "c"))
    looked_at: list[str] = []
    last_segment = control.last_segment

    def counted(range_id: str) -> SegmentMeta | None:
        looked_at.append(range_id)
        return last_segment(range_id)

    control.last_segment = counted  # type: ignore[method-assign]
    lead.sweep(range_ids)
    assert len(looked_at) == 200, "the first sweep looks at every range"
    assert _claimed(control, range_ids) == 0, "b leads them all"

    looked_at.clear()
    clock.advance(0.5)
    lead.sweep(range_ids)
    assert looked_at == [], "nothing changed"

    # b steps aside from one range: a, first now, claims it at the next sweep, having looked
    # at that range alone.
    resigned = control.last_segment(range_ids[7])
    assert resigned is not None
    result_of(control.put_segment(attrs.evolve(resigned, replicas=("a", "c", "b"))))
    looked_at.clear()
    clock.advance(0.5)
    lead.sweep(range_ids)
    assert set(looked_at) == {range_ids[7]}
    assert _claimed(control, range_ids) == 1

    # b dies: a is the first live replica of every range, and the sweep looks at them all.
    live.discard("b")
    looked_at.clear()
    clock.advance(0.5)
    lead.sweep(range_ids)
    assert set(looked_at) == set(range_ids)
    assert _claimed(control, range_ids) == 200
