"""Placement: one test per rule, then properties over random memberships and rules."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from random import Random

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from logbroker.config import BrokerConfig, SpreadPolicy
from logbroker.placement import (
    NoLiveReplicaError,
    NoQuorumError,
    Placement,
    PlacementError,
    PlacementNode,
    PlacementRule,
    SpreadError,
    domain_violations,
    place,
    preferred_leader,
    replace,
    segment_key,
)

HARD = SpreadPolicy.HARD
SOFT = SpreadPolicy.SOFT
KEYS = [segment_key(f"orders.{index % 16}", index * 1000) for index in range(3000)]


def node(node_id: str, zone: str | None = None, *, alive: bool = True) -> PlacementNode:
    return PlacementNode(node_id, () if zone is None else (("zone", zone),), alive)


def zoned(rf: int, min_domains: int, policy: SpreadPolicy = SOFT) -> PlacementRule:
    return PlacementRule(rf, "zone", min_domains, policy)


# -- values ---------------------------------------------------------------------------------------


def test_segment_key() -> None:
    assert segment_key("orders.3", 4096) == "orders.3@4096"


def test_rule_from_settings() -> None:
    config, _ = BrokerConfig.from_env(
        {
            "SVC_CONTROL_PLANE": "etcd://etcd-1:2379",
            "SVC_LOG_REPLICATION_FACTOR": "3",
            "SVC_LOG_ATTRIBUTES": "zone=a,rack=r1",
            "SVC_LOG_SPREAD_BY": "zone",
            "SVC_LOG_MIN_DOMAINS": "2",
            "SVC_LOG_SPREAD_POLICY": "hard",
        },
        cwd="/srv",
    )
    rule = PlacementRule.from_settings(config.cluster)
    assert rule == PlacementRule(3, "zone", 2, HARD)
    assert rule.quorum == 2
    assert PlacementNode("n1", config.cluster.attributes).attribute("zone") == "a"


@pytest.mark.parametrize(
    ("rf", "spread_by", "min_domains", "message"),
    [
        (0, None, 1, "replication_factor must be an integer of at least 1"),
        (True, None, 1, "replication_factor must be an integer of at least 1"),
        (3, "", 1, "spread_by must be an attribute name or None"),
        (3, "zone", 0, "min_domains must be an integer of at least 1"),
        (3, None, 2, "min_domains 2 needs spread_by"),
        (2, "zone", 3, "min_domains 3 exceeds the replication factor 2"),
    ],
)
def test_rule_is_checked(rf: int, spread_by: str | None, min_domains: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlacementRule(rf, spread_by, min_domains)


@pytest.mark.parametrize(
    ("node_id", "attributes", "message"),
    [
        ("", (), "node_id must be a non-empty string"),
        ("n1", [("zone", "a")], "must be a tuple of"),
        ("n1", (("zone", ""),), "must be a tuple of"),
        ("n1", (("zone", "a", "b"),), "must be a tuple of"),
        ("n1", (("zone", "a"), ("zone", "b")), "names an attribute twice"),
    ],
)
def test_node_is_checked(node_id: str, attributes: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlacementNode(node_id, attributes)  # type: ignore[arg-type]


@pytest.mark.parametrize("replicas", [(), ("n1", "n1"), ("n1", "")])
def test_placement_is_checked(replicas: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="distinct node ids"):
        Placement(replicas, spread_met=True, short=False)


def test_node_listed_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="'n1' is listed twice"):
        place("t.0@0", [node("n1"), node("n2"), node("n1", alive=False)], PlacementRule(1))


def test_scores_are_pinned() -> None:
    """Nodes of different releases must rank alike: changing the hash fails here."""
    nodes = [node(f"n{index}") for index in range(8)]
    placed = {key: place(key, nodes, PlacementRule(3)).replicas for key in KEYS[:4]}
    assert placed == {
        "orders.0@0": ("n5", "n4", "n2"),
        "orders.1@1000": ("n6", "n4", "n0"),
        "orders.2@2000": ("n2", "n5", "n7"),
        "orders.3@3000": ("n6", "n7", "n5"),
    }


# -- place: one test per rule ---------------------------------------------------------------------


def test_hard_refusal_names_attribute_domains_and_minimum() -> None:
    nodes = [
        node("a1", "a"),
        node("a2", "a"),
        node("b1", "b"),
        node("x"),
        node("c1", "c", alive=False),
    ]
    with pytest.raises(SpreadError) as raised:
        place("orders.0@0", nodes, zoned(4, 4, HARD))
    error = raised.value
    assert error.reason == "no_quorum"
    assert (error.attribute, error.domains, error.min_domains) == (
        "zone",
        ("a", "b", "x (no zone)"),
        4,
    )
    assert str(error) == (
        "cannot place segment orders.0@0: SVC_LOG_SPREAD_BY=zone needs SVC_LOG_MIN_DOMAINS=4"
        " distinct values among the live nodes, but they span only 3 (a, b, x (no zone)); bring up"
        " nodes in another zone, or set SVC_LOG_SPREAD_POLICY=soft to place anyway and count the"
        " segment in svc_domain_violations"
    )


def test_soft_places_and_flags_a_missed_spread() -> None:
    nodes = [node("a1", "a"), node("a2", "a"), node("b1", "b"), node("c1", "c", alive=False)]
    placement = place("orders.0@0", nodes, zoned(3, 3, SOFT))
    assert set(placement.replicas) == {"a1", "a2", "b1"}
    assert not placement.spread_met
    assert not placement.short
    assert domain_violations([placement.replicas], nodes, zoned(3, 3, SOFT)) == 1


def test_too_few_live_nodes_for_a_quorum_is_refused() -> None:
    nodes = [node("n1"), node("n2", alive=False), node("n3", alive=False)]
    with pytest.raises(NoQuorumError) as raised:
        place("orders.0@0", nodes, PlacementRule(3))
    error = raised.value
    assert error.reason == "no_quorum"
    assert (error.live, error.quorum) == (("n1",), 2)
    assert error.detail == str(error)
    assert str(error) == (
        "cannot place segment orders.0@0: 1 live node(s) (n1) is fewer than the write quorum of"
        " 2 for SVC_LOG_REPLICATION_FACTOR=3; bring nodes back or add some"
    )
    with pytest.raises(NoQuorumError, match=r"0 live node\(s\) \(none\)"):
        place("orders.0@0", [], PlacementRule(1))


def test_a_quorum_but_fewer_than_rf_places_a_short_set() -> None:
    nodes = [node("n1"), node("n2"), node("n3", alive=False)]
    placement = place("orders.0@0", nodes, PlacementRule(3))
    assert set(placement.replicas) == {"n1", "n2"}
    assert placement.short
    assert placement.spread_met


def test_a_node_without_the_attribute_is_a_domain_of_its_own() -> None:
    nodes = [node("a1", "a"), node("a2", "a"), node("a3", "a"), node("x")]
    for key in KEYS[:50]:
        placement = place(key, nodes, zoned(2, 2, HARD))
        assert "x" in placement.replicas
        assert placement.spread_met
    assert domain_violations([("a1", "x"), ("a1", "a2")], nodes, zoned(2, 2)) == 1


def test_dead_nodes_are_ignored() -> None:
    nodes = [node(f"n{index}", alive=index % 3 != 0) for index in range(9)]
    live = [each for each in nodes if each.alive]
    for key in KEYS[:200]:
        placement = place(key, nodes, PlacementRule(3))
        assert placement == place(key, live, PlacementRule(3))
        assert all(int(member[1:]) % 3 != 0 for member in placement.replicas)


def test_primaries_spread_over_nodes_not_domains() -> None:
    """Zone a has four nodes, b and c one each: b1 and c1 are in every set, yet every node is
    the primary of about a sixth of the segments."""
    nodes = [node(f"a{index}", "a") for index in range(4)] + [node("b1", "b"), node("c1", "c")]
    placements = [place(key, nodes, zoned(3, 3, HARD)) for key in KEYS]
    assert all({"b1", "c1"} <= set(placement.replicas) for placement in placements)
    primaries = Counter(placement.primary for placement in placements)
    assert set(primaries) == {each.node_id for each in nodes}
    for count in primaries.values():
        assert abs(count - len(KEYS) / 6) < 5 * math.sqrt(len(KEYS) / 6)


def test_without_a_spread_the_best_ranked_nodes_hold_it() -> None:
    nodes = [node(f"n{index}", "a") for index in range(6)]
    for key in KEYS[:50]:
        assert (
            place(key, nodes, zoned(3, 1)).replicas == place(key, nodes, PlacementRule(3)).replicas
        )


# -- replace --------------------------------------------------------------------------------------


def test_replace_keeps_live_members_in_order_and_appends() -> None:
    nodes = [node("a1", "a", alive=False), node("a2", "a"), node("b1", "b"), node("c1", "c")]
    nodes += [node("b2", "b"), node("c2", "c")]
    repaired = replace("orders.0@0", ("a1", "b1", "c1"), nodes, zoned(3, 3, HARD))
    # The primary died: the next member leads, and the only node restoring zone a is appended.
    assert repaired == Placement(("b1", "c1", "a2"), spread_met=True, short=False)


def test_replace_leaves_a_healthy_set_alone() -> None:
    nodes = [node(f"n{index}", "abc"[index % 3]) for index in range(9)]
    for key in KEYS[:50]:
        placement = place(key, nodes, zoned(3, 3))
        assert replace(key, placement.replicas, nodes, zoned(3, 3)) == placement


def test_replace_fills_a_short_set_and_forgets_unknown_members() -> None:
    nodes = [node("n1"), node("n2"), node("n3")]
    repaired = replace("orders.0@0", ("n2", "gone"), nodes, PlacementRule(3))
    assert repaired.replicas[0] == "n2"
    assert set(repaired.replicas) == {"n1", "n2", "n3"}
    assert not repaired.short


def test_replace_does_not_refuse_a_missed_spread() -> None:
    nodes = [node("a1", "a"), node("a2", "a"), node("b1", "b", alive=False)]
    repaired = replace("orders.0@0", ("a1", "b1"), nodes, zoned(2, 2, HARD))
    assert repaired == Placement(("a1", "a2"), spread_met=False, short=False)


def test_replace_with_no_live_member_is_refused() -> None:
    nodes = [node("n1", alive=False), node("n2", alive=False), node("n3"), node("n4")]
    with pytest.raises(NoLiveReplicaError) as raised:
        replace("orders.0@0", ("n1", "n2"), nodes, PlacementRule(2))
    assert raised.value.reason == "no_quorum"
    assert str(raised.value) == (
        "cannot repair segment orders.0@0: none of its replicas (n1, n2) is alive, so there is"
        " no copy to backfill from; bring one of them back"
    )


def test_replace_below_quorum_is_refused() -> None:
    nodes = [node("n1"), node("n2", alive=False), node("n3", alive=False)]
    with pytest.raises(NoQuorumError, match=r"cannot repair segment orders\.0@0: 1 live node"):
        replace("orders.0@0", ("n1", "n2", "n3"), nodes, PlacementRule(3))


@pytest.mark.parametrize("replicas", [(), ("n1", "n1")])
def test_replace_checks_the_current_set(replicas: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="distinct node ids"):
        replace("orders.0@0", replicas, [node("n1")], PlacementRule(1))


# -- domain_violations ----------------------------------------------------------------------------


def test_domain_violations_judges_live_members_only() -> None:
    nodes = [node("a1", "a"), node("a2", "a"), node("b1", "b"), node("b2", "b", alive=False)]
    nodes.append(node("x"))
    replica_sets = [
        ("a1", "b1"),  # met
        ("a1", "x"),  # met: x is a domain of its own
        ("a1", "a2"),  # one zone
        ("a1", "b2"),  # b2 is dead
        ("a1", "gone"),  # not a member of the cluster
    ]
    assert domain_violations(replica_sets, nodes, zoned(2, 2)) == 3
    assert domain_violations(replica_sets, nodes, zoned(2, 1)) == 0
    assert domain_violations(replica_sets, nodes, PlacementRule(2)) == 0


# -- properties -----------------------------------------------------------------------------------

ZONE_CHOICES = ["a", "b", "c", "d", None]


@st.composite
def memberships(draw: st.DrawFn, max_size: int = 10) -> list[PlacementNode]:
    numbers = draw(st.lists(st.integers(0, 40), unique=True, max_size=max_size))
    return [
        node(
            f"n{number}",
            draw(st.sampled_from(ZONE_CHOICES)),
            alive=draw(st.sampled_from([True, True, True, False])),
        )
        for number in numbers
    ]


@st.composite
def rules(draw: st.DrawFn) -> PlacementRule:
    rf = draw(st.integers(1, 5))
    if draw(st.booleans()):
        return zoned(rf, draw(st.integers(1, rf)), draw(st.sampled_from(SpreadPolicy)))
    return PlacementRule(rf)


keys = st.builds(
    segment_key, st.sampled_from(["orders.0", "orders.1", "a.b.7"]), st.integers(0, 10**9)
)


def live_domains(nodes: Sequence[PlacementNode]) -> int:
    """Distinct zones of the live nodes, an unlabelled node being its own."""
    return len({each.attribute("zone") or f"?{each.node_id}" for each in nodes if each.alive})


def placed_domains(nodes: Sequence[PlacementNode], members: Sequence[str]) -> int:
    by_id = {each.node_id: each for each in nodes}
    return len({by_id[member].attribute("zone") or f"?{member}" for member in members})


def try_place(key: str, nodes: Sequence[PlacementNode], rule: PlacementRule) -> Placement | None:
    try:
        return place(key, nodes, rule)
    except PlacementError:
        return None


@settings(max_examples=200)
@given(keys, memberships(), rules())
def test_place_is_sound(key: str, nodes: list[PlacementNode], rule: PlacementRule) -> None:
    live = {each.node_id for each in nodes if each.alive}
    spread_possible = not rule.spreads or live_domains(nodes) >= rule.min_domains
    refused = len(live) < rule.quorum or (rule.policy is HARD and not spread_possible)
    placement = try_place(key, nodes, rule)
    assert (placement is None) == refused
    if placement is None:
        return
    replicas = placement.replicas
    assert len(set(replicas)) == len(replicas) == min(rule.replication_factor, len(live))
    assert set(replicas) <= live
    assert placement.short == (len(replicas) < rule.replication_factor)
    # Spread met whenever the live domains allow it; else every live domain is used.
    assert placement.spread_met == spread_possible
    if rule.spreads:
        assert placed_domains(nodes, replicas) >= min(rule.min_domains, live_domains(nodes))
    assert domain_violations([replicas], nodes, rule) == (0 if placement.spread_met else 1)
    # The primary is the best-ranked live node, spread or not.
    assert placement.primary == place(key, nodes, PlacementRule(1)).primary


@settings(max_examples=150)
@given(keys, memberships(), rules(), st.randoms(use_true_random=False))
def test_place_ignores_the_order_of_nodes(
    key: str, nodes: list[PlacementNode], rule: PlacementRule, random: Random
) -> None:
    shuffled = list(nodes)
    random.shuffle(shuffled)
    assert try_place(key, shuffled, rule) == try_place(key, nodes, rule)


@settings(max_examples=150)
@given(keys, memberships(), rules())
def test_dead_nodes_do_not_matter(
    key: str, nodes: list[PlacementNode], rule: PlacementRule
) -> None:
    live = [each for each in nodes if each.alive]
    assert try_place(key, nodes, rule) == try_place(key, live, rule)


@settings(max_examples=200)
@given(keys, memberships(), rules(), st.integers(0, 9), st.booleans())
def test_losing_a_node_moves_only_its_own_slot(
    key: str, nodes: list[PlacementNode], rule: PlacementRule, which: int, dies: bool
) -> None:
    live = [each for each in nodes if each.alive]
    assume(live)
    lost = live[which % len(live)]
    if dies:
        after = [
            node(lost.node_id, lost.attribute("zone"), alive=False) if each is lost else each
            for each in nodes
        ]
    else:
        after = [each for each in nodes if each is not lost]
    before_placement, after_placement = try_place(key, nodes, rule), try_place(key, after, rule)
    assume(before_placement is not None and after_placement is not None)
    assert before_placement is not None
    assert after_placement is not None
    before, now = before_placement.replicas, after_placement.replicas
    event("lost a member" if lost.node_id in before else "lost a bystander")
    if lost.node_id not in before:
        assert now == before
    else:
        assert set(before) - {lost.node_id} <= set(now)
        assert len(set(now) - set(before)) <= 1
        if len(before) > 1:
            # Repairing the old set gives the same members as placing afresh.
            assert set(replace(key, before, after, rule).replicas) == set(now)


@settings(max_examples=200)
@given(keys, memberships(), rules(), st.sampled_from(ZONE_CHOICES))
def test_a_joining_node_takes_at_most_one_slot(
    key: str, nodes: list[PlacementNode], rule: PlacementRule, zone: str | None
) -> None:
    before_placement = try_place(key, nodes, rule)
    after_placement = try_place(key, [*nodes, node("joiner", zone)], rule)
    assume(before_placement is not None and after_placement is not None)
    assert before_placement is not None
    assert after_placement is not None
    before, now = set(before_placement.replicas), set(after_placement.replicas)
    event("joiner took a slot" if "joiner" in now else "joiner took none")
    assert now - before <= {"joiner"}
    assert len(before - now) <= 1


@settings(max_examples=12)
@given(
    st.lists(st.sampled_from(["a", "b", "c"]), min_size=3, max_size=8),
    st.integers(1, 5),
    st.integers(1, 3),
)
def test_primaries_are_shared_evenly(zone_of: list[str], rf: int, min_domains: int) -> None:
    """Each node leads about its share of segments, spread or not, however the zones are sized;
    without a spread, each also holds about its share of all replicas."""
    nodes = [node(f"n{index}", zone) for index, zone in enumerate(zone_of)]
    rf = min(rf, len(nodes))
    rule = zoned(rf, min(min_domains, rf), SOFT)
    placements = [place(key, nodes, rule) for key in KEYS[:1500]]
    expected = len(placements) / len(nodes)
    primaries = Counter(placement.primary for placement in placements)
    for each in nodes:
        assert abs(primaries[each.node_id] - expected) < 5 * math.sqrt(expected)
    if not rule.spreads:
        held = Counter(member for placement in placements for member in placement.replicas)
        for each in nodes:
            assert abs(held[each.node_id] - rf * expected) < 5 * math.sqrt(rf * expected)


@st.composite
def current_sets(draw: st.DrawFn, nodes: list[PlacementNode]) -> tuple[str, ...]:
    pool = [each.node_id for each in nodes] + ["gone1", "gone2"]
    return tuple(draw(st.lists(st.sampled_from(pool), unique=True, min_size=1, max_size=5)))


@settings(max_examples=200)
@given(keys, rules(), st.data())
def test_replace_keeps_every_live_member(
    key: str, rule: PlacementRule, data: st.DataObject
) -> None:
    nodes = data.draw(memberships())
    current = data.draw(current_sets(nodes))
    live = {each.node_id for each in nodes if each.alive}
    kept = [member for member in current if member in live]
    try:
        repaired = replace(key, current, nodes, rule)
    except NoLiveReplicaError:
        assert not kept
        return
    except NoQuorumError:
        assert len(live) < rule.quorum
        return
    replicas = repaired.replicas
    assert list(replicas[: len(kept)]) == kept
    assert len(set(replicas)) == len(replicas)
    assert set(replicas) <= live
    slots = max(0, min(rule.replication_factor, len(live)) - len(kept))
    assert len(replicas) == len(kept) + slots
    if rule.spreads:
        assert placed_domains(nodes, replicas) >= min(
            rule.min_domains, placed_domains(nodes, kept) + slots, live_domains(nodes)
        )
    assert domain_violations([replicas], nodes, rule) == (0 if repaired.spread_met else 1)


# -- the preferred leader ---------------------------------------------------------------------


@settings(max_examples=200)
@given(st.integers(0, 10_000), st.permutations(["n0", "n1", "n2", "n3", "n4"]), st.integers(1, 5))
def test_the_preferred_leader_is_the_first_primary_of_the_range_in_any_order(
    index: int, order: list[str], size: int
) -> None:
    """Among any replica set, in any order, the preferred leader is the member placement ranks
    first for the range's first segment: the primary ``place`` gave it, when that one is in."""
    range_id = f"orders.{index}"
    members = tuple(order[:size])
    preferred = preferred_leader(range_id, members)
    assert preferred in members
    assert preferred == preferred_leader(range_id, tuple(reversed(members)))
    first = place(segment_key(range_id, 0), [node(each) for each in members], zoned(size, 1))
    assert first.primary == preferred


def test_preferred_leaders_are_shared_evenly() -> None:
    """Over many ranges on the same three nodes, each node is the preferred leader of about a
    third: handing ranges back to them balances leadership."""
    ranges = 3000
    preferred = Counter(
        preferred_leader(f"idle-{index:04d}.0", ("a", "b", "c")) for index in range(ranges)
    )
    expected = ranges / 3
    assert set(preferred) == {"a", "b", "c"}
    for count in preferred.values():
        assert abs(count - expected) < 5 * math.sqrt(expected)


def test_an_empty_replica_set_has_no_preferred_leader() -> None:
    with pytest.raises(ValueError, match=r"orders\.0: an empty replica set has no leader"):
        preferred_leader("orders.0", ())
