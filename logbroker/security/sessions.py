"""Sessions: created on authentication (the client port's ``auth`` and the dashboard's login),
tied to a token and to the client IP that authenticated.

A session lives ``SVC_SESSION_TIMEOUT_SEC`` from its creation; using it does not extend it, so a
stolen token is worth a bounded time. Validating a token can find two things wrong, and reports
(and counts) both when both hold:

* expired: the session is over; it is forgotten.
* hijack attempt: the token arrived from another IP than the one that logged in. The session is
  kept for its owner (ordinary NAT rotation also causes this, so it must not log them out).

Tokens are 256 random bits; the store keys sessions by the token's SHA-256, so that looking a
token up takes no time that depends on how much of it matches a real one.

A cluster shares its sessions (``logbroker.security.shared_sessions``) through hooks and entry
points that change nothing for a single node: ``on_created``, ``on_revoked`` and
``on_user_revoked`` tell it what to publish; ``adopt`` and ``drop`` let it add and remove the
sessions other nodes opened and ended. An adopted session is known by its key only (the token
never leaves the node that made it): validating it hands back the token that was presented.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence
from enum import StrEnum

import attrs
from twisted.internet.interfaces import IReactorTime

#: Sessions one user may hold from each origin; the oldest is revoked when a login would exceed
#: it, so that a script logging in in a loop cannot grow the store without bound. Client-port
#: logins (a fleet of producers may share one account) never push out the user's dashboard
#: sessions, nor the other way round.
MAX_SESSIONS_PER_USER = 1000


class Origin(StrEnum):
    """Where a session was opened."""

    CLIENT_PORT = "client_port"
    DASHBOARD = "dashboard"


class Rejection(StrEnum):
    """Why a token was not accepted (what the dashboard answers with)."""

    INVALID = "invalid_session"
    EXPIRED = "session_expired"
    HIJACK = "session_hijack_attempt"


@attrs.frozen
class Session:
    #: Left out of ``repr``, so that no log shows a usable token.
    token: str = attrs.field(repr=False)
    user: str
    client_ip: str
    origin: Origin
    created_ms: int
    expires_ms: int


@attrs.frozen
class Validation:
    """The outcome of presenting a token: ``session`` when accepted; otherwise what was wrong
    (``expired`` and ``hijack`` may both be true)."""

    session: Session | None
    expired: bool = False
    hijack: bool = False

    @property
    def rejection(self) -> Rejection | None:
        if self.session is not None:
            return None
        if self.hijack:
            return Rejection.HIJACK
        if self.expired:
            return Rejection.EXPIRED
        return Rejection.INVALID


def session_key(token: str) -> bytes:
    """What the store keys a token's session by: its SHA-256."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class SessionStore:
    def __init__(
        self,
        clock: IReactorTime,
        timeout_sec: int,
        *,
        on_expired: Callable[[], None] = lambda: None,
        on_hijack: Callable[[], None] = lambda: None,
    ) -> None:
        self._clock = clock
        self._timeout_ms = timeout_sec * 1000
        self._on_expired = on_expired
        self._on_hijack = on_hijack
        self._sessions: dict[bytes, Session] = {}
        #: The keys of each user's sessions from each origin, oldest first.
        self._owned: dict[tuple[str, Origin], dict[bytes, None]] = {}
        #: Told of each session ``create`` opens, with its key.
        self.on_created: list[Callable[[bytes, Session], None]] = []
        #: Told of the keys of the sessions that ``revoke``, ``revoke_user`` or a login over the
        #: quota ended (not of expired ones, nor of what ``drop`` forgets).
        self.on_revoked: list[Callable[[Sequence[bytes]], None]] = []
        #: Told of each ``revoke_user``, after ``on_revoked``: the user, and when (ms).
        self.on_user_revoked: list[Callable[[str, int], None]] = []

    @property
    def timeout_ms(self) -> int:
        """How long a session lives."""
        return self._timeout_ms

    def create(self, user: str, client_ip: str, origin: Origin) -> Session:
        now = self._now_ms()
        owned = self._owned.get((user, origin))
        if owned is not None and len(owned) >= MAX_SESSIONS_PER_USER:
            oldest = next(iter(owned))
            self._forget(oldest)
            self._revoked([oldest])
        token = secrets.token_urlsafe(32)
        session = Session(token, user, client_ip, origin, now, now + self._timeout_ms)
        key = session_key(token)
        self._sessions[key] = session
        self._owned.setdefault((user, origin), {})[key] = None
        for listener in self.on_created:
            listener(key, session)
        return session

    def adopt(self, key: bytes, session: Session) -> bool:
        """Know ``session`` (another node's, its token unknown: ``""``) by ``key``, unless a
        session has that key already; whether it was added. Tells no hook and pushes out none
        of the user's sessions: the node that opened it applied the quota."""
        if key in self._sessions:
            return False
        self._sessions[key] = session
        self._owned.setdefault((session.user, session.origin), {})[key] = None
        return True

    def drop(self, key: bytes) -> Session | None:
        """Forget the session of ``key`` (ended elsewhere) without telling any hook."""
        return self._forget(key)

    def find(self, key: bytes) -> Session | None:
        """The session of ``key``, as stored (an adopted one without its token)."""
        return self._sessions.get(key)

    def sessions_of(self, user: str) -> list[tuple[bytes, Session]]:
        """Every session of ``user`` with its key, from either origin."""
        return [
            (key, self._sessions[key])
            for (owner, _), owned in self._owned.items()
            if owner == user
            for key in owned
        ]

    def _forget(self, key: bytes) -> Session | None:
        session = self._sessions.pop(key, None)
        if session is not None:
            owner = (session.user, session.origin)
            owned = self._owned[owner]
            del owned[key]
            if not owned:
                del self._owned[owner]
        return session

    def validate(self, token: str, client_ip: str) -> Validation:
        key = session_key(token)
        session = self._sessions.get(key)
        if session is None:
            return Validation(None)
        expired = self._now_ms() >= session.expires_ms
        hijack = session.client_ip != client_ip
        if expired:
            self._forget(key)
            self._on_expired()
        if hijack:
            self._on_hijack()
        if expired or hijack:
            return Validation(None, expired=expired, hijack=hijack)
        if not session.token:
            # Adopted: the token presented is the one that hashes to its key.
            session = attrs.evolve(session, token=token)
        return Validation(session)

    def revoke(self, token: str) -> bool:
        """End the session of ``token``; whether there was one."""
        key = session_key(token)
        if self._forget(key) is None:
            return False
        self._revoked([key])
        return True

    def revoke_user(self, user: str) -> int:
        """End every session of ``user`` (deleted, or given a new password); how many."""
        keys = [key for key, _ in self.sessions_of(user)]
        for key in keys:
            self._forget(key)
        if keys:
            self._revoked(keys)
        for listener in self.on_user_revoked:
            listener(user, self._now_ms())
        return len(keys)

    def _revoked(self, keys: Sequence[bytes]) -> None:
        for listener in self.on_revoked:
            listener(keys)

    def remove_expired(self) -> int:
        """Forget the sessions that are over (without counting them: nobody presented them)."""
        now = self._now_ms()
        keys = [key for key, session in self._sessions.items() if now >= session.expires_ms]
        for key in keys:
            self._forget(key)
        return len(keys)

    def __len__(self) -> int:
        return len(self._sessions)

    def _now_ms(self) -> int:
        return round(self._clock.seconds() * 1000)
