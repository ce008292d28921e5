"""Configuration from ``SVC_*`` environment variables, validated once into frozen objects.

``BrokerConfig.from_env`` parses every setting of a node; every bad value is a ``ConfigError``
naming the variable and the value, and unknown ``SVC_*`` names are warned about. ``VARIABLES``
lists every variable as docs/configuration.md shows it.
"""

from logbroker.config._broker import (
    ANY_ADDRESS,
    AccountSettings,
    BrokerConfig,
    ClusterSettings,
    ConnectionLimitSettings,
    ControlPlane,
    DashboardSettings,
    EnvMode,
    FsyncScope,
    RateLimit,
    RateLimitSettings,
    RetentionSettings,
    ScrubSettings,
    ServerSettings,
    SpreadPolicy,
    StorageSettings,
    TlsSettings,
    TlsVerify,
    TlsVersion,
    TopicSettings,
    tls_off_warning,
)
from logbroker.config._cluster_access import EtcdAccess, PeerPortLimits
from logbroker.config._env import ConfigError, parse_bool, parse_int
from logbroker.config._unbuilt import check_built
from logbroker.config._variables import VARIABLES, Variable

__all__ = [
    "ANY_ADDRESS",
    "VARIABLES",
    "AccountSettings",
    "BrokerConfig",
    "ClusterSettings",
    "ConfigError",
    "ConnectionLimitSettings",
    "ControlPlane",
    "DashboardSettings",
    "EnvMode",
    "EtcdAccess",
    "FsyncScope",
    "PeerPortLimits",
    "RateLimit",
    "RateLimitSettings",
    "RetentionSettings",
    "ScrubSettings",
    "ServerSettings",
    "SpreadPolicy",
    "StorageSettings",
    "TlsSettings",
    "TlsVerify",
    "TlsVersion",
    "TopicSettings",
    "Variable",
    "check_built",
    "parse_bool",
    "parse_int",
    "tls_off_warning",
]
