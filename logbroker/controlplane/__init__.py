"""Where the cluster's metadata lives: topics, ranges, segments, users, ACLs, group positions.

``ControlPlane`` is the interface the broker uses (DESIGN section 7); ``LocalControlPlane``
keeps it in one file in the data directory for a single node.
"""

from logbroker.controlplane._format import FORMAT_VERSION
from logbroker.controlplane._interface import ControlPlane
from logbroker.controlplane._model import (
    GRANT_OPERATIONS,
    MAX_KEYSPACE_BITS,
    AclGrant,
    Range,
    RangeState,
    SegmentMeta,
    SegmentState,
    Topic,
    User,
    pattern_matches,
    valid_name,
    valid_pattern,
    valid_user_name,
)
from logbroker.controlplane.errors import (
    AlreadyExistsError,
    ControlPlaneClosedError,
    ControlPlaneError,
    ControlPlaneWriteError,
    InvalidChangeError,
    NotFoundError,
    StateFileError,
    StateFormatTooNewError,
    UserExistsError,
    UserNotFoundError,
)
from logbroker.controlplane.local import LocalControlPlane

__all__ = [
    "FORMAT_VERSION",
    "GRANT_OPERATIONS",
    "MAX_KEYSPACE_BITS",
    "AclGrant",
    "AlreadyExistsError",
    "ControlPlane",
    "ControlPlaneClosedError",
    "ControlPlaneError",
    "ControlPlaneWriteError",
    "InvalidChangeError",
    "LocalControlPlane",
    "NotFoundError",
    "Range",
    "RangeState",
    "SegmentMeta",
    "SegmentState",
    "StateFileError",
    "StateFormatTooNewError",
    "Topic",
    "User",
    "UserExistsError",
    "UserNotFoundError",
    "pattern_matches",
    "valid_name",
    "valid_pattern",
    "valid_user_name",
]
