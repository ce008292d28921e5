"""The replica rules on their own (``logbroker.replication.core.replica``)."""

from __future__ import annotations

import attrs
from hypothesis import given
from hypothesis import strategies as st

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.replication.core import replica as rules
from logbroker.replication.core.replica import Authority, CopyView, Decision, Step
from logbroker.replication.replica_codec import CopyOutcome, ReplicateRequest
from logbroker.storage import CopyState


def _record(epoch: int = 2, replicas: str = "abc", sealed: int | None = None) -> SegmentMeta:
    if sealed is None:
        return SegmentMeta("r.0", 0, SegmentState.ACTIVE, None, None, tuple(replicas), epoch)
    return SegmentMeta("r.0", 0, SegmentState.SEALED, sealed, sealed * 10, tuple(replicas), epoch)


def _copy(epoch: int | None = 2, tail: int = 5, durable: int = 5) -> CopyView:
    return CopyView(CopyState.ACTIVE, epoch, False, tail, tail, tail * 10, durable)


def _request(epoch: int = 2, offset: int = 5, data: bytes = b"x") -> ReplicateRequest:
    return ReplicateRequest("r.0", 0, epoch, offset, offset * 10, 0, data)


def test_only_the_claimer_of_the_current_epoch_may_write() -> None:
    assert rules.authority(_record(2), 2, "a") is Authority.ACCEPT
    assert rules.authority(_record(2), 2, "b") is Authority.FENCED, "b is not first"
    assert rules.authority(_record(3), 2, "a") is Authority.FENCED, "an older epoch"
    assert rules.authority(_record(1), 2, "a") is Authority.UNKNOWN, "this view lags the claim"
    assert rules.authority(None, 0, "a") is Authority.UNKNOWN


def test_bytes_are_taken_where_the_copy_ends_at_the_claimer_s_epoch() -> None:
    assert rules.replicate_step(_copy(), _request(), "a", _record()) == Decision(
        Step.APPEND, epoch=2
    )
    assert rules.replicate_step(_copy(), _request(offset=7), "a", _record()) == Decision(
        Step.ANSWER, CopyOutcome.MISMATCH
    )
    assert rules.replicate_step(_copy(), _request(), "b", _record()) == Decision(
        Step.ANSWER, CopyOutcome.FENCED
    ), "from a node that did not claim the epoch"


def test_a_newer_epoch_cuts_an_older_tail_and_an_older_one_is_fenced() -> None:
    older_copy = _copy(epoch=1, tail=9)
    assert rules.replicate_step(older_copy, _request(offset=5), "a", _record()).step is Step.CUT
    newer_copy = _copy(epoch=3)
    assert rules.replicate_step(newer_copy, _request(), "a", _record(2)) == Decision(
        Step.ANSWER, CopyOutcome.FENCED
    )


def test_a_copy_sealed_here_takes_nothing_and_a_missing_one_is_started() -> None:
    sealed = attrs.evolve(_copy(), state=CopyState.SEALED)
    assert rules.replicate_step(sealed, _request(), "a", _record()).outcome is CopyOutcome.FENCED
    missing = CopyView(None, None)
    assert rules.replicate_step(missing, _request(offset=0), "a", _record()).step is Step.START
    unknown = _copy(epoch=None)
    assert rules.replicate_step(unknown, _request(), "a", _record()).step is Step.UNAVAILABLE


def test_a_commit_notice_is_noted_only_at_the_copy_s_epoch() -> None:
    notice = _request(data=b"")
    assert rules.replicate_step(_copy(), notice, "a", _record()).step is Step.NOTE_COMMIT
    assert rules.replicate_step(_copy(epoch=1), notice, "a", _record()) == Decision(
        Step.ANSWER, CopyOutcome.OK
    )


@given(
    copy_epoch=st.integers(0, 4),
    request_epoch=st.integers(0, 4),
    record_epoch=st.integers(0, 4),
    sender=st.sampled_from("abc"),
    first=st.sampled_from("abc"),
    offset=st.integers(0, 8),
)
def test_nothing_is_appended_but_the_current_claimer_s_bytes(
    copy_epoch: int, request_epoch: int, record_epoch: int, sender: str, first: str, offset: int
) -> None:
    record = _record(record_epoch, first + "".join(n for n in "abc" if n != first))
    decision = rules.replicate_step(
        _copy(copy_epoch), _request(request_epoch, offset), sender, record
    )
    if decision.step is Step.APPEND:
        assert sender == first
        assert request_epoch == record_epoch
        assert request_epoch >= copy_epoch
        assert decision.epoch == request_epoch


def test_a_copy_is_trusted_only_in_the_replica_set_at_the_segment_s_epoch() -> None:
    record = _record(2, "abc", sealed=9)
    whole = attrs.evolve(_copy(), state=CopyState.SEALED, next_offset=9)
    assert rules.trusted(whole, record, "b")
    assert not rules.trusted(whole, record, "d"), "not in the replica set"
    assert not rules.trusted(attrs.evolve(whole, epoch=1), record, "b"), "another epoch"
    assert not rules.trusted(attrs.evolve(whole, damaged=True), record, "b")
    assert rules.holds_whole(whole, record, "b", 9)
    assert not rules.holds_whole(whole, record, "b", 10)
    assert rules.stale(whole, record, "d")
    assert not rules.stale(whole, record, "b")
    assert not rules.stale(whole, _record(2, "abc"), "d"), "not sealed yet"


def test_a_copy_serves_only_what_it_knows_is_committed() -> None:
    active = _record(2)
    copy = _copy(tail=9, durable=8)
    assert rules.committed_end(copy, active, "b", commit=6) == 6
    assert rules.committed_end(copy, active, "b", commit=20) == 8, "not past what is durable"
    assert rules.committed_end(copy, active, "d", commit=6) == 0, "untrusted: nothing"
    sealed = _record(2, sealed=7)
    assert rules.committed_end(copy, sealed, "b", commit=3) == 3
    closed = attrs.evolve(copy, state=CopyState.SEALED, next_offset=7)
    assert rules.committed_end(closed, sealed, "b", commit=0) == 7
