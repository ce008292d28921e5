"""A dashboard on a real listening Site (127.0.0.1, a free port) over a broker in memory: the
same broker, users, guards and metrics serve a client-port ``Server`` too, as in the broker.
Every time the app reads (sessions, rate limits, rates) comes from one ``Clock``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
from treq.client import HTTPClient
from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint
from twisted.internet.interfaces import IListeningPort
from twisted.internet.task import Clock
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.iweb import IAgentEndpointFactory
from zope.interface import implementer

from logbroker.broker.core import Broker, BrokerSettings
from logbroker.cluster.view import ClusterView
from logbroker.config import BrokerConfig
from logbroker.dashboard import (
    BrokerNode,
    CappedConnections,
    DashboardApp,
    DashboardSite,
    NodeStatus,
)
from logbroker.maintenance.scrub import NoOtherCopy, Scrubber
from logbroker.maintenance.view import MaintenanceView, RetentionStatus, ScrubStatus
from logbroker.metrics import Metrics
from logbroker.security import UserDirectory, seed_accounts
from logbroker.security.connections import ConnectionRegistry
from logbroker.security.guards import Guards
from logbroker.service import build_guards
from logbroker.testing import ImmediateExecutor
from tests.unit.broker.helpers import make_broker_and_control
from tests.unit.server.test_protocol import CHEAP, Client, Server
from tests.unit.storage.helpers import result_of


@attrs.define
class Status:
    """The node status the app reads; tests move it."""

    value: NodeStatus = NodeStatus.STARTING


@attrs.define
class Dashboard:
    port: IListeningPort
    clock: Clock
    status: Status
    broker: Broker
    users: UserDirectory
    guards: Guards
    metrics: Metrics
    tcp: Server
    storage: Any
    #: ``None`` with ``SVC_SCRUB_ENABLED=false``.
    scrubber: Scrubber | None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port.getHost().port}{path}"  # type: ignore[attr-defined]

    def tcp_client(self, host: str = "127.0.0.1") -> Client:
        """A client-port connection from ``host`` to the same broker and guards."""
        return self.tcp.connect(peer=IPv4Address("TCP", host, 40000))

    def stop(self) -> Deferred[None]:
        return self.port.stopListening()  # type: ignore[return-value]


def start_dashboard(
    settings: Mapping[str, str] | None = None,
    *,
    secure: bool = False,
    node: Any = None,
    cluster: ClusterView | None = None,
) -> Dashboard:
    """A listening dashboard in test mode (limiters off) unless ``settings`` (``SVC_*``) say
    otherwise; ``node`` replaces the broker's view of itself; ``cluster`` is the app's view of
    the cluster (also watched by its metrics)."""
    config, _ = BrokerConfig.from_env({"SVC_ENV": "test", **(settings or {})}, cwd="/")
    clock = Clock()
    metrics = Metrics(clock)
    broker, storage, _, control = make_broker_and_control(
        clock, BrokerSettings(initial_ranges=2), metrics=metrics
    )
    metrics.watch(control, storage)
    if cluster is not None:
        metrics.watch_cluster(cluster)
    guards = build_guards(config, clock, metrics)
    users = UserDirectory(
        control,
        ImmediateExecutor(),
        CHEAP,
        on_credentials_revoked=guards.sessions.revoke_user,
    )
    result_of(seed_accounts(users, "test", {}))
    status = Status()
    scrubber = None
    if config.scrub.enabled:
        scrubber = Scrubber(storage.logs, control, 1, metrics, NoOtherCopy(metrics), clock)
    maintenance = MaintenanceView(
        scrub=ScrubStatus(
            config.scrub.enabled, config.scrub.interval_ms, config.scrub.segments_per_tick
        ),
        retention=RetentionStatus(False, None, None, config.retention.interval_ms),
        scrubber=scrubber,
    )
    app = DashboardApp(
        clock=clock,
        settings=config.dashboard,
        users=users,
        guards=guards,
        node=node or BrokerNode(lambda: status.value, broker, storage.logs),
        metrics=metrics,
        mode=config.mode.value,
        secure=secure,
        cluster=cluster,
        maintenance=maintenance,
    )
    site = DashboardSite(app.app.resource(), secure=secure, reactor=reactor)
    capped = CappedConnections(site, ConnectionRegistry(config.connection_limits))
    port = reactor.listenTCP(0, capped, interface="127.0.0.1")  # type: ignore[attr-defined]
    tcp = Server(broker, users, clock)
    tcp.guards = guards
    return Dashboard(port, clock, status, broker, users, guards, metrics, tcp, storage, scrubber)


@implementer(IAgentEndpointFactory)
@attrs.frozen
class _FromSource:
    """Connections from the loopback address ``source`` (127.0.0.2 is another client IP)."""

    source: str

    def endpointForURI(self, uri: Any) -> TCP4ClientEndpoint:
        return TCP4ClientEndpoint(
            reactor, uri.host.decode("ascii"), uri.port, bindAddress=(self.source, 0)
        )


def http_from(source: str = "127.0.0.1") -> HTTPClient:
    """treq from the client IP ``source``; one connection per request, closed after it."""
    pool = HTTPConnectionPool(reactor, persistent=False)
    return HTTPClient(Agent.usingEndpointFactory(reactor, _FromSource(source), pool=pool))


def json_body(value: object) -> dict[str, Any]:
    """Keyword arguments for treq: ``value`` as a JSON body, declared JSON."""
    return {
        "data": json.dumps(value).encode("utf-8"),
        "headers": {"Content-Type": ["application/json"]},
    }


def bearer(token: str) -> dict[str, list[str]]:
    return {"Authorization": [f"Bearer {token}"]}
