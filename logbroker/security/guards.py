"""What stands between a client and the broker, on either port: the connection limits, the
``auth`` rate limits and the sessions, with the hook that counts how each login ended."""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

import attrs

from logbroker.security.connections import ConnectionRegistry
from logbroker.security.ratelimit import RateLimiter
from logbroker.security.sessions import SessionStore


class AuthResult(StrEnum):
    """How an ``auth`` attempt ended (counted in ``svc_auth_attempts_total``)."""

    OK = "ok"
    INVALID_CREDENTIALS = "invalid_credentials"
    RATE_LIMITED = "rate_limited"


@attrs.frozen
class Guards:
    """The connection registry, the rate limiter and the session store one broker shares
    between its client port and its dashboard port, and ``on_auth``, told of every login."""

    connections: ConnectionRegistry
    limiter: RateLimiter
    sessions: SessionStore
    on_auth: Callable[[AuthResult], None] = lambda result: None
