"""Errors the control plane raises; each says what happened, where, and what to do.

``reason`` is the error reason a client or the dashboard is answered with.
"""

from __future__ import annotations


class ControlPlaneError(Exception):
    """Base of every control plane error."""

    reason = "control_plane_error"


class AlreadyExistsError(ControlPlaneError):
    """A topic or range with that name exists already."""

    reason = "already_exists"


class NotFoundError(ControlPlaneError):
    """The topic, range, segment or ACL grant named does not exist."""

    reason = "not_found"


class UserExistsError(ControlPlaneError):
    reason = "user_exists"


class UserNotFoundError(ControlPlaneError):
    reason = "user_not_found"


class InvalidChangeError(ControlPlaneError):
    """The change contradicts the recorded state (say, unsealing a segment, a lower epoch)."""

    reason = "invalid_change"


class ControlPlaneWriteError(ControlPlaneError):
    """The change could not be made durable, so it did not take effect."""

    reason = "control_plane_unavailable"


class ControlPlaneClosedError(ControlPlaneError):
    """The control plane is not started, or is closing (the broker is shutting down)."""

    reason = "control_plane_unavailable"


class StateFileError(ControlPlaneError):
    """The stored control state cannot be read; the broker refuses to start on it."""


class StateFormatTooNewError(StateFileError):
    """The stored control state was written by a newer format than this build reads."""

    def __init__(self, path: str, found: int, supported: int) -> None:
        super().__init__(
            f"{path} uses control state format {found}, but this logbroker reads formats up to "
            f"{supported}: upgrade logbroker, or point SVC_DATA_DIR elsewhere"
        )
        self.path = path
        self.found = found
        self.supported = supported
