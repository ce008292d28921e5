"""Errors the control plane raises; each says what happened, where, and what to do.

Each carries the ``Reason`` a client or the dashboard is answered with (``logbroker.errors``).
"""

from __future__ import annotations

from logbroker.errors import LogbrokerError, Reason


class ControlPlaneError(LogbrokerError):
    """Base of every control plane error."""

    default_reason = Reason.CONTROL_PLANE_ERROR


class AlreadyExistsError(ControlPlaneError):
    """A topic or range with that name exists already."""

    default_reason = Reason.ALREADY_EXISTS


class NotFoundError(ControlPlaneError):
    """The topic, range, segment or ACL grant named does not exist."""

    default_reason = Reason.NOT_FOUND


class UserExistsError(ControlPlaneError):
    default_reason = Reason.USER_EXISTS


class UserNotFoundError(ControlPlaneError):
    default_reason = Reason.USER_NOT_FOUND


class InvalidChangeError(ControlPlaneError):
    """The change contradicts the recorded state (say, unsealing a segment, a lower epoch)."""

    default_reason = Reason.INVALID_CHANGE


class ControlPlaneWriteError(ControlPlaneError):
    """The change could not be made durable, so it did not take effect."""

    default_reason = Reason.CONTROL_PLANE_UNAVAILABLE


class ControlPlaneClosedError(ControlPlaneError):
    """The control plane is not started, or is closing (the broker is shutting down)."""

    default_reason = Reason.CONTROL_PLANE_UNAVAILABLE


class ControlPlaneUnavailableError(ControlPlaneError):
    """No member of the store (etcd) answered, so the change did not take effect."""

    default_reason = Reason.UNREACHABLE


class OutcomeUnknownError(ControlPlaneUnavailableError):
    """The request reached the store but no answer came back: the change may or may not have
    taken effect. Read the state once the store answers again before retrying."""


class ControlPlaneAccessError(ControlPlaneUnavailableError):
    """etcd turned this node away: its TLS handshake failed (a certificate neither side
    trusts, no client certificate), or its credentials are wrong, missing or lack a permission.
    Nothing was applied; it takes the operator, not a retry, to mend."""


class ContendedError(ControlPlaneError):
    """Other nodes kept changing what the change depends on; it was retried, then given up."""

    default_reason = Reason.CONTENDED


class CompactedError(ControlPlaneError):
    """A watch asked for history the store has compacted away."""

    default_reason = Reason.COMPACTED

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class LeaseNotFoundError(ControlPlaneError):
    """The lease named has expired or was revoked."""

    default_reason = Reason.LEASE_NOT_FOUND


class StoreError(ControlPlaneError):
    """The store answered with an error this client does not expect (a bug, or a
    misconfiguration such as a proxy in front of etcd)."""

    default_reason = Reason.CONTROL_PLANE_ERROR


class AlreadyCompactedError(StoreError):
    """A compaction to a revision the store's history is compacted to already (by another
    node, or by etcd itself): what it asked for holds."""


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
