"""``SegmentLeader``: acknowledgement on a quorum, fencing, rewinds and the ack deadline, with a
real range log and scripted replicas."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.failure import Failure

from logbroker.broker.errors import BrokerError, InDoubtError
from logbroker.errors import Reason
from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.window import PeerError
from logbroker.records import Record
from logbroker.replication.core.actions import ReplicationSettings, StepDown
from logbroker.replication.core.quorum import CopyEnd
from logbroker.replication.primary import ParkedReplicas, SegmentLeader
from logbroker.replication.replica_codec import (
    CopyOutcome,
    CopyStatus,
    ReplicateRequest,
    decode_replicate,
    encode_status,
)
from logbroker.storage import LogConfig, RangeLog
from logbroker.storage._format import scan_batches
from logbroker.testing import ImmediateExecutor, MemoryFileSystem


class Replicas:
    """Scripted replicas: every replicate request waits in ``sent`` for the test to answer."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, ReplicateRequest, Deferred[bytes]]] = []

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        assert op is PeerOp.REPLICATE
        answer: Deferred[bytes] = Deferred()
        self.sent.append((node_id, decode_replicate(payload), answer))
        return answer

    def to(self, node: str) -> list[tuple[ReplicateRequest, Deferred[bytes]]]:
        return [(request, answer) for sent_to, request, answer in self.sent if sent_to == node]

    def answer(self, node: str, outcome: CopyOutcome = CopyOutcome.OK, epoch: int = 1) -> None:
        """Answer every open request to ``node`` as stored (or with ``outcome``)."""
        for request, answer in self.to(node):
            if not answer.called:
                end = (
                    request.offset + _count(request.data, request.offset)
                    if outcome is CopyOutcome.OK
                    else request.offset
                )
                position = request.position + len(request.data)
                answer.callback(encode_status(CopyStatus(outcome, epoch, end, position)))


def _count(data: bytes, base_offset: int = 0) -> int:
    scan = scan_batches(data, 0, base_offset)
    return sum(batch.record_count for batch in scan.batches)


def _records(n: int = 2) -> list[Record]:
    return [Record(key=b"k", value=f"v{i}".encode(), timestamp_ms=1) for i in range(n)]


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _open_log(clock: Clock) -> RangeLog:
    fs = MemoryFileSystem()
    opened = RangeLog.open(
        "/data/r",
        fs=fs,
        clock=clock,
        executor=ImmediateExecutor(),
        config=LogConfig(replicated=True, auto_roll=False),
    )
    range_log: RangeLog = opened.result  # type: ignore[attr-defined]
    range_log.start_segment(0, 1)
    return range_log


def _leader(
    clock: Clock,
    replicas: Replicas,
    *,
    live: Callable[[str], bool] = lambda node: True,
    commits: list[int] | None = None,
    holds_lease: Callable[[], bool] = lambda: True,
    steps: list[StepDown] | None = None,
    stopped: list[SegmentLeader] | None = None,
    records_before: int = 0,
    parked: ParkedReplicas | None = None,
) -> tuple[SegmentLeader, RangeLog]:
    """A leader of segment 0 at epoch 1 on replicas a (this node), b and c; its copy holds
    ``records_before`` records when it starts, the others' are unknown."""
    range_log = _open_log(clock)
    own_end = CopyEnd(0, 0)
    if records_before:
        written = range_log.write(_records(records_before), None, 1)
        own_end = CopyEnd(written.base_offset + written.record_count, len(written.data))

    def stepped_down(leader: SegmentLeader, step: StepDown) -> None:
        if steps is not None:
            steps.append(step)
        if stopped is not None:
            stopped.append(leader)

    leader = SegmentLeader(
        node_id="a",
        range_id="r",
        segment=0,
        epoch=1,
        replicas=("a", "b", "c"),
        range_log=range_log,
        copies={"a": own_end},
        requester=replicas,
        clock=clock,
        settings=ReplicationSettings(replication_factor=3, ack_timeout_seconds=5.0),
        is_live=live,
        on_commit=(commits.append if commits is not None else lambda commit: None),
        holds_lease=holds_lease,
        on_step_down=stepped_down,
        parked=ParkedReplicas() if parked is None else parked,
    )
    return leader, range_log


def _outcome(deferred: Deferred[None]) -> list[object]:
    seen: list[object] = []
    deferred.addBoth(seen.append)
    return seen


def test_an_append_is_acknowledged_once_a_quorum_is_durable(clock: Clock) -> None:
    replicas = Replicas()
    commits: list[int] = []
    leader, range_log = _leader(clock, replicas, commits=commits)
    outcome = _outcome(leader.append(_records(2)))
    assert replicas.sent == [], "sent once the reactor turn's appends are all in"
    clock.advance(0)
    # Sent to both replicas at once, with the same stored bytes.
    ((request_b, _),) = replicas.to("b")
    ((request_c, _),) = replicas.to("c")
    assert request_b == request_c
    assert (request_b.offset, request_b.position, request_b.epoch) == (0, 0, 1)
    assert outcome == [], "the primary alone is not a quorum"
    assert range_log.end_offset == 0, "readers see nothing uncommitted"
    replicas.answer("c")
    assert outcome == [None]
    assert leader.commit == 2
    assert commits == [2]
    assert range_log.end_offset == 2


def test_acknowledgements_go_out_in_offset_order(clock: Clock) -> None:
    replicas = Replicas()
    leader, _ = _leader(clock, replicas)
    first = _outcome(leader.append(_records(1)))
    clock.advance(0)
    second = _outcome(leader.append(_records(1)))
    clock.advance(0)
    assert len(replicas.to("b")) == 2, "pipelined: the second goes before the first is answered"
    replicas.answer("b")
    assert first == [None]
    assert second == [None]


def test_the_appends_of_one_reactor_turn_go_to_each_replica_as_one_message(
    clock: Clock,
) -> None:
    replicas = Replicas()
    leader, _ = _leader(clock, replicas)
    outcomes = [_outcome(leader.append(_records(1))) for _ in range(3)]
    clock.advance(0)
    for node in "bc":
        ((request, _),) = replicas.to(node)
        assert (request.offset, _count(request.data)) == (0, 3)
    replicas.answer("b")
    assert outcomes == [[None], [None], [None]]


def test_a_fenced_replica_stops_the_leader(clock: Clock) -> None:
    replicas = Replicas()
    leader, _ = _leader(clock, replicas)
    outcome = _outcome(leader.append(_records()))
    clock.advance(0)
    replicas.answer("b", CopyOutcome.FENCED, epoch=2)
    assert leader.stopped
    (failure,) = outcome
    assert isinstance(failure, Failure)
    assert failure.value.reason is Reason.NOT_PRIMARY
    refused = leader.refusal(1)
    assert refused is not None
    assert refused.reason is Reason.NOT_PRIMARY


def test_a_leader_fenced_as_it_starts_is_handed_to_on_step_down(clock: Clock) -> None:
    # A replica can answer before the constructor returns (here at once, as a failed link
    # does): the leader is passed along with its step-down, not found through a name its
    # creator has not bound yet (simulation seed 1291: a forwarded append failed with an
    # internal error).
    class AnsweringFenced(Replicas):
        def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
            answered = super().request(node_id, op, payload)
            answered.callback(encode_status(CopyStatus(CopyOutcome.FENCED, 2, 0, 0)))
            return answered

    steps: list[StepDown] = []
    stopped: list[SegmentLeader] = []
    leader, _ = _leader(clock, AnsweringFenced(), steps=steps, stopped=stopped, records_before=2)

    assert leader.stopped
    assert stopped == [leader]
    assert [step.reason for step in steps] == [Reason.NOT_PRIMARY]


def test_a_mismatch_rewinds_to_where_the_copy_ends(clock: Clock) -> None:
    replicas = Replicas()
    leader, _ = _leader(clock, replicas)
    leader.append(_records(1))
    clock.advance(0)
    leader.append(_records(1))
    clock.advance(0)
    (first, answer), _ = replicas.to("b")
    # b says its copy ends at 0: the two requests are forgotten and it is sent from 0 again.
    answer.callback(encode_status(CopyStatus(CopyOutcome.MISMATCH, 1, 0, 0)))
    resent = replicas.to("b")[2:]
    assert [request.offset for request, _ in resent] == [0]
    assert len(resent[0][0].data) > len(first.data), "both batches in one message"


def test_a_failed_link_is_retried_after_a_back_off(clock: Clock) -> None:
    replicas = Replicas()
    leader, _ = _leader(clock, replicas)
    outcome = _outcome(leader.append(_records()))
    clock.advance(0)
    ((_, answer),) = replicas.to("b")
    answer.errback(PeerError(PeerReason.UNREACHABLE, "link down"))
    assert len(replicas.to("b")) == 1
    clock.advance(0.05)
    assert len(replicas.to("b")) == 2, "sent again after the back-off"
    replicas.answer("b")
    assert outcome == [None]


def test_a_streak_of_failures_to_a_replica_is_logged_once(clock: Clock) -> None:
    # A node leads thousands of ranges, each retrying a dead replica: one line per streak.
    replicas = Replicas()
    leader, _ = _leader(clock, replicas)
    logged: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        leader.append(_records())
        clock.advance(0)
        for tries in range(1, 4):
            replicas.to("b")[-1][1].errback(PeerError(PeerReason.UNREACHABLE, "link down"))
            clock.advance(1.0)
            assert len(replicas.to("b")) == tries + 1
        replicas.answer("b")
        leader.append(_records())
        clock.advance(0)
        replicas.to("b")[-1][1].errback(PeerError(PeerReason.UNREACHABLE, "link down again"))
    finally:
        globalLogPublisher.removeObserver(logged.append)

    failures = [
        event["error"]
        for event in logged
        if str(event.get("log_format", "")).startswith("Replicating {range_id} to {node} failed")
    ]
    assert failures == ["unreachable: link down", "unreachable: link down again"]


def test_too_few_live_replicas_refuse_at_once(clock: Clock) -> None:
    replicas = Replicas()
    leader, _ = _leader(clock, replicas, live=lambda node: node == "a")
    refused = leader.refusal(1)
    assert refused is not None
    assert refused.reason is Reason.NO_QUORUM
    (failure,) = _outcome(leader.append(_records()))
    assert isinstance(failure, Failure)
    assert failure.value.reason is Reason.NO_QUORUM
    assert replicas.sent == [], "nothing stored when refused"


def test_a_produce_not_committed_in_time_answers_no_quorum(clock: Clock) -> None:
    replicas = Replicas()
    leader, _ = _leader(clock, replicas)
    outcome = _outcome(leader.append(_records()))
    clock.advance(4.9)
    assert outcome == []
    clock.advance(0.2)
    (failure,) = outcome
    assert isinstance(failure, Failure)
    assert isinstance(failure.value, BrokerError)
    assert failure.value.reason is Reason.NO_QUORUM
    assert "retry" in str(failure.value)


def test_a_lagging_replica_is_caught_up_from_disk(clock: Clock) -> None:
    replicas = Replicas()
    range_log = _open_log(clock)
    leader = SegmentLeader(
        node_id="a",
        range_id="r",
        segment=0,
        epoch=1,
        replicas=("a", "b", "c"),
        range_log=range_log,
        copies={"a": CopyEnd(0, 0)},
        requester=replicas,
        clock=clock,
        # A backlog too small for two appends: the first is gone from memory by the time b
        # asks for it again.
        settings=ReplicationSettings(replication_factor=3, backlog_bytes=1),
        is_live=lambda node: True,
        on_commit=lambda commit: None,
        parked=ParkedReplicas(),
    )
    leader.append(_records(1))
    clock.advance(0)
    leader.append(_records(1))
    clock.advance(0)
    replicas.answer("c")
    (_, answer), _ = replicas.to("b")
    answer.callback(encode_status(CopyStatus(CopyOutcome.MISMATCH, 1, 0, 0)))
    resent = replicas.to("b")[2:]
    assert [request.offset for request, _ in resent] == [0]
    assert _count(resent[0][0].data) == 2, "read back from the log: both batches"


def test_replicas_are_told_the_commit_once_nothing_else_goes_to_them(clock: Clock) -> None:
    replicas = Replicas()
    leader, _ = _leader(clock, replicas)
    leader.append(_records(2))
    clock.advance(0)
    replicas.answer("b")  # committed (a and b); c's message is still in flight
    assert leader.commit == 2
    clock.advance(ReplicationSettings(replication_factor=3).commit_notice_seconds)

    ((notice, _),) = replicas.to("b")[1:]
    assert (notice.data, notice.commit, notice.offset, notice.epoch) == (b"", 2, 2, 1)
    assert len(replicas.to("c")) == 1, "c has a message in flight: its answer comes first"

    replicas.answer("c")
    replicas.answer("b")
    clock.advance(1.0)
    # c's message carried commit 0: once it is answered, c is told too, and only once.
    ((notice, _),) = replicas.to("c")[1:]
    assert (notice.data, notice.commit) == (b"", 2)
    assert len(replicas.to("b")) == 2


def test_a_produce_refused_in_doubt_learns_its_fate_when_the_quorum_answers(
    clock: Clock,
) -> None:
    replicas = Replicas()
    leader, _ = _leader(clock, replicas)
    outcome = _outcome(leader.append(_records()))
    clock.advance(5.1)
    (failure,) = outcome
    assert isinstance(failure, Failure)
    assert isinstance(failure.value, InDoubtError), "its records are still in the log"
    fate = _outcome(failure.value.fate)
    assert fate == []
    replicas.answer("b")
    assert fate == [True], "committed after all: a retry is answered as stored"


def test_appends_in_doubt_are_settled_unknown_when_the_leader_stops(clock: Clock) -> None:
    replicas = Replicas()
    leader, _ = _leader(clock, replicas)
    outcome = _outcome(leader.append(_records()))
    clock.advance(5.1)
    (failure,) = outcome
    fate = _outcome(failure.value.fate)  # type: ignore[union-attr]
    replicas.answer("b", CopyOutcome.FENCED, epoch=2)
    assert fate == [False], "fenced: only the next leader knows"
    assert leader.stopped


def test_a_leader_without_its_lease_sends_nothing_and_stops(clock: Clock) -> None:
    replicas = Replicas()
    lease = {"held": True}
    steps: list[StepDown] = []
    leader, _ = _leader(clock, replicas, holds_lease=lambda: lease["held"], steps=steps)
    first = _outcome(leader.append(_records()))
    lease["held"] = False
    clock.advance(0)  # the flush of this turn's appends
    assert replicas.sent == [], "a node without its lease sends nothing it had queued"
    assert leader.stopped
    (failure,) = first
    assert isinstance(failure, Failure)
    assert failure.value.reason is Reason.UNREACHABLE  # type: ignore[union-attr]
    assert [step.resign for step in steps] == [False]


def test_a_leader_that_hears_no_quorum_for_a_lease_ttl_resigns(clock: Clock) -> None:
    replicas = Replicas()
    steps: list[StepDown] = []
    leader, _ = _leader(clock, replicas, steps=steps)
    heard = {"b": 0.0, "c": 0.0}
    clock.advance(4.0)
    heard["b"] = 4.0
    leader.check_quorum(heard.get)
    assert not leader.stopped, "b was heard from: with this node, a quorum"
    clock.advance(5.5)
    leader.check_quorum(heard.get)
    assert leader.stopped
    (step,) = steps
    assert step.resign
    assert step.reason is Reason.NOT_PRIMARY
    assert "b, c" in step.message


def test_a_leader_whose_replicas_are_dead_does_not_resign(clock: Clock) -> None:
    replicas = Replicas()
    leader, _ = _leader(clock, replicas, live=lambda node: node == "a")
    clock.advance(10.0)
    leader.check_quorum(lambda node: None)
    assert not leader.stopped, "no quorum is alive anywhere: resigning helps no one"


def test_leaders_wait_for_a_dead_replica_without_retrying_and_resume_when_it_is_back(
    clock: Clock,
) -> None:
    replicas = Replicas()
    parked = ParkedReplicas()
    alive = {"a", "b"}
    leader, _ = _leader(clock, replicas, live=alive.__contains__, parked=parked)
    other, _ = _leader(clock, replicas, live=alive.__contains__, parked=parked)
    acked = [_outcome(leader.append(_records(1))), _outcome(other.append(_records(1)))]
    clock.advance(0)
    replicas.answer("b")
    assert acked == [[None], [None]], "b and this node are a quorum"
    for _, answer in replicas.to("c"):
        answer.errback(PeerError(PeerReason.UNREACHABLE, "no link to c"))
    assert parked.nodes() == ["c"]
    clock.advance(60)
    assert len(replicas.to("c")) == 2, "nothing sent to c while it is dead, on no timer"
    parked.resume_live(alive.__contains__)
    assert len(replicas.to("c")) == 2, "still dead"
    alive.add("c")
    parked.resume_live(alive.__contains__)
    assert len(replicas.to("c")) == 4, "each leader sends c what it lacks once it is back"
    assert parked.nodes() == []
    # A leader that stops waits for no one.
    for _, answer in replicas.to("c")[2:]:
        answer.errback(PeerError(PeerReason.UNREACHABLE, "c died again"))
    alive.discard("c")
    assert parked.nodes() == [], "c answered nothing, but was alive when it failed: retried"
    clock.advance(1)
    for _, answer in replicas.to("c")[4:]:
        answer.errback(PeerError(PeerReason.UNREACHABLE, "no link to c"))
    assert parked.nodes() == ["c"]
    leader.step_down(BrokerError(Reason.NOT_PRIMARY, "sealed"))
    other.step_down(BrokerError(Reason.NOT_PRIMARY, "sealed"))
    assert parked.nodes() == []


def _three_leaders_parked_on_c(clock: Clock, replicas: Replicas, alive: set[str]) -> ParkedReplicas:
    """Three leaders whose first append reached b, and whose send to c failed while c was
    dead: each parks c."""
    parked = ParkedReplicas()
    leaders = [_leader(clock, replicas, live=alive.__contains__, parked=parked)[0] for _ in "xyz"]
    for leader in leaders:
        leader.append(_records(1))
    clock.advance(0)
    replicas.answer("b")
    for _, answer in replicas.to("c"):
        answer.errback(PeerError(PeerReason.UNREACHABLE, "no link to c"))
    return parked


def test_the_leaders_waiting_for_a_dead_replica_log_it_once_between_them(clock: Clock) -> None:
    # A survivor of a failover leads thousands of segments that all wait for the dead node.
    replicas = Replicas()
    alive = {"a", "b"}
    logged: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        parked = _three_leaders_parked_on_c(clock, replicas, alive)
        alive.add("c")
        parked.resume_live(alive.__contains__)
    finally:
        globalLogPublisher.removeObserver(logged.append)

    lines = [formatEvent(event) for event in logged]
    assert not [line for line in lines if line.startswith("Replicating")], lines
    waits = [line for line in lines if "wait for c" in line]
    assert waits == [
        "The leaders here wait for c, dead in the membership: it is sent what it lacks once"
        " it is alive again"
    ]
    assert [line for line in lines if "alive again:" in line] == [
        "c is alive again: 3 leaders here send it what it lacks"
    ]


def test_leaders_are_told_a_node_is_back_a_share_at_each_sweep(clock: Clock) -> None:
    replicas = Replicas()
    alive = {"a", "b"}
    parked = _three_leaders_parked_on_c(clock, replicas, alive)
    alive.add("c")
    logged: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        parked.resume_live(alive.__contains__, at_most=2)
        assert len(replicas.to("c")) == 3 + 2, "two of the three leaders sent c what it lacks"
        assert parked.nodes() == ["c"]
        parked.resume_live(alive.__contains__, at_most=2)
        assert len(replicas.to("c")) == 3 + 3
        assert parked.nodes() == []
    finally:
        globalLogPublisher.removeObserver(logged.append)
    lines = [formatEvent(event) for event in logged]
    assert [line for line in lines if "alive again:" in line] == [
        "c is alive again: 3 leaders here send it what it lacks"
    ]
