"""The client port's guards: connection limits at accept, the auth rate limit, sessions."""

from __future__ import annotations

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from logbroker import wire
from logbroker.broker.core import BrokerSettings
from logbroker.metrics import Metrics
from logbroker.security import UserDirectory, seed_accounts
from logbroker.security.guards import AuthResult, Guards
from logbroker.security.ratelimit import Action
from logbroker.security.sessions import Origin
from logbroker.server.protocol import (
    MAX_WAITING_REFUSALS,
    REFUSAL_GRACE_SECONDS,
    ClientFactory,
    ProtocolSettings,
)
from logbroker.service import cleanup_task
from logbroker.testing import ImmediateExecutor
from tests.certificates import issue, make_ca, serving
from tests.unit.broker.helpers import make_broker_and_control
from tests.unit.server.helpers import make_guards
from tests.unit.server.test_protocol import CHEAP, Client, Server
from tests.unit.storage.helpers import result_of
from tests.unit.test_tcp import AbortableTransport


def address(host: str) -> IPv4Address | IPv6Address:
    return IPv6Address("TCP", host, 40000) if ":" in host else IPv4Address("TCP", host, 40000)


def server_with(settings: dict[str, str]) -> tuple[Server, list[AuthResult]]:
    clock = Clock()
    broker, _, _, control = make_broker_and_control(clock, BrokerSettings(initial_ranges=1))
    metrics = Metrics(clock)
    built = make_guards(clock, settings, metrics)
    users = UserDirectory(
        control, ImmediateExecutor(), CHEAP, on_credentials_revoked=built.sessions.revoke_user
    )
    result_of(seed_accounts(users, "dev", {}))
    server = Server(broker, users, clock)
    server.metrics = metrics
    results: list[AuthResult] = []
    server.guards = Guards(built.connections, built.limiter, built.sessions, results.append)
    return server, results


def connect(server: Server, host: str) -> Client:
    return server.connect(peer=address(host))


# -- connection limits -----------------------------------------------------------------------


def test_a_connection_over_the_per_ip_cap_gets_the_error_frame_and_a_close() -> None:
    server, _ = server_with({"SVC_CONNECTION_LIMIT_ENABLED": "true", "SVC_MAX_CONN_PER_IP": "2"})
    first, second = connect(server, "10.0.0.1"), connect(server, "10.0.0.1")
    refused = connect(server, "10.0.0.1")
    assert refused.one() == wire.Response(0, b"", "connection_limit_exceeded")
    assert refused.transport.disconnecting
    # Another IP is not affected.
    other = connect(server, "10.0.0.2")
    other.login()
    assert sum(server.metrics.snapshot().connection_limit_blocks.values()) == 1
    # Closing a connection frees its slot.
    first.protocol.connectionLost()
    third = connect(server, "10.0.0.1")
    third.login()
    assert second.transport.connected
    assert server.guards.connections.count("10.0.0.1") == 2


def test_a_connection_over_the_total_cap_gets_global_limit_exceeded() -> None:
    server, _ = server_with({"SVC_CONNECTION_LIMIT_ENABLED": "true", "SVC_MAX_TOTAL_CONN": "2"})
    connect(server, "10.0.0.1")
    connect(server, "10.0.0.2")
    refused = connect(server, "10.0.0.3")
    assert refused.one() == wire.Response(0, b"", "global_limit_exceeded")
    assert server.guards.connections.total == 2


def test_every_way_a_connection_ends_frees_its_slot_once() -> None:
    server, _ = server_with({"SVC_CONNECTION_LIMIT_ENABLED": "true", "SVC_MAX_CONN_PER_IP": "1"})
    timed_out = connect(server, "10.0.0.1")
    server.clock.advance(60)  # closed by the server: no auth within the deadline
    assert timed_out.transport.disconnecting
    timed_out.protocol.connectionLost()
    timed_out.protocol.connectionLost()
    garbage = connect(server, "10.0.0.1")
    garbage.protocol.dataReceived(b"\x00\x00\x00\x01x")  # closed by the server: bad frame
    garbage.protocol.connectionLost()
    assert server.guards.connections.total == 0
    connect(server, "10.0.0.1").login()


def test_limits_off_in_test_mode_count_but_never_refuse() -> None:
    server, _ = server_with({"SVC_MAX_CONN_PER_IP": "1"})
    clients = [connect(server, "10.0.0.1") for _ in range(3)]
    for client in clients:
        client.login()
    assert server.guards.connections.total == 3


def test_ipv6_clients_are_counted_under_their_hex_groups() -> None:
    server, _ = server_with({"SVC_CONNECTION_LIMIT_ENABLED": "true", "SVC_MAX_CONN_PER_IP": "1"})
    connect(server, "::1").login()
    assert connect(server, "::1").one().reason == "connection_limit_exceeded"
    assert server.guards.connections.count("0:0:0:0:0:0:0:1") == 1


# -- the auth rate limit ---------------------------------------------------------------------

LIMITED = {"SVC_RATE_LIMIT_ENABLED": "true", "SVC_AUTH_RATE_LIMIT": "3"}


def test_auth_attempts_past_the_limit_get_rate_limit_exceeded_per_ip() -> None:
    server, results = server_with(LIMITED)
    client = connect(server, "10.0.0.9")
    for n in range(3):
        client.send(wire.Auth("admin", "wrong"), n + 1)
    client.send(wire.Auth("admin", "admin123"), 7)
    assert [r.reason for r in client.responses()] == ["invalid_credentials"] * 3 + [
        "rate_limit_exceeded"
    ]
    # The connection stays open (the client may retry later, within its auth deadline) ...
    assert client.transport.connected
    assert not client.transport.disconnecting
    # ... another address is not affected, and the block is counted against the attacker.
    connect(server, "10.0.0.10").login()
    assert server.guards.limiter.top_blocked(Action.AUTH) == [("10.0.0.9", 1)]
    assert results == [AuthResult.INVALID_CREDENTIALS] * 3 + [
        AuthResult.RATE_LIMITED,
        AuthResult.OK,
    ]


def test_the_limit_counts_attempts_across_connections_of_one_ip() -> None:
    server, _ = server_with(LIMITED)
    for _ in range(3):
        connect(server, "10.0.0.9").login()
    blocked = connect(server, "10.0.0.9")
    blocked.send(wire.Auth("admin", "admin123"), 4)
    assert blocked.one() == wire.Response(4, b"", "rate_limit_exceeded")
    # The bucket refills with time: 3 per 60 s is one every 20 s.
    server.clock.advance(20.001)
    connect(server, "10.0.0.9").login()


# -- sessions --------------------------------------------------------------------------------


def token_of(client: Client, user: str = "admin", password: str = "admin123") -> str:
    client.send(wire.Auth(user, password), 1)
    return wire.decode_token(client.one().payload)


def test_the_auth_token_resumes_the_session_from_the_same_ip() -> None:
    server, results = server_with({})
    token = token_of(connect(server, "10.0.0.1"), "producer", "producer123")
    again = connect(server, "10.0.0.1")
    again.send(wire.Auth(None, token), 2)
    assert wire.decode_token(again.one().payload) == token
    again.send(wire.CreateTopic("orders", 0), 3)
    assert again.one().ok
    assert results == [AuthResult.OK, AuthResult.OK]


def test_a_token_from_another_ip_is_refused_and_counted_as_a_hijack() -> None:
    server, results = server_with({})
    token = token_of(connect(server, "127.0.0.1"))
    stolen = connect(server, "127.0.0.2")
    stolen.send(wire.Auth(None, token), 2)
    assert stolen.one() == wire.Response(2, b"", "invalid_credentials")
    assert server.metrics.snapshot().session_hijack_attempts == 1
    assert results[-1] is AuthResult.INVALID_CREDENTIALS


def test_an_expired_token_is_refused_and_counted() -> None:
    server, _ = server_with({"SVC_SESSION_TIMEOUT_SEC": "60"})
    token = token_of(connect(server, "10.0.0.1"))
    server.clock.advance(61)
    late = connect(server, "10.0.0.1")
    late.send(wire.Auth(None, token), 2)
    assert late.one().reason == "invalid_credentials"
    assert server.metrics.snapshot().sessions_expired == 1


def test_a_token_of_a_deleted_user_is_refused() -> None:
    server, _ = server_with({})
    token = token_of(connect(server, "10.0.0.1"), "consumer", "consumer123")
    result_of(server.users.delete_user("consumer"))
    late = connect(server, "10.0.0.1")
    late.send(wire.Auth(None, token), 2)
    assert late.one().reason == "invalid_credentials"


def test_a_password_changed_over_the_client_port_ends_the_user_s_sessions() -> None:
    server, _ = server_with({})
    token = token_of(connect(server, "10.0.0.1"), "producer", "producer123")
    admin = connect(server, "10.0.0.2")
    admin.login()
    admin.send(wire.ChangePassword("producer", "a-new-password"), 5)
    assert admin.one() == wire.Response(5, b"", None)

    late = connect(server, "10.0.0.1")
    late.send(wire.Auth(None, token), 2)
    assert late.one().reason == "invalid_credentials"


def test_token_resumes_are_rate_limited_too() -> None:
    server, _ = server_with(LIMITED)
    client = connect(server, "10.0.0.1")
    for n in range(3):
        client.send(wire.Auth(None, "guess"), n + 1)
    client.send(wire.Auth(None, "guess"), 4)
    assert [r.reason for r in client.responses()] == ["invalid_credentials"] * 3 + [
        "rate_limit_exceeded"
    ]


def test_expired_buckets_and_sessions_are_removed_every_cleanup_interval() -> None:
    clock = Clock()
    guards = make_guards(clock, {"SVC_RATE_LIMIT_ENABLED": "true"})
    task = cleanup_task(guards, 300_000, clock)
    task.startService()
    guards.limiter.check("10.0.0.1", Action.AUTH)
    session = guards.sessions.create("admin", "10.0.0.1", Origin.DASHBOARD)
    clock.advance(299)
    assert guards.limiter.bucket_count() == 1
    clock.advance(1)  # 300 s: the bucket is full again (60 s window), the session lives on
    assert guards.limiter.bucket_count() == 0
    assert len(guards.sessions) == 1
    clock.advance(3600)
    assert len(guards.sessions) == 0
    assert guards.sessions.validate(session.token, "10.0.0.1").session is None
    task.stopService()


def tls_factory(server: Server, required: bool) -> ClientFactory:
    return ClientFactory(
        server.broker,  # type: ignore[arg-type]
        server.users,
        server.clock,
        ProtocolSettings(),
        server.guards,
        serving(issue(make_ca()), required=required),
    )


def test_on_a_tls_port_a_refusal_answers_the_first_frame_in_the_layer_it_came_in() -> None:
    server, _ = server_with({"SVC_CONNECTION_LIMIT_ENABLED": "true", "SVC_MAX_CONN_PER_IP": "1"})
    factory = tls_factory(server, required=False)
    factory.buildProtocol(address("10.0.0.1")).makeConnection(StringTransport())
    transport = StringTransport()
    refused = factory.buildProtocol(address("10.0.0.1"))
    refused.makeConnection(transport)
    # Nothing yet: the client has not said whether it speaks TLS.
    assert transport.value() == b""
    refused.dataReceived(wire.encode_request(1, wire.Auth("admin", "admin123")))
    assert wire.FrameDecoder().feed(transport.value()) == [
        wire.encode_error(0, wire.Reason.CONNECTION_LIMIT_EXCEEDED)[4:]
    ]
    assert transport.disconnecting


def test_on_a_tls_port_a_refused_client_that_says_nothing_is_dropped_without_a_word() -> None:
    server, _ = server_with({"SVC_CONNECTION_LIMIT_ENABLED": "true", "SVC_MAX_TOTAL_CONN": "1"})
    factory = tls_factory(server, required=True)
    factory.buildProtocol(address("10.0.0.1")).makeConnection(StringTransport())
    transport = AbortableTransport()
    refused = factory.buildProtocol(address("10.0.0.2"))
    refused.makeConnection(transport)
    server.clock.advance(REFUSAL_GRACE_SECONDS - 0.1)
    assert not transport.aborted
    server.clock.advance(0.1)
    assert transport.aborted
    assert transport.value() == b""
    assert server.guards.connections.total == 1
    refused.connectionLost(Failure(ConnectionDone()))


def test_past_so_many_waiting_refusals_a_tls_port_refuses_at_once_in_plaintext() -> None:
    server, _ = server_with({"SVC_CONNECTION_LIMIT_ENABLED": "true", "SVC_MAX_TOTAL_CONN": "1"})
    factory = tls_factory(server, required=True)
    factory.buildProtocol(address("10.0.0.1")).makeConnection(StringTransport())
    waiting = []
    for _ in range(MAX_WAITING_REFUSALS):
        transport = AbortableTransport()
        protocol = factory.buildProtocol(address("10.0.0.2"))
        protocol.makeConnection(transport)
        waiting.append((protocol, transport))
    assert all(transport.value() == b"" for _, transport in waiting)
    at_once = StringTransport()
    factory.buildProtocol(address("10.0.0.3")).makeConnection(at_once)
    assert at_once.value() == wire.encode_error(0, wire.Reason.GLOBAL_LIMIT_EXCEEDED)
    assert at_once.disconnecting
    # A waiting refusal that ends makes room for the next to wait.
    protocol, _ = waiting[0]
    protocol.connectionLost(Failure(ConnectionDone()))
    later = AbortableTransport()
    factory.buildProtocol(address("10.0.0.4")).makeConnection(later)
    assert later.value() == b""
