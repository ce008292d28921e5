"""The one base of logbroker's domain errors, every reason they carry, and the one table that says
how each reason is answered on the client port and on the dashboard port.

A domain error (the broker refusing a request, a security rule, the control plane, storage)
subclasses ``LogbrokerError`` and carries a ``Reason``. The ports never decide meanings of their
own: the client port answers ``CLIENT_REASON[reason]`` in its error frame, the dashboard answers
``HTTP_STATUS[reason]`` with the reason in its JSON body. A test holds the table to the enum, so a
new reason cannot be added without deciding both.

Pure: no Twisted, no I/O.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class Reason(StrEnum):
    """Every reason string an error may carry (docs/protocol.md and docs/dashboard.md list when
    each is sent)."""

    # From the service specification's Errors section.
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    CONNECTION_LIMIT_EXCEEDED = "connection_limit_exceeded"
    GLOBAL_LIMIT_EXCEEDED = "global_limit_exceeded"
    OVERLOADED = "overloaded"
    # From the client protocol's own table.
    AUTH_REQUIRED = "auth_required"
    INVALID_CREDENTIALS = "invalid_credentials"
    PERMISSION_DENIED = "permission_denied"
    UNKNOWN_API_KEY = "unknown_api_key"
    MALFORMED_REQUEST = "malformed_request"
    FRAME_TOO_LARGE = "frame_too_large"
    NO_SUCH_TOPIC = "no_such_topic"
    ALREADY_EXISTS = "already_exists"
    INVALID_TOPIC_NAME = "invalid_topic_name"
    INVALID_KEYSPACE_BITS = "invalid_keyspace_bits"
    INVALID_CURSOR = "invalid_cursor"
    #: A ``produce_idempotent`` whose sequence is older than its producer's window at a range:
    #: too late to tell whether its first try was stored there, so it is not stored again.
    SEQUENCE_TOO_OLD = "sequence_too_old"
    NO_QUORUM = "no_quorum"
    NOT_PRIMARY = "not_primary"
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    USER_EXISTS = "user_exists"
    USER_NOT_FOUND = "user_not_found"
    INVALID_PERMISSIONS = "invalid_permissions"
    INVALID_OPERATION = "invalid_operation"
    UNEXPECTED_FRAME = "unexpected_frame"
    #: Plaintext on a client port that requires TLS (``SVC_REQUIRE_TLS``).
    TLS_REQUIRED = "tls_required"
    # Users, passwords and grants.
    SECURITY_ERROR = "security_error"
    INVALID_USERNAME = "invalid_username"
    INVALID_PASSWORD = "invalid_password"
    # The control plane.
    CONTROL_PLANE_ERROR = "control_plane_error"
    CONTROL_PLANE_UNAVAILABLE = "control_plane_unavailable"
    NOT_FOUND = "not_found"
    INVALID_CHANGE = "invalid_change"
    #: Other nodes kept changing what a change depended on; it was retried, then given up.
    CONTENDED = "contended"
    COMPACTED = "compacted"
    LEASE_NOT_FOUND = "lease_not_found"
    # Storage.
    STORAGE_ERROR = "storage_error"
    #: A range's storage failed a write or fsync (a full or failing disk): it refuses writes
    #: until it is back in service. Nothing refused was stored; try again later.
    STORAGE_UNAVAILABLE = "storage_unavailable"
    OFFSET_OUT_OF_RANGE = "offset_out_of_range"
    # The dashboard port's own.
    INVALID_SESSION = "invalid_session"
    SESSION_EXPIRED = "session_expired"
    SESSION_HIJACK_ATTEMPT = "session_hijack_attempt"
    BODY_TOO_LARGE = "body_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    INTERNAL_ERROR = "internal_error"


class LogbrokerError(Exception):
    """Base of every domain error: ``reason`` says what a client is told, ``detail`` says in
    words what happened (for logs, and for a client where the port sends words)."""

    #: The reason of every error of the class, unless one is given when it is raised.
    default_reason: ClassVar[Reason] = Reason.INTERNAL_ERROR

    def __init__(self, detail: str = "", reason: Reason | None = None) -> None:
        super().__init__(detail)
        self.reason: Reason = reason if reason is not None else self.default_reason
        self.detail = detail


_R = Reason

#: What the client port's error frame says for each reason. Most say themselves; reasons a
#: client of protocol v1 cannot act on are folded into the one it can (retry elsewhere or later).
CLIENT_REASON: dict[Reason, Reason] = {
    **{reason: reason for reason in Reason},
    _R.CONTROL_PLANE_UNAVAILABLE: _R.UNREACHABLE,
    _R.STORAGE_ERROR: _R.UNREACHABLE,
    _R.INTERNAL_ERROR: _R.UNREACHABLE,
    _R.CONTENDED: _R.UNREACHABLE,
    _R.COMPACTED: _R.UNREACHABLE,
    _R.LEASE_NOT_FOUND: _R.UNREACHABLE,
}

#: The dashboard port's HTTP status for each reason.
HTTP_STATUS: dict[Reason, int] = {
    _R.RATE_LIMIT_EXCEEDED: 429,
    _R.CONNECTION_LIMIT_EXCEEDED: 429,
    _R.GLOBAL_LIMIT_EXCEEDED: 429,
    _R.OVERLOADED: 503,
    _R.AUTH_REQUIRED: 401,
    _R.INVALID_CREDENTIALS: 401,
    _R.PERMISSION_DENIED: 403,
    _R.UNKNOWN_API_KEY: 400,
    _R.MALFORMED_REQUEST: 400,
    _R.FRAME_TOO_LARGE: 413,
    _R.NO_SUCH_TOPIC: 404,
    _R.ALREADY_EXISTS: 409,
    _R.INVALID_TOPIC_NAME: 400,
    _R.INVALID_KEYSPACE_BITS: 400,
    _R.INVALID_CURSOR: 400,
    _R.SEQUENCE_TOO_OLD: 409,
    _R.NO_QUORUM: 503,
    _R.NOT_PRIMARY: 503,
    _R.UNREACHABLE: 503,
    _R.TIMEOUT: 504,
    _R.USER_EXISTS: 409,
    _R.USER_NOT_FOUND: 404,
    _R.INVALID_PERMISSIONS: 400,
    _R.INVALID_OPERATION: 400,
    _R.UNEXPECTED_FRAME: 400,
    _R.TLS_REQUIRED: 403,
    _R.SECURITY_ERROR: 400,
    _R.INVALID_USERNAME: 400,
    _R.INVALID_PASSWORD: 400,
    _R.CONTROL_PLANE_ERROR: 500,
    _R.CONTROL_PLANE_UNAVAILABLE: 503,
    _R.NOT_FOUND: 404,
    _R.INVALID_CHANGE: 409,
    _R.CONTENDED: 503,
    _R.COMPACTED: 503,
    _R.LEASE_NOT_FOUND: 503,
    _R.STORAGE_ERROR: 503,
    _R.STORAGE_UNAVAILABLE: 503,
    _R.OFFSET_OUT_OF_RANGE: 400,
    _R.INVALID_SESSION: 401,
    _R.SESSION_EXPIRED: 401,
    _R.SESSION_HIJACK_ATTEMPT: 401,
    _R.BODY_TOO_LARGE: 413,
    _R.UNSUPPORTED_MEDIA_TYPE: 415,
    _R.METHOD_NOT_ALLOWED: 405,
    _R.INTERNAL_ERROR: 500,
}
