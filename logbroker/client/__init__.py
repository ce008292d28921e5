"""Clients of the broker, on the same codec as the broker (docs/clients.md).

- ``BrokerClient`` (``connect``, ``connect_endpoint``): a Twisted protocol; every operation
  returns a Deferred, requests are pipelined, ``subscribe`` acknowledges pushes itself.
- ``ClusterClient``: given every node of a cluster, sends each produce's shares straight to
  their ranges' leaders (``logbroker.client._cluster``).
- ``ReconnectingClient``: a ``ClientService`` that keeps one logged-in ``BrokerClient``
  connected, with backoff, and produces through whichever connection is up.
- ``logbroker.client.blocking.BlockingClient``: one socket, one request at a time, for scripts.

Each produces idempotently: every produce is stamped with the client's random producer id and a
sequence of its own, and one refused ``not_primary``, ``unreachable`` or ``no_quorum`` is sent
again with the same stamp as ``ProduceRetry`` says, so a retry never stores records twice.

Each connects over TLS on request (``tls=True``, or ``tls_hostname`` where an endpoint is given),
checking the broker's certificate against ``cafile`` or the system's CAs and its name against the
host; ``client_tls_options`` is the Twisted clients' TLS, for endpoints of your own.

Both kinds raise (or fail with) ``BrokerRefused`` carrying the broker's reason, and
``ConnectionClosed`` when the connection goes.
"""

from logbroker.client._cluster import ClusterClient
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
from logbroker.client._retry import ProduceRetry
from logbroker.client._tls import client_tls_options

__all__ = [
    "MAX_RESPONSE_SIZE",
    "BrokerClient",
    "BrokerRefused",
    "ClusterClient",
    "ConnectionClosed",
    "OnRecords",
    "ProduceRetry",
    "ReconnectingClient",
    "Subscription",
    "client_tls_options",
    "connect",
    "connect_endpoint",
]
