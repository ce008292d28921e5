"""A node's lease while etcd answers its keepalives late, or holds one of them: etcd renewed the
lease when it took each keepalive, so an answer that comes within the TTL keeps it, and one
keepalive held does not hold back the next. A registration answered late counts once a
keepalive is answered."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, succeed
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
        #: How late etcd takes (and answers) each grant, in turn; then at once.
        self.grants_after: list[float] = []
        self.grants = 0
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

    def grant(self, ttl: int) -> Deferred[int]:
        self.grants += 1
        if not self.grants_after:
            return succeed(result_of(self.store.grant(ttl)))
        # Taken late (held on the way, or queued behind other requests), answered at once.
        answer: Deferred[int] = Deferred()
        self._clock.callLater(
            self.grants_after.pop(0), lambda: answer.callback(result_of(self.store.grant(ttl)))
        )
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


def registering(
    grants_after: list[float], answer_after: float
) -> tuple[Clock, LateKeepalives, Membership, list[str]]:
    """A node starting against an etcd that takes its grants ``grants_after`` (in turn) and
    answers every keepalive ``answer_after`` seconds late; what it tells its listeners, in
    order."""
    clock = Clock()
    etcd = LateKeepalives(MemoryKeyValueStore(clock), clock)
    etcd.grants_after = grants_after
    etcd.answer_after = answer_after
    record = NodeRecord("n1", "n1.internal", 4040, 4041, 4042, (("zone", "a"),), "0.1")
    node = Membership(etcd, PREFIX, record, clock, TTL_MS)  # type: ignore[arg-type]
    told: list[str] = []
    node.on_lease_lost.append(lambda: told.append("lost"))
    node.on_lease_regained.append(lambda: told.append("registered"))
    node.startService()
    return clock, etcd, node, told


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


def test_a_grant_answered_after_a_ttl_counts_once_a_keepalive_is_answered() -> None:
    # The grant went out as the node lost etcd, and was answered 11 s later, once it reached
    # etcd again: by the node's count from the sending, the lease may have run out.
    clock, etcd, node, told = registering([11.0], answer_after=0.25)
    registered = node.registered()
    advance(clock, 11.0)
    assert told == []
    assert not node.holds_lease
    assert not registered.called

    advance(clock, 0.25)  # the keepalive sent with the answer to the grant is answered

    assert told == ["registered"]
    assert node.holds_lease
    assert registered.called
    advance(clock, 10)
    assert told == ["registered"]
    assert etcd.grants == 1
    result_of(node.stopService())


def test_an_etcd_answering_everything_half_a_ttl_late_lets_a_node_register() -> None:
    clock, etcd, node, told = registering([1.5] * 100, answer_after=1.5)

    advance(clock, 30)

    # Registered once and kept: the keepalive sent when the grant was answered renewed it.
    assert told == ["registered"]
    assert node.holds_lease
    assert etcd.grants == 1
    assert node.lease_age() == 2.0  # renewed by the keepalive of t=28, answered at t=29.5
    result_of(node.stopService())


def test_a_late_registration_whose_keepalives_go_unanswered_is_lost_after_a_ttl() -> None:
    clock, etcd, node, told = registering([2.0], answer_after=0.0)
    etcd.held = {0, 1, 2, 3}  # the keepalives sent at t=2 (with the grant's answer), 2, 3, 4

    advance(clock, 4.75)
    assert told == []
    assert etcd.grants == 1
    advance(clock, 0.25)  # a TTL after the late registration, with no keepalive answered

    # Lost, and registered again at once under a new lease, answered in time.
    assert told == ["lost", "registered"]
    assert etcd.grants == 2
    assert node.holds_lease
    result_of(node.stopService())
