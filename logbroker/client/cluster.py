"""A blocking client of a cluster: a produce's records go straight to the nodes leading their
ranges, as Kafka's clients send them, so that no node forwards them; everything else goes to
one node of the cluster, the next one when it stops answering::

    from logbroker.client.cluster import BlockingClusterClient
    from logbroker.records import Record

    servers = [("broker-1", 4040), ("broker-2", 4040), ("broker-3", 4040)]
    with BlockingClusterClient.connect(servers, "app", "app123") as cluster:
        cluster.produce("orders", [Record(b"hello", key=b"customer-1")])
        batch = cluster.node.fetch("orders", max_records=10)

Which node leads each range comes from ``topic_leaders`` (docs/protocol.md), asked once per
topic and again after a node refused a share ``not_primary``, ``unreachable`` or ``no_quorum``
or stopped answering. A produce is cut into one share per leader with the broker's own routing
(``logbroker.key_routing``), every share stamped with the produce's stamp and sent before any
answer is read; a share that fails is cut again with the new leaders and sent again, with the
same stamp, after the produce retry's back-off: each range stores its records once. A leader
this client cannot reach, or a range no node leads now, takes the node for everything else,
which forwards the records. A broker without ``topic_leaders`` (older than this client) takes
every produce whole.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence

from logbroker import wire
from logbroker.client._closing import ClosedOnExit
from logbroker.client._errors import BrokerRefused, ConnectionClosed
from logbroker.client._leaders import (
    LeaderMap,
    Routes,
    ShareFailure,
    SharesFailed,
    share_failure,
)
from logbroker.client._retry import (
    DEFAULT_PRODUCE_RETRY,
    ProduceRetry,
    Retries,
    new_producer_id,
)
from logbroker.client.blocking import BlockingClient
from logbroker.records import ProducerStamp, Record, WireRecords

__all__ = ["BlockingClusterClient"]

#: Makes an authenticated client of the node at ``(host, port)``.
Connect = Callable[[str, int], BlockingClient]


class BlockingClusterClient(ClosedOnExit):
    """A client of the cluster whose client ports are ``servers``; ``connect`` makes each
    connection (``BlockingClusterClient.connect`` gives it the credentials and TLS), and
    ``produce_retry`` says how produces are retried (None: never)."""

    def __init__(
        self,
        servers: Sequence[tuple[str, int]],
        connect: Connect,
        produce_retry: ProduceRetry | None = DEFAULT_PRODUCE_RETRY,
    ) -> None:
        self._routes = Routes(servers)
        self._connect = connect
        self._produce_retry = produce_retry
        self._node: BlockingClient | None = None
        #: Connections to leaders, by node id.
        self._leaders: dict[str, BlockingClient] = {}
        #: This client's producer id (random), which stamps its produces.
        self.producer_id = new_producer_id()
        self._sequences = itertools.count()

    @classmethod
    def connect(
        cls,
        servers: Sequence[tuple[str, int]],
        user: str,
        password: str,
        timeout: float | None = 60.0,
        *,
        tls: bool = False,
        cafile: str | None = None,
        produce_retry: ProduceRetry | None = DEFAULT_PRODUCE_RETRY,
    ) -> BlockingClusterClient:
        """Connect to the first of ``servers`` that answers and log in there (each leader is
        connected to when a produce first needs it, with the same credentials and TLS: its
        certificate must name the host the cluster advertises for it)."""

        def connect(host: str, port: int) -> BlockingClient:
            return BlockingClient.connect(
                host, port, user, password, timeout, tls=tls, cafile=cafile, produce_retry=None
            )

        client = cls(servers, connect, produce_retry)
        client.node  # noqa: B018 - connects now, so that a cluster no server of answers fails here
        return client

    def close(self) -> None:
        for client in [*self._leaders.values(), *([self._node] if self._node else [])]:
            client.close()
        self._leaders.clear()
        self._node = None

    @property
    def node(self) -> BlockingClient:
        """The connection for everything but produces: to the first of the servers that
        answers, and to the next one once ``drop_node`` says it stopped answering."""
        if self._node is None:
            self._node = self._first_answering()
        return self._node

    def drop_node(self) -> None:
        """Close the node connection: the next use of ``node`` connects to the next server."""
        if self._node is not None:
            self._node.close()
            self._node = None

    def _first_answering(self) -> BlockingClient:
        failures = []
        for host, port in self._routes.servers_in_turn():
            try:
                return self._connect(host, port)
            except (OSError, ConnectionClosed) as error:
                failures.append(f"{host}:{port}: {error}")
        raise Routes.none_answered(failures)

    # -- produce -------------------------------------------------------------------------

    def produce(
        self, topic: str, records: Iterable[Record], *, give_up_after: float | None = None
    ) -> int:
        """Append ``records``; return their count once every one is durable on its range.

        Each share is retried as the module says, until ``give_up_after`` seconds (default:
        ``produce_retry``'s) after the first try, then the last failure is raised."""
        batch = wire.encode_wire_records(tuple(records))
        stamp = ProducerStamp(self.producer_id, next(self._sequences))
        turn = self._routes.keyless_turn()
        policy = self._produce_retry
        retries = None if policy is None else Retries(policy, time.monotonic(), give_up_after)
        pending = batch
        while True:
            try:
                self._send_shares(topic, pending, stamp, turn)
                return batch.count
            except SharesFailed as failed:
                pending = failed.records
                if retries is None or not failed.retried:
                    raise failed.error from None
                delay = retries.next_delay(time.monotonic())
                if delay is None:
                    raise failed.error from None
            time.sleep(delay)

    def _send_shares(
        self, topic: str, records: WireRecords, stamp: ProducerStamp, turn: int
    ) -> None:
        """Send every share of ``records`` before reading any answer; raise ``SharesFailed``
        with the records of those not acknowledged."""
        try:
            leader_map = self._leader_map(topic)
        except (OSError, ConnectionClosed) as error:
            self.drop_node()
            raise SharesFailed([(records, error, True)]) from None
        shares = Routes.shares(leader_map, records, stamp, turn)
        sent: list[tuple[str | None, BlockingClient, int, WireRecords]] = []
        failures: list[ShareFailure] = []
        for leader, share in shares:
            client = None
            try:
                client = self._client_of(leader, leader_map)
                request = wire.ProduceIdempotent(topic, stamp, share)
                sent.append((leader, client, client.send(request), share))
            except (OSError, ConnectionClosed) as error:
                self._lost(client, leader, topic)
                failures.append(share_failure(share, error))
        for leader, client, correlation_id, share in sent:
            try:
                wire.decode_count(client.answer(correlation_id))
            except BrokerRefused as refused:
                failures.append(share_failure(share, refused))
                if failures[-1][2]:
                    self._routes.forget(topic)
            except (OSError, ConnectionClosed) as error:
                self._lost(client, leader, topic)
                failures.append(share_failure(share, error))
        if failures:
            raise SharesFailed(failures)

    def _leader_map(self, topic: str) -> LeaderMap | None:
        """The topic's leaders, asked of the node if not known; None once a broker said it
        does not know ``topic_leaders``. A refusal (the topic does not exist...) is raised, as
        is a connection's failure."""
        if not self._routes.routes:
            return None
        known = self._routes.known(topic)
        if known is not None:
            return known
        try:
            return self._routes.learned(topic, self.node.topic_leaders(topic))
        except BrokerRefused as refused:
            self._routes.refused(refused)
            return None

    def _client_of(self, leader: str | None, leader_map: LeaderMap | None) -> BlockingClient:
        """The connection to ``leader``, made if needed; the node's for no leader, or for a
        leader this client cannot reach (the node forwards the share)."""
        if leader is None or leader_map is None:
            return self.node
        client = self._leaders.get(leader)
        if client is None:
            host, port = leader_map.addresses[leader]
            try:
                client = self._leaders[leader] = self._connect(host, port)
            except (OSError, ConnectionClosed):
                return self.node
        return client

    def _lost(self, client: BlockingClient | None, leader: str | None, topic: str) -> None:
        """``client`` (the one a share to ``leader`` went to; None: no server answered) failed:
        close it, and ask the topic's leaders again."""
        self._routes.forget(topic)
        if client is None or client is self._node:
            self.drop_node()
        elif leader is not None and self._leaders.get(leader) is client:
            del self._leaders[leader]
            client.close()
