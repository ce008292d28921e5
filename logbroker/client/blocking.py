"""A small blocking client for scripts and tools, on the same codec as the broker.

One request at a time over one socket (TLS with ``tls=True``)::

    from logbroker.client.blocking import BlockingClient
    from logbroker.records import Record

    with BlockingClient.connect("localhost", 4040, "app", "app123") as client:
        client.create_topic("orders")
        client.produce("orders", [Record(b"hello", key=b"customer-1")])
        batch = client.fetch("orders", max_records=10)
        for record in batch.records:
            print(record.key, record.value)
        client.commit("orders", "billing", batch.next_cursor)

Every error frame raises ``BrokerRefused`` carrying the server's reason. ``produce`` goes as
``produce_idempotent`` stamped with the client's producer id and the produce's own sequence, and
one refused ``not_primary``, ``unreachable`` or ``no_quorum`` is sent again with the same stamp
after a back-off (``produce_retry``), so it is never stored twice.
"""

from __future__ import annotations

import itertools
import socket
import ssl
import time
from collections.abc import Iterable, Sequence

from logbroker import wire
from logbroker.client._closing import ClosedOnExit
from logbroker.client._errors import BrokerRefused, ConnectionClosed
from logbroker.client._retry import (
    DEFAULT_PRODUCE_RETRY,
    RETRIED_REASONS,
    ProduceRetry,
    Retries,
    new_producer_id,
)
from logbroker.errors import Reason
from logbroker.records import ProducerStamp, Record

__all__ = ["BlockingClient", "BrokerRefused", "ConnectionClosed", "ProduceRetry"]


class BlockingClient(ClosedOnExit):
    """A client over ``sock`` (``connect`` makes one); ``produce_retry`` says how its produces
    are retried (None: never)."""

    def __init__(
        self, sock: socket.socket, produce_retry: ProduceRetry | None = DEFAULT_PRODUCE_RETRY
    ) -> None:
        self._socket = sock
        self._decoder = wire.FrameDecoder(2**31)
        self._frames: list[bytes] = []
        self._ids = itertools.count(1)
        self._produce_retry = produce_retry
        #: This client's producer id (random), which stamps its produces.
        self.producer_id = new_producer_id()
        self._sequences = itertools.count()
        #: Set once the broker answered ``produce_idempotent`` ``unknown_api_key``: produces go
        #: as plain ``produce`` from then on, and are not retried.
        self.sends_plain_produce = False

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        user: str,
        password: str,
        timeout: float | None = 60.0,
        *,
        tls: bool = False,
        cafile: str | None = None,
        produce_retry: ProduceRetry | None = DEFAULT_PRODUCE_RETRY,
    ) -> BlockingClient:
        """Connect and authenticate (raises ``BrokerRefused`` on bad credentials). With
        ``tls``, over TLS 1.2 or later to a broker whose certificate names ``host`` and is
        signed by a CA of ``cafile`` (PEM; default: the system's trusted CAs); a failed
        handshake raises ``ssl.SSLError``. ``produce_retry`` says how produces are retried
        (None: never)."""
        if cafile is not None and not tls:
            # Silently plaintext would be the worst reading of a CA file given without TLS.
            raise ValueError("cafile is only used with tls=True")
        # Before connecting: an unreadable CA file is not the broker's fault.
        context = ssl.create_default_context(cafile=cafile) if tls else None
        sock = socket.create_connection((host, port), timeout=timeout)
        # Requests go out at once rather than waiting on the previous one's acknowledgement.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if context is not None:
            try:
                sock = context.wrap_socket(sock, server_hostname=host)
            except BaseException:
                sock.close()
                raise
        client = cls(sock, produce_retry)
        try:
            client.auth(user, password)
        except BaseException:
            client.close()
            raise
        return client

    def close(self) -> None:
        self._socket.close()

    # -- plumbing ------------------------------------------------------------------------

    def send(self, request: wire.Request) -> int:
        """Send ``request`` without waiting; return its correlation id."""
        correlation_id = next(self._ids)
        self._socket.sendall(wire.encode_request(correlation_id, request))
        return correlation_id

    def receive(self) -> wire.Response:
        """The next response frame, whatever its correlation id."""
        while not self._frames:
            data = self._socket.recv(1 << 16)
            if not data:
                raise ConnectionClosed("the broker closed the connection")
            self._frames.extend(self._decoder.feed(data))
        return wire.decode_response(self._frames.pop(0))

    def call(self, request: wire.Request) -> bytes:
        """Send ``request`` and return its ok payload (raise ``BrokerRefused`` on an error).

        An error frame with correlation id 0 is about the whole connection (``timeout``,
        ``frame_too_large``, a connection limit; the broker closes the connection after it),
        so it fails the request too.
        """
        return self.answer(self.send(request))

    def answer(self, correlation_id: int) -> bytes:
        """The ok payload of the request ``send`` sent as ``correlation_id`` (raise
        ``BrokerRefused`` on an error, as ``call``). Answers read on the way to it are
        dropped: of requests sent together, read the answers in the order they were sent."""
        while True:
            response = self.receive()
            if response.correlation_id == correlation_id:
                break
            if response.correlation_id == 0 and response.reason is not None:
                raise BrokerRefused(response.reason, 0)
        if response.reason is not None:
            raise BrokerRefused(response.reason, correlation_id)
        return response.payload

    # -- operations ----------------------------------------------------------------------

    def auth(self, user: str | None, password: str) -> str:
        """Log in and return the session token; with ``user`` None, ``password`` is the token
        of a session this client's IP opened, which is resumed."""
        token = wire.decode_token(self.call(wire.Auth(user, password)))
        return token or ""

    def create_topic(self, topic: str, keyspace_bits: int = 0) -> None:
        wire.decode_empty(self.call(wire.CreateTopic(topic, keyspace_bits)))

    def list_topics(self) -> list[wire.TopicInfo]:
        """Every topic (extension ``list_topics``, key 64)."""
        return wire.decode_topics(self.call(wire.ListTopics()))

    def topic_leaders(self, topic: str) -> wire.LeadersInfo:
        """Which node leads each range of ``topic`` and where to reach it (extension
        ``topic_leaders``, key 69; needs ``produce`` on the topic)."""
        return wire.decode_leaders(self.call(wire.TopicLeaders(topic)))

    def describe_cluster(self) -> wire.ClusterInfo:
        """The cluster as the broker sees it (extension ``describe_cluster``, key 66; admin
        only)."""
        return wire.decode_cluster(self.call(wire.DescribeCluster()))

    def verify_cluster(self, timeout: float | None = None) -> wire.VerifyInfo:
        """Whether every sealed segment's copies are complete and identical on every node
        (extension ``verify_cluster``, key 68; admin only). The broker reads every sealed byte
        of the cluster to answer: ``timeout`` (seconds; None: none) replaces the connection's
        timeout while it does."""
        previous = self._socket.gettimeout()
        self._socket.settimeout(timeout)
        try:
            return wire.decode_verify(self.call(wire.VerifyCluster()))
        finally:
            self._socket.settimeout(previous)

    def produce(
        self, topic: str, records: Iterable[Record], *, give_up_after: float | None = None
    ) -> int:
        """Append ``records``; return their count once every one is durable.

        Sent as ``produce_idempotent`` with this client's next sequence; refused
        ``not_primary``, ``unreachable`` or ``no_quorum``, it is sent again with the same stamp
        after a back-off, until ``give_up_after`` seconds (default: ``produce_retry``'s) after
        the first try, then raises the last refusal. A broker without ``produce_idempotent``
        gets a plain ``produce``, not retried."""
        batch = tuple(records)
        if self.sends_plain_produce:
            return wire.decode_count(self.call(wire.Produce(topic, batch)))
        stamp = ProducerStamp(self.producer_id, next(self._sequences))
        policy = self._produce_retry
        retries = None if policy is None else Retries(policy, time.monotonic(), give_up_after)
        while True:
            try:
                return wire.decode_count(self.call(wire.ProduceIdempotent(topic, stamp, batch)))
            except BrokerRefused as refused:
                if refused.reason == Reason.UNKNOWN_API_KEY and refused.correlation_id:
                    self.sends_plain_produce = True
                    return wire.decode_count(self.call(wire.Produce(topic, batch)))
                if retries is None or refused.reason not in RETRIED_REASONS:
                    raise
                delay = retries.next_delay(time.monotonic())
                if delay is None:
                    raise
            time.sleep(delay)

    def fetch(
        self,
        topic: str,
        cursor: str | None = None,
        group: str | None = None,
        member: str | None = None,
        max_records: int = 0,
        wait_ms: int = 0,
    ) -> wire.RecordsPayload:
        request = wire.Fetch(topic, cursor, group, member, max_records, wait_ms)
        return wire.decode_records(self.call(request))

    def commit(self, topic: str, group: str, cursor: str) -> None:
        wire.decode_empty(self.call(wire.Commit(topic, group, cursor)))

    def leave_group(self, topic: str, group: str, member: str) -> None:
        wire.decode_empty(self.call(wire.LeaveGroup(topic, group, member)))

    def create_user(self, user: str, password: str, permissions: Sequence[str]) -> None:
        wire.decode_empty(self.call(wire.CreateUser(user, password, tuple(permissions))))

    def delete_user(self, user: str) -> None:
        wire.decode_empty(self.call(wire.DeleteUser(user)))

    def change_password(self, user: str, password: str) -> None:
        wire.decode_empty(self.call(wire.ChangePassword(user, password)))

    def list_users(self) -> list[tuple[str | None, tuple[str | None, ...]]]:
        return wire.decode_users(self.call(wire.ListUsers()))

    def grant_acl(self, user: str, operation: str, pattern: str) -> None:
        wire.decode_empty(self.call(wire.GrantAcl(user, operation, pattern)))

    def revoke_acl(self, user: str, operation: str, pattern: str) -> None:
        wire.decode_empty(self.call(wire.RevokeAcl(user, operation, pattern)))

    def list_acls(self, user: str) -> list[tuple[str | None, str | None]]:
        return wire.decode_acls(self.call(wire.ListAcls(user)))
