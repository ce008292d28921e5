"""A power cut at any step of any write leaves the old state or the new one, never a mixture,
and never loses a change that was acknowledged."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from logbroker.controlplane import ControlPlaneError, LocalControlPlane
from logbroker.controlplane._state import (
    Change,
    CommitGroupPosition,
    CreateTopic,
    CreateUser,
    DeleteSegment,
    DeleteUser,
    GrantAcl,
    PutSegment,
    RevokeAcl,
    UpdateUser,
)
from logbroker.testing import MemoryFileSystem
from tests.unit.controlplane.helpers import STATE_PATH, make_user, started
from tests.unit.controlplane.strategies import CHANGE_LISTS
from tests.unit.storage.helpers import result_of


def issue(control: LocalControlPlane, change: Change) -> Deferred[Any]:
    """Ask for ``change`` through the public interface."""
    match change:
        case CreateTopic(topic, ranges):
            return control.create_topic(topic, ranges)
        case PutSegment(meta):
            return control.put_segment(meta)
        case DeleteSegment(range_id, base_offset):
            return control.delete_segment(range_id, base_offset)
        case CreateUser(user):
            return control.create_user(user)
        case UpdateUser(name, password_hash, permissions):
            return control.update_user(name, password_hash=password_hash, permissions=permissions)
        case DeleteUser(name):
            return control.delete_user(name)
        case GrantAcl(grant):
            return control.grant_acl(grant)
        case RevokeAcl(grant):
            return control.revoke_acl(grant)
        case CommitGroupPosition(topic, group, cursor):
            return control.commit_group_position(topic, group, cursor)
    raise AssertionError(change)


def view(control: LocalControlPlane, positions: set[tuple[str, str]]) -> object:
    """Everything the public reads show, for the group positions in ``positions``."""
    ranges = [r for topic in control.topics() for r in control.ranges(topic.name)]
    return (
        control.topics(),
        ranges,
        [control.segments(r.range_id) for r in ranges],
        control.users(),
        control.acls(),
        {key: control.group_position(*key) for key in positions},
    )


@given(CHANGE_LISTS, st.data())
def test_a_crash_at_any_step_of_a_write_leaves_the_old_or_the_new_state(
    changes: list[Change], data: st.DataObject
) -> None:
    positions = {(c.topic, c.group) for c in changes if isinstance(c, CommitGroupPosition)}
    fs = MemoryFileSystem()
    control = started(fs)
    images: list[MemoryFileSystem] = []

    def crash() -> MemoryFileSystem:
        # The kernel may have written back any prefix of a file, and any directory entry.
        return fs.crash(
            keep=lambda path, unsynced: data.draw(st.integers(0, unsynced)),
            entries=lambda path: data.draw(st.booleans()),
        )

    fs.on_atomic_step = lambda step, path: images.append(crash())
    for change in changes:
        images.clear()
        old = view(control, positions)
        fired: list[object] = []
        issue(control, change).addBoth(fired.append)
        [outcome] = fired
        if isinstance(outcome, Failure):
            # Refused at call time: nothing was written.
            outcome.trap(ControlPlaneError)
            assert images == []
            continue
        new = view(control, positions)
        assert len(images) == 4, "write, sync, rename, sync-dir"
        for image in images:
            assert view(started(image), positions) in (old, new)
        # Acknowledged: every crash from now on keeps it.
        assert view(started(crash()), positions) == new
    assert fs.exists(STATE_PATH) or not changes


def test_the_crash_images_include_leftover_temporary_files() -> None:
    fs = MemoryFileSystem()
    control = started(fs)
    images: list[MemoryFileSystem] = []
    fs.on_atomic_step = lambda step, path: images.append(
        fs.crash(keep=lambda path, unsynced: unsynced // 2, entries=lambda path: True)
    )

    result_of(control.create_user(make_user()))

    write, sync, rename, sync_dir = images
    assert not write.exists(STATE_PATH + ".tmp")
    assert 0 < sync.size(STATE_PATH + ".tmp") < rename.size(STATE_PATH + ".tmp")
    assert not rename.exists(STATE_PATH)
    assert sync_dir.exists(STATE_PATH)
    for image in images:
        started(image)
        assert not image.exists(STATE_PATH + ".tmp")
