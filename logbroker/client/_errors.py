"""The errors both clients raise (blocking) or fail their Deferreds with (Twisted)."""

from __future__ import annotations


class BrokerRefused(Exception):
    """The broker answered with an error frame; ``reason`` is its reason string
    (docs/protocol.md). ``correlation_id`` 0 means the refusal was about the whole connection
    (``timeout``, ``frame_too_large``, a connection limit) and the broker closes it."""

    def __init__(self, reason: str, correlation_id: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.correlation_id = correlation_id


class ConnectionClosed(ConnectionError):
    """The connection to the broker closed before the answer came."""
