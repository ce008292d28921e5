"""The error the codec raises on bad input (its reasons are ``logbroker.errors.Reason``)."""

from __future__ import annotations

from logbroker.errors import LogbrokerError, Reason

__all__ = ["FrameTooLargeError", "Reason", "WireError"]


class WireError(LogbrokerError):
    """Input the protocol refuses: answered with an error frame carrying ``reason`` and the
    request's ``correlation_id`` (0 where none could be read)."""

    def __init__(self, reason: Reason, detail: str, correlation_id: int = 0) -> None:
        super().__init__(detail, reason)
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
