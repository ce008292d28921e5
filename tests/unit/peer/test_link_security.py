"""The peer port's defences (``logbroker.peer.connections``, ``logbroker.peer.link``): mutual TLS
with the real TLS layer in memory (``twisted.test.iosim``), each side's certificate checked
against the cluster's CA and against the node its owner claims to be; and the caps on
connections still in their handshake. Time is a ``Clock``; no socket is opened."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.protocol import Protocol
from twisted.internet.ssl import CertificateOptions
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import globalLogPublisher
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.test.iosim import FakeTransport, IOPump, connect

from logbroker.config import TlsSettings, TlsVerify, TlsVersion
from logbroker.peer.connections import REFUSAL_LOG_SECONDS, PeerConnections, PeerServerFactory
from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.handshake import Handshake, PeerIdentity, Role
from logbroker.peer.link import LinkState, PeerProtocol, PeerSettings
from logbroker.security.tls import load_server_tls
from tests.certificates import NOW, Issued, issue, make_ca
from tests.unit.peer.test_link import (
    DIALER_ADDRESS,
    SECRET,
    SETTINGS,
    FakeEndpoint,
    Handler,
    Result,
    Seen,
)

CLUSTER_CA = make_ca("cluster CA")
OTHER_CA = make_ca("another CA")


def node_certificate(node: str, authority: Issued = CLUSTER_CA, cluster: str = "c1") -> Issued:
    return issue(
        authority, (f"{node}.example",), both=True, uris=(f"logbroker://{cluster}/{node}",)
    )


def peer_options(certificate: Issued, cluster_ca: Issued = CLUSTER_CA) -> CertificateOptions:
    """The peer port's options as a node loads them from its files."""
    files = {
        "/tls/cert.pem": certificate.cert_pem,
        "/tls/key.pem": certificate.key_pem,
        "/tls/cluster-ca.pem": cluster_ca.cert_pem,
    }
    settings = TlsSettings(
        enabled=True,
        required=True,
        certfile="/tls/cert.pem",
        keyfile="/tls/key.pem",
        cacertfile=None,
        verify=TlsVerify.VERIFY_NONE,
        versions=(TlsVersion.TLSV1_3, TlsVersion.TLSV1_2),
        peer_cacertfile="/tls/cluster-ca.pem",
    )
    tls = load_server_tls(settings, NOW, files.__getitem__)
    assert tls is not None
    assert tls.peer is not None
    return tls.peer.options


class TcpTransport(StringTransport):
    """A ``StringTransport`` with the TCP options a TLS layer passes on from it."""

    def setTcpNoDelay(self, enabled: bool) -> None:
        pass


def tls_identity(node: str) -> PeerIdentity:
    return PeerIdentity("c1", node, SECRET, mutual_tls=True)


@pytest.fixture
def clock() -> Iterator[Clock]:
    clock = Clock()
    yield clock
    assert clock.getDelayedCalls() == [], "a timer outlived its connection"


@attrs.define
class TlsPair:
    """Node a dialing node b's peer port, both over TLS, connected in memory."""

    clock: Clock
    server: PeerServerFactory
    dialer: PeerProtocol
    pump: IOPump
    dialer_seen: Seen
    listener_seen: Seen
    handler: Handler

    @property
    def listener(self) -> PeerProtocol:
        [protocol] = self.server.connections
        return protocol

    def flush(self) -> None:
        self.pump.flush()


def tls_pair(
    clock: Clock,
    dialer_tls: CertificateOptions | None,
    listener_tls: CertificateOptions | None = None,
    dialer_claims: str = "a",
) -> TlsPair:
    """``dialer_tls`` None: the dialer speaks plaintext to the TLS listener."""
    handler, dialer_seen, listener_seen = Handler(), Seen(), Seen()
    server = PeerServerFactory(
        tls_identity("b"),
        clock,
        handler,
        SETTINGS,
        observer=listener_seen,
        tls=listener_tls or peer_options(node_certificate("b")),
    )
    dialer = PeerProtocol(
        Handshake(
            Role.DIALER,
            PeerIdentity("c1", dialer_claims, SECRET, mutual_tls=dialer_tls is not None),
            expected_peer="b",
        ),
        clock,
        SETTINGS,
        observer=dialer_seen,
    )
    client: Protocol = dialer
    if dialer_tls is not None:
        wrapping = TLSMemoryBIOFactory(dialer_tls, True, _Returning(dialer), clock)
        client = wrapping.buildProtocol(None)
    listening = server.buildProtocol(DIALER_ADDRESS)
    assert listening is not None
    pump = connect(
        listening,
        FakeTransport(listening, isServer=True),
        client,
        FakeTransport(client, isServer=False),
        clock=clock,
    )
    return TlsPair(clock, server, dialer, pump, dialer_seen, listener_seen, handler)


class _Returning:
    """A protocol factory for one protocol made beforehand."""

    def __init__(self, protocol: PeerProtocol) -> None:
        self._protocol = protocol

    def buildProtocol(self, addr: object) -> PeerProtocol:
        return self._protocol

    def doStart(self) -> None:
        pass

    def doStop(self) -> None:
        pass


def messages(logged: list[dict[str, Any]]) -> str:
    return "\n".join(str(event.get("reason", "")) for event in logged)


# -- mutual TLS --------------------------------------------------------------------------------


def test_nodes_with_certificates_of_the_cluster_naming_them_establish(clock: Clock) -> None:
    pair = tls_pair(clock, peer_options(node_certificate("a")))

    assert pair.dialer.state is pair.listener.state is LinkState.ESTABLISHED
    assert (pair.dialer.peer_node_id, pair.listener.peer_node_id) == ("b", "a")
    result = Result(pair.dialer.request(PeerOp.READ, b"question"))
    pair.flush()
    pair.handler.answer(0, b"answer")
    pair.flush()
    assert result.value == b"answer"
    assert pair.server.handshaking == 0
    listener = pair.listener
    pair.dialer.close()
    pair.flush()
    assert pair.dialer.state is listener.state is LinkState.CLOSED
    assert pair.server.connections == set()


def test_a_certificate_of_another_ca_is_refused_at_tls(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    pair = tls_pair(clock, peer_options(node_certificate("a", authority=OTHER_CA)))

    assert pair.dialer.state is LinkState.CLOSED
    assert pair.server.connections == set()
    assert pair.listener_seen.refusals == ["tls"]
    assert pair.dialer_seen.refusals == []
    assert pair.listener_seen.opened_total == pair.dialer_seen.opened_total == 0
    refused = [e for e in logged_errors if e.get("role") == "listener"]
    assert "certificate verify failed" in messages(refused)
    assert "Refused the TLS handshake" in refused[0]["log_format"]
    # The dialer hears of it as the listener's TLS alert.
    told = [e for e in logged_errors if e.get("role") == "dialer"]
    assert "alert" in messages(told)
    assert pair.server.handshaking == 0
    logged_errors.clear()


def test_a_dialer_without_a_certificate_is_refused_at_tls(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    pair = tls_pair(clock, CertificateOptions())

    assert pair.dialer.state is LinkState.CLOSED
    assert pair.listener_seen.refusals == ["tls"]
    assert "did not return a certificate" in messages(logged_errors)
    logged_errors.clear()


def test_a_dialer_whose_certificate_names_another_node_is_refused(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    # A real node of the cluster (its certificate is good: it is node x) claiming to be a.
    pair = tls_pair(clock, peer_options(node_certificate("x")))

    assert pair.dialer.state is LinkState.CLOSED
    assert pair.listener_seen.refusals == ["certificate"]
    [refusal] = [e for e in logged_errors if e.get("role") == "listener"]
    assert refusal["reason"] == PeerReason.WRONG_CERTIFICATE
    assert refusal["peer_node_id"] == "a"
    assert "names logbroker://c1/x, not logbroker://c1/a" in refusal["detail"]
    logged_errors.clear()


def test_a_listener_whose_certificate_names_another_node_is_refused_by_the_dialer(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    pair = tls_pair(
        clock,
        peer_options(node_certificate("a")),
        listener_tls=peer_options(node_certificate("a")),
    )

    assert pair.dialer.state is LinkState.CLOSED
    assert pair.dialer_seen.refusals == ["certificate"]
    [refusal] = [e for e in logged_errors if e.get("role") == "dialer"]
    assert refusal["reason"] == PeerReason.WRONG_CERTIFICATE
    logged_errors.clear()


def test_a_certificate_of_a_node_of_another_cluster_is_refused(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    pair = tls_pair(clock, peer_options(node_certificate("a", cluster="c2")))

    assert pair.listener_seen.refusals == ["certificate"]
    logged_errors.clear()


def test_a_plaintext_dialer_is_refused_at_tls(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    pair = tls_pair(clock, None)

    assert pair.dialer.state is LinkState.CLOSED
    assert pair.server.connections == set()
    assert pair.listener_seen.refusals == ["tls"]
    logged_errors.clear()


def test_a_listener_keeps_reading_while_the_tls_layer_holds_its_hello(clock: Clock) -> None:
    """The listener writes its Hello at once; the TLS layer holds it until its handshake is
    through. A listener that stopped reading for that would never read the handshake."""
    server = PeerServerFactory(
        tls_identity("b"), clock, Handler(), SETTINGS, tls=peer_options(node_certificate("b"))
    )
    protocol = server.buildProtocol(DIALER_ADDRESS)
    assert protocol is not None
    transport = TcpTransport()
    protocol.makeConnection(transport)
    clock.advance(0)  # the TLS layer passes small writes on at the next turn

    assert transport.producerState == "producing"
    protocol.connectionLost(Failure(ConnectionDone()))
    clock.advance(SETTINGS.handshake_timeout_s)


def test_a_connection_stalled_in_its_tls_handshake_is_aborted_at_the_timeout(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    server = PeerServerFactory(
        tls_identity("b"), clock, Handler(), SETTINGS, tls=peer_options(node_certificate("b"))
    )
    protocol = server.buildProtocol(DIALER_ADDRESS)
    assert protocol is not None
    transport = TcpTransport()
    protocol.makeConnection(transport)
    assert server.handshaking == 1

    clock.advance(SETTINGS.handshake_timeout_s)

    # Aborted at once, not after a close grace: nothing could be read before TLS is through.
    assert transport.disconnecting
    assert not clock.getDelayedCalls()
    protocol.connectionLost(Failure(ConnectionDone()))
    assert server.handshaking == 0
    logged_errors.clear()


def test_the_dialing_side_puts_tls_under_its_links(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    handler, seen = Handler(), Seen()
    server = PeerServerFactory(
        tls_identity("b"), clock, handler, SETTINGS, tls=peer_options(node_certificate("b"))
    )
    endpoint = FakeEndpoint(clock, server)
    connections = PeerConnections(
        tls_identity("a"),
        clock,
        lambda node: endpoint,
        SETTINGS,
        observer=seen,
        tls=peer_options(node_certificate("a")),
    )
    connections.add_peer("b")
    connections.startService()
    endpoint.flush()

    link = connections.established("b")
    assert link is not None
    assert link.peer_node_id == "b"
    result = Result(connections.request("b", PeerOp.READ, b""))
    endpoint.flush()
    handler.answer(0, b"over TLS")
    endpoint.flush()
    assert result.value == b"over TLS"
    connections.stopService()
    endpoint.flush()
    assert logged_errors == []


def test_tls_options_come_with_a_mutual_tls_identity_and_only_then() -> None:
    options = peer_options(node_certificate("b"))
    with pytest.raises(ValueError, match="mutual TLS"):
        PeerServerFactory(PeerIdentity("c1", "b", SECRET), Clock(), Handler(), tls=options)
    with pytest.raises(ValueError, match="mutual TLS"):
        PeerServerFactory(tls_identity("b"), Clock(), Handler())
    server = PeerServerFactory(tls_identity("b"), Clock(), Handler(), tls=options)
    with pytest.raises(ValueError, match="mutual TLS"):
        PeerConnections(tls_identity("a"), Clock(), lambda node: FakeEndpoint(Clock(), server))


# -- caps on connections in their handshake ---------------------------------------------------

#: Connections in their handshake stay so for two minutes, unless a test says otherwise.
CAPPED = PeerSettings(handshake_timeout_s=120, max_handshakes_per_ip=2, max_handshakes=3)


def address(host: str) -> IPv4Address:
    return IPv4Address("TCP", host, 50000)


def capped(clock: Clock, seen: Seen) -> PeerServerFactory:
    return PeerServerFactory(
        PeerIdentity("c1", "b", SECRET), clock, Handler(), CAPPED, observer=seen
    )


def accept(factory: PeerServerFactory, host: str) -> PeerProtocol | None:
    protocol = factory.buildProtocol(address(host))
    if protocol is not None:
        assert isinstance(protocol, PeerProtocol)
        protocol.makeConnection(StringTransport(peerAddress=address(host)))
    return protocol


def test_connections_past_the_per_address_cap_are_refused_at_accept(
    clock: Clock,
) -> None:
    seen = Seen()
    factory = capped(clock, seen)

    first, second = accept(factory, "10.0.0.9"), accept(factory, "10.0.0.9")
    third = accept(factory, "10.0.0.9")
    other = accept(factory, "10.0.0.8")

    assert first is not None
    assert second is not None
    assert other is not None
    assert third is None
    assert seen.refusals == ["per_ip_limit"]
    assert factory.handshaking == 3
    for protocol in (first, second, other):
        protocol.connectionLost(Failure(ConnectionDone()))
    assert factory.handshaking == 0


def test_connections_past_the_total_cap_are_refused_at_accept(clock: Clock) -> None:
    seen = Seen()
    factory = capped(clock, seen)
    accepted = [accept(factory, f"10.0.0.{n}") for n in range(1, 5)]

    assert [protocol is not None for protocol in accepted] == [True, True, True, False]
    assert seen.refusals == ["total_limit"]
    for protocol in accepted[:3]:
        assert protocol is not None
        protocol.connectionLost(Failure(ConnectionDone()))


def test_a_connection_that_ends_or_is_established_leaves_the_count(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    seen = Seen()
    factory = capped(clock, seen)
    lost = accept(factory, "10.0.0.9")
    assert lost is not None
    lost.connectionLost(Failure(ConnectionDone()))
    timed_out = accept(factory, "10.0.0.9")
    assert timed_out is not None
    clock.advance(CAPPED.handshake_timeout_s + 5)  # refused, then the close grace ends
    timed_out.connectionLost(Failure(ConnectionDone()))
    assert factory.handshaking == 0
    [timeout] = logged_errors
    assert timeout["reason"] == PeerReason.TIMEOUT
    logged_errors.clear()

    # An established connection no longer counts: a node's links never use up the caps.
    dialers = [established(clock, factory, f"n{n}") for n in range(4)]
    assert factory.handshaking == 0
    assert seen.refusals == ["handshake"]  # the timed-out one
    for dialer, pump in dialers:
        dialer.close()
        pump.flush()
    assert factory.connections == set()


def established(clock: Clock, factory: PeerServerFactory, node: str) -> tuple[PeerProtocol, IOPump]:
    """A plaintext connection of node ``node`` from 10.0.0.9, through its handshake."""
    listener = factory.buildProtocol(address("10.0.0.9"))
    assert listener is not None
    dialer = PeerProtocol(
        Handshake(Role.DIALER, PeerIdentity("c1", node, SECRET), expected_peer="b"),
        clock,
        SETTINGS,
    )
    pump = connect(
        listener,
        FakeTransport(listener, isServer=True),
        dialer,
        FakeTransport(dialer, isServer=False),
        clock=clock,
    )
    assert dialer.state is LinkState.ESTABLISHED
    return dialer, pump


def test_refusals_are_logged_at_most_once_a_minute(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    warnings: list[dict[str, Any]] = []

    def observe(event: dict[str, Any]) -> None:
        if "Refused {count}" in event.get("log_format", ""):
            warnings.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        refuse_for_a_minute(clock, seen := Seen())
    finally:
        globalLogPublisher.removeObserver(observe)

    assert [w["count"] for w in warnings] == [1, 5]
    assert warnings[0]["cap"] == "per_ip_limit"
    assert warnings[0]["source"] == "10.0.0.9"
    assert len(seen.refusals) == 6
    assert logged_errors == []


def refuse_for_a_minute(clock: Clock, seen: Seen) -> None:
    """One refusal, four more within the minute, a sixth just after it."""
    factory = capped(clock, seen)
    kept = [accept(factory, "10.0.0.9") for _ in range(2)]
    for _ in range(5):
        assert accept(factory, "10.0.0.9") is None
    clock.advance(REFUSAL_LOG_SECONDS)
    assert accept(factory, "10.0.0.9") is None
    for protocol in kept:
        assert protocol is not None
        protocol.connectionLost(Failure(ConnectionDone()))
