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


def _copy(
    epoch: int | None = 2, tail: int = 5, durable: int = 5, data_epoch: int | None = None
) -> CopyView:
    """An active copy; its records are ``epoch``'s unless ``data_epoch`` says whose."""
    data_epoch = epoch if data_epoch is None else data_epoch
    return CopyView(CopyState.ACTIVE, epoch, data_epoch, False, tail, tail, tail * 10, durable)


def _request(
    epoch: int = 2, offset: int = 5, data: bytes = b"x", data_epoch: int | None = None
) -> ReplicateRequest:
    data_epoch = epoch if data_epoch is None else data_epoch
    return ReplicateRequest("r.0", 0, epoch, offset, offset * 10, 0, data, data_epoch=data_epoch)


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
    # Fenced late, the copy holds the epoch 1 primary's records: epoch 2's commit index is
    # not about them.
    fenced_late = _copy(epoch=2, data_epoch=1)
    assert rules.replicate_step(fenced_late, notice, "a", _record()) == Decision(
        Step.ANSWER, CopyOutcome.OK
    )
    # A claim completing copies with the epoch 1 primary's records says so.
    completing = _request(data=b"", data_epoch=1)
    assert rules.replicate_step(fenced_late, completing, "a", _record()).step is Step.NOTE_COMMIT


def test_a_copy_fenced_late_cuts_the_older_primary_s_records_wherever_the_request_starts() -> None:
    # The claim at epoch 2 went on without this copy and led the segment on empty; the fence
    # reached it afterwards. Its records are still the epoch 1 primary's.
    fenced_late = _copy(epoch=2, tail=5, data_epoch=1)
    for offset in (0, 3, 5, 7):
        decision = rules.replicate_step(fenced_late, _request(offset=offset), "a", _record())
        assert decision.step is Step.CUT, f"a request at offset {offset}"
    # The claimer's completion with those very records goes on where the copy ends.
    same = _request(offset=5, data_epoch=1)
    assert rules.replicate_step(fenced_late, same, "a", _record()) == Decision(Step.APPEND, epoch=2)


def test_an_empty_copy_takes_the_request_s_data_epoch_before_its_records() -> None:
    empty = _copy(epoch=3, tail=0, durable=0)
    claimed = _request(epoch=3, offset=0, data_epoch=1)
    assert rules.replicate_step(empty, claimed, "a", _record(3)).step is Step.CUT
    named = _copy(epoch=3, tail=0, durable=0, data_epoch=1)
    assert rules.replicate_step(named, claimed, "a", _record(3)) == Decision(Step.APPEND, epoch=3)


def test_only_a_copy_of_the_sealed_records_is_sealed_without_its_primary() -> None:
    rolled = _record(2, sealed=5)
    assert rules.seals_in_place(_copy(epoch=2), rolled)
    assert not rules.seals_in_place(_copy(epoch=2, data_epoch=1), rolled), "fenced late"
    assert not rules.seals_in_place(_copy(epoch=1), rolled)
    assert not rules.seals_in_place(_copy(epoch=None), rolled)
    # A claim at epoch 2 sealed the epoch 1 primary's records: its copies are fenced at 2.
    by_claim = attrs.evolve(rolled, data_epoch=1)
    assert rules.seals_in_place(_copy(epoch=2, data_epoch=1), by_claim)
    assert not rules.seals_in_place(_copy(epoch=2, data_epoch=0), by_claim)
    assert not rules.seals_in_place(_copy(epoch=2), by_claim)


@given(
    copy_epoch=st.integers(0, 4),
    copy_data_epoch=st.integers(0, 4),
    request_epoch=st.integers(0, 4),
    request_data_epoch=st.integers(0, 4),
    record_epoch=st.integers(0, 4),
    sender=st.sampled_from("abc"),
    first=st.sampled_from("abc"),
    offset=st.integers(0, 8),
)
def test_nothing_is_appended_but_the_current_claimer_s_bytes_to_the_same_primary_s_records(
    copy_epoch: int,
    copy_data_epoch: int,
    request_epoch: int,
    request_data_epoch: int,
    record_epoch: int,
    sender: str,
    first: str,
    offset: int,
) -> None:
    record = _record(record_epoch, first + "".join(n for n in "abc" if n != first))
    copy = _copy(copy_epoch, data_epoch=copy_data_epoch)
    request = _request(request_epoch, offset, data_epoch=request_data_epoch)
    decision = rules.replicate_step(copy, request, sender, record)
    if decision.step is Step.APPEND:
        assert sender == first
        assert request_epoch == record_epoch
        assert request_epoch >= copy_epoch
        assert decision.epoch == request_epoch
        assert copy_data_epoch == request_data_epoch
    if decision.step is Step.ANSWER and decision.outcome is CopyOutcome.MISMATCH:
        # The copy's end is only worth sending from if its records are the request's.
        assert copy_data_epoch == request_data_epoch


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


def test_an_open_copy_of_other_records_than_the_sealed_ones_is_not_trusted() -> None:
    sealed_by_claim = _record(2, "abc", sealed=5)
    fenced_late = _copy(epoch=2, tail=5, data_epoch=1)
    assert not rules.trusted(fenced_late, sealed_by_claim, "b")
    assert not rules.holds_whole(fenced_late, sealed_by_claim, "b", 5)
    assert rules.committed_end(fenced_late, sealed_by_claim, "b", commit=5) == 0
    # Sealed (by the claim's seal request, which names the records), it is.
    sealed_here = attrs.evolve(fenced_late, state=CopyState.SEALED, data_epoch=2)
    assert rules.trusted(sealed_here, sealed_by_claim, "b")
    # A copy its own primary wrote at the sealed epoch (a roll) is, still open.
    assert rules.trusted(_copy(epoch=2, tail=5), sealed_by_claim, "b")
    # While the claim goes on, the copy counts (its commit index says how far).
    assert rules.trusted(fenced_late, _record(2, "abc"), "b")
