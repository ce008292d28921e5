"""What is particular to the etcd control plane, on the etcd double: several nodes on one
store racing for the same names, segments and users, watches that drop or fall behind a
compaction, and a store that stops answering."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure

from logbroker.controlplane import (
    AclGrant,
    AlreadyExistsError,
    ContendedError,
    ControlPlaneClosedError,
    ControlPlaneUnavailableError,
    EtcdControlPlane,
    EtcdGatewayStore,
    InvalidChangeError,
    NotFoundError,
    OutcomeUnknownError,
    SegmentState,
    StateFileError,
    UserExistsError,
    UserNotFoundError,
)
from logbroker.controlplane._kv import Compare, DeletePrefix, Put, Result, Target
from logbroker.controlplane._state import ControlState, PutSegment
from logbroker.controlplane.etcd import (
    CATCH_UP_SECONDS,
    MAX_ATTEMPTS,
    RESOLVE_ATTEMPTS,
    RESOLVE_RETRY_SECONDS,
)
from logbroker.controlplane.follower import RESUME_DELAY
from logbroker.testing import MemoryKeyValueStore
from tests.unit.controlplane.helpers import active, make_topic, make_user, sealed
from tests.unit.storage.helpers import failure_of, result_of

PREFIX = "/logbroker/c1/"


@attrs.define
class Cluster:
    clock: Clock
    store: MemoryKeyValueStore
    nodes: list[EtcdControlPlane] = attrs.Factory(list)

    def node(self) -> EtcdControlPlane:
        control = EtcdControlPlane(self.store, prefix=PREFIX, clock=self.clock)
        result_of(control.start())
        self.nodes.append(control)
        return control


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    clock = Clock()
    made = Cluster(clock, MemoryKeyValueStore(clock))
    yield made
    made.store.unavailable = False
    made.store.release()
    for node in made.nodes:
        result_of(node.close())
    assert made.store.watch_count == 0
    assert clock.getDelayedCalls() == []


def test_a_change_on_one_node_is_seen_on_the_others(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    heard: list[set[str]] = []
    b.watch_segments(lambda changed: heard.append(set(changed)))
    topic, ranges = make_topic("orders", ranges=2)

    result_of(a.create_topic(topic, ranges))
    result_of(a.put_segment(active("orders.1", 0)))

    assert heard == [{"orders.1"}]
    assert b.topics() == [topic]
    assert list(b.ranges("orders")) == ranges
    assert b.segments("orders.1") == [active("orders.1", 0)]
    # B's own checks use what it saw.
    failure_of(b.create_topic(topic, ranges)).trap(AlreadyExistsError)
    result_of(b.commit_group_position("orders", "billing", "AQ"))
    assert a.group_position("orders", "billing") == "AQ"


def test_a_change_fires_only_once_the_watch_brought_it_back(cluster: Cluster) -> None:
    a = cluster.node()
    cluster.store.drop_watches()

    creating = a.create_user(make_user("alice"))

    # Written, but not yet seen by the node that wrote it.
    assert cluster.store.get(f"{PREFIX}users/alice".encode()) is not None
    assert not creating.called
    assert a.user("alice") is None
    cluster.clock.advance(RESUME_DELAY)
    result_of(creating)
    assert a.user("alice") == make_user("alice")


def test_of_two_nodes_creating_one_topic_exactly_one_wins(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders", ranges=2)
    theirs = attrs.evolve(topic, created_ms=topic.created_ms + 1)
    cluster.store.hold()

    first = a.create_topic(topic, ranges)
    second = b.create_topic(theirs, ranges)
    cluster.store.release()

    result_of(first)
    lost = failure_of(second)
    lost.trap(AlreadyExistsError)
    assert str(lost.value) == "topic 'orders' exists already"
    assert a.topics() == b.topics() == [topic]


def test_a_topic_whose_range_id_another_node_took_fails(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders")
    other = attrs.evolve(topic, name="other")
    cluster.store.hold()

    first = a.create_topic(topic, ranges)
    second = b.create_topic(other, [attrs.evolve(ranges[0], topic="other")])
    cluster.store.release()

    result_of(first)
    failure_of(second).trap(AlreadyExistsError)
    assert b.topics() == [topic]


def test_of_two_nodes_creating_one_user_exactly_one_wins(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    cluster.store.hold()

    first = b.create_user(make_user("alice", "admin"))
    second = a.create_user(make_user("alice", "produce"))
    cluster.store.release()

    result_of(first)
    failure_of(second).trap(UserExistsError)
    assert a.users() == b.users() == [make_user("alice", "admin")]


def test_of_two_nodes_bumping_a_segment_s_epoch_exactly_one_wins(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders")
    result_of(a.create_topic(topic, ranges))
    read = active("orders.0", 0, epoch=1)
    result_of(a.put_segment(read))
    mine = attrs.evolve(active("orders.0", 0, epoch=2), replicas=("node-2",))
    theirs = attrs.evolve(active("orders.0", 0, epoch=2), replicas=("node-3",))
    cluster.store.hold()

    first = b.put_segment(theirs, expected=read)
    second = a.put_segment(mine, expected=read)
    cluster.store.release()

    result_of(first)
    lost = failure_of(second)
    lost.trap(InvalidChangeError)
    assert "another node changed it first" in str(lost.value)
    assert a.segments("orders.0") == b.segments("orders.0") == [theirs]


def test_a_claim_queued_behind_other_changes_loses_to_a_rival_of_the_same_epoch(
    cluster: Cluster,
) -> None:
    """The claim is checked against the record when its transaction is made, after the
    rival's claim reached this node's cache, and compared on etcd's revision of the key: an
    equal epoch is a lost race, never an overwrite."""
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders")
    result_of(a.create_topic(topic, ranges))
    read = active("orders.0", 0, epoch=1)
    result_of(a.put_segment(read))
    mine = attrs.evolve(read, epoch=2, replicas=("node-2",))
    theirs = attrs.evolve(read, epoch=2, replicas=("node-3",))
    cluster.store.hold()
    rival = b.put_segment(theirs, expected=read)
    ahead = a.create_user(make_user("alice", "produce"))
    queued = a.put_segment(mine, expected=read)
    # b's claim lands, and reaches a's cache, before a's claim (queued behind a's user) goes.
    cluster.store.release()
    result_of(ahead)
    result_of(rival)
    lost = failure_of(queued)
    lost.trap(InvalidChangeError)
    assert a.segments("orders.0") == b.segments("orders.0") == [theirs]


def test_a_node_whose_queue_stays_busy_records_segments_of_topics_created_elsewhere(
    cluster: Cluster,
) -> None:
    """A queued change is checked on the cache with the changes queued before it. While the
    queue never empties, that is the cache as it was when it last did: a topic another node
    created since is missing from it, and its first segment must not be refused for it."""
    a, b = cluster.node(), cluster.node()
    result_of(a.create_topic(*make_topic("first")))
    cluster.store.hold()
    created = b.create_topic(*make_topic("orders"))
    busy = a.put_segment(active("first.0", 0))
    cluster.store.release(1)
    result_of(created)
    assert a.ranges("orders"), "a's cache has b's topic"
    assert not busy.called, "a's queue is still busy"

    placed = a.put_segment(active("orders.0", 0))
    cluster.store.release()

    result_of(busy)
    result_of(placed)
    assert b.segments("orders.0") == [active("orders.0", 0)]
    # What neither the queue nor the cache knows is still refused at once.
    failure_of(a.put_segment(active("nowhere.0", 0))).trap(NotFoundError)


def test_changes_refused_behind_a_long_queue_do_not_each_apply_the_whole_queue_again(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node giving up thousands of ranges at once queues a change for each, and its claims
    refused meanwhile were each checked on the cache with the whole queue applied again: its
    reactor was taken for seconds, and its membership lease ran out. The queue applied on
    the cache is carried on while the cache stays the same, and made anew once it changes."""
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders", ranges=64)
    result_of(a.create_topic(topic, ranges))
    led = [active(r.range_id, 0, epoch=1) for r in ranges]
    for meta in led:
        result_of(a.put_segment(meta))
    cluster.store.hold()
    created = b.create_topic(*make_topic("later"))
    aside = [a.put_segment(attrs.evolve(m, epoch=2, replicas=("node-2",)), expected=m) for m in led]
    applied = 0
    apply = PutSegment.apply

    def counted(change: PutSegment, state: ControlState) -> ControlState:
        nonlocal applied
        applied += 1
        return apply(change, state)

    monkeypatch.setattr(PutSegment, "apply", counted)

    claims = [a.put_segment(attrs.evolve(m, epoch=2), expected=m) for m in led]

    for claim in claims:
        failure_of(claim).trap(InvalidChangeError)
    # Each claim checked on what is queued, then on the cache with the queue (applied once),
    # where the whole queue again for each was 64 times 66.
    assert applied <= 3 * len(led), applied

    # The cache changes (the other node's topic lands): the next check starts from it.
    cluster.store.release(1)
    result_of(created)
    placed = a.put_segment(active("later.0", 0))
    cluster.store.release()
    result_of(placed)
    for change in aside:
        result_of(change)
    assert b.segments("orders.5") == [attrs.evolve(led[5], epoch=2, replicas=("node-2",))]


def test_opening_a_segment_that_exists_is_a_lost_race(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders")
    result_of(a.create_topic(topic, ranges))
    cluster.store.hold()
    first = a.put_segment(active("orders.0", 100), expected=None)
    second = b.put_segment(attrs.evolve(active("orders.0", 100), replicas=("x",)), expected=None)
    cluster.store.release()
    result_of(first)
    failure_of(second).trap(InvalidChangeError)
    assert b.segments("orders.0") == [active("orders.0", 100)]


def test_a_lower_epoch_racing_a_higher_one_loses(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders")
    result_of(a.create_topic(topic, ranges))
    result_of(a.put_segment(active("orders.0", 0, epoch=1)))
    cluster.store.hold()

    higher = a.put_segment(active("orders.0", 0, epoch=5))
    lower = b.put_segment(active("orders.0", 0, epoch=3))
    cluster.store.release()

    result_of(higher)
    failure_of(lower).trap(InvalidChangeError)
    assert b.segments("orders.0") == [active("orders.0", 0, epoch=5)]


def test_updates_of_different_fields_on_two_nodes_both_stay(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    result_of(a.create_user(make_user("alice", "produce")))
    cluster.store.hold()

    rehashing = a.update_user("alice", password_hash="$argon2id$new")
    promoting = b.update_user("alice", permissions=frozenset({"admin"}))
    cluster.store.release()

    result_of(rehashing)
    promoted = result_of(promoting)
    expected = attrs.evolve(
        make_user("alice"), password_hash="$argon2id$new", permissions=frozenset({"admin"})
    )
    assert promoted == expected
    assert a.user("alice") == b.user("alice") == expected


def test_a_grant_racing_the_user_s_deletion_leaves_no_orphan(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    result_of(a.create_user(make_user("alice")))
    grant = AclGrant("alice", "produce", "orders")

    # The grant first: the deletion takes it along, though the deleting node never saw it.
    cluster.store.hold()
    granting = b.grant_acl(grant)
    deleting = a.delete_user("alice")
    cluster.store.release()
    result_of(granting)
    result_of(deleting)
    assert a.acls() == b.acls() == []
    assert cluster.store.get(f"{PREFIX}acls/alice/produce/orders".encode()) is None

    # The deletion first: the grant finds no user.
    result_of(a.create_user(make_user("alice")))
    cluster.store.hold()
    deleting = a.delete_user("alice")
    granting = b.grant_acl(grant)
    cluster.store.release()
    result_of(deleting)
    failure_of(granting).trap(UserNotFoundError)
    assert a.acls() == b.acls() == []


def test_racing_group_commits_both_land_in_order(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders")
    result_of(a.create_topic(topic, ranges))
    cluster.store.hold()

    first = a.commit_group_position("orders", "billing", "AQ")
    second = b.commit_group_position("orders", "billing", "AR")
    cluster.store.release()

    result_of(first)
    result_of(second)
    assert a.group_position("orders", "billing") == b.group_position("orders", "billing") == "AR"


def test_racing_merged_group_commits_on_two_nodes_keep_both_ranges(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders")
    result_of(a.create_topic(topic, ranges))

    def merge(stored: str | None, committed: str) -> str:
        return ",".join(sorted({*(stored or "").split(","), committed} - {""}))

    cluster.store.hold()
    first = a.commit_group_position("orders", "billing", "range0=5", merge)
    second = b.commit_group_position("orders", "billing", "range1=7", merge)
    cluster.store.release()

    result_of(first)
    result_of(second)
    # The second lost the race, was applied again to the first's position, and merged into it.
    expected = "range0=5,range1=7"
    assert (
        a.group_position("orders", "billing") == b.group_position("orders", "billing") == expected
    )


def test_each_change_is_one_transaction_comparing_what_it_depends_on(cluster: Cluster) -> None:
    a = cluster.node()
    topic, ranges = make_topic("orders")
    result_of(a.create_topic(topic, ranges))
    result_of(a.create_user(make_user("alice")))
    result_of(a.grant_acl(AclGrant("alice", "produce", "orders")))
    before = len(cluster.store.transactions)

    segment = f"{PREFIX}segments/orders.0/{0:020d}".encode()
    result_of(a.put_segment(active("orders.0", 0)))
    recorded = cluster.store.get(segment)
    assert recorded is not None
    result_of(a.put_segment(active("orders.0", 0, epoch=1)))
    result_of(a.delete_user("alice"))

    range_key = f"{PREFIX}ranges/orders.0".encode()
    range_revision = cluster.store.get(range_key)
    assert range_revision is not None
    created, bumped, deleted = cluster.store.transactions[before:]
    assert created[0] == (
        Compare.absent(segment),
        Compare.unchanged(range_key, range_revision.mod_revision),
    )
    assert [type(op) for op in created[1]] == [Put]
    # A segment that exists is compared alone: at its revision, it has its range.
    assert bumped[0] == (Compare(segment, Target.MOD, Result.EQUAL, recorded.mod_revision),)
    assert DeletePrefix(f"{PREFIX}acls/alice/".encode()) in deleted[1]
    # Nothing to write, nothing sent.
    result_of(a.grant_acl(AclGrant("nobody-else", "produce", "x")).addErrback(lambda _: None))
    assert len(cluster.store.transactions) == before + 3


def test_a_dropped_watch_resumes_without_a_gap(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    result_of(a.create_user(make_user("alice")))
    cluster.store.hold()
    cluster.store.drop_watches()
    cluster.store.release()

    creating = b.create_user(make_user("bob"))
    deleting_alice = b.delete_user("alice")
    cluster.clock.advance(RESUME_DELAY / 2)
    assert a.users() == [make_user("alice")]

    cluster.clock.advance(RESUME_DELAY / 2)
    result_of(creating)
    result_of(deleting_alice)
    assert a.users() == b.users() == [make_user("bob")]


def test_a_watch_that_keeps_failing_backs_off_and_recovers(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    cluster.store.drop_watches()
    cluster.store.unavailable = True
    for _ in range(5):
        cluster.clock.advance(60)
    cluster.store.unavailable = False
    cluster.clock.advance(60)

    result_of(b.create_user(make_user("carol")))
    assert a.users() == [make_user("carol")]


def test_a_compaction_while_the_watch_was_down_forces_a_full_reload(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders", ranges=2)
    result_of(a.create_topic(topic, ranges))
    result_of(a.create_user(make_user("alice")))
    result_of(a.put_segment(active("orders.0", 0)))
    heard: list[set[str]] = []
    a.watch_segments(lambda changed: heard.append(set(changed)))
    cluster.store.drop_watches()

    result_of(cluster.store.delete_prefix(f"{PREFIX}users/".encode()))
    result_of(cluster.store.delete_prefix(f"{PREFIX}segments/".encode()))
    result_of(cluster.store.put(b"/elsewhere", b"x"))
    cluster.store.compact(cluster.store.revision)
    cluster.clock.advance(RESUME_DELAY)
    cluster.clock.advance(0)

    assert a.users() == b.users() == []
    assert a.topics() == [topic]
    # A reload tells the segment listeners of every range it held or holds (here one, gone).
    assert a.segments("orders.0") == []
    assert heard == [{"orders.0"}]
    result_of(a.create_user(make_user("alice")))
    assert b.user("alice") == make_user("alice")


def test_an_unreachable_store_fails_changes_with_a_typed_error_then_recovers(
    cluster: Cluster,
) -> None:
    a = cluster.node()
    cluster.store.hold()
    first = a.create_user(make_user("alice"))
    behind = a.grant_acl(AclGrant("alice", "produce", "orders"))
    cluster.store.unavailable = True
    cluster.store.release()

    error = failure_of(first).value
    assert isinstance(error, ControlPlaneUnavailableError)
    assert error.reason == "unreachable"
    assert "no etcd member answered" in str(error)
    later = failure_of(behind).value
    assert isinstance(later, ControlPlaneUnavailableError)
    assert "was not tried" in str(later)
    assert a.users() == []
    # Checked against the state without them: the grant now finds no user.
    failure_of(a.grant_acl(AclGrant("alice", "produce", "orders"))).trap(UserNotFoundError)

    cluster.store.unavailable = False
    result_of(a.create_user(make_user("alice")))
    result_of(a.grant_acl(AclGrant("alice", "produce", "orders")))
    assert a.acls() == [AclGrant("alice", "produce", "orders")]


def test_a_lost_answer_is_resolved_by_asking_again(cluster: Cluster) -> None:
    a = cluster.node()
    topic, ranges = make_topic("orders")
    result_of(a.create_topic(topic, ranges))
    result_of(a.create_user(make_user("alice")))

    # Each took effect; sent again, each fails its compares and finds its writes in place.
    for change in [
        lambda: a.create_user(make_user("bob")),
        lambda: a.put_segment(active("orders.0", 0)),
        lambda: a.commit_group_position("orders", "billing", "AQ"),
        lambda: a.delete_user("alice"),
    ]:
        cluster.store.lost_answers = 1
        result_of(change())
        assert cluster.store.lost_answers == 0

    assert a.users() == [make_user("bob")]
    assert a.segments("orders.0") == [active("orders.0", 0)]
    assert a.group_position("orders", "billing") == "AQ"


def wait_out_the_resolution(cluster: Cluster) -> None:
    for _ in range(RESOLVE_ATTEMPTS):
        cluster.clock.advance(RESOLVE_RETRY_SECONDS)


def test_a_lost_answer_that_cannot_be_resolved_says_so(cluster: Cluster) -> None:
    a = cluster.node()
    cluster.store.lost_answers = 1 + RESOLVE_ATTEMPTS  # every answer to the resolution too

    creating = a.create_user(make_user("alice"))
    wait_out_the_resolution(cluster)

    error = failure_of(creating).value

    assert isinstance(error, OutcomeUnknownError)
    assert error.reason == "unreachable"
    assert "did not answer" in str(error)
    # It did take effect here; the watch shows it.
    assert a.user("alice") == make_user("alice")


def lost_then_no_member(cluster: Cluster, a: EtcdControlPlane) -> Deferred[None]:
    """Create a user whose first attempt takes effect and loses its answer; then no member
    answers."""
    cluster.store.hold()
    creating = a.create_user(make_user("alice"))
    cluster.store.lost_answers = 1
    cluster.store.release(1)
    cluster.store.unavailable = True
    cluster.store.release()
    return creating


def test_a_lost_answer_then_no_member_says_the_outcome_is_unknown(cluster: Cluster) -> None:
    a = cluster.node()
    creating = lost_then_no_member(cluster, a)
    assert not creating.called, "asked again while no member answers"
    wait_out_the_resolution(cluster)

    error = failure_of(creating).value
    assert isinstance(error, OutcomeUnknownError)


def test_a_lost_answer_is_resolved_once_a_member_answers_again(cluster: Cluster) -> None:
    # A member died with the answer, and it led: the others answer once they elected another.
    a = cluster.node()
    creating = lost_then_no_member(cluster, a)
    cluster.clock.advance(RESOLVE_RETRY_SECONDS)
    assert not creating.called

    cluster.store.unavailable = False
    cluster.clock.advance(RESOLVE_RETRY_SECONDS)

    result_of(creating)
    assert a.user("alice") == make_user("alice")


def test_start_fails_when_no_member_answers(cluster: Cluster) -> None:
    cluster.store.unavailable = True
    control = EtcdControlPlane(cluster.store, prefix=PREFIX, clock=cluster.clock)

    failure_of(control.start()).trap(ControlPlaneUnavailableError)
    failure_of(control.create_user(make_user())).trap(ControlPlaneClosedError)


def test_start_refuses_an_unreadable_entry(cluster: Cluster) -> None:
    result_of(cluster.store.put(f"{PREFIX}users/alice".encode(), b"{not json"))
    control = EtcdControlPlane(cluster.store, prefix=PREFIX, clock=cluster.clock)

    error = failure_of(control.start()).value

    assert isinstance(error, StateFileError)
    assert "invalid control state under /logbroker/c1/" in str(error)


def test_close_waits_for_queued_changes(cluster: Cluster) -> None:
    a = cluster.node()
    cluster.store.hold()
    creating = a.create_user(make_user("alice"))

    closing = a.close()
    failure_of(a.create_user(make_user("bob"))).trap(ControlPlaneClosedError)
    assert not closing.called
    cluster.store.release()

    result_of(creating)
    result_of(closing)
    assert cluster.store.watch_count == 0


def test_group_commits_queued_together_go_out_in_one_transaction(cluster: Cluster) -> None:
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders")
    result_of(a.create_topic(topic, ranges))
    before = len(cluster.store.transactions)
    fired: list[str] = []
    cluster.store.hold()

    changes = [a.commit_group_position("orders", "g0", "AQ")]
    changes += [a.commit_group_position("orders", f"g{i}", "AQ") for i in range(1, 150)]
    changes.append(a.create_user(make_user("alice")))
    changes.append(a.commit_group_position("orders", "g0", "AR"))
    for i, change in enumerate(changes):
        change.addCallback(lambda _, i=i: fired.append(i))
    cluster.store.release()

    # The first went out alone; the rest queued behind it, in batches etcd accepts.
    sent = cluster.store.transactions[before:]
    assert [len(operations) for _, operations in sent] == [1, 64, 64, 21, 1, 1]
    assert fired == list(range(len(changes)))
    assert b.group_position("orders", "g149") == "AQ"
    assert b.group_position("orders", "g0") == "AR"
    assert b.user("alice") == make_user("alice")


def test_segment_records_queued_together_go_out_together_and_one_refused_spares_the_rest(
    cluster: Cluster,
) -> None:
    # What a node back from an outage meets: the chores holder adds it to the replica sets of
    # every segment sealed without it, all at once, while another node changes one of them.
    a, b = cluster.node(), cluster.node()
    topic, ranges = make_topic("orders")
    result_of(a.create_topic(topic, ranges))
    records = [sealed("orders.0", 10 * i, 10, 100) for i in range(200)]
    for meta in records:
        result_of(a.put_segment(meta))
    before = len(cluster.store.transactions)
    cluster.store.hold()

    joined = [attrs.evolve(meta, replicas=("node-1", "node-2")) for meta in records]
    outcomes: list[object] = []
    for old, new in zip(records, joined, strict=True):
        a.put_segment(new, expected=old).addBoth(outcomes.append)
    # b's change lands after a's first transaction and before the batch behind it.
    rival = attrs.evolve(records[50], replicas=("node-1", "node-3"))
    b.put_segment(rival, expected=records[50])
    cluster.store.release(1)
    cluster.store.release()

    assert len(outcomes) == 200
    refused = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, Failure)]
    assert refused == [50]
    failure = outcomes[50]
    assert isinstance(failure, Failure)
    failure.trap(InvalidChangeError)
    assert b.segments("orders.0") == [rival if i == 50 else meta for i, meta in enumerate(joined)]
    # a: the first alone, the rest 128 at a time (a change to a record that exists compares
    # that record alone); the first batch met b's change (its compare failed) and went again
    # without the refused one. Not two hundred round trips.
    sent = cluster.store.transactions[before:]
    assert [len(operations) for _, operations in sent] == [1, 1, 128, 127, 71]
    assert [len(compares) for compares, _ in sent] == [1, 1, 128, 127, 71]


def test_seals_with_their_next_openings_go_out_in_transactions_of_at_most_128_compares(
    cluster: Cluster,
) -> None:
    # What a node taking over many ranges sends: each seal with the opening of the next
    # segment, one change of two records, queued together.
    a = cluster.node()
    topic, ranges = make_topic("orders", ranges=50)
    result_of(a.create_topic(topic, ranges))
    records = [active(r.range_id, 0) for r in ranges]
    for meta in records:
        result_of(a.put_segment(meta))
    before = len(cluster.store.transactions)
    cluster.store.hold()

    outcomes: list[object] = []
    for meta in records:
        seal = sealed(meta.range_id, 0, 10, 100)
        a.put_segments([(seal, meta), (active(meta.range_id, 10), None)]).addBoth(outcomes.append)
    cluster.store.release()

    assert outcomes == [None] * 50
    assert all(
        [m.state for m in a.segments(r.range_id)] == [SegmentState.SEALED, SegmentState.ACTIVE]
        for r in ranges
    )
    # The first alone, then 42 at a time: each compares three keys (the sealed record, the new
    # one, and the new one's range).
    sizes = [len(operations) for _, operations in cluster.store.transactions[before:]]
    assert sizes == [2, 2 * 42, 2 * 7]
    assert all(len(compares) <= 128 for compares, _ in cluster.store.transactions[before:])


def test_a_change_that_keeps_losing_races_gives_up_with_a_typed_error(cluster: Cluster) -> None:
    a = cluster.node()
    result_of(a.create_user(make_user("alice")))
    key = f"{PREFIX}users/alice".encode()
    value = cluster.store.get(key)
    assert value is not None
    store = cluster.store
    send = store.txn
    meddled = []

    def meddling_txn(*args: Any, **kwargs: Any) -> Any:
        # Another node rewrites the user just before each attempt.
        store.txn = send  # type: ignore[method-assign]
        result_of(store.put(key, value.value))
        store.txn = meddling_txn  # type: ignore[method-assign]
        meddled.append(1)
        return send(*args, **kwargs)

    store.txn = meddling_txn  # type: ignore[method-assign]
    try:
        error = failure_of(a.update_user("alice", password_hash="$argon2id$new")).value
    finally:
        store.txn = send  # type: ignore[method-assign]

    assert isinstance(error, ContendedError)
    assert error.reason == "contended"
    assert len(meddled) == MAX_ATTEMPTS
    assert a.user("alice") == make_user("alice")


def test_the_gateway_tries_the_member_that_answered_then_the_others_then_the_failed() -> None:
    reactor = MemoryReactorClock()
    store = EtcdGatewayStore(["http://a:1", "http://b:2/", "http://c:3"], reactor=reactor)
    assert store._order() == ["http://a:1", "http://b:2", "http://c:3"]

    store._mark_down("http://a:1", "refused")
    reactor.advance(1)
    store._mark_down("http://b:2", "refused")
    assert store._order() == ["http://c:3", "http://a:1", "http://b:2"]

    store._mark_up("http://c:3")
    assert store._order() == ["http://c:3", "http://a:1", "http://b:2"]
    # A failed member that answers again is back in use.
    store._mark_up("http://b:2")
    assert store._order() == ["http://b:2", "http://c:3", "http://a:1"]


def test_a_change_whose_watch_went_silent_fires_once_the_cache_is_reloaded(
    cluster: Cluster,
) -> None:
    control = cluster.node()
    # The watch's member is cut off without a word: no event, no end, ever.
    assert cluster.store.watch_count == 1
    cluster.store.silence_watches()

    creating = control.create_user(make_user("alice"))
    assert not creating.called
    cluster.clock.advance(CATCH_UP_SECONDS)

    result_of(creating)
    assert control.user("alice") == make_user("alice")
    assert cluster.store.watch_count == 1  # following again, from the reloaded revision


def test_when_loaded_fires_once_the_cache_is_loaded(cluster: Cluster) -> None:
    control = EtcdControlPlane(cluster.store, prefix=PREFIX, clock=cluster.clock)
    waiting = control.when_loaded()
    cluster.store.hold()
    started = control.start()
    assert not waiting.called, "etcd has not answered the load yet"

    cluster.store.release()
    result_of(started)
    cluster.nodes.append(control)
    assert waiting.called
    assert control.when_loaded().called
