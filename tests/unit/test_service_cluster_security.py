"""The composition root's wiring of a cluster node's security, before the reactor runs: the peer
port listens with mutual TLS when the node has TLS, the node's certificate must name it, and
the files of ``SVC_ETCD_*`` are checked at build time. Nothing here touches a socket: the
reactor is a ``MemoryReactorClock`` and connections are ``twisted.test.iosim`` pumps."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.test import iosim

from logbroker.config import BrokerConfig, ConfigError, TlsSettings, TlsVerify, TlsVersion
from logbroker.peer.handshake import Handshake, PeerIdentity, Role
from logbroker.peer.link import LinkState, PeerProtocol, PeerSettings
from logbroker.security.tls import ServerTls, load_server_tls
from logbroker.service import BrokerService, build_service
from logbroker.storage import DataDirectory, OsFileSystem
from tests.certificates import NOW, Issued, issue, make_ca, write

SECRET = "a cluster secret for the tests"
CLUSTER_CA = make_ca("cluster CA")


@pytest.fixture(autouse=True)
def switch_interval() -> Iterator[None]:
    """Restore this test process's GIL switch interval, which the composition root changes."""
    before = sys.getswitchinterval()
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def node_tls(certificate: Issued) -> ServerTls:
    """A cluster node's TLS, loaded as the broker loads it, the peer CA being the cluster's."""
    files = {
        "/tls/cert.pem": certificate.cert_pem,
        "/tls/key.pem": certificate.key_pem,
        "/tls/ca.pem": CLUSTER_CA.cert_pem,
    }
    settings = TlsSettings(
        enabled=True,
        required=True,
        certfile="/tls/cert.pem",
        keyfile="/tls/key.pem",
        cacertfile=None,
        verify=TlsVerify.VERIFY_NONE,
        versions=(TlsVersion.TLSV1_3, TlsVersion.TLSV1_2),
        peer_cacertfile="/tls/ca.pem",
    )
    tls = load_server_tls(settings, NOW, files.__getitem__)
    assert tls is not None
    return tls


def build(
    tmp_path: Path, tls: ServerTls | None, **env: str
) -> tuple[BrokerService, MemoryReactorClock]:
    config, _ = BrokerConfig.from_env(
        {
            "SVC_CONTROL_PLANE": "etcd://127.0.0.1:2379",
            "SVC_NODE_ID": "n1",
            "SVC_CLUSTER_ID": "c1",
            "SVC_CLUSTER_SECRET": SECRET,
            "SVC_PEER_PORT": "4042",
            **env,
        },
        cwd=str(tmp_path),
    )
    if tls is not None:
        config = attrs.evolve(config, tls=attrs.evolve(config.tls, certfile="/tls/cert.pem"))
    data_dir = DataDirectory.open(config.storage.data_dir, OsFileSystem())
    reactor = MemoryReactorClock()
    # Certificates are checked as of the reactor's time.
    reactor.advance(NOW.timestamp())
    return build_service(reactor, config, data_dir, tls), reactor


def peer_port(reactor: MemoryReactorClock) -> Any:
    [factory] = [factory for port, factory, _, _ in reactor.tcpServers if port == 4042]
    return factory


def dial(reactor: MemoryReactorClock, certificate: Issued, node: str = "n2") -> PeerProtocol:
    """Node ``node`` dialing the peer port over mutual TLS with ``certificate``."""
    tls = node_tls(certificate).peer
    assert tls is not None
    dialer = PeerProtocol(
        Handshake(Role.DIALER, PeerIdentity("c1", node, SECRET.encode(), True), expected_peer="n1"),
        reactor,
        PeerSettings(),
    )

    class One:
        def buildProtocol(self, addr: object) -> PeerProtocol:
            return dialer

        def doStart(self) -> None:
            pass

        def doStop(self) -> None:
            pass

    client = TLSMemoryBIOFactory(tls.options, True, One(), reactor)  # type: ignore[arg-type]
    iosim.connectedServerAndClient(
        lambda: peer_port(reactor).buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000)),
        lambda: client.buildProtocol(None),
        clock=reactor,
    )
    return dialer


def node_certificate(node: str, authority: Issued = CLUSTER_CA) -> Issued:
    return issue(authority, ("localhost",), both=True, uris=(f"logbroker://c1/{node}",))


def test_a_cluster_node_with_tls_serves_its_peer_port_with_mutual_tls(tmp_path: Path) -> None:
    _, reactor = build(tmp_path, node_tls(node_certificate("n1")))

    assert dial(reactor, node_certificate("n2")).state is LinkState.ESTABLISHED


def test_its_peer_port_refuses_a_node_certificate_of_another_ca(
    tmp_path: Path, logged_errors: list[dict[str, Any]]
) -> None:
    root, reactor = build(tmp_path, node_tls(node_certificate("n1")))

    dialer = dial(reactor, node_certificate("n2", authority=make_ca("another CA")))

    assert dialer.state is LinkState.CLOSED
    assert (
        root.metrics.registry.get_sample_value(
            "svc_peer_connections_refused_total", {"reason": "tls"}
        )
        == 1
    )
    logged_errors.clear()


def test_a_node_whose_certificate_does_not_name_it_is_refused_at_build(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        build(tmp_path, node_tls(node_certificate("n7")))

    assert raised.value.variable == "SVC_TLS_CERTFILE"
    assert "URI:logbroker://c1/n1" in str(raised.value)
    assert "it names logbroker://c1/n7" in str(raised.value)


def test_without_tls_the_peer_port_is_plaintext(tmp_path: Path) -> None:
    _, reactor = build(tmp_path, None)

    assert not isinstance(peer_port(reactor), TLSMemoryBIOFactory)
    protocol = peer_port(reactor).buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
    assert isinstance(protocol, PeerProtocol)
    assert not protocol.handshake.mutual_tls


def test_etcd_files_that_do_not_hold_what_they_should_are_refused_at_build(
    tmp_path: Path,
) -> None:
    client = issue(CLUSTER_CA, client=True)
    env = {
        "SVC_CONTROL_PLANE": "etcd+https://127.0.0.1:2379",
        "SVC_ETCD_CERTFILE": write(tmp_path / "etcd.pem", client.cert_pem),
        "SVC_ETCD_KEYFILE": write(tmp_path / "etcd-key.pem", issue(None).key_pem),
    }

    with pytest.raises(ConfigError) as raised:
        build(tmp_path, None, **env)

    assert raised.value.variable == "SVC_ETCD_KEYFILE"
    assert "belongs to another certificate" in str(raised.value)
