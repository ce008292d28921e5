"""Client-protocol connections send small frames at once (TCP_NODELAY)."""

from __future__ import annotations

from twisted.internet.interfaces import ITCPTransport
from twisted.internet.testing import StringTransport
from zope.interface import implementer

from logbroker._tcp import no_delay


@implementer(ITCPTransport)
class TcpTransport(StringTransport):
    def __init__(self) -> None:
        super().__init__()
        self.no_delay = False

    def setTcpNoDelay(self, enabled: bool) -> None:
        self.no_delay = enabled


@implementer(ITCPTransport)
class AbortableTransport(TcpTransport):
    """A TCP connection as far as an abort goes."""

    aborted = False

    def abortConnection(self) -> None:
        self.aborted = True


def test_a_tcp_transport_gets_no_delay() -> None:
    transport = TcpTransport()

    no_delay(transport)

    assert transport.no_delay
