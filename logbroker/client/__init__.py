"""Clients of the broker, on the same codec as the broker (docs/clients.md).

- ``BrokerClient`` (``connect``, ``connect_endpoint``): a Twisted protocol; every operation
  returns a Deferred, requests are pipelined, ``subscribe`` acknowledges pushes itself.
- ``ReconnectingClient``: a ``ClientService`` that keeps one logged-in ``BrokerClient``
  connected, with backoff.
- ``logbroker.client.blocking.BlockingClient``: one socket, one request at a time, for scripts.

Both kinds raise (or fail with) ``BrokerRefused`` carrying the broker's reason, and
``ConnectionClosed`` when the connection goes.
"""

from logbroker.client._errors import BrokerRefused, ConnectionClosed
from logbroker.client._protocol import (
    MAX_RESPONSE_SIZE,
    BrokerClient,
    OnRecords,
    Subscription,
    connect,
    connect_endpoint,
)
from logbroker.client._reconnecting import ReconnectingClient

__all__ = [
    "MAX_RESPONSE_SIZE",
    "BrokerClient",
    "BrokerRefused",
    "ConnectionClosed",
    "OnRecords",
    "ReconnectingClient",
    "Subscription",
    "connect",
    "connect_endpoint",
]
