"""Settings whose feature this version does not have yet: they stop the boot or warn at it.

A broker must never boot as if a setting worked when nothing acts on it. Each rule here names
the variable and says what is missing; a rule goes away in the change that builds its feature.
"""

from __future__ import annotations

from logbroker.config._broker import BrokerConfig, ControlPlane
from logbroker.config._env import ConfigError


def check_built(config: BrokerConfig) -> list[str]:
    """Raise ``ConfigError`` for a setting that needs a feature not built yet; return a warning
    for each setting that is accepted but not yet in effect."""
    cluster = config.cluster
    if cluster.replication_factor > 1:
        raise ConfigError(
            "SVC_LOG_REPLICATION_FACTOR",
            str(cluster.replication_factor),
            "1: quorum replication is not built in this version, so a higher factor would"
            " acknowledge after one local fsync",
        )
    if cluster.control_plane is ControlPlane.ETCD:
        raise ConfigError(
            "SVC_CONTROL_PLANE",
            "etcd://"
            + ",".join(
                f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
                for host, port in cluster.etcd_endpoints
            ),
            "local: the broker cannot run as a cluster node yet in this version (node"
            " membership and serving other nodes' ranges are not built), so it would keep its"
            " data alone while sharing its metadata",
        )
    warnings = []
    if config.scrub.enabled:
        warnings.append(
            "SVC_SCRUB_ENABLED is true, but the integrity scrub is not built in this version:"
            " no sealed segment is verified in the background (svc_scrub_enabled reads 0)"
        )
    retention = config.retention
    for variable, value in (
        ("SVC_RETENTION_MAX_AGE_MS", retention.max_age_ms),
        ("SVC_RETENTION_MAX_BYTES", retention.max_bytes),
    ):
        if value is not None:
            warnings.append(
                f"{variable}={value} is not in effect: retention is not built in this version,"
                " so every segment is kept"
            )
    return warnings
