"""When changes become durable and visible: one write in flight, the rest coalesced behind it,
failures failing exactly what was not written, and a clean close."""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from twisted.internet.defer import Deferred

from logbroker.controlplane import (
    AclGrant,
    ControlPlaneClosedError,
    ControlPlaneError,
    ControlPlaneWriteError,
    LocalControlPlane,
    UserExistsError,
    UserNotFoundError,
)
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from tests.unit.controlplane.helpers import (
    CONTROL_DIR,
    STATE_PATH,
    make_topic,
    make_user,
    started,
)
from tests.unit.storage.helpers import failure_of, result_of

_T = TypeVar("_T")


def atomic_writes(fs: MemoryFileSystem) -> int:
    return sum(entry.operation == "write-atomic" for entry in fs.journal)


def outcomes(deferreds: list[Deferred[Any]]) -> list[Any]:
    seen: list[Any] = []
    for d in deferreds:
        d.addBoth(seen.append)
    return seen


def test_a_change_is_visible_and_acknowledged_only_once_durable() -> None:
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    control = started(fs, executor)
    topic, ranges = make_topic()

    created = control.create_topic(topic, ranges)

    assert not created.called
    assert control.topic("orders") is None
    assert not fs.exists(STATE_PATH)
    seen: list[object] = []
    created.addCallback(lambda _: seen.append(control.topic("orders")))
    executor.run_next()
    assert seen == [topic]


def test_changes_asked_for_during_a_write_go_out_together_in_the_next_one() -> None:
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    control = started(fs, executor)
    topic, ranges = make_topic()
    first = control.create_topic(topic, ranges)
    assert len(executor.pending) == 1

    later = [control.commit_group_position("orders", "g", f"c{i}") for i in range(50)]
    later.append(control.create_user(make_user()))
    fired = outcomes([first, *later])

    assert len(executor.pending) == 1, "nothing starts while a write runs"
    executor.run_next()
    assert fired == [None]
    assert len(executor.pending) == 1, "one write carries every queued change"
    assert control.group_position("orders", "g") is None
    executor.run_next()
    assert fired == [None] * 52
    assert executor.pending == []
    assert atomic_writes(fs) == 2
    assert control.group_position("orders", "g") == "c49"
    assert control.user("alice") == make_user()


def test_acknowledgements_fire_in_call_order_and_see_their_own_change() -> None:
    executor = ManualExecutor()
    control = started(MemoryFileSystem(), executor)
    topic, ranges = make_topic()
    order: list[tuple[int, str | None]] = []
    d = control.create_topic(topic, ranges)
    d.addCallback(lambda _: order.append((0, None)))
    for i in range(1, 4):
        control.commit_group_position("orders", "g", f"c{i}").addCallback(
            lambda _, i=i: order.append((i, control.group_position("orders", "g")))
        )

    executor.run_all()

    # Reads show the state of the whole write that carried a change.
    assert order == [(0, None), (1, "c3"), (2, "c3"), (3, "c3")]


def test_changes_asked_for_by_acknowledgements_share_one_write() -> None:
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    control = started(fs, executor)
    topic, ranges = make_topic()

    def fan_out(_: object) -> None:
        for i in range(10):
            control.commit_group_position("orders", f"g{i}", "c")

    control.create_topic(topic, ranges).addCallback(fan_out)
    executor.run_all()

    assert atomic_writes(fs) == 2


class _ImmediateOnceReleased(ManualExecutor):
    """Holds jobs until ``released``, then runs each later one at once."""

    released = False

    def run(self, job: Callable[..., _T], *args: Any) -> Deferred[_T]:
        if self.released:
            return ImmediateExecutor().run(job, *args)
        return super().run(job, *args)


def test_a_long_chain_of_changes_does_not_recurse_with_an_executor_that_fires_at_once() -> None:
    executor = _ImmediateOnceReleased()
    control = started(MemoryFileSystem(), executor)
    topic, ranges = make_topic()
    created = control.create_topic(topic, ranges)
    remaining = [5000]

    # Each acknowledgement asks for the next change while its write still counts as running,
    # so every write finishes inside the previous one's acknowledgement.
    def next_commit(_: object) -> None:
        remaining[0] -= 1
        if remaining[0]:
            control.commit_group_position("orders", "g", str(remaining[0])).addCallback(next_commit)

    created.addCallback(next_commit)
    executor.released = True
    executor.run_next()

    assert control.group_position("orders", "g") == "1"


def test_changes_are_checked_against_the_queued_state_at_call_time() -> None:
    executor = ManualExecutor()
    control = started(MemoryFileSystem(), executor)

    created = control.create_user(make_user("alice"))
    granted = control.grant_acl(AclGrant("alice", "produce", "orders"))
    twice = control.create_user(make_user("alice"))
    deleted = control.delete_user("alice")
    grant_after_delete = control.grant_acl(AclGrant("alice", "consume", "orders"))

    failure_of(twice).trap(UserExistsError)
    failure_of(grant_after_delete).trap(UserNotFoundError)
    executor.run_all()
    assert [result_of(d) for d in (created, granted, deleted)] == [None, None, None]
    assert control.users() == []


def test_a_failed_write_fails_exactly_the_changes_it_carried(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    control = started(fs)
    result_of(control.create_user(make_user("alice")))
    before = fs.read_file(STATE_PATH)

    fs.failing_atomic_writes = 1
    failure = failure_of(control.create_user(make_user("bob")))
    result_of(control.create_user(make_user("carol")))

    assert isinstance(failure.value, ControlPlaneWriteError)
    assert str(failure.value) == (
        "writing /data/control/state.json failed ([Errno 28] No space left on device "
        "(injected): '/data/control/state.json'); the change did not take effect"
    )
    assert [u.name for u in control.users()] == ["alice", "carol"]
    assert [u.name for u in started(fs.crash()).users()] == ["alice", "carol"]
    assert before != fs.read_file(STATE_PATH)
    assert len(logged_errors) == 1
    assert "1 changes did not take effect" in logged_errors[0]["log_format"].format(
        **logged_errors[0]
    )
    logged_errors.clear()


def test_a_failed_write_fails_the_changes_queued_behind_it_and_leaves_the_durable_state(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    control = started(fs, executor)
    result_of_write = control.create_user(make_user("alice"))
    executor.run_all()
    result_of(result_of_write)

    carried = control.update_user("alice", permissions=frozenset({"admin"}))
    behind = [
        control.grant_acl(AclGrant("alice", "produce", "orders")),
        control.create_user(make_user("bob")),
    ]
    fs.failing_atomic_writes = 1
    executor.run_next()

    failure_of(carried).trap(ControlPlaneWriteError)
    for d in behind:
        assert "for a change asked for before this one" in str(failure_of(d).value)
    assert executor.pending == []
    assert control.users() == [make_user("alice")]
    assert control.acls() == []
    # The next change starts from the durable state: bob can be created now.
    created = control.create_user(make_user("bob"))
    executor.run_all()
    result_of(created)
    reloaded = started(fs.crash())
    assert reloaded.users() == [make_user("alice"), make_user("bob")]
    assert reloaded.acls() == []
    logged_errors.clear()


def test_a_write_failing_after_its_rename_is_superseded_by_the_next_one(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    control = started(fs)

    def fail_directory_sync(step: str, path: str) -> None:
        if step == "sync-dir":
            raise OSError(errno.EIO, "Input/output error (injected)", path)

    fs.on_atomic_step = fail_directory_sync
    failure_of(control.create_user(make_user("alice"))).trap(ControlPlaneWriteError)
    fs.on_atomic_step = None

    assert control.users() == []
    result_of(control.create_user(make_user("bob")))
    assert [u.name for u in started(fs.crash()).users()] == ["bob"]
    logged_errors.clear()


def test_close_waits_for_every_change_then_refuses_more() -> None:
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    control = started(fs, executor)
    first = control.create_user(make_user("alice"))
    second = control.create_user(make_user("bob"))

    closed = control.close()
    refused = control.create_user(make_user("carol"))

    assert not closed.called
    failure_of(refused).trap(ControlPlaneClosedError)
    executor.run_all()
    assert result_of(first) is None
    assert result_of(second) is None
    assert result_of(closed) is None
    assert result_of(control.close()) is None
    # Reads still answer; the directory is free for the next one.
    assert [u.name for u in control.users()] == ["alice", "bob"]
    assert [u.name for u in started(fs).users()] == ["alice", "bob"]


def test_close_before_start_fires_at_once() -> None:
    control = LocalControlPlane(CONTROL_DIR, fs=MemoryFileSystem(), executor=ImmediateExecutor())

    assert result_of(control.close()) is None


def test_a_second_control_plane_on_the_same_directory_is_refused() -> None:
    fs = MemoryFileSystem()
    first = started(fs)

    second = LocalControlPlane(CONTROL_DIR, fs=fs, executor=ImmediateExecutor())
    failure = failure_of(second.start())

    failure.trap(ControlPlaneError)
    assert "in use by another logbroker process" in str(failure.value)
    result_of(first.close())
    result_of(second.start())


@pytest.mark.parametrize("content", [b"", b'{"format":1,"crc32c":0,"sta'])
def test_a_leftover_temporary_file_is_removed_at_start(content: bytes) -> None:
    fs = MemoryFileSystem()
    control = started(fs)
    result_of(control.create_user(make_user("alice")))
    result_of(control.close())
    fs.write_atomic(STATE_PATH + ".tmp", content)

    assert [u.name for u in started(fs).users()] == ["alice"]
    assert not fs.exists(STATE_PATH + ".tmp")
