"""Errors of users, passwords and ACLs; ``reason`` is what a client or the dashboard is told."""

from __future__ import annotations


class SecurityError(Exception):
    """Base of every security error."""

    reason = "security_error"


class InvalidUsernameError(SecurityError):
    reason = "invalid_username"


class InvalidPasswordError(SecurityError):
    reason = "invalid_password"


class InvalidPermissionsError(SecurityError):
    """A permission other than ``admin``, ``produce`` and ``consume`` was named."""

    reason = "invalid_permissions"


class InvalidAclError(SecurityError):
    """A grant names an operation other than produce or consume, or a bad topic pattern."""

    reason = "invalid_operation"


class MissingAdminPasswordError(SecurityError):
    """Production was started without ``SVC_ADMIN_PASS``: no credentials ship with it."""
