"""A cluster node's TLS material beyond the client port's: the peer port's (the node certificate
used both ways, the cluster's CA) and etcd's client side (``SVC_ETCD_*``). Each problem is a
``ConfigError`` naming the variable at fault; what loads is tried in real in-memory handshakes."""

from __future__ import annotations

import pytest
from OpenSSL import SSL, crypto
from twisted.internet.address import IPv4Address
from twisted.internet.interfaces import IHandshakeListener
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.ssl import CertificateOptions
from twisted.internet.task import Clock
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.test import iosim
from zope.interface import implementer

from logbroker.config import ConfigError, EtcdAccess, TlsSettings, TlsVerify, TlsVersion
from logbroker.security.etcd_tls import load_etcd_tls
from logbroker.security.tls import load_server_tls
from tests.certificates import DAY, NOW, Issued, issue, make_ca
from tests.unit.security.test_tls import handshake, reader

CLUSTER_CA = make_ca("cluster CA")
CLIENT_CA = make_ca("client CA")


def node_settings(peer_cacertfile: str | None, cacertfile: str | None = None) -> TlsSettings:
    return TlsSettings(
        enabled=True,
        required=True,
        certfile="/tls/cert.pem",
        keyfile="/tls/key.pem",
        cacertfile=cacertfile,
        verify=TlsVerify.VERIFY_NONE,
        versions=(TlsVersion.TLSV1_3, TlsVersion.TLSV1_2),
        peer_cacertfile=peer_cacertfile,
    )


def node_files(certificate: Issued) -> dict[str, bytes | OSError]:
    return {
        "/tls/cert.pem": certificate.cert_pem,
        "/tls/key.pem": certificate.key_pem,
        "/tls/cluster-ca.pem": CLUSTER_CA.cert_pem,
        "/tls/client-ca.pem": CLIENT_CA.cert_pem,
    }


def node(name: str, authority: Issued = CLUSTER_CA) -> Issued:
    return issue(authority, (f"{name}.example",), both=True, uris=(f"logbroker://c1/{name}",))


def peer_context(certificate: Issued) -> SSL.Context:
    tls = load_server_tls(
        node_settings("/tls/cluster-ca.pem"), NOW, reader(node_files(certificate))
    )
    assert tls is not None
    assert tls.peer is not None
    return tls.peer.options.getContext()


# -- the peer port ---------------------------------------------------------------------------


def test_a_single_node_has_no_peer_tls() -> None:
    tls = load_server_tls(node_settings(None), NOW, reader(node_files(node("a"))))
    assert tls is not None
    assert tls.peer is None


def test_the_peer_tls_holds_the_node_certificate_and_requires_the_peer_s() -> None:
    certificate = node("a")
    tls = load_server_tls(
        node_settings("/tls/cluster-ca.pem"), NOW, reader(node_files(certificate))
    )
    assert tls is not None
    assert tls.peer is not None
    assert tls.peer.certificate == certificate.certificate

    # Both ends of a peer connection use the same options, one as server, one as client.
    assert handshake(peer_context(node("b")), peer_context(node("a"))).startswith("TLSv1")
    with pytest.raises(SSL.Error, match="certificate verify failed"):
        handshake(peer_context(node("b")), peer_context(node("a", authority=CLIENT_CA)))
    anonymous = CertificateOptions().getContext()
    with pytest.raises(SSL.Error):
        handshake(peer_context(node("b")), anonymous)


def test_the_client_port_keeps_its_own_ca_beside_the_cluster_s() -> None:
    tls = load_server_tls(
        node_settings("/tls/cluster-ca.pem", cacertfile="/tls/client-ca.pem"),
        NOW,
        reader(node_files(node("a"))),
    )
    assert tls is not None
    assert tls.peer is not None
    # A node certificate of the client CA is no peer.
    with pytest.raises(SSL.Error, match="certificate verify failed"):
        handshake(tls.peer.options.getContext(), peer_context(node("b", authority=CLIENT_CA)))


@pytest.mark.parametrize(
    ("client", "missing"), [(False, "clientAuth"), (True, "serverAuth")], ids=["server", "client"]
)
def test_a_node_certificate_must_serve_tls_servers_and_clients(client: bool, missing: str) -> None:
    one_way = issue(CLUSTER_CA, ("a.example",), client=client, uris=("logbroker://c1/a",))

    with pytest.raises(ConfigError) as raised:
        load_server_tls(node_settings("/tls/cluster-ca.pem"), NOW, reader(node_files(one_way)))

    assert raised.value.variable == "SVC_TLS_CERTFILE"
    assert f"lacks {missing}" in str(raised.value)


@pytest.mark.parametrize(
    ("peer_ca", "variable"),
    [("/tls/peer-ca.pem", "SVC_PEER_TLS_CACERTFILE"), ("/tls/ca.pem", "SVC_TLS_CACERTFILE")],
)
def test_an_unreadable_peer_ca_names_the_variable_it_came_from(peer_ca: str, variable: str) -> None:
    files = {**node_files(node("a")), peer_ca: b"not PEM\n"}
    cacertfile = "/tls/ca.pem" if variable == "SVC_TLS_CACERTFILE" else None

    with pytest.raises(ConfigError) as raised:
        load_server_tls(node_settings(peer_ca, cacertfile), NOW, reader(files))

    assert raised.value.variable == variable


# -- etcd's client side -------------------------------------------------------------------------


def anonymous_client(authority: Issued, client: bool = True) -> Issued:
    """A client certificate with an empty subject, as etcd's gateway wants with auth on."""
    return issue(authority, ("logbroker",), client=client, anonymous=True)


ETCD_CA = make_ca("etcd CA")


def etcd_files(client: Issued) -> dict[str, bytes | OSError]:
    return {
        "/etcd/ca.pem": ETCD_CA.cert_pem,
        "/etcd/client.pem": client.cert_pem,
        "/etcd/client-key.pem": client.key_pem,
    }


def access(user: str | None = "logbroker", **changes: str | None) -> EtcdAccess:
    fields: dict[str, str | None] = {
        "cacertfile": "/etcd/ca.pem",
        "certfile": "/etcd/client.pem",
        "keyfile": "/etcd/client-key.pem",
        **changes,
    }
    return EtcdAccess(https=True, user=user, password="pw" if user else None, **fields)  # type: ignore[arg-type]


def test_plaintext_etcd_has_no_tls() -> None:
    assert load_etcd_tls(EtcdAccess(), ["e1"], NOW) is None


@implementer(IHandshakeListener)
class Ends(Protocol):
    """One end of a connection: whether its TLS handshake finished, and why it ended."""

    done = False
    lost: Failure | None = None

    def handshakeCompleted(self) -> None:
        self.done = True

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost = reason


def connect_to_etcd(etcd: Issued, creator: object, trusted: Issued = ETCD_CA) -> Ends:
    """An agent's TLS connection (``creator``) to a server playing etcd: its certificate and
    key ``etcd``, client certificates of ``trusted`` required. The server's end."""
    clock = Clock()
    server_end = Ends()
    server = TLSMemoryBIOFactory(
        CertificateOptions(
            privateKey=etcd.key,  # type: ignore[arg-type]
            certificate=etcd.certificate,  # type: ignore[arg-type]
            verify=True,
            caCerts=[crypto.X509.from_cryptography(trusted.certificate)],
            requireCertificate=True,
        ),
        False,
        Factory.forProtocol(lambda: server_end),
        clock,
    )
    client = TLSMemoryBIOFactory(creator, True, Factory.forProtocol(Ends), clock)  # type: ignore[arg-type]
    iosim.connectedServerAndClient(
        lambda: server.buildProtocol(IPv4Address("TCP", "127.0.0.1", 2379)),
        lambda: client.buildProtocol(None),
        clock=clock,
    )
    return server_end


def test_etcd_s_tls_verifies_etcd_and_presents_the_client_certificate() -> None:
    tls = load_etcd_tls(access(), ["localhost"], NOW, reader(etcd_files(anonymous_client(ETCD_CA))))
    assert tls is not None
    etcd = issue(ETCD_CA, ("localhost", "127.0.0.1"), both=True)

    assert connect_to_etcd(etcd, tls.creatorForNetloc(b"localhost", 2379)).done
    assert connect_to_etcd(etcd, tls.creatorForNetloc(b"127.0.0.1", 2379)).done
    # etcd's certificate must name the endpoint's host...
    assert not connect_to_etcd(etcd, tls.creatorForNetloc(b"etcd-2.example", 2379)).done
    # ...and be signed by a CA of SVC_ETCD_CACERTFILE.
    impostor = issue(make_ca("impostor"), ("localhost",), both=True)
    assert not connect_to_etcd(impostor, tls.creatorForNetloc(b"localhost", 2379)).done
    # An etcd that trusts another CA for its clients refuses this node's certificate.
    refusing = connect_to_etcd(etcd, tls.creatorForNetloc(b"localhost", 2379), make_ca("x"))
    assert not refusing.done
    assert refusing.lost is not None


def test_with_a_user_the_client_certificate_must_have_no_common_name() -> None:
    named = issue(ETCD_CA, ("logbroker",), client=True)

    with pytest.raises(ConfigError) as raised:
        load_etcd_tls(access(), ["localhost"], NOW, reader(etcd_files(named)))
    without_user = load_etcd_tls(access(user=None), ["localhost"], NOW, reader(etcd_files(named)))

    assert raised.value.variable == "SVC_ETCD_CERTFILE"
    assert "without a Common Name (this one has CN=logbroker)" in str(raised.value)
    assert without_user is not None


def test_the_etcd_client_certificate_must_serve_tls_clients() -> None:
    server_only = anonymous_client(ETCD_CA, client=False)

    with pytest.raises(ConfigError) as raised:
        load_etcd_tls(access(), ["localhost"], NOW, reader(etcd_files(server_only)))

    assert raised.value.variable == "SVC_ETCD_CERTFILE"
    assert "clientAuth" in str(raised.value)


@pytest.mark.parametrize(
    ("path", "content", "variable"),
    [
        ("/etcd/ca.pem", b"junk", "SVC_ETCD_CACERTFILE"),
        ("/etcd/client.pem", b"junk", "SVC_ETCD_CERTFILE"),
        ("/etcd/client-key.pem", b"junk", "SVC_ETCD_KEYFILE"),
        ("/etcd/client-key.pem", PermissionError(13, "Permission denied"), "SVC_ETCD_KEYFILE"),
    ],
)
def test_each_etcd_file_is_checked_under_its_own_name(
    path: str, content: bytes | OSError, variable: str
) -> None:
    files = {**etcd_files(anonymous_client(ETCD_CA)), path: content}

    with pytest.raises(ConfigError) as raised:
        load_etcd_tls(access(), ["localhost"], NOW, reader(files))

    assert raised.value.variable == variable


def test_an_expired_etcd_client_certificate_is_refused() -> None:
    expired = issue(ETCD_CA, client=True, not_before=NOW - 10 * DAY, not_after=NOW - DAY)

    with pytest.raises(ConfigError) as raised:
        load_etcd_tls(access(user=None), ["localhost"], NOW, reader(etcd_files(expired)))

    assert raised.value.variable == "SVC_ETCD_CERTFILE"
    assert "expired" in str(raised.value)
