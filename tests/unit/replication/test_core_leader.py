"""``LeaderCore`` on its own: a hypothesis state machine feeds it writes, replicas that store,
lose, refuse, reorder and fence, local fsyncs and the passing of time, and checks after every
step what acknowledging on a quorum means."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from logbroker.errors import Reason
from logbroker.replication.core.actions import (
    Acknowledge,
    Action,
    Commit,
    Park,
    ReadBack,
    Refuse,
    ReplicationSettings,
    Send,
    Settle,
    StepDown,
)
from logbroker.replication.core.leader import LeaderCore
from logbroker.replication.core.quorum import CopyEnd
from logbroker.replication.replica_codec import CopyOutcome, CopyStatus

REPLICAS = ("a", "b", "c")
SETTINGS = ReplicationSettings(
    replication_factor=3,
    window_bytes=64,
    max_message_bytes=48,
    backlog_bytes=1 << 20,
    ack_timeout_seconds=5.0,
)


def _new_core() -> LeaderCore:
    """A leader of segment 0 at epoch 1 on ``REPLICAS``, from time 0, its copy empty."""
    return LeaderCore(
        node_id="a",
        range_id="r",
        segment=0,
        epoch=1,
        replicas=REPLICAS,
        copies={"a": CopyEnd(0, 0)},
        settings=SETTINGS,
        now=0.0,
    )


@attrs.define
class _Copy:
    """A scripted replica's copy: where its bytes end, and whether it is fenced past us."""

    offset: int = 0
    position: int = 0
    fenced: bool = False


class LeaderMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.now = 0.0
        self.core = _new_core()
        self.copies = {node: _Copy() for node in REPLICAS[1:]}
        #: What the local log holds durably (the primary's copy).
        self.local_durable = 0
        self.written = 0
        #: Sends not yet delivered, in send order (the network may reorder them).
        self.in_flight: list[Send] = []
        self.waiting: dict[int, int] = {}
        self.acknowledged: list[int] = []
        self.acked_ends: list[int] = []
        self.refused: dict[int, Refuse] = {}
        self.settled: dict[int, bool] = {}
        self.stopped: StepDown | None = None
        self.commit_seen = 0
        #: How far the primary's readers were told they may read: a ``Commit``'s index, as far
        #: as the primary's copy held it durably when told.
        self.readable_told = 0
        #: Replicas the core parked (dead in the membership), not told back yet.
        self.parked: set[str] = set()
        #: The offset each write ends at, by the byte position it ends at: a send is whole
        #: writes, so its end position tells how many records it holds.
        self.ends_at = {0: 0}
        self.run(self.core.start(self.now))

    # -- the world ---------------------------------------------------------------------------

    def run(self, actions: Sequence[Action]) -> None:
        for action in actions:
            assert self.stopped is None or not isinstance(action, (Send, ReadBack)), (
                "a stopped leader sends nothing"
            )
            if isinstance(action, Send):
                assert action.node not in self.parked, "a parked replica is sent nothing"
                self.in_flight.append(action)
            elif isinstance(action, Park):
                assert action.node not in self.parked, "parked once until it is back"
                self.parked.add(action.node)
            elif isinstance(action, ReadBack):
                raise AssertionError("the backlog holds everything in this machine")
            elif isinstance(action, Commit):
                assert action.index >= self.commit_seen, "the commit index never goes back"
                self.commit_seen = action.index
                self.readable_told = max(self.readable_told, min(action.index, self.local_durable))
            elif isinstance(action, Acknowledge):
                for ticket in action.tickets:
                    end = self.waiting.pop(ticket)
                    assert end <= self.commit_seen
                    self.acknowledged.append(ticket)
                    self.acked_ends.append(end)
            elif isinstance(action, Refuse):
                for ticket in action.tickets:
                    self.waiting.pop(ticket)
                    self.refused[ticket] = action
            elif isinstance(action, Settle):
                for ticket in action.tickets:
                    assert self.refused[ticket].in_doubt, "only doubts are settled"
                    assert ticket not in self.settled, "settled once"
                    self.settled[ticket] = action.committed
            else:
                assert self.stopped is None, "a leader stops once"
                self.stopped = action

    def status(self, node: str, outcome: CopyOutcome) -> CopyStatus:
        copy = self.copies[node]
        return CopyStatus(outcome, 2 if copy.fenced else 1, copy.offset, copy.position)

    # -- rules -------------------------------------------------------------------------------

    @rule(records=st.integers(1, 5), size=st.integers(1, 40))
    def append(self, records: int, size: int) -> None:
        if self.core.refusal(lambda node: True) is not None:
            return
        offset = self.written
        self.written += records
        self.core.wrote(offset, self.written, bytes(size))
        self.ends_at[self.core.position] = self.written
        ticket, actions = self.core.wait(self.written, self.now)
        self.waiting[ticket] = self.written
        self.run(actions)

    @rule()
    def flush(self) -> None:
        self.run(self.core.flush(self.now))

    @rule(data=st.data())
    def local_fsync(self, data: st.DataObject) -> None:
        if self.local_durable < self.written:
            self.local_durable = data.draw(st.integers(self.local_durable + 1, self.written))
            self.run(self.core.locally_durable(self.local_durable, self.now))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        send = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        copy = self.copies[send.node]
        request = send.request
        if send.notice:
            outcome = CopyOutcome.FENCED if copy.fenced else CopyOutcome.OK
            self.run(
                self.core.notice_answered(send.node, self.status(send.node, outcome), self.now)
            )
            return
        if copy.fenced:
            outcome = CopyOutcome.FENCED
        elif request.offset == copy.offset and request.position == copy.position:
            copy.position += len(request.data)
            copy.offset = self.ends_at[copy.position]
            outcome = CopyOutcome.OK
        else:
            outcome = CopyOutcome.MISMATCH
        status = self.status(send.node, outcome)
        self.run(self.core.answered(send.node, send.generation, status, self.now))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        """The link fails; ``live``: whether the membership has the replica alive then."""
        send = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        live = data.draw(st.booleans())
        if not send.notice:
            self.run(self.core.send_failed(send.node, send.generation, self.now, live))

    @rule(node=st.sampled_from(REPLICAS[1:]))
    def member_back(self, node: str) -> None:
        was_parked = node in self.parked
        self.parked.discard(node)
        actions = self.core.member_back(node, self.now)
        self.run(actions)
        if was_parked and self.stopped is None and self.copies[node].offset < self.written:
            assert any(isinstance(a, Send) and a.node == node for a in actions), (
                "a replica back from the dead is sent what it lacks at once"
            )

    @rule(node=st.sampled_from(REPLICAS[1:]))
    def fence(self, node: str) -> None:
        """Another node takes the segment over: this replica refuses us from now on."""
        self.copies[node].fenced = True

    @rule(seconds=st.floats(0.0, 3.0))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.run(self.core.tick(self.now))

    @rule()
    def check_quorum(self) -> None:
        self.run(self.core.check_quorum(self.now, lambda node: None, lambda node: True))

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def acknowledged_means_a_quorum_holds_it(self) -> None:
        for end in self.acked_ends:
            holders = (self.local_durable >= end) + sum(
                copy.offset >= end for copy in self.copies.values()
            )
            assert holders >= SETTINGS.quorum

    @invariant()
    def the_commit_index_is_what_a_quorum_holds(self) -> None:
        ends = sorted([self.local_durable, *(c.offset for c in self.copies.values())])
        assert self.core.commit <= ends[-SETTINGS.quorum]
        assert self.core.commit <= self.core.written

    @invariant()
    def the_primary_s_readers_are_told_of_every_record_its_copy_can_show(self) -> None:
        # Committed records its copy holds durably, whichever of the two came last.
        if self.stopped is None:
            assert self.readable_told == min(self.core.commit, self.local_durable)

    @invariant()
    def acknowledgements_go_out_in_offset_order(self) -> None:
        assert self.acked_ends == sorted(self.acked_ends)

    @invariant()
    def a_stopped_leader_leaves_nothing_waiting(self) -> None:
        if self.stopped is not None:
            assert not self.waiting
            doubts = [t for t, r in self.refused.items() if r.in_doubt]
            assert all(t in self.settled for t in doubts), "every doubt settles at the stop"

    @invariant()
    def a_fenced_answer_stops_it(self) -> None:
        if self.stopped is not None and not self.stopped.resign:
            assert self.stopped.reason is Reason.NOT_PRIMARY

    @invariant()
    def doubts_settled_committed_are_committed(self) -> None:
        for ticket, committed in self.settled.items():
            if committed:
                assert self.refused[ticket].in_doubt


TestLeaderCore = LeaderMachine.TestCase


def test_a_dead_replica_is_parked_not_retried_until_it_is_back() -> None:
    core = _new_core()
    core.wrote(0, 1, b"x" * 10)
    sent = [a for a in core.flush(0.0) if isinstance(a, Send)]
    assert {send.node for send in sent} == {"b", "c"}
    to_c = next(send for send in sent if send.node == "c")
    assert core.send_failed("c", to_c.generation, 0.1, False) == [Park("c")]
    # Nothing is timed for it, and nothing is sent to it, however long it stays dead.
    assert core.deadline() is None
    for now in (1.0, 10.0, 100.0):
        assert not [a for a in core.tick(now) if isinstance(a, Send) and a.node == "c"]
    back = core.member_back("c", 101.0)
    assert [(send.node, send.request.offset) for send in back if isinstance(send, Send)] == [
        ("c", 0)
    ]
    assert core.member_back("c", 102.0) == [], "told once; not parked any more"


def test_records_a_replica_stored_while_its_answers_were_lost_commit_once_it_answers() -> None:
    # Two replicas stopped (SIGSTOP) just after they stored a write: their answers never come,
    # the append is refused in doubt, and once they are back they answer that their copies
    # end past what they are sent. No other append comes (the producer waits for the fate of
    # this one): the commit must move on their word, or the doubt never settles.
    core = _new_core()
    core.wrote(0, 1, b"x" * 10)
    ticket, _ = core.wait(1, 0.0)
    sent = [a for a in core.flush(0.0) if isinstance(a, Send)]
    core.locally_durable(1, 0.0)
    for send in sent:
        assert core.send_failed(send.node, send.generation, 1.0, False) == [Park(send.node)]
    refused = [a for a in core.tick(5.0) if isinstance(a, Refuse)]
    assert [(r.tickets, r.in_doubt) for r in refused] == [((ticket,), True)]

    [again] = [a for a in core.member_back("b", 9.0) if isinstance(a, Send)]
    assert again.request.offset == 0, "sent from where the leader last knew the copy ended"
    answer = CopyStatus(CopyOutcome.MISMATCH, 1, 1, 10)
    actions = core.answered("b", again.generation, answer, 9.1)

    assert Commit(1) in actions
    assert Settle((ticket,), committed=True) in actions
    assert core.commit == 1


def test_a_copy_of_an_older_epoch_that_ends_further_commits_nothing() -> None:
    # Its bytes past where this leader's copy agrees with it may be another primary's.
    core = _new_core()
    core.wrote(0, 2, b"x" * 20)
    core.wait(2, 0.0)
    sent = [a for a in core.flush(0.0) if isinstance(a, Send) and a.node == "b"]
    core.locally_durable(2, 0.0)
    actions = core.answered(
        "b", sent[0].generation, CopyStatus(CopyOutcome.MISMATCH, 0, 2, 20), 0.1
    )
    assert not [a for a in actions if isinstance(a, Commit)]
    assert core.commit == 0
