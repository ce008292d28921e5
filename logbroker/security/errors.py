"""Errors of users, passwords and ACLs; ``reason`` is what a client or the dashboard is told."""

from __future__ import annotations

from logbroker.errors import LogbrokerError, Reason


class SecurityError(LogbrokerError):
    """Base of every security error."""

    default_reason = Reason.SECURITY_ERROR


class InvalidUsernameError(SecurityError):
    default_reason = Reason.INVALID_USERNAME


class InvalidPasswordError(SecurityError):
    default_reason = Reason.INVALID_PASSWORD


class InvalidPermissionsError(SecurityError):
    """A permission other than ``admin``, ``produce`` and ``consume`` was named."""

    default_reason = Reason.INVALID_PERMISSIONS


class InvalidAclError(SecurityError):
    """A grant names an operation other than produce or consume, or a bad topic pattern."""

    default_reason = Reason.INVALID_OPERATION


class MissingAdminPasswordError(SecurityError):
    """Production was started without ``SVC_ADMIN_PASS``: no credentials ship with it."""
