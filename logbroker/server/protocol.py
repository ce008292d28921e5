"""The client port: a thin Twisted protocol over the wire codec and the broker core.

Connection lifecycle (``_State``):

    AWAITING_AUTH --auth ok--> READY --connection lost / fatal error--> CLOSED

A connection over the per-IP or total connection limit is refused at accept: it gets the error
frame ``connection_limit_exceeded`` or ``global_limit_exceeded`` (correlation id 0) and is closed.

In ``AWAITING_AUTH`` the only accepted frame is ``auth``; anything else is answered
``auth_required`` and the connection is closed, as is a connection that has not authenticated
within ``SVC_AUTH_TIMEOUT_MS`` (``timeout``, correlation id 0). Every ``auth`` first passes the
``auth`` rate limit of the client's IP (``rate_limit_exceeded`` when blocked). Wrong credentials
are answered ``invalid_credentials``; either way the client may try again within the same
deadline. A successful ``auth`` opens a session bound to the client's IP and answers its token;
an ``auth`` with a null user and that token as the password resumes the session (from the same
IP, before it expires) without the password. In ``READY`` every
request is answered (pipelined requests may complete out of order; the correlation id says which
is which), except ``stream_ack``, which is answered only when it fails. A connection is never
dropped for being idle, so long polls and subscriptions can wait as long as they need to.

``describe_cluster`` (admin only) answers the factory's ``cluster`` view as it is at that moment;
a factory without one answers ``invalid_operation``. ``verify_cluster`` (admin only) answers what
the factory's ``verifier`` finds comparing every sealed segment's copies on every node (taking
as long as reading them takes); a factory without one answers ``invalid_operation``.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from twisted.internet.defer import CancelledError, Deferred, gatherResults, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime, ITCPTransport
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker import wire
from logbroker._tcp import no_delay
from logbroker.broker.core import Broker, FetchResult, fetch_limit
from logbroker.broker.errors import BrokerError
from logbroker.controlplane import User
from logbroker.errors import CLIENT_REASON, LogbrokerError
from logbroker.security import Operation, Permission, UserDirectory
from logbroker.security.connections import client_identifier
from logbroker.security.guards import AuthResult, Guards
from logbroker.security.ratelimit import Action
from logbroker.security.sessions import Origin
from logbroker.security.tls import ServerTls
from logbroker.server.leaders import leaders_info
from logbroker.server.tls import secure_protocol
from logbroker.wire import Reason

if TYPE_CHECKING:
    from logbroker.cluster.verify import ClusterVerifier, VerifyReport
    from logbroker.cluster.view import ClusterStatus, ClusterView

log = Logger()
_T = TypeVar("_T")

DEFAULT_WINDOW = 100
MAX_WINDOW = 10_000
#: How long a connection the broker closes may take to get its last bytes out.
CLOSE_GRACE_SECONDS = 5.0
#: A subscription's long polls end this often (at most), so its member's session stays fresh.
_SUBSCRIPTION_POLL_MS = 10_000


@attrs.frozen
class ProtocolSettings:
    auth_timeout_ms: int = 10_000
    max_frame_size: int = wire.DEFAULT_MAX_FRAME_SIZE
    #: Enforce ACL grants (``SVC_ACL_STRICT``); otherwise the global permissions decide.
    acl_strict: bool = False
    #: Requests one connection may have in flight; past it, its socket is not read until
    #: half of them are answered.
    max_in_flight: int = 1024


class _State(Enum):
    AWAITING_AUTH = auto()
    READY = auto()
    CLOSED = auto()


#: What each topic operation asks to do (``admin`` passes every check); the others but
#: ``list_topics`` are user and ACL management, for admins only.
_TOPIC_OPERATIONS: dict[type[wire.Request], Operation] = {
    wire.CreateTopic: Operation.CREATE_TOPIC,
    wire.Produce: Operation.PRODUCE,
    wire.ProduceIdempotent: Operation.PRODUCE,
    wire.Fetch: Operation.CONSUME,
    wire.Commit: Operation.CONSUME,
    wire.Subscribe: Operation.CONSUME,
    wire.StreamAck: Operation.CONSUME,
    wire.LeaveGroup: Operation.CONSUME,
    # Asked by a producer, to send each range's records to its leader.
    wire.TopicLeaders: Operation.PRODUCE,
}


class ClientProtocol(Protocol):
    def __init__(
        self,
        broker: Broker,
        users: UserDirectory,
        clock: IReactorTime,
        settings: ProtocolSettings,
        guards: Guards,
        client_ip: str,
    ) -> None:
        self._broker = broker
        self._users = users
        self._clock = clock
        self._settings = settings
        self._guards = guards
        #: The spec's client IP identifier, which the connection was counted under.
        self.client_ip = client_ip
        #: Counted in the connection registry (by the factory) until the connection is lost.
        self._counted = True
        #: Aborts the connection if a close the broker began has not finished in time.
        self._closing: IDelayedCall | None = None
        self._decoder = wire.FrameDecoder(settings.max_frame_size)
        self._state = _State.AWAITING_AUTH
        self._user: User | None = None
        self._auth_timer: IDelayedCall | None = None
        #: Requests in flight, with their correlation ids.
        self._pending: dict[Deferred[Any], int] = {}
        self._subscriptions: dict[int, _Subscription] = {}
        #: Frames received and not handled yet: they wait while ``auth`` is being checked or
        #: while the connection has as many requests in flight as it may.
        self._inbox: deque[bytes] = deque()
        self._authenticating = False
        self._too_large: wire.FrameTooLargeError | None = None
        #: Why reading from the socket is paused: the client does not read its responses
        #: (the transport's buffer is full), or it has too many requests in flight.
        self._writes_blocked = False
        self._requests_blocked = False

    # -- connection ----------------------------------------------------------------------

    def connectionMade(self) -> None:
        no_delay(self.transport)
        self.factory.connections.add(self)
        # Streaming producer: the transport pauses us when the client stops reading.
        self.transport.registerProducer(self, True)  # type: ignore[union-attr]
        self._auth_timer = self._clock.callLater(
            self._settings.auth_timeout_ms / 1000.0, self._auth_timed_out
        )

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._counted:
            self._counted = False
            self._guards.connections.release(self.client_ip)
        self.factory.connections.discard(self)
        self._state = _State.CLOSED
        self._inbox.clear()
        self._cancel_auth_timer()
        if self._closing is not None and self._closing.active():
            self._closing.cancel()
        self._closing = None
        for subscription in list(self._subscriptions.values()):
            subscription.stop()
            # The member is gone with its connection: hand its share over now, not after
            # the session timeout.
            subscription.leave()
        self._subscriptions.clear()
        for pending in list(self._pending):
            pending.cancel()

    # -- flow control (IPushProducer) ----------------------------------------------------

    def pauseProducing(self) -> None:
        self._writes_blocked = True
        self._update_reading()

    def resumeProducing(self) -> None:
        self._writes_blocked = False
        self._update_reading()
        for subscription in list(self._subscriptions.values()):
            subscription.poll()
        self._process()

    def stopProducing(self) -> None:
        """The transport is going away; ``connectionLost`` cleans up."""

    @property
    def writes_blocked(self) -> bool:
        return self._writes_blocked

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or self._closed():
            return
        if self._writes_blocked or self._requests_blocked:
            transport.pauseProducing()  # type: ignore[attr-defined]
        else:
            transport.resumeProducing()  # type: ignore[attr-defined]

    def drain(self) -> Deferred[None]:
        """Stop pushing to subscriptions; fire once every request in flight is answered."""
        for subscription in list(self._subscriptions.values()):
            subscription.stop()
        self._subscriptions.clear()
        waiting = [pending for pending in self._pending if not pending.called]
        finished: Deferred[None] = Deferred()
        remaining = [len(waiting)]

        def one_done(result: object) -> object:
            remaining[0] -= 1
            if remaining[0] == 0 and not finished.called:
                finished.callback(None)
            return result

        for pending in waiting:
            pending.addBoth(one_done)
        if not waiting:
            finished.callback(None)
        return finished

    def abort_requests(self) -> None:
        """Fail what is still in flight (the broker is going away), then close."""
        for pending, correlation_id in list(self._pending.items()):
            self._send(wire.encode_error(correlation_id, Reason.UNREACHABLE))
            pending.cancel()
        self._close()

    def _close(self) -> None:
        """Close once what was written is out, but for at most ``CLOSE_GRACE_SECONDS``: a
        client that stopped reading would otherwise hold the connection, and its slot under the
        connection limits, for ever (a paused transport never finishes a ``loseConnection``)."""
        transport = self.transport
        if transport is None:
            return
        transport.loseConnection()
        if self._closing is None:
            self._closing = self._clock.callLater(CLOSE_GRACE_SECONDS, self._abort)

    def _abort(self) -> None:
        self._closing = None
        transport = self.transport
        if ITCPTransport.providedBy(transport):
            transport.abortConnection()

    def _auth_timed_out(self) -> None:
        self._auth_timer = None
        if self._state is _State.AWAITING_AUTH:
            self._fatal(0, Reason.TIMEOUT)

    def _cancel_auth_timer(self) -> None:
        if self._auth_timer is not None and self._auth_timer.active():
            self._auth_timer.cancel()
        self._auth_timer = None

    def _fatal(self, correlation_id: int, reason: Reason) -> None:
        """Answer with an error frame, then close: the connection cannot go on."""
        self._send(wire.encode_error(correlation_id, reason))
        self._state = _State.CLOSED
        self._close()

    def _closed(self) -> bool:
        return self._state is _State.CLOSED

    def _send(self, frame: bytes) -> None:
        if self._state is not _State.CLOSED:
            self.transport.write(frame)  # type: ignore[union-attr]

    def _send_parts(self, parts: list[bytes]) -> None:
        if self._state is not _State.CLOSED:
            self.transport.writeSequence(parts)  # type: ignore[union-attr]

    # -- frames --------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        if self._closed() or self._too_large is not None:
            return
        try:
            self._inbox.extend(self._decoder.feed(data))
        except wire.FrameTooLargeError as error:
            # The frames ahead of the oversized one are answered first.
            self._inbox.extend(error.complete_frames)
            self._too_large = error
        self._process()

    def _process(self) -> None:
        """Handle queued frames in order while nothing holds them back."""
        while self._inbox and not self._closed() and not self._authenticating:
            if len(self._pending) >= self._settings.max_in_flight:
                self._requests_blocked = True
                self._update_reading()
                return
            self._handle(self._inbox.popleft())
        done = not self._inbox and not self._authenticating and not self._closed()
        if self._too_large is not None and done:
            self._fatal(0, Reason.FRAME_TOO_LARGE)

    def _handle(self, body: bytes) -> None:
        try:
            received = wire.decode_request(body)
        except wire.WireError as error:
            if self._state is _State.AWAITING_AUTH:
                # Garbage before authenticating: say what was wrong with it, then close.
                self._fatal(error.correlation_id, error.reason)
            else:
                self._send(wire.encode_error(error.correlation_id, error.reason))
            return
        correlation_id, request = received.correlation_id, received.request
        if self._state is _State.AWAITING_AUTH:
            if isinstance(request, wire.Auth):
                self._authenticate(correlation_id, request)
            else:
                self._fatal(correlation_id, Reason.AUTH_REQUIRED)
            return
        if isinstance(request, wire.Auth):
            self._send(wire.encode_error(correlation_id, Reason.UNEXPECTED_FRAME))
            return
        if not self._permitted(request):
            self._send(wire.encode_error(correlation_id, Reason.PERMISSION_DENIED))
            return
        try:
            self._dispatch(correlation_id, request)
        except Exception as error:
            # Whatever a handler raises fails that request, never the connection.
            if not isinstance(error, LogbrokerError):
                log.failure("A request failed unexpectedly")
            self._send(wire.encode_error(correlation_id, _reason_of(error)))

    def _permitted(self, request: wire.Request) -> bool:
        user = self._user
        assert user is not None
        if isinstance(request, wire.ListTopics):
            return True  # any authenticated user may see which topics exist
        operation = _TOPIC_OPERATIONS.get(type(request))
        if operation is None:
            return Permission.ADMIN in user.permissions
        topic = getattr(request, "topic", None) or ""
        return self._users.allows(user, operation, topic, strict=self._settings.acl_strict)

    def _authenticate(self, correlation_id: int, request: wire.Auth) -> None:
        guards = self._guards
        decision = guards.limiter.check(self.client_ip, Action.AUTH)
        if not decision.allowed:
            guards.on_auth(AuthResult.RATE_LIMITED)
            self._send(wire.encode_error(correlation_id, Reason.RATE_LIMIT_EXCEEDED))
            return
        if request.password is None:
            self._refuse_credentials(correlation_id)
            return
        if request.user is None:
            self._resume(correlation_id, request.password)
            return
        # Frames behind this one wait until the password is checked (on a thread): a client
        # may pipeline its first requests right after its auth.
        self._authenticating = True
        checking = self._users.authenticate(request.user, request.password)

        def checked(outcome: _T) -> _T:
            self._authenticating = False
            return outcome

        checking.addCallbacks(checked, checked)
        self._track(correlation_id, checking.addCallback(self._logged_in), _token)
        # Once answered (``_track`` comes first), go on with the frames that waited.
        checking.addBoth(lambda _: self._process())

    def _refuse_credentials(self, correlation_id: int) -> None:
        self._guards.on_auth(AuthResult.INVALID_CREDENTIALS)
        self._send(wire.encode_error(correlation_id, Reason.INVALID_CREDENTIALS))

    def _resume(self, correlation_id: int, token: str) -> None:
        """Log in with the token of a session this client IP opened (and that is still on)."""
        session = self._guards.sessions.validate(token, self.client_ip).session
        user = None if session is None else self._users.user(session.user)
        if session is None or user is None:
            self._refuse_credentials(correlation_id)
            return
        self._enter(user)
        self._guards.on_auth(AuthResult.OK)
        self._send(wire.encode_ok(correlation_id, wire.encode_token(session.token)))

    def _logged_in(self, user: User | None) -> str:
        if user is None:
            self._guards.on_auth(AuthResult.INVALID_CREDENTIALS)
            raise BrokerError(Reason.INVALID_CREDENTIALS, "wrong user name or password")
        self._guards.on_auth(AuthResult.OK)
        self._enter(user)
        return self._guards.sessions.create(user.name, self.client_ip, Origin.CLIENT_PORT).token

    def _enter(self, user: User) -> None:
        if not self._closed():
            self._user = user
            self._state = _State.READY
            self._cancel_auth_timer()

    # -- operations ----------------------------------------------------------------------

    def _dispatch(self, correlation_id: int, request: wire.Request) -> None:
        broker = self._broker
        match request:
            case wire.CreateTopic(topic, bits):
                self._track(correlation_id, broker.create_topic(topic, bits), _empty)
            case wire.Produce(topic, records):
                self._track(correlation_id, broker.produce(topic, records), wire.encode_count)
            case wire.ProduceIdempotent(topic, stamp, records):
                produced = broker.produce(topic, records, stamp)
                self._track(correlation_id, produced, wire.encode_count)
            case wire.Fetch(topic, cursor, group, member, max_records, wait_ms):
                fetched = broker.fetch(topic, cursor, group, member, max_records, wait_ms)
                self._track(correlation_id, fetched, _records_payload)
            case wire.Commit(topic, group, cursor):
                self._track(correlation_id, broker.commit(topic, group, cursor), _empty)
            case wire.Subscribe():
                self._subscribe(correlation_id, request)
            case wire.StreamAck():
                self._stream_ack(correlation_id, request)
            case wire.ListTopics():
                topics = [
                    wire.TopicInfo(topic.name, topic.keyspace_bits, len(topic.range_ids))
                    for topic in broker.topics()
                ]
                self._send(wire.encode_ok(correlation_id, wire.encode_topics(topics)))
            case wire.DescribeCluster():
                self._describe_cluster(correlation_id)
            case wire.TopicLeaders(topic):
                self._topic_leaders(correlation_id, topic)
            case wire.VerifyCluster():
                self._verify_cluster(correlation_id)
            case wire.LeaveGroup(topic, group, member):
                try:
                    broker.leave_group(topic, group, member)
                except BrokerError as error:
                    self._send(wire.encode_error(correlation_id, error.reason))
                else:
                    self._send(wire.encode_ok(correlation_id))
            case _:
                self._track(correlation_id, self._admin(request), lambda payload: payload)

    def _describe_cluster(self, correlation_id: int) -> None:
        cluster = self.factory.cluster
        if cluster is None:
            log.info(
                "describe_cluster answered invalid_operation: this broker was built without a"
                " view of its cluster"
            )
            self._send(wire.encode_error(correlation_id, Reason.INVALID_OPERATION))
            return
        payload = wire.encode_cluster(cluster_info(cluster.status()))
        self._send(wire.encode_ok(correlation_id, payload))

    def _topic_leaders(self, correlation_id: int, name: str | None) -> None:
        try:
            topic, active = self._broker.active_ranges(name)
        except BrokerError as error:
            self._send(wire.encode_error(correlation_id, error.reason))
            return
        factory = self.factory
        status = None if factory.cluster is None else factory.cluster.status()
        info = leaders_info(topic.keyspace_bits, active, factory.leader_of, status)
        self._send(wire.encode_ok(correlation_id, wire.encode_leaders(info)))

    def _verify_cluster(self, correlation_id: int) -> None:
        verifier = self.factory.verifier
        if verifier is None:
            log.info(
                "verify_cluster answered invalid_operation: this broker is not a node of a"
                " cluster, it has no copies to compare"
            )
            self._send(wire.encode_error(correlation_id, Reason.INVALID_OPERATION))
            return
        node_id = verifier.node_id
        self._track(
            correlation_id,
            verifier.verify(),
            lambda report: wire.encode_verify(verify_info(node_id, report)),
        )

    def _admin(self, request: wire.Request) -> Deferred[bytes]:
        users = self._users
        match request:
            case wire.CreateUser(name, password, permissions):
                named = [permission or "" for permission in permissions]
                return users.create_user(name or "", password or "", named).addCallback(_empty)
            case wire.DeleteUser(name):
                return users.delete_user(name or "").addCallback(_empty)
            case wire.ChangePassword(name, password):
                return users.change_password(name or "", password or "").addCallback(_empty)
            case wire.ListUsers():
                listed = [(user.name, sorted(user.permissions)) for user in users.list_users()]
                return succeed(wire.encode_users(listed))
            case wire.RevokeAcl(name, operation, pattern):
                revoked = users.revoke_acl(name or "", operation or "", pattern or "")
                return revoked.addCallback(_empty)
            case wire.GrantAcl(name, operation, pattern):
                granted = users.grant_acl(name or "", operation or "", pattern or "")
                return granted.addCallback(_empty)
            case wire.ListAcls(name):
                grants = [(grant.operation, grant.pattern) for grant in users.list_acls(name)]
                return succeed(wire.encode_acls(grants))
        raise AssertionError(f"no handler for {request!r}")

    def _track(
        self,
        correlation_id: int,
        result: Deferred[Any],
        encode: Callable[[Any], bytes | list[bytes] | None],
    ) -> None:
        """Answer ``correlation_id`` when ``result`` fires: ok with ``encode(result)``, or an
        error frame with the reason the failure carries."""
        self._pending[result] = correlation_id

        def answered(value: object) -> None:
            self._pending.pop(result, None)
            payload = encode(value)
            if isinstance(payload, list):
                self._send_parts(wire.ok_frame_parts(correlation_id, payload))
            elif payload is not None:
                self._send(wire.encode_ok(correlation_id, payload))
            self._request_finished()

        def failed(failure: Failure) -> None:
            self._pending.pop(result, None)
            if not isinstance(failure.value, CancelledError):
                self._send(wire.encode_error(correlation_id, _reason(failure)))
            self._request_finished()

        result.addCallbacks(answered, failed)

    def _request_finished(self) -> None:
        if self._requests_blocked and len(self._pending) <= self._settings.max_in_flight // 2:
            self._requests_blocked = False
            self._update_reading()
            self._process()

    # -- subscriptions -------------------------------------------------------------------

    def _subscribe(self, correlation_id: int, request: wire.Subscribe) -> None:
        if correlation_id in self._subscriptions:
            self._send(wire.encode_error(correlation_id, Reason.UNEXPECTED_FRAME))
            return
        window = DEFAULT_WINDOW if request.window == 0 else min(request.window, MAX_WINDOW)
        subscription = _Subscription(self, correlation_id, request, window)
        self._subscriptions[correlation_id] = subscription
        subscription.poll()

    def _stream_ack(self, correlation_id: int, request: wire.StreamAck) -> None:
        matching = [
            s
            for s in self._subscriptions.values()
            if (s.request.topic, s.request.group, s.request.member)
            == (request.topic, request.group, request.member)
        ]
        if not matching:
            self._send(wire.encode_error(correlation_id, Reason.UNEXPECTED_FRAME))
            return
        subscription = matching[0]

        def failed(failure: Failure) -> None:
            if not isinstance(failure.value, CancelledError):
                self._send(wire.encode_error(correlation_id, _reason(failure)))

        subscription.ack(request.cursor, request.count).addErrback(failed)

    def _subscription_failed(self, subscription: _Subscription, failure: Failure) -> None:
        self._subscriptions.pop(subscription.correlation_id, None)
        self._send(wire.encode_error(subscription.correlation_id, _reason(failure)))


class _Subscription:
    """Pushes records to one subscriber, never more than its credit window unacknowledged."""

    def __init__(
        self, owner: ClientProtocol, correlation_id: int, request: wire.Subscribe, window: int
    ) -> None:
        self._owner = owner
        self.correlation_id = correlation_id
        self.request = request
        self._window = window
        self._limit = fetch_limit(request.max)
        self._in_flight = 0
        self._cursor: str | None = None
        self._polling: Deferred[FetchResult] | None = None
        self._stopped = False

    def poll(self) -> None:
        if self._stopped or self._polling is not None or self._owner.writes_blocked:
            # Resumed when the client reads again (``resumeProducing``).
            return
        request = self.request
        credit = self._window - self._in_flight
        if credit <= 0:
            # Waiting for acknowledgements is not idleness: the member stays in its group.
            if request.topic is not None and request.group is not None and request.member:
                self._owner._broker.touch_member(request.topic, request.group, request.member)
            return
        polling = self._owner._broker.fetch(
            request.topic,
            self._cursor,
            request.group,
            request.member,
            min(self._limit, credit),
            _SUBSCRIPTION_POLL_MS,
        )
        self._polling = polling
        polling.addCallbacks(self._fetched, self._failed)

    def _fetched(self, result: FetchResult) -> None:
        self._polling = None
        if self._stopped:
            return
        self._cursor = result.next_cursor
        if result.count:
            self._in_flight += result.count
            frame = wire.ok_frame_parts(self.correlation_id, _records_payload(result))
            self._owner._send_parts(frame)
        # On the next turn of the reactor, not from inside this callback: a stream of fetches
        # that complete at once must not recurse.
        self._owner._clock.callLater(0, self.poll)

    def _failed(self, failure: Failure) -> None:
        self._polling = None
        if not self._stopped and not isinstance(failure.value, CancelledError):
            self._stopped = True
            self._owner._subscription_failed(self, failure)

    def ack(self, cursor: str | None, count: int) -> Deferred[None]:
        """Return ``count`` credits and commit ``cursor`` as the group's position."""
        self._in_flight = max(0, self._in_flight - count)
        request = self.request
        committed: Deferred[None] = (
            self._owner._broker.commit(request.topic, request.group, cursor)
            if request.group is not None and cursor is not None
            else succeed(None)
        )
        self.poll()
        return committed

    def stop(self) -> None:
        self._stopped = True
        if self._polling is not None:
            self._polling.cancel()

    def leave(self) -> None:
        """Give the member's share of the group up."""
        request = self.request
        if request.group is not None and request.member is not None:
            # A topic that is gone or names that were invalid leave nothing to give up.
            with contextlib.suppress(BrokerError):
                self._owner._broker.leave_group(request.topic, request.group, request.member)


def _token(token: str) -> bytes:
    return wire.encode_token(token)


#: How long a refused connection on a TLS port may take to show which layer it speaks.
REFUSAL_GRACE_SECONDS = 2.0
#: Refused connections on a TLS port that may wait for that at once. They hold no slot under
#: the connection limits, so this bounds their sockets and handshakes; past it a refusal goes
#: out at once, in plaintext, as on a plaintext-only port.
MAX_WAITING_REFUSALS = 32


class _Refused(Protocol):
    """A connection over a connection limit: told why (correlation id 0), then closed.

    On a plaintext-only port that happens at once. On a port that takes TLS, the client has not
    yet said whether it speaks TLS, and an error written now would reach a TLS client as
    garbage in place of the server's handshake. So the answer waits for the client's first
    bytes above the TLS layer (its ``auth`` frame, once its handshake is through, or the
    plaintext frame) and goes out through whichever layer brought them; a client that shows
    nothing within ``REFUSAL_GRACE_SECONDS`` is dropped without a word. ``on_ended`` hears when
    a waiting refusal's connection is gone.
    """

    def __init__(
        self,
        reason: Reason,
        clock: IReactorTime,
        *,
        await_layer: bool,
        on_ended: Callable[[], None] = lambda: None,
    ) -> None:
        self._reason = reason
        self._clock = clock
        self._await_layer = await_layer
        self._on_ended = on_ended
        self._deadline: IDelayedCall | None = None

    def connectionMade(self) -> None:
        if self._await_layer:
            self._deadline = self._clock.callLater(REFUSAL_GRACE_SECONDS, self._give_up)
        else:
            self._refuse()

    def dataReceived(self, data: bytes) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
            self._refuse()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()
        if self._await_layer:
            self._on_ended()

    def _refuse(self) -> None:
        assert self.transport is not None
        self.transport.write(wire.encode_error(0, self._reason))
        self.transport.loseConnection()

    def _give_up(self) -> None:
        transport = self.transport
        assert transport is not None
        if ITCPTransport.providedBy(transport):
            transport.abortConnection()
        else:
            transport.loseConnection()


def _empty(_: object) -> bytes:
    return b""


def _no_leader(_: str) -> str | None:
    return None


def cluster_info(status: ClusterStatus) -> wire.ClusterInfo:
    """``status`` as ``describe_cluster`` carries it."""
    lease = status.lease_age_seconds
    return wire.ClusterInfo(
        cluster_id=status.cluster_id,
        node_id=status.node_id,
        control_plane=status.control_plane.value,
        chores_holder=status.chores_holder,
        domain_violations=status.domain_violations,
        lease_age_ms=None if lease is None else round(lease * 1000),
        under_replicated=status.under_replicated,
        unavailable_ranges=status.unavailable_ranges,
        nodes=tuple(
            wire.ClusterNodeInfo(
                node_id=node.record.node_id,
                host=node.record.host,
                client_port=node.record.client_port,
                dashboard_port=node.record.dashboard_port,
                peer_port=node.record.peer_port,
                alive=node.alive,
                segments_led=node.segments_led,
                attributes=node.record.attributes,
                version=node.record.version,
            )
            for node in status.nodes
        ),
    )


def verify_info(node_id: str, report: VerifyReport) -> wire.VerifyInfo:
    """``report`` as ``verify_cluster`` carries it."""
    return wire.VerifyInfo(
        node_id=node_id,
        segments_checked=report.segments_checked,
        copies_checked=report.copies_checked,
        copies_unchecked=report.copies_unchecked,
        problem_count=len(report.problems),
        problems=tuple(
            wire.VerifyProblemInfo(
                kind=problem.kind.value,
                node_id=problem.node_id,
                range_id=problem.range_id,
                base_offset=problem.base_offset,
                files=tuple(kind.value for kind in problem.files),
                detail=problem.detail,
            )
            for problem in report.problems[: wire.MAX_LISTED_PROBLEMS]
        ),
    )


def _records_payload(result: FetchResult) -> list[bytes]:
    return wire.records_payload_parts(result.count, result.data, result.next_cursor)


def _reason_of(error: BaseException) -> Reason:
    """What the error frame says: the domain error's reason as the client port answers it
    (``logbroker.errors.CLIENT_REASON``); anything else was not meant to happen."""
    if isinstance(error, LogbrokerError):
        return CLIENT_REASON[error.reason]
    return Reason.UNREACHABLE


def _reason(failure: Failure) -> Reason:
    error = failure.value
    assert error is not None
    if not isinstance(error, LogbrokerError):
        log.failure("A request failed unexpectedly", failure)
    return _reason_of(error)


class ClientFactory(Factory):
    protocol = ClientProtocol

    def __init__(
        self,
        broker: Broker,
        users: UserDirectory,
        clock: IReactorTime,
        settings: ProtocolSettings,
        guards: Guards,
        tls: ServerTls | None = None,
        cluster: ClusterView | None = None,
    ) -> None:
        self._broker = broker
        self._users = users
        self._clock = clock
        self._settings = settings
        self._guards = guards
        self._tls = tls
        #: What ``describe_cluster`` answers; None: it answers ``invalid_operation``. The
        #: composition root may set it after building the factory (once its ports are bound,
        #: so that the node's record carries them), before the port accepts.
        self.cluster = cluster
        #: What ``verify_cluster`` runs; None (not a node of a cluster): it answers
        #: ``invalid_operation``. Set by the composition root like ``cluster``.
        self.verifier: ClusterVerifier | None = None
        #: The node leading a range, for ``topic_leaders``; None for every range (one node,
        #: or not set): the node answering takes every range's records. Set like ``cluster``.
        self.leader_of: Callable[[str], str | None] = _no_leader
        #: The open connections, for draining at shutdown.
        self.connections: set[ClientProtocol] = set()
        #: Refused connections waiting to show which layer they speak (``_Refused``).
        self._waiting_refusals = 0

    def buildProtocol(self, addr: object) -> Protocol:
        """Count the connection at accept (refusing it over a limit), then serve it."""
        client_ip = client_identifier(addr)
        refusal = self._guards.connections.acquire(client_ip)
        if refusal is not None:
            # Debug only: under a flood this would be a line per connection attempt; the
            # refusals are counted in the metrics.
            log.debug(
                "Refused a connection from {client_ip}: {reason}",
                client_ip=client_ip,
                reason=refusal.value,
            )
            return secure_protocol(self._refused(refusal), self._tls, self._clock)
        protocol = ClientProtocol(
            self._broker, self._users, self._clock, self._settings, self._guards, client_ip
        )
        protocol.factory = self
        return secure_protocol(protocol, self._tls, self._clock)

    def _refused(self, reason: Reason) -> _Refused:
        if self._tls is None or self._waiting_refusals >= MAX_WAITING_REFUSALS:
            return _Refused(reason, self._clock, await_layer=False)
        self._waiting_refusals += 1

        def ended() -> None:
            self._waiting_refusals -= 1

        return _Refused(reason, self._clock, await_layer=True, on_ended=ended)

    def drain(self, clock: IReactorTime, grace_seconds: float) -> Deferred[None]:
        """Let every connection's requests in flight finish (produces become durable and are
        acknowledged), for at most ``grace_seconds``; then fail what is left and close them."""
        connections = list(self.connections)
        draining = [connection.drain() for connection in connections]
        # Long polls answer now with what they have, rather than at the end of the grace.
        self._broker.wake_all()
        drained = gatherResults(draining, consumeErrors=True)
        finished: Deferred[None] = Deferred()

        def close(_: object) -> None:
            if timer.active():
                timer.cancel()
            for connection in list(self.connections):
                connection.abort_requests()
            if not finished.called:
                finished.callback(None)

        timer = clock.callLater(grace_seconds, close, None)
        drained.addBoth(close)
        return finished
