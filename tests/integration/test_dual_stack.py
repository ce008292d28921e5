"""The default listening address takes IPv4 and IPv6 clients on one socket, whatever the host's
``net.ipv6.bindv6only`` says."""

from __future__ import annotations

import socket

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.protocol import Factory, Protocol

from logbroker.config import ANY_ADDRESS
from logbroker.service import DualStackPort, listen_tcp

pytestmark = pytest.mark.integration


@pytest_twisted.ensureDeferred
async def test_the_default_address_listens_dual_stack() -> None:
    port = listen_tcp(reactor, 0, Factory.forProtocol(Protocol), ANY_ADDRESS, "SVC_TCP_PORT")
    try:
        assert isinstance(port, DualStackPort)
        listening = port.socket
        assert listening.family == socket.AF_INET6
        assert listening.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
        number = port.getHost().port
        # The kernel completes the TCP handshake into the backlog, before any accept.
        for address in ("127.0.0.1", "::1"):
            with socket.create_connection((address, number), timeout=5) as client:
                assert client.getpeername()[1] == number
    finally:
        await port.stopListening()
