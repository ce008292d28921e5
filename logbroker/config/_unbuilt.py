"""Settings whose feature this version does not have yet: they stop the boot or warn at it.

A broker must never boot as if a setting worked when nothing acts on it. Each rule here names
the variable and says what is missing; a rule goes away in the change that builds its feature.
"""

from __future__ import annotations

from logbroker.config._broker import BrokerConfig, ControlPlane, EnvMode
from logbroker.config._env import ConfigError


def check_built(config: BrokerConfig) -> list[str]:
    """Raise ``ConfigError`` for a setting that needs a feature not built yet; return a warning
    for each setting that is accepted but not yet in effect."""
    cluster = config.cluster
    warnings = []
    if cluster.control_plane is ControlPlane.ETCD:
        if cluster.cluster_secret is None and config.mode is EnvMode.PROD:
            raise ConfigError(
                "SVC_CLUSTER_SECRET",
                None,
                "a long random secret shared by the cluster's nodes, which prod requires:"
                " peers prove they hold it at the handshake, inside TLS when TLS is on",
            )
        if cluster.replication_factor == 1:
            warnings.append(
                "SVC_LOG_REPLICATION_FACTOR=1: each range has one copy, so a node that is down"
                " takes its ranges with it until it returns; set 3 to survive the loss of a node"
            )
    return warnings
