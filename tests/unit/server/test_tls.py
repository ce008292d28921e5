"""TLS and plaintext on one port: the first byte decides, over a StringTransport for plaintext
and with real handshakes in memory (``iosim``) for TLS."""

from __future__ import annotations

import pytest
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IProtocol
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.internet.ssl import Certificate, optionsForClientTLS
from twisted.internet.task import Clock
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.test import iosim

from logbroker import wire
from logbroker._tcp import no_delay
from logbroker.security.tls import ServerTls
from logbroker.server.tls import secure_protocol
from tests.certificates import Issued, issue, make_ca, serving
from tests.unit.test_tcp import TcpTransport

AUTH = wire.encode_request(1, wire.Auth("app", "app123"))


class Recorder(Protocol):
    """An inner protocol that keeps what happens to it."""

    def __init__(self) -> None:
        self.made = 0
        self.received: list[bytes] = []
        self.lost: list[Failure] = []

    def connectionMade(self) -> None:
        self.made += 1

    def dataReceived(self, data: bytes) -> None:
        self.received.append(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost.append(reason)

    @property
    def data(self) -> bytes:
        return b"".join(self.received)


@pytest.fixture(scope="module")
def ca() -> Issued:
    return make_ca()


@pytest.fixture(scope="module")
def server_certificate(ca: Issued) -> Issued:
    return issue(ca)


class Connection:
    """One connection to the client port, its inner protocol behind ``secure_protocol``."""

    def __init__(self, tls: ServerTls) -> None:
        self.inner = Recorder()
        self.transport = TcpTransport()
        self.outer = secure_protocol(self.inner, tls, Clock())
        self.outer.makeConnection(self.transport)

    def send(self, data: bytes, chunk: int) -> None:
        for start in range(0, len(data), chunk):
            self.outer.dataReceived(data[start : start + chunk])

    def lose(self) -> None:
        self.outer.connectionLost(Failure(ConnectionDone()))


def test_with_tls_off_the_protocol_is_served_as_it_is() -> None:
    inner = Recorder()

    assert secure_protocol(inner, None, Clock()) is inner


def test_the_inner_protocol_is_connected_at_once_to_the_real_connection(
    server_certificate: Issued,
) -> None:
    connection = Connection(serving(server_certificate, required=False))
    inner, transport = connection.inner, connection.transport
    assert inner.transport is not None
    producer = Recorder()

    no_delay(inner.transport)
    inner.transport.registerProducer(producer, True)  # type: ignore[attr-defined]
    inner.transport.pauseProducing()  # type: ignore[attr-defined]

    assert inner.made == 1
    assert inner.transport.getPeer() == transport.getPeer()
    assert inner.transport.getHost() == transport.getHost()
    assert transport.no_delay
    assert transport.producer is producer
    assert transport.producerState == "paused"


@pytest.mark.parametrize("chunk", [len(AUTH), 5, 1], ids=["whole", "split", "bytewise"])
def test_plaintext_passes_through_when_tls_is_offered(
    server_certificate: Issued, chunk: int
) -> None:
    connection = Connection(serving(server_certificate, required=False))

    connection.send(AUTH + AUTH, chunk)
    assert connection.inner.transport is not None
    connection.inner.transport.writeSequence([b"an ", b"answer"])
    connection.lose()

    assert connection.inner.data == AUTH + AUTH
    assert connection.transport.value() == b"an answer"
    assert len(connection.inner.lost) == 1


@pytest.mark.parametrize("chunk", [len(AUTH), 1], ids=["whole", "bytewise"])
def test_plaintext_is_answered_tls_required_and_closed_when_tls_is_required(
    server_certificate: Issued, chunk: int
) -> None:
    connection = Connection(serving(server_certificate, required=True))

    connection.send(AUTH, chunk)

    assert wire.FrameDecoder().feed(connection.transport.value()) == [
        wire.encode_error(0, wire.Reason.TLS_REQUIRED)[4:]
    ]
    assert connection.transport.disconnecting
    assert connection.inner.received == []
    connection.lose()
    assert len(connection.inner.lost) == 1


def test_a_connection_lost_before_its_first_byte_tells_the_inner_protocol_once(
    server_certificate: Issued,
) -> None:
    connection = Connection(serving(server_certificate))

    connection.lose()

    assert connection.inner.made == 1
    assert [reason.type for reason in connection.inner.lost] == [ConnectionDone]


def test_what_is_said_before_the_first_byte_goes_out_in_plaintext_at_once(
    server_certificate: Issued,
) -> None:
    # As an auth timeout is: the client has said nothing, in TLS or plaintext.
    connection = Connection(serving(server_certificate))
    assert connection.inner.transport is not None

    connection.inner.transport.write(b"timeout")
    connection.inner.transport.loseConnection()

    assert connection.transport.value() == b"timeout"
    assert connection.transport.disconnecting


def test_closing_mid_handshake_aborts_rather_than_waiting_on_the_client(
    server_certificate: Issued,
) -> None:
    outcomes: list[str] = []
    connection = Connection(serving(server_certificate, on_handshake=outcomes.append))
    connection.send(b"\x16\x03\x01\x00", 4)  # the start of a ClientHello, then silence
    assert connection.inner.transport is not None

    connection.inner.transport.write(b"timeout")  # unreadable before the handshake ends
    connection.inner.transport.loseConnection()

    assert connection.transport.disconnecting
    connection.lose()
    assert len(connection.inner.lost) == 1
    assert outcomes == ["failed"]


# -- real handshakes, in memory ------------------------------------------------------------


class Pair:
    """The client port's side (``secure_protocol`` over a ``Recorder``) and a TLS client's
    (a ``Recorder`` under ``TLSMemoryBIOProtocol``), connected through ``iosim``."""

    def __init__(self, tls: ServerTls, client_trusts: Issued, hostname: str = "localhost") -> None:
        clock = Clock()
        self.server = Recorder()
        self.client = Recorder()
        options = optionsForClientTLS(
            hostname, trustRoot=Certificate.loadPEM(client_trusts.cert_pem)
        )
        client_factory = TLSMemoryBIOFactory(
            options, True, Factory.forProtocol(lambda: self.client), clock
        )

        def client_side() -> IProtocol:
            protocol = client_factory.buildProtocol(None)
            assert protocol is not None
            return protocol

        _, _, self.pump = iosim.connectedServerAndClient(
            lambda: secure_protocol(self.server, tls, clock), client_side, clock=clock
        )


@pytest.mark.parametrize("required", [True, False])
def test_a_tls_client_talks_to_the_inner_protocol_through_the_handshake(
    server_certificate: Issued, ca: Issued, required: bool
) -> None:
    outcomes: list[str] = []
    pair = Pair(serving(server_certificate, required, outcomes.append), ca)
    assert pair.server.transport is not None
    assert pair.client.transport is not None

    pair.client.transport.write(AUTH)
    pair.pump.flush()
    pair.server.transport.write(b"answer")
    pair.pump.flush()

    assert outcomes == ["ok"]
    assert pair.server.data == AUTH
    assert pair.client.data == b"answer"
    assert pair.server.transport.getPeer() == pair.pump.serverIO.getPeer()

    pair.server.transport.loseConnection()
    pair.pump.flush()

    assert len(pair.server.lost) == 1
    assert len(pair.client.lost) == 1
    assert outcomes == ["ok"]


def test_a_failed_handshake_is_counted_and_closes_the_inner_protocol_once(
    server_certificate: Issued,
) -> None:
    outcomes: list[str] = []

    pair = Pair(serving(server_certificate, on_handshake=outcomes.append), make_ca("another"))

    assert outcomes == ["failed"]
    assert pair.server.received == []
    assert len(pair.server.lost) == 1
    assert len(pair.client.lost) == 1


def test_a_client_checking_another_name_refuses_the_certificate(
    server_certificate: Issued, ca: Issued
) -> None:
    outcomes: list[str] = []

    pair = Pair(serving(server_certificate, on_handshake=outcomes.append), ca, "broker.example")

    assert outcomes == ["failed"]
    assert len(pair.server.lost) == 1
    assert "broker.example" in pair.client.lost[0].getErrorMessage()
