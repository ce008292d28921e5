"""The Twisted client: one connection to a broker, requests pipelined by correlation id.

Connection lifecycle (``_State``)::

    CONNECTING --connectionMade--> OPEN --connectionLost, an error frame with correlation
                                         id 0, or a response that breaks the protocol--> CLOSED

In ``OPEN`` every method sends its request at once and returns a Deferred that fires with the
decoded answer when the frame with its correlation id arrives, in whatever order the answers
come; an error frame fails it with ``BrokerRefused``. On ``CLOSED`` every request still waiting
fails (``ConnectionClosed``, or ``BrokerRefused`` with correlation id 0 when the broker said
why), every subscription ends the same way, and new requests fail at once.

``produce`` is the one request retried: it goes as ``produce_idempotent`` with the client's
producer stamp, and one refused ``not_primary``, ``unreachable`` or ``no_quorum`` is sent again
with the same stamp after a back-off on the client's clock (``StampedProducer``), so a retry
never stores its records twice. ``ReconnectingClient`` reconnects, and its own ``produce`` also
retries through the next connection one whose connection was lost; anything else that was in
flight is for the caller to redo.

A client given credentials logs in on ``connectionMade`` and holds every other request until
the login's answer (the broker closes a connection whose first frames are not a login): they go
out once it succeeds and fail with its error if it does not.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from enum import Enum, auto
from typing import Any, TypeVar, cast

from twisted.internet.defer import Deferred, fail, maybeDeferred, succeed
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import (
    IAddress,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker import wire
from logbroker._tcp import no_delay
from logbroker.client._errors import BrokerRefused, ConnectionClosed
from logbroker.client._retry import DEFAULT_PRODUCE_RETRY, ProduceRetry
from logbroker.client._stamped import StampedProducer
from logbroker.client._tls import secured
from logbroker.errors import Reason
from logbroker.records import ProducerStamp, Record

log = Logger()

_T = TypeVar("_T")

#: The largest response frame accepted: a fetch answer holds about 4 MiB and at least one
#: record, which itself came in a request of at most ``SVC_MAX_FRAME_SIZE`` (16 MiB).
MAX_RESPONSE_SIZE = 64 * 1024 * 1024
_MAX_CORRELATION_ID = 0xFFFFFFFF
#: stream_ack has no answer unless it fails: this many recent ones are remembered, so that a
#: failure can be told to its subscription.
_REMEMBERED_ACKS = 1024

#: Called with each push's records and the cursor after them; may return a Deferred.
OnRecords = Callable[[tuple[Record, ...], str | None], object]


class _State(Enum):
    CONNECTING = auto()
    OPEN = auto()
    CLOSED = auto()


class BrokerClient(Protocol):
    """One connection to a broker (``connect`` makes one and logs in).

    With ``credentials``, the client logs in as soon as it is connected, holds every other
    request until the login succeeds, and closes the connection if the broker refuses it;
    ``ready()`` says how that went.

    ``produce`` is retried as ``produce_retry`` says (None: never), waiting on ``clock``.
    """

    def __init__(
        self,
        credentials: tuple[str, str] | None = None,
        max_frame_size: int = MAX_RESPONSE_SIZE,
        *,
        clock: IReactorTime,
        produce_retry: ProduceRetry | None = DEFAULT_PRODUCE_RETRY,
    ) -> None:
        self._credentials = credentials
        self._producer = StampedProducer(clock, produce_retry)
        #: Set once the broker answered ``produce_idempotent`` ``unknown_api_key``: produces go
        #: as plain ``produce`` from then on, and are not retried.
        self.sends_plain_produce = False
        self._decoder = wire.FrameDecoder(max_frame_size)
        self._state = _State.CONNECTING
        self._last_id = 0
        self._pending: dict[int, Deferred[bytes]] = {}
        #: Requests cancelled by the caller: their answers are dropped when they come.
        self._cancelled: set[int] = set()
        self._subscriptions: dict[int, Subscription] = {}
        self._acks: OrderedDict[int, Subscription] = OrderedDict()
        self._ended: Exception | None = None
        self._login: Failure | str | None = None
        self._ready_waiters: list[Deferred[BrokerClient]] = []
        self._lost_waiters: list[Deferred[None]] = []

    # -- connection ----------------------------------------------------------------------

    def connectionMade(self) -> None:
        no_delay(self.transport)
        self._state = _State.OPEN
        if self._credentials is not None:
            self.auth(*self._credentials).addCallbacks(self._logged_in, self._login_failed)

    def _logged_in(self, token: str) -> None:
        self._settle_login(token)

    def _login_failed(self, failure: Failure) -> None:
        self._settle_login(failure)
        self.close()

    def _settle_login(self, outcome: Failure | str) -> None:
        self._login = outcome
        waiters, self._ready_waiters = self._ready_waiters, []
        for waiter in waiters:
            self._fire_ready(waiter)

    def _fire_ready(self, waiter: Deferred[BrokerClient]) -> None:
        if isinstance(self._login, Failure):
            waiter.errback(self._login)
        else:
            waiter.callback(self)

    def ready(self) -> Deferred[BrokerClient]:
        """Fires with this client once its login (``credentials``) succeeded; fails with the
        login's error (``BrokerRefused``: ``invalid_credentials``; ``ConnectionClosed``)."""
        waiter: Deferred[BrokerClient] = Deferred()
        if self._login is None and self._credentials is None:
            waiter.callback(self)
        elif self._login is None:
            self._ready_waiters.append(waiter)
        else:
            self._fire_ready(waiter)
        return waiter

    def close(self) -> Deferred[None]:
        """Close the connection; fires once it is closed. Requests in flight fail."""
        if self.transport is None:
            return succeed(None)
        lost: Deferred[None] = Deferred()
        self._lost_waiters.append(lost)
        self.transport.loseConnection()
        return lost

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._end(
            ConnectionClosed(f"the connection to the broker closed: {reason.getErrorMessage()}")
        )
        self.transport = None
        waiters, self._lost_waiters = self._lost_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def _end(self, error: Exception) -> None:
        """Go to ``CLOSED``: fail what waits with ``error`` (the first reason given wins)."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        self._ended = error
        self._producer.interrupt(error)
        pending, self._pending = self._pending, {}
        subscriptions, self._subscriptions = self._subscriptions, {}
        self._cancelled.clear()
        self._acks.clear()
        for waiting in pending.values():
            waiting.errback(error)
        for subscription in subscriptions.values():
            subscription._end(error)

    def _abort(self, error: Exception) -> None:
        self._end(error)
        if self.transport is not None:
            self.transport.loseConnection()

    # -- frames --------------------------------------------------------------------------

    def _open(self) -> bool:
        return self._state is _State.OPEN

    @property
    def closed(self) -> bool:
        """Whether the connection has closed (every request fails from now on)."""
        return self._state is _State.CLOSED

    def dataReceived(self, data: bytes) -> None:
        if not self._open():
            return
        try:
            bodies = self._decoder.feed(data)
        except wire.FrameTooLargeError as error:
            for body in error.complete_frames:
                self._handle(body)
            self._abort(wire.ProtocolViolation(f"a response frame is too large: {error.detail}"))
            return
        for body in bodies:
            if not self._open():
                return
            self._handle(body)

    def _handle(self, body: bytes) -> None:
        try:
            response = wire.decode_response(body)
        except wire.ProtocolViolation as error:
            self._abort(error)
            return
        correlation_id, reason = response.correlation_id, response.reason
        waiting = self._pending.pop(correlation_id, None)
        if waiting is not None:
            if reason is None:
                waiting.callback(response.payload)
            else:
                waiting.errback(BrokerRefused(reason, correlation_id))
        elif correlation_id in self._subscriptions:
            self._pushed(correlation_id, response)
        elif correlation_id in self._cancelled:
            self._cancelled.discard(correlation_id)
        elif correlation_id in self._acks:
            subscription = self._acks.pop(correlation_id)
            subscription._ack_refused(reason or "")
        elif correlation_id == 0 and reason is not None:
            # About the whole connection; the broker closes it after this frame.
            self._abort(BrokerRefused(reason, 0))
        else:
            log.warn(
                "Dropped an answer to no request in flight (correlation id {correlation_id}, "
                "reason {reason})",
                correlation_id=correlation_id,
                reason=reason,
            )

    def _pushed(self, correlation_id: int, response: wire.Response) -> None:
        if response.reason is not None:
            subscription = self._subscriptions.pop(correlation_id)
            subscription._end(BrokerRefused(response.reason, correlation_id))
            return
        try:
            batch = wire.decode_records(response.payload)
        except wire.ProtocolViolation as error:
            self._abort(error)
            return
        self._subscriptions[correlation_id]._push(batch)

    # -- requests ------------------------------------------------------------------------

    def _next_id(self) -> int:
        while True:
            self._last_id = self._last_id % _MAX_CORRELATION_ID + 1
            taken = self._pending, self._subscriptions, self._cancelled
            if not any(self._last_id in ids for ids in taken):
                return self._last_id

    def _send(self, correlation_id: int, request: wire.Request) -> None:
        assert self.transport is not None
        self.transport.write(wire.encode_request(correlation_id, request))

    def _closed_error(self) -> Exception:
        if self._ended is not None:
            return self._ended
        return ConnectionClosed("the client is not connected")

    def _held_for_login(self, request: wire.Request) -> bool:
        """Whether ``request`` must wait for the login to succeed: the broker refuses anything
        but ``auth`` until it has answered the login, and closes the connection."""
        return (
            self._credentials is not None
            and self._login is None
            and self._state is not _State.CLOSED
            and not isinstance(request, wire.Auth)
        )

    def request(self, request: wire.Request) -> Deferred[bytes]:
        """Send ``request``; fires with its ok payload, fails with ``BrokerRefused``.
        Cancelling the Deferred drops the answer when it comes. With ``credentials``, a
        request made before the login succeeded is sent once it has (or fails with it)."""
        if self._held_for_login(request):
            return self.ready().addCallback(lambda _: self.request(request))
        if self._state is not _State.OPEN:
            return fail(self._closed_error())
        correlation_id = self._next_id()

        def cancel(_: Deferred[bytes]) -> None:
            if self._pending.pop(correlation_id, None) is not None:
                self._cancelled.add(correlation_id)

        waiting: Deferred[bytes] = Deferred(cancel)
        self._pending[correlation_id] = waiting
        self._send(correlation_id, request)
        return waiting

    def _call(self, request: wire.Request, decode: Callable[[bytes], _T]) -> Deferred[_T]:
        return self.request(request).addCallback(decode)

    # -- operations ----------------------------------------------------------------------

    def auth(self, user: str, password: str) -> Deferred[str]:
        return self._call(wire.Auth(user, password), lambda p: wire.decode_token(p) or "")

    def create_topic(self, topic: str, keyspace_bits: int = 0) -> Deferred[None]:
        return self._call(wire.CreateTopic(topic, keyspace_bits), wire.decode_empty)

    def list_topics(self) -> Deferred[list[wire.TopicInfo]]:
        """Every topic (extension ``list_topics``, key 64)."""
        return self._call(wire.ListTopics(), wire.decode_topics)

    def topic_leaders(self, topic: str) -> Deferred[wire.LeadersInfo]:
        """Which node leads each range of ``topic`` and where to reach it (extension
        ``topic_leaders``, key 69; needs ``produce`` on the topic)."""
        return self._call(wire.TopicLeaders(topic), wire.decode_leaders)

    def describe_cluster(self) -> Deferred[wire.ClusterInfo]:
        """The cluster as the broker sees it (extension ``describe_cluster``, key 66; admin
        only)."""
        return self._call(wire.DescribeCluster(), wire.decode_cluster)

    @property
    def producer_id(self) -> int:
        """This client's producer id (random), which stamps its produces."""
        return self._producer.producer_id

    def produce(
        self, topic: str, records: Iterable[Record], *, give_up_after: float | None = None
    ) -> Deferred[int]:
        """Fires with the count appended once every record is durable.

        Sent as ``produce_idempotent`` with this client's next sequence, once the window lets it
        go out (``wire.PRODUCER_WINDOW`` produces ahead of the oldest unfinished one at most;
        later ones wait). Refused ``not_primary``, ``unreachable`` or ``no_quorum``, it is sent
        again with the same stamp, as the client's ``produce_retry`` says, until
        ``give_up_after`` seconds (default: the policy's) after the first try; then it fails with
        the last refusal. A broker without ``produce_idempotent`` gets a plain ``produce``,
        not retried."""
        return self._producer.produce(
            topic, tuple(records), lambda: succeed(self), give_up_after=give_up_after
        )

    def _produce_stamped(
        self, topic: str, records: tuple[Record, ...], stamp: ProducerStamp
    ) -> Deferred[int]:
        """One try of a produce: ``produce_idempotent`` with ``stamp``, or a plain ``produce``
        once the broker has said it does not know the extension."""
        if self.sends_plain_produce:
            return self._call(wire.Produce(topic, records), wire.decode_count)

        def unknown(failure: Failure) -> Deferred[int]:
            error = failure.value
            if not (isinstance(error, BrokerRefused) and error.reason == Reason.UNKNOWN_API_KEY):
                failure.raiseException()
            if not self.sends_plain_produce:
                self.sends_plain_produce = True
                log.warn(
                    "The broker does not know produce_idempotent (it is older than this client):"
                    " produces go as plain produce from now on, and are not retried"
                )
            return self._call(wire.Produce(topic, records), wire.decode_count)

        sent = self._call(wire.ProduceIdempotent(topic, stamp, records), wire.decode_count)
        return sent.addErrback(unknown)

    def fetch(
        self,
        topic: str,
        cursor: str | None = None,
        group: str | None = None,
        member: str | None = None,
        max_records: int = 0,
        wait_ms: int = 0,
    ) -> Deferred[wire.RecordsPayload]:
        request = wire.Fetch(topic, cursor, group, member, max_records, wait_ms)
        return self._call(request, wire.decode_records)

    def commit(self, topic: str, group: str, cursor: str) -> Deferred[None]:
        return self._call(wire.Commit(topic, group, cursor), wire.decode_empty)

    def leave_group(self, topic: str, group: str, member: str) -> Deferred[None]:
        return self._call(wire.LeaveGroup(topic, group, member), wire.decode_empty)

    def create_user(self, user: str, password: str, permissions: Sequence[str]) -> Deferred[None]:
        request = wire.CreateUser(user, password, tuple(permissions))
        return self._call(request, wire.decode_empty)

    def delete_user(self, user: str) -> Deferred[None]:
        return self._call(wire.DeleteUser(user), wire.decode_empty)

    def change_password(self, user: str, password: str) -> Deferred[None]:
        return self._call(wire.ChangePassword(user, password), wire.decode_empty)

    def list_users(self) -> Deferred[list[tuple[str | None, tuple[str | None, ...]]]]:
        return self._call(wire.ListUsers(), wire.decode_users)

    def grant_acl(self, user: str, operation: str, pattern: str) -> Deferred[None]:
        return self._call(wire.GrantAcl(user, operation, pattern), wire.decode_empty)

    def revoke_acl(self, user: str, operation: str, pattern: str) -> Deferred[None]:
        return self._call(wire.RevokeAcl(user, operation, pattern), wire.decode_empty)

    def list_acls(self, user: str) -> Deferred[list[tuple[str | None, str | None]]]:
        return self._call(wire.ListAcls(user), wire.decode_acls)

    def subscribe(
        self,
        topic: str,
        group: str | None,
        member: str | None,
        window: int,
        max_records: int,
        on_records: OnRecords,
    ) -> Subscription:
        """Have the broker push records: ``on_records(records, next_cursor)`` is called for
        each push, one push at a time, and once it returns (or the Deferred it returns fires)
        a ``stream_ack`` commits ``next_cursor`` for ``group`` and returns the push's credit.

        ``window`` (0: 100, at most 10 000) caps the records pushed and not yet acknowledged;
        ``max_records`` (0: 100, at most 1000) caps one push. Only one subscription per
        (topic, group, member) on a connection.
        """
        subscription = Subscription(self, topic, group, member, on_records)
        request = wire.Subscribe(topic, group, member, window, max_records)
        if self._held_for_login(request):
            self.ready().addCallbacks(
                lambda _: self._start_subscription(subscription, request), subscription._end
            )
        else:
            self._start_subscription(subscription, request)
        return subscription

    def _start_subscription(self, subscription: Subscription, request: wire.Subscribe) -> None:
        if self._state is not _State.OPEN:
            subscription._end(self._closed_error())
            return
        correlation_id = self._next_id()
        self._subscriptions[correlation_id] = subscription
        self._send(correlation_id, request)

    def _stream_ack(self, subscription: Subscription, batch: wire.RecordsPayload) -> None:
        if self._state is not _State.OPEN:
            return
        correlation_id = self._next_id()
        self._acks[correlation_id] = subscription
        while len(self._acks) > _REMEMBERED_ACKS:
            self._acks.popitem(last=False)
        ack = wire.StreamAck(
            subscription.topic,
            subscription.group,
            subscription.member,
            batch.next_cursor,
            len(batch.records),
        )
        self._send(correlation_id, ack)


class Subscription:
    """Records pushed to one ``on_records`` callback, acknowledged after each call.

    ``done`` fires with ``None`` after ``stop()``; it fails with ``BrokerRefused`` when the
    broker ends the subscription, ``ConnectionClosed`` when the connection goes, or the
    callback's own exception (the push it failed on is not acknowledged, so a group gets its
    records again from its last committed position).
    """

    def __init__(
        self,
        client: BrokerClient,
        topic: str,
        group: str | None,
        member: str | None,
        on_records: OnRecords,
    ) -> None:
        self.topic = topic
        self.group = group
        self.member = member
        self.done: Deferred[None] = Deferred()
        self._client = client
        self._on_records = on_records
        self._queue: deque[wire.RecordsPayload] = deque()
        self._busy = False
        self._delivering = False
        self._finished = False

    def stop(self) -> None:
        """Call ``on_records`` no more and acknowledge nothing more. The broker keeps the
        subscription until the connection closes, but pushes no more than its window."""
        if not self._finished:
            self._finished = True
            self._queue.clear()
            self.done.callback(None)

    def _end(self, error: Failure | BaseException) -> None:
        if not self._finished:
            self._finished = True
            self._queue.clear()
            self.done.errback(error)

    def _push(self, batch: wire.RecordsPayload) -> None:
        if not self._finished:
            self._queue.append(batch)
            self._deliver()

    def _deliver(self) -> None:
        """Hand queued pushes to the callback, one at a time, in order."""
        if self._delivering:
            return
        self._delivering = True
        try:
            while self._queue and not self._busy and not self._finished:
                batch = self._queue.popleft()
                self._busy = True
                called = maybeDeferred(self._on_records, batch.records, batch.next_cursor)
                called.addCallbacks(self._processed, self._end, callbackArgs=(batch,))
        finally:
            self._delivering = False

    def _processed(self, _: object, batch: wire.RecordsPayload) -> None:
        self._busy = False
        if self._finished:
            return
        self._client._stream_ack(self, batch)
        self._deliver()

    def _ack_refused(self, reason: str) -> None:
        log.warn(
            "The broker refused a stream_ack of topic {topic} for group {group}: {reason}; "
            "the group's position was not committed, so its records will come again",
            topic=self.topic,
            group=self.group,
            reason=reason,
        )


class _OneClient(Factory):
    def __init__(self, client: BrokerClient) -> None:
        self._client = client

    def buildProtocol(self, addr: IAddress | None) -> BrokerClient:
        return self._client


def connect_endpoint(
    endpoint: IStreamClientEndpoint,
    user: str,
    password: str,
    max_frame_size: int = MAX_RESPONSE_SIZE,
    *,
    clock: IReactorTime,
    tls_hostname: str | None = None,
    cafile: str | None = None,
    produce_retry: ProduceRetry | None = DEFAULT_PRODUCE_RETRY,
) -> Deferred[BrokerClient]:
    """Connect through ``endpoint`` and log in; fires with the client. With ``tls_hostname``,
    over TLS to a broker whose certificate names that host and is signed by a CA of ``cafile``
    (PEM; default: the system's trusted CAs). ``clock`` (the reactor) runs the TLS layer's write
    coalescing and the waits before produces are retried; ``produce_retry`` says how they are
    (None: never)."""
    client = BrokerClient(
        (user, password), max_frame_size, clock=clock, produce_retry=produce_retry
    )
    endpoint = secured(endpoint, tls_hostname, cafile, clock)
    connected = cast("Deferred[Any]", endpoint.connect(_OneClient(client)))
    return connected.addCallback(lambda _: client.ready())


def connect(
    reactor: Any,
    host: str,
    port: int,
    user: str,
    password: str,
    timeout: float = 30.0,
    *,
    tls: bool = False,
    cafile: str | None = None,
    produce_retry: ProduceRetry | None = DEFAULT_PRODUCE_RETRY,
) -> Deferred[BrokerClient]:
    """Connect to ``host:port`` over TCP, or TLS with ``tls`` (the broker's certificate must
    name ``host`` and be signed by a CA of ``cafile``, else of the system), and log in; fires
    with the client, or fails with ``BrokerRefused`` (``invalid_credentials``,
    ``tls_required``) or the connection's error. ``produce_retry`` says how the client's
    produces are retried (None: never)."""
    return connect_endpoint(
        HostnameEndpoint(reactor, host, port, timeout=timeout),
        user,
        password,
        tls_hostname=host if tls else None,
        cafile=cafile,
        clock=reactor,
        produce_retry=produce_retry,
    )
