"""The Twisted client of a cluster: a produce's records go straight to the nodes leading their
ranges, as Kafka's clients send them, so that no node forwards them; everything else goes to one
node of the cluster, the next one when it stops answering::

    cluster = await ClusterClient.connect(
        reactor, [("broker-1", 4040), ("broker-2", 4040)], "app", "app123"
    )
    await cluster.produce("orders", [Record(b"hello", key=b"customer-1")])
    node = await cluster.node()
    batch = await node.fetch("orders", max_records=10)

As ``BlockingClusterClient`` (``logbroker.client.cluster``) does it: which node leads each range
comes from ``topic_leaders``, asked once per topic and again after a node refused a share
``not_primary``, ``unreachable`` or ``no_quorum`` or stopped answering. A produce is cut into one
share per leader with the broker's own routing, every share stamped with the produce's stamp
and all sent together; the shares that fail are cut again with the new leaders and sent again,
with the same stamp, after the produce retry's back-off, so each range stores its records once.
A leader this client cannot reach, or a range no node leads now, takes the node, which forwards
the records. Produces are pipelined up to the producer window (``wire.PRODUCER_WINDOW``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from twisted.internet.defer import Deferred, ensureDeferred, gatherResults
from twisted.internet.error import ConnectError, ConnectingCancelledError, DNSLookupError
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from logbroker import wire
from logbroker.client._errors import BrokerRefused, ConnectionClosed
from logbroker.client._leaders import (
    LeaderMap,
    Routes,
    ShareFailure,
    SharesFailed,
    share_failure,
)
from logbroker.client._protocol import BrokerClient, connect
from logbroker.client._retry import DEFAULT_PRODUCE_RETRY, ProduceRetry, Retries
from logbroker.client._stamped import StampedProducer, TryFailed
from logbroker.records import ProducerStamp, Record, WireRecords

__all__ = ["ClusterClient"]

#: Connects to the node at ``(host, port)`` and logs in; fires with its client.
Connect = Callable[[str, int], Deferred[BrokerClient]]

#: What a connection that could not be made, or was lost, fails with.
_LOST = (ConnectionClosed, ConnectError, ConnectingCancelledError, DNSLookupError, OSError)


class _Link:
    """One connection, being made or made, that any number of callers wait for."""

    def __init__(self, connecting: Deferred[BrokerClient]) -> None:
        self._client: BrokerClient | None = None
        self._failure: Failure | None = None
        self._waiters: list[Deferred[BrokerClient]] = []
        self._closing = False
        connecting.addCallbacks(self._made, self._failed)

    @property
    def lost(self) -> bool:
        """Whether the connection could not be made, or has closed since."""
        return self._failure is not None or (self._client is not None and self._client.closed)

    def client(self) -> Deferred[BrokerClient]:
        waiter: Deferred[BrokerClient] = Deferred()
        if self._client is None and self._failure is None:
            self._waiters.append(waiter)
        else:
            self._fire(waiter)
        return waiter

    @property
    def made(self) -> BrokerClient | None:
        """The connection, once made."""
        return self._client

    def close(self) -> None:
        """Close the connection, now or once it is made."""
        self._closing = True
        if self._client is not None:
            self._client.close()

    def _made(self, client: BrokerClient) -> None:
        self._client = client
        if self._closing:
            client.close()
        self._settle()

    def _failed(self, failure: Failure) -> None:
        self._failure = failure
        self._settle()

    def _settle(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            self._fire(waiter)

    def _fire(self, waiter: Deferred[BrokerClient]) -> None:
        if self._client is not None:
            waiter.callback(self._client)
        else:
            waiter.errback(self._failure)


class ClusterClient:
    """A client of the cluster whose client ports are ``servers``: ``connect`` makes each
    connection (``ClusterClient.connect`` gives it the credentials and TLS), ``clock`` times
    the produce retries' back-off, and ``produce_retry`` says how produces are retried (None:
    never)."""

    def __init__(
        self,
        servers: Sequence[tuple[str, int]],
        connect: Connect,
        *,
        clock: IReactorTime,
        produce_retry: ProduceRetry | None = DEFAULT_PRODUCE_RETRY,
    ) -> None:
        self._routes = Routes(servers)
        self._connect = connect
        self._producer = StampedProducer(clock, produce_retry)
        self._node: _Link | None = None
        #: Connections to leaders, by node id.
        self._leaders: dict[str, _Link] = {}

    @classmethod
    def connect(
        cls,
        reactor: Any,
        servers: Sequence[tuple[str, int]],
        user: str,
        password: str,
        timeout: float = 30.0,
        *,
        tls: bool = False,
        cafile: str | None = None,
        produce_retry: ProduceRetry | None = DEFAULT_PRODUCE_RETRY,
    ) -> Deferred[ClusterClient]:
        """Connect to the first of ``servers`` that answers and log in there; fires with the
        client (each leader is connected to when a produce first needs it, with the same
        credentials and TLS: its certificate must name the host the cluster advertises)."""

        def connect_to(host: str, port: int) -> Deferred[BrokerClient]:
            return connect(
                reactor,
                host,
                port,
                user,
                password,
                timeout,
                tls=tls,
                cafile=cafile,
                produce_retry=None,
            )

        client = cls(servers, connect_to, clock=reactor, produce_retry=produce_retry)
        return client.node().addCallback(lambda _: client)

    @property
    def producer_id(self) -> int:
        """This client's producer id (random), which stamps its produces."""
        return self._producer.producer_id

    def close(self) -> None:
        """Close every connection; requests in flight fail."""
        self._producer.interrupt(ConnectionClosed("the cluster client was closed"))
        for link in [*self._leaders.values(), *([self._node] if self._node else [])]:
            link.close()
        self._leaders.clear()
        self._node = None

    def node(self) -> Deferred[BrokerClient]:
        """The connection for everything but produces: to the first of the servers that
        answers, and to the next one once it has closed (or ``drop_node`` said so)."""
        if self._node is None or self._node.lost:
            self._node = _Link(ensureDeferred(self._first_answering()))
        return self._node.client()

    def drop_node(self) -> None:
        """Close the node connection: the next ``node()`` connects to the next server."""
        if self._node is not None:
            self._node.close()
            self._node = None

    async def _first_answering(self) -> BrokerClient:
        failures = []
        for host, port in self._routes.servers_in_turn():
            try:
                return await self._connect(host, port)
            except _LOST as error:
                failures.append(f"{host}:{port}: {error}")
        raise Routes.none_answered(failures)

    # -- produce -------------------------------------------------------------------------

    def produce(
        self, topic: str, records: Iterable[Record], *, give_up_after: float | None = None
    ) -> Deferred[int]:
        """Fires with the count of ``records`` once every one is durable on its range.

        Sent once the producer window lets it go out; the shares that fail are retried as the
        module says, until ``give_up_after`` seconds (default: ``produce_retry``'s) after the
        first try, and then it fails with the last failure."""
        batch = wire.encode_wire_records(tuple(records))
        turn = self._routes.keyless_turn()
        pending = batch

        async def attempt(stamp: ProducerStamp, _: Retries | None, __: Exception | None) -> int:
            nonlocal pending
            try:
                await self._send_shares(topic, pending, stamp, turn)
            except SharesFailed as failed:
                pending = failed.records
                raise TryFailed(failed.error, failed.retried) from None
            return batch.count

        return self._producer.produce_with(attempt, give_up_after)

    async def _send_shares(
        self, topic: str, records: WireRecords, stamp: ProducerStamp, turn: int
    ) -> None:
        """Send every share of ``records`` at once; raise ``SharesFailed`` with the records of
        those not acknowledged."""
        try:
            leader_map = await self._leader_map(topic)
        except _LOST as error:
            self.drop_node()
            raise SharesFailed([(records, error, True)]) from None
        shares = Routes.shares(leader_map, records, stamp, turn)
        sent = [
            ensureDeferred(self._send_share(topic, leader, leader_map, share, stamp))
            for leader, share in shares
        ]
        outcomes: list[ShareFailure | None] = await gatherResults(sent, consumeErrors=True)
        failures = [outcome for outcome in outcomes if outcome is not None]
        if failures:
            raise SharesFailed(failures)

    async def _send_share(
        self,
        topic: str,
        leader: str | None,
        leader_map: LeaderMap | None,
        share: WireRecords,
        stamp: ProducerStamp,
    ) -> ShareFailure | None:
        """Send one share to ``leader``; None once acknowledged, else how it failed."""
        client = None
        try:
            client = await self._client_of(leader, leader_map)
            await client.request(wire.ProduceIdempotent(topic, stamp, share))
        except BrokerRefused as refused:
            failure = share_failure(share, refused)
            if failure[2]:
                self._routes.forget(topic)
            return failure
        except _LOST as error:
            self._lost(client, leader, topic)
            return share_failure(share, error)
        return None

    async def _leader_map(self, topic: str) -> LeaderMap | None:
        """The topic's leaders, asked of the node if not known; None once a broker said it
        does not know ``topic_leaders``. A refusal (the topic does not exist...) is raised, as
        is a connection's failure."""
        if not self._routes.routes:
            return None
        known = self._routes.known(topic)
        if known is not None:
            return known
        node = await self.node()
        try:
            return self._routes.learned(topic, await node.topic_leaders(topic))
        except BrokerRefused as refused:
            self._routes.refused(refused)
            return None

    async def _client_of(self, leader: str | None, leader_map: LeaderMap | None) -> BrokerClient:
        """The connection to ``leader``, made if needed; the node's for no leader, or for a
        leader this client cannot reach (the node forwards the share)."""
        if leader is None or leader_map is None:
            return await self.node()
        link = self._leaders.get(leader)
        if link is None or link.lost:
            link = self._leaders[leader] = _Link(self._connect(*leader_map.addresses[leader]))
        try:
            return await link.client()
        except _LOST:
            if self._leaders.get(leader) is link:
                del self._leaders[leader]
            return await self.node()

    def _lost(self, client: BrokerClient | None, leader: str | None, topic: str) -> None:
        """``client`` (the one a share to ``leader`` went to; None: no server answered) failed:
        let it go, and ask the topic's leaders again."""
        self._routes.forget(topic)
        link = None if leader is None else self._leaders.get(leader)
        if leader is not None and link is not None and link.made is client is not None:
            del self._leaders[leader]
            link.close()
        elif client is None or (self._node is not None and self._node.made is client):
            self.drop_node()
