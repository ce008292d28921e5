"""Passwords verified lately sign in again without an argon2 check, and only while they are
still the user's: a wrong password, an expired entry, a changed password or a deleted user
always goes through the full check."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from logbroker.controlplane import LocalControlPlane
from logbroker.security import UserDirectory, hash_password
from logbroker.security.verified import VerifiedPasswords
from logbroker.testing import ImmediateExecutor
from tests.unit.security.test_users import RecordingHasher, control, hasher
from tests.unit.storage.helpers import result_of

__all__ = ["control", "hasher"]

TTL = 300.0


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def users(control: LocalControlPlane, hasher: RecordingHasher, clock: Clock) -> UserDirectory:
    directory = UserDirectory(
        control, ImmediateExecutor(), hasher, verified=VerifiedPasswords(clock, TTL)
    )
    result_of(directory.create_user("alice", "s3cret", ["produce"]))
    return directory


def test_a_password_verified_lately_signs_in_again_without_the_check(
    users: UserDirectory, hasher: RecordingHasher, control: LocalControlPlane
) -> None:
    first = result_of(users.authenticate("alice", "s3cret"))
    again = result_of(users.authenticate("alice", "s3cret"))

    assert first == again == control.user("alice")
    assert len(hasher.verified) == 1


def test_a_wrong_password_always_costs_the_check(
    users: UserDirectory, hasher: RecordingHasher
) -> None:
    result_of(users.authenticate("alice", "s3cret"))
    for _ in range(3):
        assert result_of(users.authenticate("alice", "s3cre")) is None

    assert len(hasher.verified) == 4
    # Nor does a wrong password make the right one forgotten.
    assert result_of(users.authenticate("alice", "s3cret")) is not None
    assert len(hasher.verified) == 4


def test_an_entry_stands_for_its_time_only(
    users: UserDirectory, hasher: RecordingHasher, clock: Clock
) -> None:
    result_of(users.authenticate("alice", "s3cret"))
    clock.advance(TTL - 1)
    result_of(users.authenticate("alice", "s3cret"))
    assert len(hasher.verified) == 1
    clock.advance(1)

    assert result_of(users.authenticate("alice", "s3cret")) is not None
    assert len(hasher.verified) == 2


def test_a_password_changed_on_another_node_ends_the_entry(
    users: UserDirectory, hasher: RecordingHasher, control: LocalControlPlane
) -> None:
    result_of(users.authenticate("alice", "s3cret"))
    # Another node changes the password: only the stored hash changes here.
    result_of(control.update_user("alice", password_hash=hash_password("n3w", hasher)))

    assert result_of(users.authenticate("alice", "s3cret")) is None
    assert result_of(users.authenticate("alice", "n3w")) is not None
    assert len(hasher.verified) == 3


def test_a_deleted_user_signs_in_no_more(users: UserDirectory) -> None:
    result_of(users.authenticate("alice", "s3cret"))
    result_of(users.delete_user("alice"))

    assert result_of(users.authenticate("alice", "s3cret")) is None


def test_the_oldest_entry_goes_first_when_full(clock: Clock) -> None:
    verified = VerifiedPasswords(clock, TTL, max_entries=2)
    for name in ("a", "b", "c"):
        verified.remember(name, f"hash-{name}", b"pw")

    assert not verified.matches("a", "hash-a", b"pw")
    assert verified.matches("b", "hash-b", b"pw")
    assert verified.matches("c", "hash-c", b"pw")
    assert not verified.matches("c", "hash-c", b"other")
