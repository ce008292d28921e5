"""Who may do what: users (argon2id), permissions and ACL grants.

See ``logbroker.security.users``.
"""

from logbroker.security.errors import (
    InvalidAclError,
    InvalidPasswordError,
    InvalidPermissionsError,
    InvalidUsernameError,
    MissingAdminPasswordError,
    SecurityError,
)
from logbroker.security.users import (
    Operation,
    Permission,
    UserDirectory,
    allows,
    hash_password,
    seed_accounts,
    verify_password,
)

__all__ = [
    "InvalidAclError",
    "InvalidPasswordError",
    "InvalidPermissionsError",
    "InvalidUsernameError",
    "MissingAdminPasswordError",
    "Operation",
    "Permission",
    "SecurityError",
    "UserDirectory",
    "allows",
    "hash_password",
    "seed_accounts",
    "verify_password",
]
