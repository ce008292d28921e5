"""Each change and each read of the control plane, on a file system in memory."""

from __future__ import annotations

import attrs
import pytest

from logbroker.controlplane import (
    AclGrant,
    AlreadyExistsError,
    ControlPlaneClosedError,
    InvalidChangeError,
    LocalControlPlane,
    NotFoundError,
    Range,
    RangeState,
    Topic,
    UserExistsError,
    UserNotFoundError,
)
from logbroker.testing import ImmediateExecutor, MemoryFileSystem
from tests.unit.controlplane.helpers import (
    CONTROL_DIR,
    STATE_PATH,
    active,
    make_topic,
    make_user,
    sealed,
    started,
)
from tests.unit.storage.helpers import failure_of, result_of


@pytest.fixture
def fs() -> MemoryFileSystem:
    return MemoryFileSystem()


@pytest.fixture
def control(fs: MemoryFileSystem) -> LocalControlPlane:
    return started(fs)


def reopened(fs: MemoryFileSystem, control: LocalControlPlane) -> LocalControlPlane:
    result_of(control.close())
    return started(fs)


def test_a_new_directory_starts_empty_and_is_written_at_the_first_change(
    fs: MemoryFileSystem, control: LocalControlPlane
) -> None:
    assert control.topics() == []
    assert control.users() == []
    assert control.acls() == []
    assert fs.is_dir(CONTROL_DIR)
    assert not fs.exists(STATE_PATH)

    result_of(control.create_user(make_user()))

    assert fs.exists(STATE_PATH)


def test_reads_and_changes_wait_for_start(fs: MemoryFileSystem) -> None:
    control = LocalControlPlane(CONTROL_DIR, fs=fs, executor=ImmediateExecutor())

    with pytest.raises(ControlPlaneClosedError, match="not started"):
        control.topics()
    failure_of(control.create_user(make_user())).trap(ControlPlaneClosedError)


def test_create_topic_and_read_it_back(fs: MemoryFileSystem, control: LocalControlPlane) -> None:
    orders, ranges = make_topic("orders", ranges=4)
    audit, audit_ranges = make_topic("audit", bits=0)

    result_of(control.create_topic(orders, ranges))
    result_of(control.create_topic(audit, audit_ranges))

    assert control.topic("orders") == orders
    assert control.topic("nope") is None
    assert control.topics() == [audit, orders]
    assert control.ranges("orders") == ranges
    assert [(r.start, r.end) for r in ranges] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert control.ranges("nope") == []
    assert control.range("orders.2") == ranges[2]
    assert control.range("orders.9") is None
    assert reopened(fs, control).topics() == [audit, orders]


def test_a_topic_name_or_range_id_is_taken_once(control: LocalControlPlane) -> None:
    orders, ranges = make_topic("orders")
    result_of(control.create_topic(orders, ranges))

    failure_of(control.create_topic(orders, ranges)).trap(AlreadyExistsError)
    # Range ids name storage directories: unique across topics.
    other = Topic("other", 8, 0, ("orders.0",))
    taken = failure_of(control.create_topic(other, [attrs.evolve(ranges[0], topic="other")])).value
    assert isinstance(taken, AlreadyExistsError)
    assert str(taken) == "range 'orders.0' exists already"


@pytest.mark.parametrize(
    ("spans", "ids"),
    [
        ([(0, 128)], None),  # a gap at the end
        ([(0, 128), (100, 256)], None),  # an overlap
        ([(0, 128), (128, 300)], None),  # past the keyspace
        ([(1, 256)], None),  # a gap at the start
        ([(0, 256)], ("t.9",)),  # not the ranges the topic lists
    ],
)
def test_a_new_topic_s_ranges_tile_its_keyspace(
    control: LocalControlPlane, spans: list[tuple[int, int]], ids: tuple[str, ...] | None
) -> None:
    ranges = [Range(f"t.{i}", "t", s, e, RangeState.ACTIVE) for i, (s, e) in enumerate(spans)]
    topic = Topic("t", 8, 0, ids or tuple(r.range_id for r in ranges))

    failure_of(control.create_topic(topic, ranges)).trap(InvalidChangeError)
    assert control.topics() == []


@pytest.mark.parametrize(
    "change",
    [
        {"topic": "other"},
        {"state": RangeState.SEALED},
        {"parent": "t.x"},
    ],
)
def test_a_new_topic_s_ranges_are_its_own_active_roots(
    control: LocalControlPlane, change: dict[str, object]
) -> None:
    topic, ranges = make_topic("t")

    failure = failure_of(control.create_topic(topic, [attrs.evolve(ranges[0], **change)]))

    failure.trap(InvalidChangeError)


def test_segments_are_recorded_sealed_and_deleted(
    fs: MemoryFileSystem, control: LocalControlPlane
) -> None:
    topic, ranges = make_topic("orders", ranges=2)
    result_of(control.create_topic(topic, ranges))
    result_of(control.put_segment(active("orders.0", 100)))
    result_of(control.put_segment(active("orders.0", 0)))
    result_of(control.put_segment(active("orders.1", 0)))

    assert control.segments("orders.0") == [active("orders.0", 0), active("orders.0", 100)]

    seal = sealed("orders.0", 0, count=100, size=4096)
    result_of(control.put_segment(seal))
    result_of(control.delete_segment("orders.1", 0))

    assert control.segments("orders.0") == [seal, active("orders.0", 100)]
    assert control.segments("orders.1") == []
    assert control.segments("nope") == []
    again = reopened(fs, control)
    assert again.segments("orders.0") == [seal, active("orders.0", 100)]
    assert again.segments("orders.1") == []


def test_segment_changes_that_would_lose_data_are_refused(control: LocalControlPlane) -> None:
    topic, ranges = make_topic("orders")
    result_of(control.create_topic(topic, ranges))
    result_of(control.put_segment(active("orders.0", 0, epoch=3)))

    failure_of(control.put_segment(active("orders.9", 0))).trap(NotFoundError)
    lower = failure_of(control.put_segment(active("orders.0", 0, epoch=2))).value
    assert str(lower) == "segment orders.0@0 is at epoch 3; it cannot go back to 2"

    seal = sealed("orders.0", 0, count=10, size=500, epoch=4)
    result_of(control.put_segment(seal))
    failure_of(control.put_segment(active("orders.0", 0, epoch=4))).trap(InvalidChangeError)
    failure_of(control.put_segment(sealed("orders.0", 0, 10, 499, epoch=4))).trap(
        InvalidChangeError
    )
    # A sealed segment still gets new replica sets and epochs (healing, failover).
    moved = attrs.evolve(seal, replicas=("node-2", "node-3"), epoch=5)
    result_of(control.put_segment(moved))
    assert control.segments("orders.0") == [moved]
    failure_of(control.delete_segment("orders.0", 7)).trap(NotFoundError)


def test_users_are_created_updated_and_deleted(
    fs: MemoryFileSystem, control: LocalControlPlane
) -> None:
    alice = make_user("alice", "produce")
    bob = make_user("bob", "consume")
    result_of(control.create_user(bob))
    result_of(control.create_user(alice))

    assert control.users() == [alice, bob]
    assert control.user("alice") == alice
    assert control.user("carol") is None
    failure_of(control.create_user(make_user("alice", "admin"))).trap(UserExistsError)

    rehashed = result_of(control.update_user("alice", password_hash="$argon2id$new"))
    assert rehashed == attrs.evolve(alice, password_hash="$argon2id$new")
    promoted = result_of(control.update_user("alice", permissions=frozenset({"admin"})))
    assert promoted == attrs.evolve(rehashed, permissions=frozenset({"admin"}))
    assert control.user("alice") == promoted
    failure_of(control.update_user("carol", password_hash="x")).trap(UserNotFoundError)

    result_of(control.delete_user("bob"))
    assert control.users() == [promoted]
    failure_of(control.delete_user("bob")).trap(UserNotFoundError)
    assert reopened(fs, control).users() == [promoted]


def test_acl_grants_are_stored_listed_and_revoked(
    fs: MemoryFileSystem, control: LocalControlPlane
) -> None:
    result_of(control.create_user(make_user("alice")))
    result_of(control.create_user(make_user("bob")))
    grants = [
        AclGrant("bob", "consume", "orders.*"),
        AclGrant("alice", "produce", "orders"),
        AclGrant("alice", "consume", "orders"),
    ]
    for grant in grants:
        result_of(control.grant_acl(grant))
    result_of(control.grant_acl(grants[0]))  # again: no change

    assert control.acls("alice") == [grants[2], grants[1]]
    assert control.acls() == [grants[2], grants[1], grants[0]]
    assert control.acls("carol") == []
    failure_of(control.grant_acl(AclGrant("carol", "produce", "x"))).trap(UserNotFoundError)

    result_of(control.revoke_acl(grants[1]))
    failure_of(control.revoke_acl(grants[1])).trap(NotFoundError)
    assert control.acls("alice") == [grants[2]]
    assert reopened(fs, control).acls() == [grants[2], grants[0]]


def test_deleting_a_user_drops_its_grants(control: LocalControlPlane) -> None:
    result_of(control.create_user(make_user("alice")))
    result_of(control.grant_acl(AclGrant("alice", "produce", "orders")))

    result_of(control.delete_user("alice"))
    result_of(control.create_user(make_user("alice")))

    assert control.acls() == []


def test_group_positions_are_committed_and_replaced(
    fs: MemoryFileSystem, control: LocalControlPlane
) -> None:
    topic, ranges = make_topic("orders")
    result_of(control.create_topic(topic, ranges))

    result_of(control.commit_group_position("orders", "billing", "AQAAAA"))
    result_of(control.commit_group_position("orders", "billing", "AQAAAB"))
    result_of(control.commit_group_position("orders", "audit", "AQ"))

    assert control.group_position("orders", "billing") == "AQAAAB"
    assert control.group_position("orders", "audit") == "AQ"
    assert control.group_position("orders", "nope") is None
    failure_of(control.commit_group_position("nope", "billing", "AQ")).trap(NotFoundError)
    with pytest.raises(ValueError, match="group name"):
        control.commit_group_position("orders", "", "AQ")
    assert reopened(fs, control).group_position("orders", "billing") == "AQAAAB"
