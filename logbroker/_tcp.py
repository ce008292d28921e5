"""Socket options every connection of the client protocol uses."""

from __future__ import annotations

from twisted.internet.interfaces import ITCPTransport, ITransport


def no_delay(transport: ITransport | None) -> None:
    """Send small frames at once. The protocol is request/response with pipelining: Nagle's
    algorithm would hold a response's last segment back until the peer acknowledges the
    previous one, which left both ends of a large fetch idle about half the time."""
    if transport is not None and ITCPTransport.providedBy(transport):
        transport.setTcpNoDelay(True)
