"""etcd's own user authentication, as its JSON gateway speaks it: one token for every request.

With etcd's auth on (``etcdctl auth enable``), a request needs a token in its ``Authorization``
header: without one etcd answers ``user name is empty``, with one it no longer knows ``invalid
auth token``. ``POST /v3/auth/authenticate {"name": ..., "password": ...}`` gives a token. A
token expires: a simple token (etcd's default) once unused for ``--auth-token-ttl`` (300 s) on
the member asked, each member timing it on its own; a JWT at its expiry.

``EtcdSession`` keeps the token of one user. ``token()`` gives it, authenticating first when
there is none: requests that wait meanwhile share that one authentication. ``rejected(token)``
forgets a token etcd refused, so that the next ``token()`` authenticates anew; a token given
out again after that (another request's new one) is kept. ``expire()`` forgets the token
whichever it is (a watch cancelled for an expired token does not say which it carried). A
session whose authentication failed holds no token and tries again on the next ``token()``.

``NO_TOKEN`` is what ``authenticate`` answers when etcd's auth is off: requests go without the
header until etcd asks for one (once auth is enabled), so that nodes may be given their etcd
user before ``etcdctl auth enable`` as well as after.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

#: The token when etcd's auth is off: no ``Authorization`` header.
NO_TOKEN = ""


@attrs.frozen
class EtcdUser:
    """An etcd user (``SVC_ETCD_USER``) and its password, which no ``repr`` shows."""

    name: str
    password: str = attrs.field(repr=False)


class EtcdSession:
    """The token of ``user``, got with ``authenticate`` (etcd's answer: a token, or
    ``NO_TOKEN`` while its auth is off; it raises what etcd refuses)."""

    def __init__(self, user: EtcdUser, authenticate: Callable[[EtcdUser], Awaitable[str]]) -> None:
        self.user = user
        self._authenticate = authenticate
        self._token: str | None = None
        #: Requests waiting for the authentication under way (none: none is).
        self._waiting: list[Deferred[str]] = []

    def token(self) -> Deferred[str]:
        """The token to send (``NO_TOKEN``: none), once there is one."""
        if self._token is not None:
            return succeed(self._token)
        waiter: Deferred[str] = Deferred(self._waiting.remove)
        self._waiting.append(waiter)
        if len(self._waiting) == 1:
            Deferred.fromCoroutine(self._run())
        return waiter

    async def _run(self) -> None:
        try:
            token = await self._authenticate(self.user)
        except Exception:
            outcome: str | Failure = Failure()  # type: ignore[no-untyped-call]
        else:
            self._token = outcome = token
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if isinstance(outcome, Failure):
                waiter.errback(outcome)
            else:
                waiter.callback(outcome)

    def expire(self) -> None:
        """The token is known to have expired: the next ``token()`` authenticates anew."""
        self._token = None

    def rejected(self, token: str) -> None:
        """etcd refused ``token``: authenticate anew for the next request (unless a newer
        token has replaced it already)."""
        if self._token == token:
            self._token = None
