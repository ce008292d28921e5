"""How a node runs: alone (``SingleNode``), or as a member of a cluster (``ClusterMember``).

The composition root (``logbroker.service.build_service``) builds the same tree for both and
asks the mode, at each place where they differ, for its part: its control plane, range
directory and group coordinator; the services that stop just before the control plane (a
member leaves the cluster before its metadata is flushed) and those that stop just after the
listeners (the shared sessions outlive every request); when it may serve; whether it serves
degraded; its own listening ports; how the operator surfaces describe it; and how the dashboard
opens a session. Each mode is assembled once, here, from the config: nothing outside asks which
one it is.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from twisted.application.service import Service
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IListeningPort, IProtocolFactory, IReactorTime
from twisted.logger import Logger

from logbroker import __version__
from logbroker.broker.groups import GroupCoordinator
from logbroker.broker.ranges import LocalRanges, RangeDirectory
from logbroker.cluster.membership import NodeRecord
from logbroker.cluster.node import PeerPortService, build_cluster
from logbroker.cluster.verify import ClusterVerifier
from logbroker.cluster.view import ClusterView, SingleNodeView
from logbroker.config import BrokerConfig
from logbroker.controlplane import ControlPlane, LocalControlPlane
from logbroker.controlplane.local import SINGLE_NODE_CONTROL
from logbroker.maintenance.retention import (
    Retention,
    RetentionMetrics,
    RetentionRule,
    local_newest_times,
)
from logbroker.metrics import Metrics
from logbroker.replication.repair import SegmentRepairs
from logbroker.security.sessions import Origin, Session, SessionStore
from logbroker.security.shared_sessions import SharedSessions
from logbroker.security.tls import PeerTls
from logbroker.storage import DataDirectory, Executor, FileSystem, OpenLogs

log = Logger()

#: Listens on the configured bind address: ``(port, factory, the variable naming the port)``.
Listen = Callable[[int, IProtocolFactory, str], IListeningPort]
#: Opens a login's session (``DashboardApp.open_session``): ``(user, client ip, origin)``.
OpenSession = Callable[[str, str, Origin], Deferred[Session]]


class NodeMode(Protocol):
    """What a way of running a node puts into the service tree, at the places it goes."""

    @property
    def control(self) -> ControlPlane: ...

    @property
    def ranges(self) -> RangeDirectory: ...

    @property
    def groups(self) -> GroupCoordinator | None:
        """The broker's group coordinator; ``None``: the broker's own, for one node."""

    @property
    def open_session(self) -> OpenSession | None:
        """``None``: the dashboard opens sessions in the node's own session store."""

    @property
    def verifier(self) -> ClusterVerifier | None:
        """Compares every node's copies (``logbroker cluster verify``); ``None`` on one node."""

    @property
    def repairs(self) -> SegmentRepairs | None:
        """Repairs damaged sealed copies from other copies; ``None``: there are none (one node,
        or replication factor 1)."""

    def retention(
        self, rule: RetentionRule, clock: IReactorTime, metrics: RetentionMetrics
    ) -> Retention:
        """Retention of the node's ranges under ``rule`` (decided by one node of a cluster)."""

    def beside_control_plane(self) -> Sequence[Service]:
        """Named services started right after the control plane, stopped right before it."""

    def before_listeners(self) -> Sequence[Service]:
        """Named services started before the listeners and stopped after them."""

    def joined(self) -> Deferred[None]:
        """Fires once the node may serve, its control plane loaded."""

    def degraded(self) -> bool:
        """Whether the node, ready, serves less than it should."""

    def listen(self, listen: Listen) -> Sequence[Service]:
        """Bind the mode's own ports; the named services that close them."""

    def describe(self, client_port: int, dashboard_port: int) -> ClusterView:
        """What the operator surfaces show of the cluster, once the ports are bound."""

    def leader_of(self, range_id: str) -> str | None:
        """The node leading the range, for clients that send to it (``topic_leaders``);
        ``None``: none known, or one node (the one answering leads every range)."""


def port_number(listening: IListeningPort) -> int:
    """The TCP port ``listening`` listens on (a free one when asked for port 0)."""
    address = listening.getHost()
    assert isinstance(address, IPv4Address | IPv6Address)
    return address.port


def _named(service: Service, name: str) -> Service:
    service.setName(name)  # type: ignore[no-untyped-call]
    return service


class SingleNode:
    """One node: its control plane a file in the data directory, every range local to it."""

    groups: GroupCoordinator | None = None
    open_session: OpenSession | None = None
    verifier: ClusterVerifier | None = None
    repairs: SegmentRepairs | None = None

    def __init__(
        self,
        config: BrokerConfig,
        node_id: str,
        data_dir: DataDirectory,
        fs: FileSystem,
        storage: OpenLogs,
        executor: Executor,
    ) -> None:
        self._config = config
        self._node_id = node_id
        control = f"{data_dir.path}/{SINGLE_NODE_CONTROL}"
        self.control = LocalControlPlane(control, fs=fs, executor=executor)
        self.ranges = LocalRanges(storage)
        self._storage = storage

    def retention(
        self, rule: RetentionRule, clock: IReactorTime, metrics: RetentionMetrics
    ) -> Retention:
        logs = self._storage.logs
        return Retention(
            self.control, logs, rule, clock, metrics, newest_times=local_newest_times(logs)
        )

    def beside_control_plane(self) -> Sequence[Service]:
        return ()

    def before_listeners(self) -> Sequence[Service]:
        return ()

    def joined(self) -> Deferred[None]:
        return succeed(None)

    def degraded(self) -> bool:
        return False

    def listen(self, listen: Listen) -> Sequence[Service]:
        return ()

    def describe(self, client_port: int, dashboard_port: int) -> ClusterView:
        cluster = self._config.cluster
        record = NodeRecord(
            self._node_id,
            cluster.advertise_host or socket.gethostname(),
            client_port,
            dashboard_port,
            0,  # a single node has no peer port
            cluster.attributes,
            __version__,
        )
        return SingleNodeView(cluster.cluster_id, record, self.control)

    def leader_of(self, range_id: str) -> str | None:
        return None


class ClusterMember:
    """A member of a cluster: the etcd control plane, membership under a lease, peer links and
    the peer port, the cluster's chores, and sessions shared through etcd."""

    def __init__(
        self,
        reactor: Any,
        config: BrokerConfig,
        node_id: str,
        storage: OpenLogs,
        metrics: Metrics,
        sessions: SessionStore,
        peer_tls: PeerTls | None,
    ) -> None:
        self._config = config
        self._node_id = node_id
        self._peer_tls = peer_tls
        self._parts = parts = build_cluster(reactor, config, node_id, storage, metrics, peer_tls)
        self._storage = storage
        self.control = parts.control
        self.ranges = parts.ranges
        self.groups = parts.groups
        self.verifier = parts.verifier
        self.repairs: SegmentRepairs | None = parts.repairs
        # Sessions valid on every node: kept in etcd, each node following them.
        self._shared = SharedSessions(
            sessions,
            parts.store,
            f"/logbroker/{config.cluster.cluster_id}/".encode(),
            reactor,
            metrics=metrics,
        )
        self.open_session = self._shared.login
        self._peer_port: PeerPortService | None = None

    def beside_control_plane(self) -> Sequence[Service]:
        # They stop before the control plane: the node leaves the cluster (its lease revoked,
        # its peer links closed) before its metadata is flushed.
        parts = self._parts
        return (
            _named(parts.membership, "membership"),
            _named(parts.peers, "peer-links"),
            *parts.chores,
        )

    def retention(
        self, rule: RetentionRule, clock: IReactorTime, metrics: RetentionMetrics
    ) -> Retention:
        membership = self._parts.membership
        return Retention(
            self.control,
            self._storage.logs,
            rule,
            clock,
            metrics,
            newest_times=self._parts.newest_times,
            decides=lambda: membership.holds_chores,
        )

    def before_listeners(self) -> Sequence[Service]:
        return (_named(self._shared, "shared-sessions"),)

    def joined(self) -> Deferred[None]:
        # Its lease is what lets it lead ranges.
        return self._parts.membership.registered()

    def degraded(self) -> bool:
        """Without its lease, it leads no range."""
        return not self._parts.membership.holds_lease

    def listen(self, listen: Listen) -> Sequence[Service]:
        factory = self._parts.peer_factory
        port = listen(self._config.cluster.peer_port, factory, "SVC_PEER_PORT")
        self._peer_port = PeerPortService(factory, port)
        return (_named(self._peer_port, "peer-port"),)

    def leader_of(self, range_id: str) -> str | None:
        return self._parts.ranges.primary(range_id)

    def describe(self, client_port: int, dashboard_port: int) -> ClusterView:
        assert self._peer_port is not None, "describe() before listen()"
        cluster = self._config.cluster
        peer_port = port_number(self._peer_port.port)
        self._parts.set_record(
            cluster.advertise_host or socket.gethostname(), client_port, dashboard_port, peer_port
        )
        log.info(
            "Cluster {cluster}: node {node_id}, peer port {peer_port} ({peer_security}),"
            " control plane etcd at {endpoints} ({etcd_security})",
            cluster=cluster.cluster_id,
            node_id=self._node_id,
            peer_port=peer_port,
            peer_security="plaintext" if self._peer_tls is None else "mutual TLS",
            endpoints=",".join(f"{h}:{p}" for h, p in cluster.etcd_endpoints),
            etcd_security=cluster.etcd.scheme,
        )
        return self._parts.view
