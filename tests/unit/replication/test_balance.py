"""``LeadershipBalance``: once the cluster has been quiet for a while, a node takes back the
ranges it is the preferred leader of from the live nodes that took them over, a bounded number
at a time, without losing a record; never while a member is dead, the membership just changed
or the sweep has claims of its own to make."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from logbroker.broker.keyspace import split_keyspace
from logbroker.controlplane import Range, RangeState, SegmentMeta, SegmentState, Topic
from logbroker.placement import preferred_leader
from logbroker.records import Record
from logbroker.replication.balance import LeadershipBalance
from logbroker.replication.copies import CommittedCopies
from logbroker.replication.leading import LeadRanges
from logbroker.replication.takeover import ClaimContext, SegmentClaims
from tests.unit.replication.harness import CONFIG, RANGE, Cluster, cluster
from tests.unit.storage.helpers import result_of

SETTLE = 10.0
_T = TypeVar("_T")


@attrs.define
class _Preferred:
    world: Cluster
    #: The node the range prefers, and the one that leads it now (as a failover left it).
    preferred: str
    leader: str
    lead: LeadRanges
    balance: LeadershipBalance


def _led_by_another(records: int = 0) -> _Preferred:
    """The range led by a node other than its preferred leader (its first replica, as after
    a failover), with ``records`` committed on every copy; the preferred leader's balance
    made, not ticked yet."""
    world = cluster()
    preferred = preferred_leader(RANGE, ("a", "b", "c"))
    leader = next(node for node in "abc" if node != preferred)
    meta = world.control.last_segment(RANGE)
    assert meta is not None
    others = tuple(node for node in "abc" if node != leader)
    result_of(world.control.put_segment(attrs.evolve(meta, replicas=(leader, *others))))
    led = world.lead(leader)
    for index in range(records):
        led.handle(RANGE).append([Record(b"value-%02d" % index)])
        world.settle()
    world.clock.advance(0.1)  # the commit notice of the last append
    world.settle()
    context = world.context(preferred)
    lead = LeadRanges(
        context.storage, SegmentClaims(context), CommittedCopies(context), CONFIG.roll_bytes
    )
    balance = LeadershipBalance(lead, context, settle_seconds=SETTLE)
    return _Preferred(world, preferred, leader, lead, balance)


def _tick_for(setup: _Preferred, seconds: float, range_ids: Sequence[str] = (RANGE,)) -> None:
    for _ in range(int(seconds / 0.5)):
        setup.balance.tick(range_ids)
        setup.world.settle()
        setup.world.clock.advance(0.5)
    setup.world.settle()


def _done(world: Cluster, waiting: Deferred[_T]) -> _T:
    """What ``waiting`` gives once the nodes have run for up to 5 s of the clock."""
    for _ in range(50):
        world.settle()
        world.clock.advance(0.1)
    return result_of(waiting)


def _primary(world: Cluster) -> str:
    meta = world.control.last_segment(RANGE)
    assert meta is not None
    return meta.replicas[0]


def test_the_preferred_leader_takes_its_range_back_once_quiet_keeping_every_record() -> None:
    setup = _led_by_another(records=5)
    _tick_for(setup, SETTLE - 1)
    assert _primary(setup.world) == setup.leader, "not before the cluster was quiet long enough"

    _tick_for(setup, 2)

    assert _primary(setup.world) == setup.preferred
    handle = setup.lead.handle(RANGE)
    assert _done(setup.world, handle.append([Record(b"after")])) is None
    led_elsewhere = _done(setup.world, handle.read(0, 100, 1 << 20))
    assert (led_elsewhere.count, led_elsewhere.next_offset) == (5, 5), "sealed by the claim"
    appended_after = _done(setup.world, handle.read(5, 100, 1 << 20))
    assert appended_after.count == 1
    assert b"after" in b"".join(appended_after.data)


def test_nothing_is_taken_back_while_a_member_is_dead() -> None:
    setup = _led_by_another()
    third = next(node for node in "abc" if node not in (setup.preferred, setup.leader))
    setup.world.peers.dead.add(third)

    _tick_for(setup, 3 * SETTLE)

    assert _primary(setup.world) == setup.leader
    assert not setup.balance.under_way


def test_a_membership_change_starts_the_quiet_period_again() -> None:
    setup = _led_by_another()
    third = next(node for node in "abc" if node not in (setup.preferred, setup.leader))
    _tick_for(setup, SETTLE - 2)
    setup.world.peers.dead.add(third)
    _tick_for(setup, 1)
    setup.world.peers.dead.discard(third)

    _tick_for(setup, SETTLE - 2)
    assert _primary(setup.world) == setup.leader, "quiet for less than the settle time"

    _tick_for(setup, 3)
    assert _primary(setup.world) == setup.preferred


def test_a_node_without_its_lease_takes_nothing_back() -> None:
    setup = _led_by_another()
    context = attrs.evolve(setup.world.context(setup.preferred), holds_lease=lambda: False)
    setup.balance = LeadershipBalance(setup.lead, context, settle_seconds=SETTLE)

    _tick_for(setup, 3 * SETTLE)

    assert _primary(setup.world) == setup.leader


class _ClaimsHeldOpen:
    """A ``LeadRanges`` whose claims never end: what the balance starts, and when."""

    def __init__(self, sweep_claims: int = 0) -> None:
        self.asked: list[str] = []
        self.sweep_claims = sweep_claims
        self.pending: dict[str, Deferred[None]] = {}

    def prepare(self, range_id: str) -> Deferred[None]:
        self.asked.append(range_id)
        self.pending[range_id] = Deferred()
        return self.pending[range_id]

    def claiming(self, range_id: str) -> bool:
        return range_id in self.pending

    def claims_under_way(self) -> int:
        return self.sweep_claims + len(self.pending)

    def sweep_pending(self) -> bool:
        return False


def _many_ranges_led_by_another(count: int) -> tuple[ClaimContext, list[str], set[str]]:
    """A topic of ``count`` ranges, each led by a node other than its preferred leader: node
    ``a``'s context, the ranges in order, and those ``a`` is the preferred leader of."""
    world = cluster()
    range_ids = [f"m.{index}" for index in range(count)]
    bounds = split_keyspace(16, count)
    ranges = [
        Range(range_id, "m", start, end, RangeState.ACTIVE)
        for range_id, (start, end) in zip(range_ids, bounds, strict=True)
    ]
    result_of(world.control.create_topic(Topic("m", 16, 0, tuple(range_ids)), ranges))
    for range_id in range_ids:
        preferred = preferred_leader(range_id, ("a", "b", "c"))
        leader = next(node for node in "abc" if node != preferred)
        others = tuple(node for node in "abc" if node != leader)
        meta = SegmentMeta(range_id, 0, SegmentState.ACTIVE, None, None, (leader, *others), 0)
        result_of(world.control.put_segment(meta))
    preferred_by_a = {r for r in range_ids if preferred_leader(r, ("a", "b", "c")) == "a"}
    return world.context("a"), range_ids, preferred_by_a


def _quiet_balance(
    context: ClaimContext, claims: _ClaimsHeldOpen, **limits: int
) -> LeadershipBalance:
    """A balance past its settle time (the first tick sees the membership)."""
    balance = LeadershipBalance(claims, context, settle_seconds=SETTLE, **limits)  # type: ignore[arg-type]
    balance.tick([])
    assert isinstance(context.clock, Clock)
    context.clock.advance(SETTLE)
    return balance


def test_at_most_a_few_claims_at_once_the_next_as_each_ends() -> None:
    context, range_ids, preferred = _many_ranges_led_by_another(64)
    claims = _ClaimsHeldOpen()
    balance = _quiet_balance(context, claims, max_under_way=4)

    balance.tick(range_ids)
    assert len(claims.asked) == 4
    assert set(claims.asked) <= preferred
    balance.tick(range_ids)
    assert len(claims.asked) == 4, "none more while four are under way"

    for range_id in claims.asked[:2]:
        claims.pending.pop(range_id).callback(None)
    balance.tick(range_ids)

    assert len(claims.asked) == 6
    assert len(set(claims.asked)) == 6
    assert set(claims.asked) <= preferred


def test_a_tick_looks_at_a_bounded_number_of_ranges_going_round_them_all() -> None:
    context, range_ids, preferred = _many_ranges_led_by_another(64)
    claims = _ClaimsHeldOpen()
    balance = _quiet_balance(context, claims, max_under_way=100, looks_per_tick=16)

    balance.tick(range_ids)
    assert set(claims.asked) == preferred & set(range_ids[:16])
    for _ in range(3):
        balance.tick(range_ids)

    assert set(claims.asked) == preferred
    assert len(claims.asked) == len(preferred)


def test_nothing_is_taken_back_while_the_sweep_claims() -> None:
    context, range_ids, _ = _many_ranges_led_by_another(16)
    claims = _ClaimsHeldOpen(sweep_claims=1)
    balance = _quiet_balance(context, claims)

    balance.tick(range_ids)

    assert claims.asked == []
