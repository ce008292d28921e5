"""Users, passwords, permissions and ACLs over a control plane in memory.

Every test hashes with cheap argon2 parameters through the injectable hasher; only
``test_the_default_hasher_is_argon2_cffi_s_default_profile`` pays for the production profile.
"""

from __future__ import annotations

from typing import Any

import argon2
import pytest
from argon2 import PasswordHasher, extract_parameters

from logbroker.controlplane import (
    AclGrant,
    LocalControlPlane,
    User,
    UserExistsError,
    UserNotFoundError,
)
from logbroker.security import (
    InvalidAclError,
    InvalidPasswordError,
    InvalidPermissionsError,
    InvalidUsernameError,
    MissingAdminPasswordError,
    Operation,
    UserDirectory,
    allows,
    hash_password,
    seed_accounts,
    verify_password,
)
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from tests.unit.controlplane.helpers import started
from tests.unit.storage.helpers import failure_of, result_of


class RecordingHasher(PasswordHasher):
    """Cheap parameters, and a note of every hash it verified against."""

    def __init__(self) -> None:
        super().__init__(time_cost=1, memory_cost=8, parallelism=1)
        self.verified: list[str] = []

    def verify(self, hash: str | bytes, password: str | bytes) -> Any:
        self.verified.append(str(hash))
        return super().verify(hash, password)


@pytest.fixture
def hasher() -> RecordingHasher:
    return RecordingHasher()


@pytest.fixture
def control() -> LocalControlPlane:
    return started(MemoryFileSystem())


@pytest.fixture
def users(control: LocalControlPlane, hasher: RecordingHasher) -> UserDirectory:
    return UserDirectory(control, ImmediateExecutor(), hasher)


def test_passwords_are_hashed_with_argon2id(hasher: RecordingHasher) -> None:
    stored = hash_password("s3cret", hasher)

    assert stored.startswith("$argon2id$")
    assert extract_parameters(stored) == extract_parameters(hasher.hash("x"))
    assert hash_password("s3cret", hasher) != stored, "a fresh salt each time"
    assert verify_password(stored, "s3cret", hasher)
    assert not verify_password(stored, "s3cret ", hasher)
    assert not verify_password("not a hash", "s3cret", hasher)
    odd = "p\u00e4ss \U0001f511 \ud800"
    assert verify_password(hash_password(odd, hasher), odd, hasher)


def test_the_default_hasher_is_argon2_cffi_s_default_profile() -> None:
    stored = hash_password("s3cret")

    assert extract_parameters(stored) == argon2.profiles.get_default_parameters()
    assert verify_password(stored, "s3cret")


def test_a_user_is_created_and_authenticated(users: UserDirectory) -> None:
    alice = result_of(users.create_user("alice", "pw-alice", ["produce", "consume"]))

    assert alice.permissions == {"produce", "consume"}
    assert alice.password_hash.startswith("$argon2id$")
    assert "pw-alice" not in alice.password_hash
    assert users.user("alice") == alice
    assert users.list_users() == [alice]
    assert result_of(users.authenticate("alice", "pw-alice")) == alice
    assert result_of(users.authenticate("alice", "pw-bob")) is None
    assert result_of(users.authenticate("bob", "pw-alice")) is None


def test_an_unknown_name_costs_one_verification_like_a_known_one(
    users: UserDirectory, hasher: RecordingHasher
) -> None:
    alice = result_of(users.create_user("alice", "pw", ["produce"]))

    result_of(users.authenticate("alice", "wrong"))
    result_of(users.authenticate("nobody", "wrong"))

    known, unknown = hasher.verified
    assert known == alice.password_hash
    assert unknown != known
    assert extract_parameters(unknown) == extract_parameters(known)


def test_hashing_and_verifying_run_on_the_executor(
    control: LocalControlPlane, hasher: RecordingHasher
) -> None:
    executor = ManualExecutor()
    users = UserDirectory(control, executor, hasher)

    created = users.create_user("alice", "pw", ["produce"])
    assert control.user("alice") is None
    executor.run_all()
    result_of(created)
    authenticated = users.authenticate("alice", "pw")

    assert hasher.verified == []
    assert not authenticated.called
    executor.run_all()
    assert result_of(authenticated) == control.user("alice")


@pytest.mark.parametrize("change", ["password", "delete"])
def test_a_user_changed_during_verification_is_not_authenticated(
    control: LocalControlPlane, hasher: RecordingHasher, change: str
) -> None:
    executor = ManualExecutor()
    users = UserDirectory(control, executor, hasher)
    result_of(control.create_user(User("alice", hash_password("old", hasher), frozenset())))

    authenticated = users.authenticate("alice", "old")
    if change == "password":
        result_of(control.update_user("alice", password_hash=hash_password("new", hasher)))
    else:
        result_of(control.delete_user("alice"))
    executor.run_all()

    assert result_of(authenticated) is None


@pytest.mark.parametrize(
    ("name", "password", "permissions", "error", "reason"),
    [
        ("alice", "pw", ["produce", "root"], InvalidPermissionsError, "invalid_permissions"),
        ("alice", "pw", ["Admin"], InvalidPermissionsError, "invalid_permissions"),
        ("al ice", "pw", ["produce"], InvalidUsernameError, "invalid_username"),
        ("", "pw", ["produce"], InvalidUsernameError, "invalid_username"),
        ("alice", "", ["produce"], InvalidPasswordError, "invalid_password"),
    ],
)
def test_bad_users_are_refused_with_a_reason(
    users: UserDirectory,
    hasher: RecordingHasher,
    name: str,
    password: str,
    permissions: list[str],
    error: type[Exception],
    reason: str,
) -> None:
    failure = failure_of(users.create_user(name, password, permissions))

    failure.trap(error)
    assert getattr(failure.value, "reason", None) == reason
    assert users.list_users() == []


def test_invalid_permissions_name_the_unknown_ones(users: UserDirectory) -> None:
    failure = failure_of(users.create_user("alice", "pw", ["produce", "root", "sudo"]))

    assert str(failure.value) == (
        "unknown permissions ['root', 'sudo']; use admin, produce or consume"
    )


def test_a_name_is_taken_once(users: UserDirectory) -> None:
    result_of(users.create_user("alice", "pw", []))

    failure_of(users.create_user("alice", "other", ["admin"])).trap(UserExistsError)
    assert users.list_users()[0].permissions == frozenset()


def test_a_password_change_keeps_the_permissions(users: UserDirectory) -> None:
    alice = result_of(users.create_user("alice", "old", ["consume"]))

    changed = result_of(users.change_password("alice", "new"))

    assert changed.permissions == alice.permissions
    assert result_of(users.authenticate("alice", "old")) is None
    assert result_of(users.authenticate("alice", "new")) == changed
    failure_of(users.change_password("bob", "new")).trap(UserNotFoundError)
    failure_of(users.change_password("alice", "")).trap(InvalidPasswordError)


def test_permissions_change_and_keep_the_password(users: UserDirectory) -> None:
    result_of(users.create_user("alice", "pw", ["consume"]))

    changed = result_of(users.set_permissions("alice", ["produce", "admin"]))

    assert changed.permissions == {"produce", "admin"}
    assert result_of(users.authenticate("alice", "pw")) == changed
    failure_of(users.set_permissions("alice", ["everything"])).trap(InvalidPermissionsError)
    failure_of(users.set_permissions("bob", ["admin"])).trap(UserNotFoundError)


def test_a_deleted_user_cannot_log_in_and_loses_its_grants(users: UserDirectory) -> None:
    result_of(users.create_user("alice", "pw", ["produce"]))
    result_of(users.grant_acl("alice", "produce", "orders"))

    result_of(users.delete_user("alice"))

    assert result_of(users.authenticate("alice", "pw")) is None
    assert users.list_acls() == []
    failure_of(users.delete_user("alice")).trap(UserNotFoundError)


def test_acl_grants_are_stored_listed_and_revoked(users: UserDirectory) -> None:
    result_of(users.create_user("alice", "pw", ["produce", "consume"]))
    result_of(users.create_user("bob", "pw", ["consume"]))

    granted = result_of(users.grant_acl("alice", "produce", "orders.*"))
    result_of(users.grant_acl("bob", "consume", "orders"))

    assert granted == AclGrant("alice", "produce", "orders.*")
    assert users.list_acls("alice") == [granted]
    assert users.list_acls() == [granted, AclGrant("bob", "consume", "orders")]
    result_of(users.revoke_acl("alice", "produce", "orders.*"))
    assert users.list_acls("alice") == []
    failure_of(users.grant_acl("carol", "produce", "orders")).trap(UserNotFoundError)


@pytest.mark.parametrize(
    ("operation", "pattern"),
    [("admin", "orders"), ("create_topic", "orders"), ("produce", "*"), ("consume", "a/b")],
)
def test_bad_grants_are_refused_as_invalid_operation(
    users: UserDirectory, operation: str, pattern: str
) -> None:
    result_of(users.create_user("alice", "pw", ["produce"]))

    for asked in (users.grant_acl, users.revoke_acl):
        failure = failure_of(asked("alice", operation, pattern))
        failure.trap(InvalidAclError)
        assert failure.value.reason == "invalid_operation"


def _user(*permissions: str) -> User:
    return User("u", "h", frozenset(permissions))


GRANTS = [AclGrant("u", "produce", "orders.*"), AclGrant("u", "consume", "audit")]


@pytest.mark.parametrize(
    ("permissions", "operation", "topic", "loose", "strict"),
    [
        # admin passes everything, grants or not
        (("admin",), Operation.PRODUCE, "other", True, True),
        (("admin",), Operation.CREATE_TOPIC, "other", True, True),
        (("admin",), Operation.CONSUME, "other", True, True),
        # without strict, the permission decides; with it, a matching grant is needed too
        (("produce",), Operation.PRODUCE, "orders.eu", True, True),
        (("produce",), Operation.PRODUCE, "other", True, False),
        (("produce",), Operation.PRODUCE, "orders", True, False),
        (("produce",), Operation.CREATE_TOPIC, "orders.eu", True, True),
        (("produce",), Operation.CREATE_TOPIC, "other", True, False),
        (("produce",), Operation.CONSUME, "audit", False, False),
        (("consume",), Operation.CONSUME, "audit", True, True),
        (("consume",), Operation.CONSUME, "orders.eu", True, False),
        # a grant without the permission is not enough
        (("consume",), Operation.PRODUCE, "orders.eu", False, False),
        (("consume",), Operation.CREATE_TOPIC, "orders.eu", False, False),
        ((), Operation.CONSUME, "audit", False, False),
    ],
)
def test_allows(
    permissions: tuple[str, ...], operation: Operation, topic: str, loose: bool, strict: bool
) -> None:
    user = _user(*permissions)

    assert allows(user, GRANTS, operation, topic, strict=False) is loose
    assert allows(user, GRANTS, operation, topic, strict=True) is strict


def test_the_directory_checks_stored_grants_only_when_strict(users: UserDirectory) -> None:
    producer = result_of(users.create_user("p", "pw", ["produce"]))

    assert users.allows(producer, Operation.PRODUCE, "orders", strict=False)
    assert not users.allows(producer, Operation.PRODUCE, "orders", strict=True)
    result_of(users.grant_acl("p", "produce", "orders"))
    assert users.allows(producer, Operation.PRODUCE, "orders", strict=True)


DEV_ACCOUNTS = {
    "admin": ("admin123", {"admin"}),
    "producer": ("producer123", {"produce"}),
    "consumer": ("consumer123", {"consume"}),
    "app": ("app123", {"produce", "consume"}),
}


@pytest.mark.parametrize("env_mode", ["dev", "test"])
def test_dev_and_test_seed_the_four_development_accounts(
    users: UserDirectory, env_mode: str
) -> None:
    result_of(seed_accounts(users, env_mode, {}))

    assert {u.name: u.permissions for u in users.list_users()} == {
        name: permissions for name, (_, permissions) in DEV_ACCOUNTS.items()
    }
    for name, (password, _) in DEV_ACCOUNTS.items():
        assert result_of(users.authenticate(name, password)) is not None, name


def test_seeding_again_never_overwrites_an_existing_account(users: UserDirectory) -> None:
    result_of(seed_accounts(users, "dev", {}))
    result_of(users.change_password("admin", "changed"))
    result_of(users.delete_user("app"))

    result_of(seed_accounts(users, "dev", {"admin": "from-the-environment"}))

    assert result_of(users.authenticate("admin", "changed")) is not None
    assert result_of(users.authenticate("admin", "from-the-environment")) is None
    assert result_of(users.authenticate("app", "app123")) is not None


def test_a_password_given_in_dev_replaces_the_development_default(users: UserDirectory) -> None:
    result_of(seed_accounts(users, "dev", {"admin": "chosen", "app": None}))

    assert result_of(users.authenticate("admin", "chosen")) is not None
    assert result_of(users.authenticate("admin", "admin123")) is None
    assert result_of(users.authenticate("app", "app123")) is not None


@pytest.mark.parametrize("admin", [None, ""])
def test_prod_refuses_to_seed_without_the_admin_password(
    users: UserDirectory, admin: str | None
) -> None:
    with pytest.raises(MissingAdminPasswordError) as raised:
        seed_accounts(users, "prod", {"admin": admin, "producer": "p"})

    assert "SVC_ADMIN_PASS is not set" in str(raised.value)
    assert users.list_users() == []


def test_prod_seeds_only_the_accounts_whose_password_is_set(users: UserDirectory) -> None:
    result_of(seed_accounts(users, "prod", {"admin": "a-long-one", "consumer": "c", "app": None}))

    assert [u.name for u in users.list_users()] == ["admin", "consumer"]
    assert result_of(users.authenticate("admin", "a-long-one")) is not None
    assert result_of(users.authenticate("admin", "admin123")) is None
    assert result_of(users.authenticate("consumer", "c")) is not None


def test_an_unknown_environment_mode_is_refused(users: UserDirectory) -> None:
    with pytest.raises(ValueError, match="env_mode must be prod, dev or test, not 'production'"):
        seed_accounts(users, "production", {"admin": "x"})


def test_a_password_change_or_a_deletion_is_reported_once_durable_and_nothing_else(
    control: LocalControlPlane, hasher: RecordingHasher
) -> None:
    revoked: list[str] = []
    users = UserDirectory(
        control, ImmediateExecutor(), hasher, on_credentials_revoked=revoked.append
    )
    result_of(users.create_user("alice", "alice-password", ["consume"]))
    result_of(users.set_permissions("alice", ["produce"]))
    result_of(users.grant_acl("alice", "produce", "orders.*"))
    assert revoked == []
    result_of(users.change_password("alice", "new-password"))
    assert revoked == ["alice"]
    failure_of(users.change_password("nobody", "new-password"))
    failure_of(users.change_password("alice", ""))
    assert revoked == ["alice"]
    result_of(users.delete_user("alice"))
    assert revoked == ["alice", "alice"]
