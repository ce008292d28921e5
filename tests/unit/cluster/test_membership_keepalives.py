"""A node's lease while etcd answers its keepalives late, or holds one of them: etcd renewed the
lease when it took each keepalive, so an answer that comes within the TTL keeps it, and one
keepalive held does not hold back the next."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from logbroker.cluster.membership import Membership, NodeRecord
from logbroker.testing import MemoryKeyValueStore
from tests.unit.storage.helpers import result_of

PREFIX = b"/logbroker/test/cluster/"
TTL_MS = 3000


class LateKeepalives:
    """etcd that takes each keepalive at once (the lease is renewed then) and answers it
    ``answer_after`` seconds later; the keepalives numbered in ``held`` (from 0) it takes but
    answers only when the test ``release``s them, as a hung member would."""

    def __init__(self, store: MemoryKeyValueStore, clock: Clock) -> None:
        self.store = store
        self._clock = clock
        self.answer_after = 0.0
        self.held: set[int] = set()
        self.unanswered: dict[int, tuple[Deferred[int], int]] = {}
        self.sent: list[float] = []
        self.cancelled: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def keepalive(self, lease: int) -> Deferred[int]:
        number = len(self.sent)
        self.sent.append(self._clock.seconds())
        taken = result_of(self.store.keepalive(lease))
        answer: Deferred[int] = Deferred(lambda _: self.cancelled.append(self._clock.seconds()))
        if number in self.held:
            self.unanswered[number] = (answer, taken)
        else:
            self._clock.callLater(self.answer_after, _answer, answer, taken)
        return answer

    def release(self, number: int) -> None:
        _answer(*self.unanswered.pop(number))


def _answer(answer: Deferred[int], remaining: int) -> None:
    if not answer.called:
        answer.callback(remaining)


def joined() -> tuple[Clock, LateKeepalives, Membership, list[str]]:
    clock = Clock()
    etcd = LateKeepalives(MemoryKeyValueStore(clock), clock)
    record = NodeRecord("n1", "n1.internal", 4040, 4041, 4042, (("zone", "a"),), "0.1")
    node = Membership(etcd, PREFIX, record, clock, TTL_MS)  # type: ignore[arg-type]
    lost: list[str] = []
    node.on_lease_lost.append(lambda: lost.append("lost"))
    node.startService()
    assert node.holds_lease
    return clock, etcd, node, lost


def advance(clock: Clock, seconds: float, step: float = 0.25) -> None:
    for _ in range(round(seconds / step)):
        clock.advance(step)


def test_keepalives_answered_half_a_ttl_late_keep_the_lease() -> None:
    clock, etcd, node, lost = joined()
    # Each answer comes 1.5 s after its keepalive went out: after the next one is due.
    etcd.answer_after = 1.5

    advance(clock, 30)

    assert lost == []
    assert node.holds_lease
    assert etcd.cancelled == []
    # One keepalive every third of the TTL, none waiting for the answer to the one before.
    assert etcd.sent == [float(second) for second in range(1, 31)]
    # The last answered went out at t=28: etcd renewed the lease as of then.
    assert node.lease_age() == 2.0
    result_of(node.stopService())


def test_a_keepalive_never_answered_holds_back_neither_the_next_nor_the_lease() -> None:
    clock, etcd, node, lost = joined()
    etcd.held = {0}

    advance(clock, 2.5)
    # The first went out at t=1 and is held; the second went out on time and was answered.
    assert etcd.sent == [1.0, 2.0]
    assert node.lease_age() == 0.5
    # The held one is given up once the renewal it asked for would have run out (t=4).
    advance(clock, 1.25)
    assert etcd.cancelled == []
    advance(clock, 0.25)
    assert etcd.cancelled == [4.0]

    advance(clock, 10)
    assert lost == []
    assert node.holds_lease
    result_of(node.stopService())


def test_an_older_keepalive_answered_after_a_newer_one_renews_nothing() -> None:
    clock, etcd, node, lost = joined()
    etcd.held = {0}
    advance(clock, 2.0)  # the keepalive of t=2 answered at once; that of t=1 held
    assert node.lease_age() == 0.0

    clock.advance(0.5)
    etcd.release(0)

    # Still renewed as of t=2, not moved back to t=1.
    assert node.lease_age() == 0.5
    assert lost == []
    result_of(node.stopService())


def test_a_node_that_stops_leaves_its_keepalives_still_out_without_a_deadline() -> None:
    clock, etcd, node, lost = joined()
    etcd.held = {0, 1}
    advance(clock, 2.0)  # two keepalives out, unanswered

    result_of(node.stopService())
    etcd.store.stop()

    assert not clock.getDelayedCalls()
    etcd.release(0)
    etcd.release(1)
    assert not node.holds_lease
    assert lost == []
