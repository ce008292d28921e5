"""A node's lease across a reactor turn that ran long: a keepalive etcd answered in time keeps
it, although its answer is read only after the turn's timers ran (the keepalive's deadline and
the lease's expiry were both due by then).

``TurnClock`` runs calls as Twisted's reactor does: each turn runs the calls due when it
starts, and a call made during a turn waits for the next, after the reactor has read its
connections (``tests/integration/test_reactor_turns.py`` holds the real reactor to this)."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from logbroker.cluster.membership import Membership, NodeRecord
from logbroker.testing import MemoryKeyValueStore

PREFIX = b"/logbroker/test/cluster/"


class TurnClock(Clock):
    def turn(self, seconds: float = 0.0) -> None:
        """One turn of the reactor, started ``seconds`` after the last: the calls due then
        run; those they make wait for the next turn, however short their delay."""
        self.rightNow += seconds
        due = [call for call in self.calls if call.getTime() <= self.rightNow]
        for call in due:
            if call in self.calls:  # not cancelled by an earlier one of this turn
                self.calls.remove(call)
                call.called = 1
                call.func(*call.args, **call.kw)

    def turns(self, seconds: float, step: float = 0.25) -> None:
        for _ in range(round(seconds / step)):
            self.turn(step)


class UnreadAnswers:
    """etcd that takes each keepalive at once, but whose answers wait in the node's connection
    while ``holding``, until the test reads them (the reactor's next poll)."""

    def __init__(self, store: MemoryKeyValueStore) -> None:
        self._store = store
        self.holding = False
        self.unread: list[tuple[Deferred[int], int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def keepalive(self, lease: int) -> Deferred[int]:
        taken = self._store.keepalive(lease)
        if not self.holding:
            return taken
        answer: Deferred[int] = Deferred()
        taken.addCallback(lambda remaining: self.unread.append((answer, remaining)))
        return answer

    def read(self) -> None:
        unread, self.unread = self.unread, []
        for answer, remaining in unread:
            if not answer.called:
                answer.callback(remaining)


def joined() -> tuple[TurnClock, UnreadAnswers, Membership, list[str]]:
    clock = TurnClock()
    etcd = UnreadAnswers(MemoryKeyValueStore(clock))
    record = NodeRecord("n1", "n1.internal", 4040, 4041, 4042, (("zone", "a"),), "0.1")
    node = Membership(etcd, PREFIX, record, clock, 3000)  # type: ignore[arg-type]
    lost: list[str] = []
    node.on_lease_lost.append(lambda: lost.append("lost"))
    node.startService()
    clock.turns(1.0)  # the keepalive of t=1 answered
    assert node.holds_lease
    return clock, etcd, node, lost


def test_a_keepalive_answered_during_a_long_turn_keeps_the_lease() -> None:
    clock, etcd, node, lost = joined()
    etcd.holding = True
    clock.turns(1.0)  # t=2: a keepalive goes out; etcd takes it at once
    assert len(etcd.unread) == 1

    # The turn that should have read its answer starts at t=4.5: the keepalive's deadline
    # (t=3) and the expiry of the lease etcd renewed last at t=1 (t=4) are both due.
    clock.turn(2.5)
    etcd.read()  # the same turn's poll of the connections
    clock.turn()

    assert lost == []
    assert node.holds_lease, "renewed as of t=2: held until t=5"
    etcd.holding = False
    clock.turns(5.0)
    assert lost == []
    assert node.holds_lease


def test_a_lease_whose_keepalive_is_not_answered_by_the_next_turn_is_lost() -> None:
    clock, etcd, node, lost = joined()
    etcd.holding = True
    clock.turns(1.0)

    clock.turn(2.5)
    assert not node.holds_lease, "read from the clock: no longer held past its expiry"
    clock.turn()  # nothing came in meanwhile

    assert lost == ["lost"]
    etcd.holding = False
    clock.turns(1.0)
    assert node.holds_lease, "registered again"
