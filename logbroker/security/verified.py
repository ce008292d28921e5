"""Passwords verified lately, so that a client signing in again does not cost an argon2 check.

An argon2id verification costs a quarter of a second of CPU on a small machine, and more when
the machine is busy: a node taking over thousands of ranges made sign-ins take seconds. A user
whose password was verified within ``ttl_seconds`` signs in again against a keyed digest of it
(HMAC-SHA-256 under a random key that lives only in this process's memory), which costs
microseconds. Only a password that matched is remembered, so a wrong one always costs the full
check: guessing is no cheaper through the port. An entry holds only while the user's stored hash
is the one it was verified against, so a changed password (on any node: the control plane's
record changes) ends it at once; ``forget`` ends it when this node makes the change.
Elasticsearch's realm cache does the same (``cache.ttl``, ``cache.hash_algo``).
"""

from __future__ import annotations

import hashlib
import hmac
import os

import attrs
from twisted.internet.interfaces import IReactorTime

#: How long a verified password stands in for the full check.
VERIFIED_SECONDS = 300.0
#: The most users remembered at once: the oldest entry goes first.
MAX_VERIFIED = 10_000


@attrs.frozen
class _Verified:
    #: The stored hash the password was verified against.
    password_hash: str
    digest: bytes
    until: float


class VerifiedPasswords:
    """Remembers, per user, a password verified lately (a keyed digest of it)."""

    def __init__(
        self,
        clock: IReactorTime,
        ttl_seconds: float = VERIFIED_SECONDS,
        max_entries: int = MAX_VERIFIED,
    ) -> None:
        self._clock = clock
        self._ttl = ttl_seconds
        self._max = max_entries
        self._key = os.urandom(32)
        self._entries: dict[str, _Verified] = {}

    def _digest(self, password: bytes) -> bytes:
        return hmac.new(self._key, password, hashlib.sha256).digest()

    def matches(self, name: str, password_hash: str, password: bytes) -> bool:
        """Whether ``password`` was verified lately against ``password_hash``, ``name``'s
        stored hash now."""
        entry = self._entries.get(name)
        if entry is None:
            return False
        if entry.until <= self._clock.seconds() or entry.password_hash != password_hash:
            del self._entries[name]
            return False
        return hmac.compare_digest(entry.digest, self._digest(password))

    def remember(self, name: str, password_hash: str, password: bytes) -> None:
        """``password`` matched ``password_hash``, ``name``'s stored hash, just now."""
        self._entries.pop(name, None)
        while len(self._entries) >= self._max:
            del self._entries[next(iter(self._entries))]
        until = self._clock.seconds() + self._ttl
        self._entries[name] = _Verified(password_hash, self._digest(password), until)

    def forget(self, name: str) -> None:
        self._entries.pop(name, None)
