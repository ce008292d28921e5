"""Error reasons of the client protocol and the error the codec raises on bad input."""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """Every reason string an error frame may carry (docs/protocol.md lists when each is sent)."""

    # From the service specification's Errors section.
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    CONNECTION_LIMIT_EXCEEDED = "connection_limit_exceeded"
    GLOBAL_LIMIT_EXCEEDED = "global_limit_exceeded"
    OVERLOADED = "overloaded"
    # From the protocol's own table.
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


class WireError(Exception):
    """Input the protocol refuses: answered with an error frame carrying ``reason`` and the
    request's ``correlation_id`` (0 where none could be read)."""

    def __init__(self, reason: Reason, detail: str, correlation_id: int = 0) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.correlation_id = correlation_id


class FrameTooLargeError(WireError):
    """A length prefix above the maximum frame size: refused before any of the body is read,
    and the connection is closed after the error frame (its framing can no longer be trusted)."""

    def __init__(self, length: int, maximum: int) -> None:
        super().__init__(
            Reason.FRAME_TOO_LARGE, f"frame of {length} bytes exceeds the maximum of {maximum}"
        )
        self.length = length
        self.maximum = maximum
        #: Frames completed ahead of the oversized one in the same ``feed`` call.
        self.complete_frames: list[bytes] = []
