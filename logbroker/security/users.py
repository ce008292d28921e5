"""Users, their passwords and permissions, and the ACL grants that narrow them.

Passwords are stored only as argon2id hashes, made with argon2-cffi's default profile (RFC 9106
low-memory: 64 MiB, 3 passes, 4 lanes) unless a ``PasswordHasher`` is injected (tests use a
cheap one). Hashing and verifying cost tens of milliseconds of CPU each, so ``UserDirectory``
runs both on an injected executor; argon2-cffi releases the GIL meanwhile, so the reactor keeps
serving. A password verified lately signs in again without the check
(``logbroker.security.verified``).

Permissions: ``admin`` passes every check; ``produce`` allows producing and creating topics;
``consume`` allows consuming. ACL grants (produce or consume on a topic or a ``prefix.*``) are
stored and listed always, but only checked with ``SVC_ACL_STRICT``: then a user who is not an
admin needs both the permission and a matching grant.
"""

from __future__ import annotations

import base64
import hmac
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import TypeVar

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from argon2.low_level import ARGON2_VERSION
from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger

from logbroker.controlplane import (
    GRANT_OPERATIONS,
    AclGrant,
    ControlPlane,
    User,
    UserExistsError,
    pattern_matches,
    valid_pattern,
    valid_user_name,
)
from logbroker.security.errors import (
    InvalidAclError,
    InvalidPasswordError,
    InvalidPermissionsError,
    InvalidUsernameError,
    MissingAdminPasswordError,
)
from logbroker.security.verified import VerifiedPasswords
from logbroker.storage import Executor

log = Logger()

_T = TypeVar("_T")

_DEFAULT_HASHER = PasswordHasher()


class Permission(StrEnum):
    #: Passes every check, ACLs included.
    ADMIN = "admin"
    #: Produce, and create topics.
    PRODUCE = "produce"
    CONSUME = "consume"


class Operation(StrEnum):
    """What a request asks to do to a topic."""

    PRODUCE = "produce"
    CONSUME = "consume"
    CREATE_TOPIC = "create_topic"


#: The accounts seeded at first start: name, permissions, the password in dev and test, and the
#: variable that sets it in prod.
SEEDED_ACCOUNTS: tuple[tuple[str, frozenset[Permission], str, str], ...] = (
    ("admin", frozenset({Permission.ADMIN}), "admin123", "SVC_ADMIN_PASS"),
    ("producer", frozenset({Permission.PRODUCE}), "producer123", "SVC_PRODUCER_PASS"),
    ("consumer", frozenset({Permission.CONSUME}), "consumer123", "SVC_CONSUMER_PASS"),
    ("app", frozenset({Permission.PRODUCE, Permission.CONSUME}), "app123", "SVC_APP_PASS"),
)


def _secret(password: str) -> bytes:
    # Any str can arrive here; a lone surrogate must not turn a login into an exception.
    return password.encode("utf-8", "surrogatepass")


def hash_password(password: str, hasher: PasswordHasher = _DEFAULT_HASHER) -> str:
    """The argon2id hash of ``password`` with a fresh salt (blocking: tens of ms of CPU)."""
    return hasher.hash(_secret(password))


def verify_password(
    password_hash: str, password: str, hasher: PasswordHasher = _DEFAULT_HASHER
) -> bool:
    """Whether ``password`` matches ``password_hash`` (blocking, like ``hash_password``).

    A stored hash that is not a valid argon2 hash matches nothing.
    """
    try:
        return hasher.verify(password_hash, _secret(password))
    except (VerificationError, InvalidHashError):
        return False


def _unmatchable_hash(hasher: PasswordHasher) -> str:
    """A well-formed hash with ``hasher``'s parameters that no password matches (its digest is
    all zeros): verifying against it costs what verifying a real user's hash costs."""

    def b64(size: int) -> str:
        return base64.b64encode(bytes(size)).decode("ascii").rstrip("=")

    return (
        f"$argon2{hasher.type.name.lower()}$v={ARGON2_VERSION}"
        f"$m={hasher.memory_cost},t={hasher.time_cost},p={hasher.parallelism}"
        f"${b64(hasher.salt_len)}${b64(hasher.hash_len)}"
    )


def _same_secret(a: str, b: str) -> bool:
    return hmac.compare_digest(_secret(a), _secret(b))


def allows(
    user: User, grants: Iterable[AclGrant], operation: Operation, topic: str, *, strict: bool
) -> bool:
    """Whether ``user`` may do ``operation`` on ``topic``, given the user's ``grants``."""
    if Permission.ADMIN in user.permissions:
        return True
    # Creating a topic is part of producing to it.
    needed = Operation.PRODUCE if operation is Operation.CREATE_TOPIC else operation
    if needed.value not in user.permissions:
        return False
    if not strict:
        return True
    return any(g.operation == needed and pattern_matches(g.pattern, topic) for g in grants)


def _permissions(permissions: Iterable[str]) -> frozenset[str]:
    named = frozenset(permissions)
    unknown = named - {p.value for p in Permission}
    if unknown:
        raise InvalidPermissionsError(
            f"unknown permissions {sorted(unknown)!r}; use admin, produce or consume"
        )
    return named


def _check_name(name: str) -> None:
    if not valid_user_name(name):
        raise InvalidUsernameError(
            f"invalid user name {name!r}: use 1 to 128 of A-Z a-z 0-9 . _ @ -"
        )


def _check_password(password: str) -> None:
    if not password:
        raise InvalidPasswordError("a password cannot be empty")


def _grant(user: str, operation: str, pattern: str) -> AclGrant:
    if operation not in GRANT_OPERATIONS or not valid_pattern(pattern):
        raise InvalidAclError(
            f"cannot grant {operation!r} on {pattern!r}: the operation is produce or consume, "
            "the pattern a topic name or prefix.*"
        )
    return AclGrant(user, operation, pattern)


class UserDirectory:
    """Users and ACL grants over a ``ControlPlane``, with passwords hashed off the reactor.

    Changes fire once durable; bad input fails at once with a ``SecurityError`` carrying its
    ``reason``; unknown or duplicate users fail with the control plane's errors.
    """

    def __init__(
        self,
        control_plane: ControlPlane,
        executor: Executor,
        hasher: PasswordHasher = _DEFAULT_HASHER,
        *,
        on_credentials_revoked: Callable[[str], object] = lambda name: None,
        verified: VerifiedPasswords | None = None,
    ) -> None:
        self._control = control_plane
        #: Passwords verified lately, which sign in again without an argon2 check (none
        #: remembered without it).
        self._verified = verified
        self._executor = executor
        self._hasher = hasher
        self._unmatchable = _unmatchable_hash(hasher)
        #: Hears the name of a user whose password changed or who was deleted, once durable:
        #: their sessions must end, whichever port made the change.
        self._on_credentials_revoked = on_credentials_revoked

    def authenticate(self, name: str, password: str) -> Deferred[User | None]:
        """The user, if ``password`` is theirs; ``None`` otherwise.

        An unknown name costs one verification too (against a hash nothing matches), so the
        time taken does not tell which names exist.
        """
        user = self._control.user(name)
        remembered = self._verified
        if (
            user is not None
            and remembered is not None
            and remembered.matches(name, user.password_hash, _secret(password))
        ):
            return succeed(user)
        checked = user.password_hash if user is not None else self._unmatchable
        verifying = self._executor.run(verify_password, checked, password, self._hasher)

        def verified(matches: bool) -> User | None:
            if not matches:
                return None
            # The password may have changed, or the user gone, while the check ran.
            current = self._control.user(name)
            if current is None or not _same_secret(current.password_hash, checked):
                return None
            if remembered is not None:
                remembered.remember(name, checked, _secret(password))
            return current

        return verifying.addCallback(verified)

    def user(self, name: str) -> User | None:
        return self._control.user(name)

    def list_users(self) -> list[User]:
        return self._control.users()

    def create_user(self, name: str, password: str, permissions: Iterable[str]) -> Deferred[User]:
        try:
            _check_name(name)
            _check_password(password)
            granted = _permissions(permissions)
        except (InvalidUsernameError, InvalidPasswordError, InvalidPermissionsError):
            return fail()
        hashing = self._executor.run(hash_password, password, self._hasher)

        def store(password_hash: str) -> Deferred[User]:
            user = User(name, password_hash, granted)
            return self._control.create_user(user).addCallback(lambda _: user)

        return hashing.addCallback(store)

    def change_password(self, name: str, password: str) -> Deferred[User]:
        try:
            _check_password(password)
        except InvalidPasswordError:
            return fail()
        hashing = self._executor.run(hash_password, password, self._hasher)
        changing = hashing.addCallback(
            lambda password_hash: self._control.update_user(name, password_hash=password_hash)
        )
        return changing.addCallback(self._revoked, name)

    def set_permissions(self, name: str, permissions: Iterable[str]) -> Deferred[User]:
        try:
            granted = _permissions(permissions)
        except InvalidPermissionsError:
            return fail()
        return self._control.update_user(name, permissions=granted)

    def delete_user(self, name: str) -> Deferred[None]:
        """Remove the user and every grant naming it."""
        return self._control.delete_user(name).addCallback(self._revoked, name)

    def _revoked(self, result: _T, name: str) -> _T:
        if self._verified is not None:
            self._verified.forget(name)
        self._on_credentials_revoked(name)
        return result

    def grant_acl(self, user: str, operation: str, pattern: str) -> Deferred[AclGrant]:
        try:
            grant = _grant(user, operation, pattern)
        except InvalidAclError:
            return fail()
        return self._control.grant_acl(grant).addCallback(lambda _: grant)

    def revoke_acl(self, user: str, operation: str, pattern: str) -> Deferred[None]:
        try:
            grant = _grant(user, operation, pattern)
        except InvalidAclError:
            return fail()
        return self._control.revoke_acl(grant)

    def list_acls(self, user: str | None = None) -> list[AclGrant]:
        return self._control.acls(user)

    def allows(self, user: User, operation: Operation, topic: str, *, strict: bool) -> bool:
        """``allows`` with the user's stored grants (only read when ``strict``)."""
        grants = self._control.acls(user.name) if strict else ()
        return allows(user, grants, operation, topic, strict=strict)


def seed_accounts(
    directory: UserDirectory, env_mode: str, passwords: Mapping[str, str | None]
) -> Deferred[None]:
    """Create the standard accounts that do not exist yet; never touch one that does.

    ``passwords`` maps account names (admin, producer, consumer, app) to the passwords their
    ``SVC_*_PASS`` variables set. In dev and test all four are seeded, with the development
    defaults where no password is set. In prod only the accounts with a password are, and the
    admin password is required (``MissingAdminPasswordError``, raised before anything is done).
    """
    if env_mode not in ("prod", "dev", "test"):
        raise ValueError(f"env_mode must be prod, dev or test, not {env_mode!r}")
    production = env_mode == "prod"
    if production and not passwords.get("admin"):
        raise MissingAdminPasswordError(
            "SVC_ADMIN_PASS is not set: production ships no credentials, so the admin "
            "password must be set explicitly; set SVC_ADMIN_PASS (and SVC_PRODUCER_PASS, "
            "SVC_CONSUMER_PASS, SVC_APP_PASS for those accounts) and start again"
        )
    wanted: list[tuple[str, frozenset[Permission], str, bool]] = []
    for name, permissions, default, variable in SEEDED_ACCOUNTS:
        given = passwords.get(name)
        if given:
            wanted.append((name, permissions, given, False))
        elif not production:
            wanted.append((name, permissions, default, True))
        if production and not given:
            log.info(
                "Not seeding account {name}: {variable} is not set", name=name, variable=variable
            )

    async def seed() -> None:
        for name, permissions, password, development in wanted:
            if directory.user(name) is not None:
                continue
            try:
                await directory.create_user(name, password, permissions)
            except UserExistsError:
                # Created meanwhile by someone else: theirs stands.
                continue
            if development:
                log.warn(
                    "Seeded account {name} with its development password; never run "
                    "SVC_ENV={env_mode} in production",
                    name=name,
                    env_mode=env_mode,
                )
            else:
                log.info("Seeded account {name}", name=name)

    return Deferred.fromCoroutine(seed())
