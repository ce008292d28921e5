"""Where the cluster's metadata lives: topics, ranges, segments, users, ACLs, group positions.

``ControlPlane`` is the interface the broker uses (DESIGN section 7); ``LocalControlPlane``
keeps it in one file in the data directory for a single node, ``EtcdControlPlane`` in etcd for
a cluster (through a ``KeyValueStore``: ``EtcdGatewayStore`` for a real etcd,
``logbroker.testing.MemoryKeyValueStore`` in tests).
"""

from logbroker.controlplane._etcd_auth import EtcdUser
from logbroker.controlplane._etcd_gateway import EtcdGatewayStore
from logbroker.controlplane._format import FORMAT_VERSION
from logbroker.controlplane._interface import ControlPlane
from logbroker.controlplane._kv import KeyValueStore
from logbroker.controlplane._model import (
    ANY_RECORD,
    GRANT_OPERATIONS,
    MAX_KEYSPACE_BITS,
    AclGrant,
    AnyRecord,
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
    AlreadyCompactedError,
    AlreadyExistsError,
    CompactedError,
    ContendedError,
    ControlPlaneAccessError,
    ControlPlaneClosedError,
    ControlPlaneError,
    ControlPlaneUnavailableError,
    ControlPlaneWriteError,
    InvalidChangeError,
    LeaseNotFoundError,
    NotFoundError,
    OutcomeUnknownError,
    StateFileError,
    StateFormatTooNewError,
    StoreError,
    UserExistsError,
    UserNotFoundError,
)
from logbroker.controlplane.etcd import EtcdControlPlane
from logbroker.controlplane.local import LocalControlPlane

__all__ = [
    "ANY_RECORD",
    "FORMAT_VERSION",
    "GRANT_OPERATIONS",
    "MAX_KEYSPACE_BITS",
    "AclGrant",
    "AlreadyCompactedError",
    "AlreadyExistsError",
    "AnyRecord",
    "CompactedError",
    "ContendedError",
    "ControlPlane",
    "ControlPlaneAccessError",
    "ControlPlaneClosedError",
    "ControlPlaneError",
    "ControlPlaneUnavailableError",
    "ControlPlaneWriteError",
    "EtcdControlPlane",
    "EtcdGatewayStore",
    "EtcdUser",
    "InvalidChangeError",
    "KeyValueStore",
    "LeaseNotFoundError",
    "LocalControlPlane",
    "NotFoundError",
    "OutcomeUnknownError",
    "Range",
    "RangeState",
    "SegmentMeta",
    "SegmentState",
    "StateFileError",
    "StateFormatTooNewError",
    "StoreError",
    "Topic",
    "User",
    "UserExistsError",
    "UserNotFoundError",
    "pattern_matches",
    "valid_name",
    "valid_pattern",
    "valid_user_name",
]
