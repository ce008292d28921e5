"""Each change and each read of the control plane: one contract suite for every implementation.

``backend`` runs each test on ``LocalControlPlane`` (a file system in memory),
``EtcdControlPlane`` on the etcd double, and ``EtcdControlPlane`` on a real three-member etcd
(marked integration). Reopening is a new instance on the same backing store.
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import pytest
import pytest_twisted
from twisted.internet.defer import Deferred

from logbroker.controlplane import (
    AclGrant,
    AlreadyExistsError,
    ControlPlane,
    ControlPlaneClosedError,
    ControlPlaneError,
    InvalidChangeError,
    NotFoundError,
    Range,
    RangeState,
    SegmentMeta,
    Topic,
    UserExistsError,
    UserNotFoundError,
)
from tests.unit.controlplane.backends import Backend, LocalBackend
from tests.unit.controlplane.helpers import (
    CONTROL_DIR,
    STATE_PATH,
    active,
    make_topic,
    make_user,
    sealed,
)
from tests.unit.storage.helpers import failure_of

_T = TypeVar("_T")


async def done(backend: Backend, change: Deferred[_T]) -> _T:
    """The result of a change; a synchronous backend has it at once."""
    if backend.synchronous:
        assert change.called, "the change did not fire at once"
    return await change


def rejected(change: Deferred[Any], error: type[ControlPlaneError]) -> ControlPlaneError:
    """A change refused when it was asked for: every implementation fails it at once."""
    failure = failure_of(change)
    failure.trap(error)
    assert isinstance(failure.value, ControlPlaneError)
    return failure.value


@pytest_twisted.ensureDeferred
async def test_a_new_store_starts_empty(backend: Backend, control: ControlPlane) -> None:
    assert control.topics() == []
    assert control.users() == []
    assert control.acls() == []

    await done(backend, control.create_user(make_user()))

    assert control.users() == [make_user()]


@pytest_twisted.ensureDeferred
async def test_the_local_directory_is_written_at_the_first_change() -> None:
    backend = LocalBackend()
    control = await backend.open()

    assert backend.fs.is_dir(CONTROL_DIR)
    assert not backend.fs.exists(STATE_PATH)
    await done(backend, control.create_user(make_user()))
    assert backend.fs.exists(STATE_PATH)
    await backend.close()


@pytest_twisted.ensureDeferred
async def test_reads_and_changes_wait_for_start(backend: Backend) -> None:
    control = backend.unstarted()

    with pytest.raises(ControlPlaneClosedError, match="not started"):
        control.topics()
    rejected(control.create_user(make_user()), ControlPlaneClosedError)


@pytest_twisted.ensureDeferred
async def test_create_topic_and_read_it_back(backend: Backend, control: ControlPlane) -> None:
    orders, ranges = make_topic("orders", ranges=4)
    audit, audit_ranges = make_topic("audit", bits=0)

    await done(backend, control.create_topic(orders, ranges))
    assert list(control.range_ids()) == ["orders.0", "orders.1", "orders.2", "orders.3"]
    await done(backend, control.create_topic(audit, audit_ranges))

    assert control.topic("orders") == orders
    assert control.topic("nope") is None
    assert control.topics() == [audit, orders]
    assert list(control.range_ids()) == ["audit.0", "orders.0", "orders.1", "orders.2", "orders.3"]
    assert list(control.ranges("orders")) == ranges
    assert [(r.start, r.end) for r in ranges] == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert not control.ranges("nope")
    assert control.range("orders.2") == ranges[2]
    assert control.range("orders.9") is None
    assert (await backend.reopen(control)).topics() == [audit, orders]


@pytest_twisted.ensureDeferred
async def test_a_topic_s_ranges_read_before_a_change_are_read_anew_after_it(
    backend: Backend, control: ControlPlane
) -> None:
    # ``ranges`` is asked at every produce and kept between changes: a change must show.
    orders, ranges = make_topic("orders", ranges=2)
    audit, audit_ranges = make_topic("audit", bits=0)
    assert not control.ranges("audit")

    await done(backend, control.create_topic(orders, ranges))
    first = control.ranges("orders")
    assert list(first) == ranges
    assert control.ranges("orders") is first  # unchanged: not made again
    assert not control.ranges("audit")

    await done(backend, control.create_topic(audit, audit_ranges))
    assert list(control.ranges("audit")) == audit_ranges
    assert list(control.ranges("orders")) == ranges


@pytest_twisted.ensureDeferred
async def test_a_topic_name_or_range_id_is_taken_once(
    backend: Backend, control: ControlPlane
) -> None:
    orders, ranges = make_topic("orders")
    await done(backend, control.create_topic(orders, ranges))

    rejected(control.create_topic(orders, ranges), AlreadyExistsError)
    # Range ids name storage directories: unique across topics.
    other = Topic("other", 8, 0, ("orders.0",))
    taken = rejected(
        control.create_topic(other, [attrs.evolve(ranges[0], topic="other")]), AlreadyExistsError
    )
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
@pytest_twisted.ensureDeferred
async def test_a_new_topic_s_ranges_tile_its_keyspace(
    control: ControlPlane, spans: list[tuple[int, int]], ids: tuple[str, ...] | None
) -> None:
    ranges = [Range(f"t.{i}", "t", s, e, RangeState.ACTIVE) for i, (s, e) in enumerate(spans)]
    topic = Topic("t", 8, 0, ids or tuple(r.range_id for r in ranges))

    rejected(control.create_topic(topic, ranges), InvalidChangeError)
    assert control.topics() == []


@pytest.mark.parametrize(
    "change",
    [
        {"topic": "other"},
        {"state": RangeState.SEALED},
        {"parent": "t.x"},
    ],
)
@pytest_twisted.ensureDeferred
async def test_a_new_topic_s_ranges_are_its_own_active_roots(
    control: ControlPlane, change: dict[str, object]
) -> None:
    topic, ranges = make_topic("t")

    rejected(control.create_topic(topic, [attrs.evolve(ranges[0], **change)]), InvalidChangeError)


@pytest_twisted.ensureDeferred
async def test_segments_are_recorded_sealed_and_deleted(
    backend: Backend, control: ControlPlane
) -> None:
    topic, ranges = make_topic("orders", ranges=2)
    await done(backend, control.create_topic(topic, ranges))
    await done(backend, control.put_segment(active("orders.0", 100)))
    await done(backend, control.put_segment(active("orders.0", 0)))
    await done(backend, control.put_segment(active("orders.1", 0)))

    assert control.segments("orders.0") == [active("orders.0", 0), active("orders.0", 100)]
    assert control.last_segment("orders.0") == active("orders.0", 100)

    seal = sealed("orders.0", 0, count=100, size=4096)
    await done(backend, control.put_segment(seal))
    await done(backend, control.delete_segment("orders.1", 0))

    assert control.segments("orders.0") == [seal, active("orders.0", 100)]
    assert control.segments("orders.1") == []
    assert control.segments("nope") == []
    assert control.last_segment("orders.1") is None
    assert control.last_segment("nope") is None
    again = await backend.reopen(control)
    assert again.segments("orders.0") == [seal, active("orders.0", 100)]
    assert again.segments("orders.1") == []


@pytest_twisted.ensureDeferred
async def test_segment_listeners_hear_the_ranges_whose_records_changed(
    backend: Backend, control: ControlPlane
) -> None:
    heard: list[dict[str, SegmentMeta | None]] = []
    control.watch_segments(
        lambda changed: heard.append({r: control.last_segment(r) for r in changed})
    )
    topic, ranges = make_topic("orders", ranges=3)
    await done(backend, control.create_topic(topic, ranges))
    await done(backend, control.put_segment(active("orders.0", 0)))
    await done(backend, control.put_segment(active("orders.2", 0)))
    await done(backend, control.create_user(make_user("alice")))
    await done(backend, control.put_segment(sealed("orders.0", 0, count=10, size=400)))
    await done(backend, control.delete_segment("orders.2", 0))

    # Each once per change of it (a change of something else is not heard at all), once the
    # change is readable.
    assert heard == [
        {"orders.0": active("orders.0", 0)},
        {"orders.2": active("orders.2", 0)},
        {"orders.0": sealed("orders.0", 0, count=10, size=400)},
        {"orders.2": None},
    ]


@pytest_twisted.ensureDeferred
async def test_a_seal_and_the_next_opening_are_recorded_together_or_not_at_all(
    backend: Backend, control: ControlPlane
) -> None:
    topic, ranges = make_topic("orders", ranges=2)
    await done(backend, control.create_topic(topic, ranges))
    first = active("orders.0", 0)
    await done(backend, control.put_segment(first))
    heard: list[set[str]] = []
    control.watch_segments(lambda changed: heard.append(set(changed)))

    seal = sealed("orders.0", 0, count=10, size=400)
    await done(backend, control.put_segments([(seal, first), (active("orders.0", 10), None)]))
    assert control.segments("orders.0") == [seal, active("orders.0", 10)]
    assert heard == [{"orders.0"}], "one change"

    # The second part refused (it expects a record that is not there): the first does not
    # take effect either.
    again = sealed("orders.0", 10, count=5, size=200)
    refused = control.put_segments(
        [(again, active("orders.0", 10)), (active("orders.0", 15), active("orders.0", 15))]
    )
    rejected(refused, InvalidChangeError)
    rejected(control.put_segments([(active("nope.0", 0), None)]), NotFoundError)
    assert control.segments("orders.0") == [seal, active("orders.0", 10)]
    assert (await backend.reopen(control)).segments("orders.0") == [seal, active("orders.0", 10)]


@pytest_twisted.ensureDeferred
async def test_segment_changes_that_would_lose_data_are_refused(
    backend: Backend, control: ControlPlane
) -> None:
    topic, ranges = make_topic("orders")
    await done(backend, control.create_topic(topic, ranges))
    await done(backend, control.put_segment(active("orders.0", 0, epoch=3)))

    rejected(control.put_segment(active("orders.9", 0)), NotFoundError)
    lower = rejected(control.put_segment(active("orders.0", 0, epoch=2)), InvalidChangeError)
    assert str(lower) == "segment orders.0@0 is at epoch 3; it cannot go back to 2"

    seal = sealed("orders.0", 0, count=10, size=500, epoch=4)
    await done(backend, control.put_segment(seal))
    rejected(control.put_segment(active("orders.0", 0, epoch=4)), InvalidChangeError)
    rejected(control.put_segment(sealed("orders.0", 0, 10, 499, epoch=4)), InvalidChangeError)
    # A sealed segment still gets new replica sets and epochs (healing, failover).
    moved = attrs.evolve(seal, replicas=("node-2", "node-3"), epoch=5)
    await done(backend, control.put_segment(moved))
    assert control.segments("orders.0") == [moved]
    rejected(control.delete_segment("orders.0", 7), NotFoundError)


@pytest_twisted.ensureDeferred
async def test_a_segment_change_expecting_a_record_is_a_compare_and_swap(
    backend: Backend, control: ControlPlane
) -> None:
    topic, ranges = make_topic("orders")
    await done(backend, control.create_topic(topic, ranges))
    first = active("orders.0", 0, epoch=1)
    await done(backend, control.put_segment(first, expected=None))
    exists = rejected(control.put_segment(first, expected=None), InvalidChangeError)
    assert "exists already" in str(exists)

    claimed = attrs.evolve(first, epoch=2, replicas=("node-2", "node-1"))
    await done(backend, control.put_segment(claimed, expected=first))
    # A second claim of the same epoch, from what was read before the first: a lost race.
    rival = attrs.evolve(first, epoch=2, replicas=("node-3", "node-1"))
    lost = rejected(control.put_segment(rival, expected=first), InvalidChangeError)
    assert "another node changed it first" in str(lost)
    missing = rejected(
        control.put_segment(active("orders.0", 100), expected=first), InvalidChangeError
    )
    assert "is not recorded" in str(missing)
    assert control.segments("orders.0") == [claimed]


@pytest_twisted.ensureDeferred
async def test_users_are_created_updated_and_deleted(
    backend: Backend, control: ControlPlane
) -> None:
    alice = make_user("alice", "produce")
    bob = make_user("bob", "consume")
    await done(backend, control.create_user(bob))
    await done(backend, control.create_user(alice))

    assert control.users() == [alice, bob]
    assert control.user("alice") == alice
    assert control.user("carol") is None
    rejected(control.create_user(make_user("alice", "admin")), UserExistsError)

    rehashed = await done(backend, control.update_user("alice", password_hash="$argon2id$new"))
    assert rehashed == attrs.evolve(alice, password_hash="$argon2id$new")
    promoted = await done(backend, control.update_user("alice", permissions=frozenset({"admin"})))
    assert promoted == attrs.evolve(rehashed, permissions=frozenset({"admin"}))
    assert control.user("alice") == promoted
    rejected(control.update_user("carol", password_hash="x"), UserNotFoundError)

    await done(backend, control.delete_user("bob"))
    assert control.users() == [promoted]
    rejected(control.delete_user("bob"), UserNotFoundError)
    assert (await backend.reopen(control)).users() == [promoted]


@pytest_twisted.ensureDeferred
async def test_acl_grants_are_stored_listed_and_revoked(
    backend: Backend, control: ControlPlane
) -> None:
    await done(backend, control.create_user(make_user("alice")))
    await done(backend, control.create_user(make_user("bob")))
    grants = [
        AclGrant("bob", "consume", "orders.*"),
        AclGrant("alice", "produce", "orders"),
        AclGrant("alice", "consume", "orders"),
    ]
    for grant in grants:
        await done(backend, control.grant_acl(grant))
    await done(backend, control.grant_acl(grants[0]))  # again: no change

    assert control.acls("alice") == [grants[2], grants[1]]
    assert control.acls() == [grants[2], grants[1], grants[0]]
    assert control.acls("carol") == []
    rejected(control.grant_acl(AclGrant("carol", "produce", "x")), UserNotFoundError)

    await done(backend, control.revoke_acl(grants[1]))
    rejected(control.revoke_acl(grants[1]), NotFoundError)
    assert control.acls("alice") == [grants[2]]
    assert (await backend.reopen(control)).acls() == [grants[2], grants[0]]


@pytest_twisted.ensureDeferred
async def test_deleting_a_user_drops_its_grants(backend: Backend, control: ControlPlane) -> None:
    await done(backend, control.create_user(make_user("alice")))
    await done(backend, control.grant_acl(AclGrant("alice", "produce", "orders")))

    await done(backend, control.delete_user("alice"))
    await done(backend, control.create_user(make_user("alice")))

    assert control.acls() == []


@pytest_twisted.ensureDeferred
async def test_group_positions_are_committed_and_replaced(
    backend: Backend, control: ControlPlane
) -> None:
    topic, ranges = make_topic("orders")
    await done(backend, control.create_topic(topic, ranges))

    await done(backend, control.commit_group_position("orders", "billing", "AQAAAA"))
    await done(backend, control.commit_group_position("orders", "billing", "AQAAAB"))
    await done(backend, control.commit_group_position("orders", "audit", "AQ"))

    assert control.group_position("orders", "billing") == "AQAAAB"
    assert control.group_position("orders", "audit") == "AQ"
    assert control.group_position("orders", "nope") is None
    rejected(control.commit_group_position("nope", "billing", "AQ"), NotFoundError)
    with pytest.raises(ValueError, match="group name"):
        control.commit_group_position("orders", "", "AQ")
    assert (await backend.reopen(control)).group_position("orders", "billing") == "AQAAAB"


@pytest_twisted.ensureDeferred
async def test_a_merged_commit_merges_into_the_stored_position(
    backend: Backend, control: ControlPlane
) -> None:
    topic, ranges = make_topic("orders")
    await done(backend, control.create_topic(topic, ranges))
    seen: list[tuple[str | None, str]] = []

    def merge(stored: str | None, committed: str) -> str:
        seen.append((stored, committed))
        return committed if stored is None else f"{stored}+{committed}"

    await done(backend, control.commit_group_position("orders", "billing", "a", merge))
    await done(backend, control.commit_group_position("orders", "billing", "b", merge))

    assert control.group_position("orders", "billing") == "a+b"
    assert (None, "a") in seen
    assert ("a", "b") in seen


@pytest_twisted.ensureDeferred
async def test_changes_asked_for_together_apply_in_order(
    backend: Backend, control: ControlPlane
) -> None:
    topic, ranges = make_topic("orders")
    fired: list[str] = []

    # Each checked against the state the ones before it will make.
    changes = {
        "topic": control.create_topic(topic, ranges),
        "segment": control.put_segment(active("orders.0", 0)),
        "user": control.create_user(make_user("alice", "produce")),
        "grant": control.grant_acl(AclGrant("alice", "produce", "orders")),
        "password": control.update_user("alice", password_hash="$argon2id$new"),
        "permissions": control.update_user("alice", permissions=frozenset({"admin"})),
        "position": control.commit_group_position("orders", "billing", "AQ"),
        "again": control.commit_group_position("orders", "billing", "AR"),
    }
    for name, change in changes.items():
        change.addCallback(lambda _, name=name: fired.append(name))
    rejected(control.create_user(make_user("alice")), UserExistsError)
    for change in changes.values():
        await done(backend, change)

    assert fired == list(changes)
    # Neither update undid the other.
    assert control.user("alice") == attrs.evolve(
        make_user("alice"), password_hash="$argon2id$new", permissions=frozenset({"admin"})
    )
    assert control.acls() == [AclGrant("alice", "produce", "orders")]
    assert control.segments("orders.0") == [active("orders.0", 0)]
    assert (await backend.reopen(control)).group_position("orders", "billing") == "AR"


@pytest_twisted.ensureDeferred
async def test_close_settles_every_change_asked_for(
    backend: Backend, control: ControlPlane
) -> None:
    creating = control.create_user(make_user("alice"))

    closing = control.close()
    rejected(control.create_user(make_user("bob")), ControlPlaneClosedError)
    await done(backend, closing)

    assert creating.called
    await creating
    assert (await backend.open()).users() == [make_user("alice")]


@pytest_twisted.ensureDeferred
async def test_a_segment_sealed_by_a_claim_keeps_whose_records_it_holds(
    backend: Backend, control: ControlPlane
) -> None:
    topic, ranges = make_topic("orders")
    await done(backend, control.create_topic(topic, ranges))
    seal = attrs.evolve(sealed("orders.0", 0, count=10, size=500, epoch=4), data_epoch=2)
    await done(backend, control.put_segment(seal))

    assert control.segments("orders.0") == [seal]
    assert control.segments("orders.0")[0].records_epoch == 2
    with pytest.raises(ValueError, match="older than its epoch 4"):
        attrs.evolve(seal, data_epoch=4)
    with pytest.raises(ValueError, match="only for a sealed segment"):
        attrs.evolve(active("orders.0", 0, epoch=4), data_epoch=1)
