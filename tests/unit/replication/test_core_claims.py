"""The claim rules on their own (``logbroker.replication.core.claims``)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbroker.config import SpreadPolicy
from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.placement import NoQuorumError, PlacementNode, PlacementRule, preferred_leader
from logbroker.replication.core import claims
from logbroker.replication.core.claims import Ends, FencedOut, NoQuorum
from logbroker.replication.core.quorum import CopyEnd, quorum_size
from logbroker.replication.replica_codec import CopyOutcome, CopyStatus

RULE = PlacementRule(3, None, 1, SpreadPolicy.SOFT)


def _active(replicas: str = "abc", epoch: int = 1, base: int = 0) -> SegmentMeta:
    return SegmentMeta("r.0", base, SegmentState.ACTIVE, None, None, tuple(replicas), epoch)


def _nodes(ids: str) -> list[PlacementNode]:
    return [PlacementNode(node) for node in ids]


def test_the_first_live_replica_takes_a_dead_primary_over() -> None:
    meta = _active("abc")
    live = {"b", "c"}.__contains__
    assert claims.should_take_over(meta, "b", live)
    assert not claims.should_take_over(meta, "c", live), "b comes first"
    assert not claims.should_take_over(meta, "b", lambda node: True), "a is alive"
    assert not claims.should_take_over(meta, "d", live), "d holds no copy"


def test_the_preferred_leader_takes_a_range_back_from_a_live_primary() -> None:
    preferred = preferred_leader("r.0", ("a", "b", "c"))
    others = [node for node in "abc" if node != preferred]
    led_elsewhere = _active("".join([others[0], preferred, others[1]]))

    def everyone(node: str) -> bool:
        return True

    assert claims.should_take_back(led_elsewhere, preferred, everyone)
    assert not claims.should_take_back(led_elsewhere, others[1], everyone), "not preferred"
    assert not claims.should_take_back(
        _active("".join([preferred, *others])), preferred, everyone
    ), "it leads it already"
    assert not claims.should_take_back(led_elsewhere, preferred, lambda node: node != others[1]), (
        "a member is dead: its return would move the range again"
    )
    sealed = attrs.evolve(led_elsewhere, state=SegmentState.SEALED, record_count=1, byte_size=9)
    assert not claims.should_take_back(sealed, preferred, everyone), "a roll is under way"
    assert not claims.should_take_back(_active("".join(others)), preferred, everyone), "no copy"


def test_a_claim_bumps_the_epoch_and_puts_the_claimer_first() -> None:
    assert claims.claimed(_active("abc", epoch=4), "c") == _active("cab", epoch=5)
    assert claims.claimed(_active("abc"), "d") is None


def test_stepping_aside_moves_the_node_last_at_the_same_epoch() -> None:
    assert claims.stepped_aside(_active("abc", epoch=3), "a") == _active("bca", epoch=3)


def _status(
    end: int, outcome: CopyOutcome = CopyOutcome.OK, epoch: int = 2, data_epoch: int = 0
) -> CopyStatus:
    return CopyStatus(outcome, epoch, end, end * 10, data_epoch=data_epoch)


def test_a_fence_needs_a_quorum_with_the_claimer_among_it() -> None:
    meta = _active("abc", epoch=2)
    ends = claims.fence_outcome(meta, {"a": _status(5), "c": _status(7)}, "a", 2)
    assert ends == Ends({"a": CopyEnd(5, 50), "c": CopyEnd(7, 70)}, 0)
    assert claims.fence_outcome(meta, {"b": _status(5), "c": _status(7)}, "a", 2) == NoQuorum(
        2, ("a",)
    ), "the claimer's own copy must be among them"
    assert claims.fence_outcome(meta, {"a": _status(5), "b": None}, "a", 2) == NoQuorum(
        1, ("b", "c")
    )
    fenced = {"a": _status(5), "b": _status(0, CopyOutcome.FENCED, epoch=9)}
    assert claims.fence_outcome(meta, fenced, "a", 2) == FencedOut("b", 9)


@given(
    st.integers(3, 5).flatmap(
        lambda rf: st.tuples(
            st.just(rf),
            st.lists(st.integers(0, 100), min_size=rf, max_size=rf),
            st.sets(st.integers(0, rf - 1), min_size=quorum_size(rf)),
        )
    )
)
def test_the_seal_point_of_any_quorum_holds_every_acknowledged_record(
    case: tuple[int, list[int], set[int]],
) -> None:
    """Every acknowledged record is on a quorum; any quorum of answers shares a copy with it,
    so the longest end among them is past every acknowledged record."""
    rf, durable, answering = case
    acknowledged = sorted(durable, reverse=True)[quorum_size(rf) - 1]
    ends = {str(i): CopyEnd(durable[i], durable[i]) for i in answering}
    _, end = claims.seal_point(ends, "0")
    assert end.offset >= acknowledged


def test_a_claim_goes_on_with_the_latest_primary_s_records_and_counts_older_ones_as_empty() -> None:
    meta = _active("abc", epoch=4)
    # c was fenced late: it still holds what the epoch 1 primary wrote, more than a and b hold
    # of the epoch 3 primary's records.
    answers = {"a": _status(5, data_epoch=3), "b": _status(4, data_epoch=3)}
    answers["c"] = _status(9, data_epoch=1)
    outcome = claims.fence_outcome(meta, answers, "a", 2)
    assert outcome == Ends({"a": CopyEnd(5, 50), "b": CopyEnd(4, 40), "c": CopyEnd(0, 0)}, 3)
    assert isinstance(outcome, Ends)
    assert claims.seal_point(outcome.ends, "a") == ("a", CopyEnd(5, 50))
    # No copy holds records: the claim's own epoch is theirs from now on.
    empty = {"a": _status(0, data_epoch=3), "c": _status(0, data_epoch=1)}
    assert claims.fence_outcome(meta, empty, "a", 2) == Ends(
        {"a": CopyEnd(0, 0), "c": CopyEnd(0, 0)}, 4
    )


@given(
    st.integers(3, 5).flatmap(
        lambda rf: st.tuples(
            st.just(rf),
            st.integers(1, 50),
            st.lists(st.tuples(st.integers(0, 3), st.integers(0, 100)), min_size=rf, max_size=rf),
            st.sets(st.integers(0, rf - 1), min_size=quorum_size(rf)),
            st.sets(st.integers(0, rf - 1), min_size=quorum_size(rf)),
        )
    )
)
def test_a_claim_finds_every_acknowledged_record_whatever_older_primaries_left_behind(
    case: tuple[int, int, list[tuple[int, int]], set[int], set[int]],
) -> None:
    """The records acknowledged at data epoch 2 (up to ``acknowledged``) are on a quorum of
    copies of that data epoch; the others hold an older primary's records (any length), or
    the same primary's (any length), or none. Fenced late, every copy says so at the claim's
    epoch: any quorum of answers leads to data epoch 2 and a seal point past them all."""
    rf, acknowledged, others, holding, answering = case
    statuses = {}
    for i in range(rf):
        older, length = others[i]
        if i in holding:
            statuses[str(i)] = _status(acknowledged + length % 3, epoch=5, data_epoch=2)
        else:
            statuses[str(i)] = _status(length, epoch=5, data_epoch=min(older, 2))
    meta = _active("".join(str(i) for i in range(rf)), epoch=5)
    claimer = str(min(answering))
    answers = {node: statuses[node] if int(node) in answering else None for node in statuses}

    outcome = claims.fence_outcome(meta, answers, claimer, quorum_size(rf))

    assert isinstance(outcome, Ends)
    assert outcome.data_epoch == 2
    holder, end = claims.seal_point(outcome.ends, claimer)
    assert end.offset >= acknowledged
    assert statuses[holder].data_epoch == 2


def test_a_seal_records_whose_records_it_sealed_when_they_are_an_older_primary_s() -> None:
    by_claim = claims.sealed(_active("ab", epoch=4), 10, 100, 2)
    assert (by_claim.data_epoch, by_claim.records_epoch) == (2, 2)
    by_roll = claims.sealed(_active("ab", epoch=4), 10, 100, 4)
    assert (by_roll.data_epoch, by_roll.records_epoch) == (None, 4)


def test_a_claim_whose_fence_found_no_quorum_steps_aside_only_when_cut_off() -> None:
    meta = _active("abc", epoch=2)
    silent = NoQuorum(1, ("b", "c"))
    alive = lambda node: True  # noqa: E731
    assert claims.steps_aside_after(silent, meta, 2, alive, lambda node: False)
    assert not claims.steps_aside_after(silent, meta, 2, alive, lambda node: node == "b"), (
        "it heard from b lately: not cut off"
    )
    assert not claims.steps_aside_after(silent, meta, 2, "a".__contains__, lambda node: False), (
        "b and c are dead: no quorum anywhere"
    )


def test_the_next_segment_keeps_the_live_members_with_the_leader_first() -> None:
    sealed = claims.sealed(_active("bac", epoch=3, base=10), 25, 900, 3)
    assert (sealed.record_count, sealed.byte_size, sealed.state) == (15, 900, SegmentState.SEALED)
    following = claims.next_segment(sealed, "a", _nodes("abc"), RULE)
    assert following == SegmentMeta("r.0", 25, SegmentState.ACTIVE, None, None, ("a", "b", "c"), 0)
    assert claims.next_segment(sealed, "a", _nodes("bc"), RULE) is None, "a is not alive"
    with pytest.raises(NoQuorumError):
        claims.next_segment(sealed, "a", _nodes("a"), RULE)


def test_an_empty_segment_whose_copy_did_not_answer_gets_a_live_node_in_its_place() -> None:
    meta = _active("abc", epoch=2)
    kept = claims.kept_answered(meta, ["a", "b"], _nodes("abd"), RULE)
    assert kept.replicas == ("a", "b", "d")
    assert claims.kept_answered(meta, "abc", _nodes("abc"), RULE) is meta


def test_an_empty_segment_keeps_a_silent_copy_that_no_live_node_can_replace() -> None:
    meta = _active("abc", epoch=2)
    assert claims.kept_answered(meta, ["a", "b"], _nodes("ab"), RULE) is meta
    assert claims.kept_answered(meta, ["a", "b"], _nodes("abc"), RULE) is meta, "c is slow"


def test_an_empty_segment_placed_short_is_made_whole_on_its_claim() -> None:
    meta = _active("ab", epoch=2)
    assert claims.kept_answered(meta, ["a", "b"], _nodes("abc"), RULE).replicas == ("a", "b", "c")


def test_a_short_sealed_set_is_completed_with_live_nodes_keeping_its_members() -> None:
    sealed = claims.sealed(_active("ab", epoch=2), 10, 100, 2)
    completed = claims.completed_set(sealed, _nodes("bc"), RULE)
    assert completed == attrs.evolve(sealed, replicas=("a", "b", "c")), "a is down, kept"
    assert claims.completed_set(completed, _nodes("abcd"), RULE) is None, "full already"
    assert claims.completed_set(sealed, _nodes("ab"), RULE) is None, "no node to add"
