"""The client port's guards, built as the broker builds them, count into ``Metrics``: driven
through the real protocol over ``StringTransport``."""

from __future__ import annotations

from twisted.internet.address import IPv4Address
from twisted.internet.task import Clock

from logbroker import wire
from logbroker.broker.core import BrokerSettings
from logbroker.config import BrokerConfig
from logbroker.metrics import Metrics
from logbroker.security import UserDirectory, seed_accounts
from logbroker.service import build_guards
from logbroker.testing import ImmediateExecutor
from tests.unit.broker.helpers import make_broker_and_control
from tests.unit.server.test_protocol import CHEAP, Client, Server
from tests.unit.storage.helpers import result_of


def counting_server(settings: dict[str, str]) -> tuple[Server, Metrics]:
    clock = Clock()
    metrics = Metrics(clock)
    broker, _, _, control = make_broker_and_control(
        clock, BrokerSettings(initial_ranges=1), metrics=metrics
    )
    users = UserDirectory(control, ImmediateExecutor(), CHEAP)
    result_of(seed_accounts(users, "dev", {}))
    server = Server(broker, users, clock)
    config, _ = BrokerConfig.from_env({"SVC_ENV": "test", **settings}, cwd="/")
    server.guards = build_guards(config, clock, metrics)
    return server, metrics


def connect(server: Server, host: str) -> Client:
    return server.connect(peer=IPv4Address("TCP", host, 40000))


def test_connections_open_and_refused_by_each_cap() -> None:
    server, metrics = counting_server(
        {
            "SVC_CONNECTION_LIMIT_ENABLED": "true",
            "SVC_MAX_CONN_PER_IP": "1",
            "SVC_MAX_TOTAL_CONN": "2",
        }
    )
    first = connect(server, "10.0.0.1")
    connect(server, "10.0.0.1")  # over the per-IP cap
    connect(server, "10.0.0.2")
    connect(server, "10.0.0.3")  # over the total cap
    assert metrics.snapshot().open_connections == 2

    first.protocol.connectionLost()

    snapshot = metrics.snapshot()
    assert snapshot.connection_limit_blocks == {"per_ip": 1, "global": 1}
    assert snapshot.open_connections == 1


def test_auth_attempts_and_auth_rate_limit_blocks() -> None:
    server, metrics = counting_server(
        {"SVC_RATE_LIMIT_ENABLED": "true", "SVC_AUTH_RATE_LIMIT": "3"}
    )
    client = connect(server, "10.0.0.9")
    client.send(wire.Auth("admin", "wrong"))
    client.send(wire.Auth("admin", "admin123"))
    connect(server, "10.0.0.9").login()
    blocked = connect(server, "10.0.0.9")
    blocked.send(wire.Auth("admin", "admin123"))
    assert blocked.one().reason == "rate_limit_exceeded"

    snapshot = metrics.snapshot()
    assert snapshot.auth_attempts == {"ok": 2, "invalid_credentials": 1, "rate_limited": 1}
    assert snapshot.rate_limit_blocks == {
        "auth": 1,
        "dashboard_auth": 0,
        "publish": 0,
        "subscribe": 0,
    }


def test_expired_and_hijacked_session_tokens() -> None:
    server, metrics = counting_server({"SVC_SESSION_TIMEOUT_SEC": "60"})
    owner = connect(server, "10.0.0.1")
    owner.send(wire.Auth("admin", "admin123"))
    token = wire.decode_token(owner.one().payload)
    stolen = connect(server, "10.0.0.2")
    stolen.send(wire.Auth(None, token))
    assert stolen.one().reason == "invalid_credentials"
    server.clock.advance(61)

    late = connect(server, "10.0.0.2")
    late.send(wire.Auth(None, token))
    assert late.one().reason == "invalid_credentials"

    snapshot = metrics.snapshot()
    # One validation can be both (expired, and from another IP): the counters overlap.
    assert (snapshot.session_hijack_attempts, snapshot.sessions_expired) == (2, 1)
    assert snapshot.auth_attempts["invalid_credentials"] == 2
