"""One peer connection (port 4042): a thin Twisted protocol over the peer frames and handshake.

A ``PeerProtocol`` is one connection between two nodes of a cluster. Its lifecycle
(``LinkState``)::

    HANDSHAKING --handshake established--> ESTABLISHED --lost, dead, bad bytes, close()--> CLOSED
    HANDSHAKING --refused (by either side), timed out, bad bytes, lost--> CLOSED

In ``HANDSHAKING`` every message goes to the ``Handshake`` (``logbroker.peer.handshake``); a
handshake not over within ``PeerSettings.handshake_timeout_s`` is refused (``timeout``). A
refusal, either way, is logged with its reason and the connection is closed; the ``Refuse``
goes out first when this side refused.

Over mutual TLS (the identity's ``mutual_tls``: the connection's transport is a TLS layer)
``HANDSHAKING`` starts with the TLS handshake, which verifies the peer's certificate; once it is
done (``handshakeCompleted``) the certificate's URIs go to the ``Handshake``, which checks that
they name the node the peer claims to be. A TLS handshake that fails is logged with OpenSSL's
reasons and ends the connection; this side closing before TLS is through aborts the socket
(nothing written could be read anyway). In ``ESTABLISHED`` the connection carries pipelined
requests:

* ``request(op, payload)`` sends a ``Request`` with a fresh correlation id and returns a
  ``Deferred`` of the ok payload, failing with ``PeerError`` (the error response's reason).
  Forwarded client requests, internal ones, and claims' fences and seals each have room of
  their own; past it a request is held back and sent in order as answers come (past
  ``max_queued_bytes`` held back, refused ``overloaded``): ``logbroker.peer.window`` says why.
  When the connection ends, every request still waiting fails with ``unreachable``; a request
  on a connection that is not ``ESTABLISHED`` fails so at once.
  A request has no deadline of its own: a caller that needs one cancels it (for instance with
  ``Deferred.addTimeout(seconds, clock)``), and its late answer is ignored; one sent keeps its
  room until that answer comes, as the peer is still working on it.
* A side with a handler (``RequestHandler``, the accepting side) hands each ``Request`` to it and
  answers in whatever order the handler finishes. A handler's error with a ``reason`` attribute
  (a string) is answered with that reason; anything else is logged and answered
  ``internal_error``. At most ``max_inbound`` requests are handled at once: past that, or while
  the transport's write buffer is full (the peer does not read its answers), the transport is
  paused (``pauseProducing``), so a peer can never make this side buffer without bound. The
  requesting side never stops reading (its answers are bounded by its rooms), so two
  nodes cannot deadlock on each other's full buffers.
* A connection idle for ``ping_interval_s`` sends a ``Ping``; one that has received nothing for
  ``dead_after_s`` is aborted, so a dead peer is noticed within ``dead_after_s +
  ping_interval_s``.

Each connection reports to a ``PeerObserver``: it is ``opened`` when its handshake succeeds and
``closed`` when such a connection ends, however it ends (so connections refused or lost during
the handshake are never counted); every byte read and written, handshake included, goes to
``bytes`` as ``in`` or ``out``; a connection this side refuses is ``refused`` with the reason
(``REFUSALS``): ``tls`` when this side failed the TLS handshake (the peer's certificate is not
from the cluster's CA, is missing or expired; the peer speaks no TLS), ``certificate`` when the
certificate names another node than the peer claims, ``handshake`` for any other refusal of the
peer handshake (``wrong_cluster``, ``bad_credentials``, ``timeout``...). A refusal by the peer
is logged, not counted: the peer counts it. ``logbroker.peer.connections`` holds both ends'
factories.
"""

from __future__ import annotations

import typing
from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum, auto
from typing import Any

import attrs
from OpenSSL import SSL
from twisted.internet.defer import (
    CancelledError,
    Deferred,
    fail,
    maybeDeferred,
)
from twisted.internet.interfaces import IDelayedCall, IHandshakeListener, IReactorTime
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from logbroker._openssl import openssl_reasons
from logbroker._tcp import no_delay
from logbroker.peer.frames import (
    DEFAULT_MAX_PEER_FRAME_SIZE,
    PeerCodecError,
    PeerFrameDecoder,
    PeerMessage,
    PeerOp,
    PeerReason,
    Ping,
    Pong,
    Refuse,
    Request,
    Response,
    encode,
)
from logbroker.peer.handshake import (
    Established,
    Handshake,
    Refused,
    certificate_uris,
)
from logbroker.peer.window import PeerError, RequestWindow

log = Logger()

#: How long a connection this side closes may take to get its last bytes out.
CLOSE_GRACE_SECONDS = 5.0
#: What a peer may make this side buffer before its handshake is through: room for a Hello
#: with the longest ids the codec takes, and more than any other handshake message.
MAX_HANDSHAKE_BUFFER = 256 * 1024
#: The head of a Response's frame body: kind, correlation id, status.
_RESPONSE_HEAD = 1 + 4 + 1
#: The head of a Request's frame body: kind, correlation id, op.
_REQUEST_HEAD = 1 + 4 + 1

#: ``(peer node id, op, payload) -> Deferred[ok payload]``: serves the peer's requests.
RequestHandler = Callable[[str, PeerOp, bytes], "Deferred[bytes]"]

#: Why this side refused a peer connection (``PeerObserver.refused``): at accept, past the caps
#: on connections in their handshake (``logbroker.peer.connections``), then as the module
#: docstring says.
REFUSALS = ("per_ip_limit", "total_limit", "tls", "certificate", "handshake")


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, not {value!r}")


@attrs.frozen
class PeerSettings:
    handshake_timeout_s: float = attrs.field(default=10.0, validator=_positive)
    max_frame_size: int = attrs.field(default=DEFAULT_MAX_PEER_FRAME_SIZE, validator=_positive)
    #: Forwarded client requests this side may have waiting for answers on one connection,
    #: and as many internal ones (``logbroker.peer.window``).
    max_in_flight: int = attrs.field(default=256, validator=_positive)
    #: Fences and seals this side may have waiting (``window.RESERVED_OPS``), more held back
    #: in order: data requests that fill ``max_in_flight`` (a node leading thousands of ranges
    #: replicates to each peer at once) must not hold up the claims that let ranges be led.
    reserved_in_flight: int = attrs.field(default=256, validator=_positive)
    #: Bytes of requests this side holds back, unsent, while their lane's room is full: they
    #: go out in order as answers come. Past it a request is refused ``overloaded``. A node
    #: that takes over or gets back thousands of ranges sends each peer more than the room at
    #: once; refused, each was retried after a back-off, and the retries cost more than the
    #: wait (``bench/cluster_scale.py``).
    max_queued_bytes: int = attrs.field(default=32 * 1024 * 1024, validator=_positive)
    #: Requests from the peer handled at once before the connection stops reading. Above the
    #: peers' rooms together (two of ``max_in_flight`` and ``reserved_in_flight``), so that a
    #: well-behaved peer is never paused (a paused connection does not read the peer's pings
    #: either).
    max_inbound: int = attrs.field(default=1024, validator=_positive)
    #: A connection that has received nothing for this long sends a ping.
    ping_interval_s: float = attrs.field(default=5.0, validator=_positive)
    #: A connection that has received nothing for this long is dropped: the peer is dead.
    dead_after_s: float = attrs.field(default=15.0, validator=_positive)
    #: Accepted connections still in their handshake, from one address and in all: past
    #: these, a new one is refused at accept (``SVC_PEER_MAX_HANDSHAKES_PER_IP``,
    #: ``SVC_PEER_MAX_HANDSHAKES``).
    max_handshakes_per_ip: int = attrs.field(default=8, validator=_positive)
    max_handshakes: int = attrs.field(default=64, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.dead_after_s <= self.ping_interval_s:
            raise ValueError("dead_after_s must be longer than ping_interval_s")


class LinkState(Enum):
    HANDSHAKING = auto()
    ESTABLISHED = auto()
    CLOSED = auto()


def _ignore(protocol: PeerProtocol) -> None:
    pass


class PeerObserver(typing.Protocol):
    """Hears of peer connections: each one established and ended, and the bytes they carry."""

    def opened(self) -> None:
        """A connection's handshake succeeded."""

    def closed(self) -> None:
        """A connection reported by ``opened`` ended."""

    def bytes(self, direction: str, n: int) -> None:
        """``n`` bytes were read (``in``) or written (``out``)."""

    def refused(self, reason: str) -> None:
        """This side refused a connection, for one of ``REFUSALS``."""


class _Unobserved:
    def opened(self) -> None:
        pass

    def closed(self) -> None:
        pass

    def bytes(self, direction: str, n: int) -> None:
        pass

    def refused(self, reason: str) -> None:
        pass


UNOBSERVED: PeerObserver = _Unobserved()


@implementer(IHandshakeListener)
class PeerProtocol(Protocol):
    """One peer connection, either side (``handshake.role``)."""

    def __init__(
        self,
        handshake: Handshake,
        clock: IReactorTime,
        settings: PeerSettings,
        *,
        handler: RequestHandler | None = None,
        on_established: Callable[[PeerProtocol], None] = _ignore,
        on_ended: Callable[[PeerProtocol], None] = _ignore,
        observer: PeerObserver = UNOBSERVED,
    ) -> None:
        self.handshake = handshake
        self._clock = clock
        self._settings = settings
        self._handler = handler
        self._on_established = on_established
        self._on_ended = on_ended
        self._observer = observer
        #: Whether ``observer.opened`` was called (and ``closed`` is owed).
        self._observed_open = False
        self.state = LinkState.HANDSHAKING
        self._decoder = PeerFrameDecoder(settings.max_frame_size)
        #: Messages received and not handled yet (held while ``max_inbound`` requests run).
        self._inbox: deque[PeerMessage] = deque()
        #: This side's requests: waiting for answers, or held back.
        self._requests = RequestWindow(
            self._send_request,
            max_in_flight=settings.max_in_flight,
            reserved_in_flight=settings.reserved_in_flight,
            max_queued_bytes=settings.max_queued_bytes,
        )
        #: The peer's requests being handled, by correlation id.
        self._serving: dict[int, Deferred[bytes]] = {}
        self._handshake_timer: IDelayedCall | None = None
        self._liveness_timer: IDelayedCall | None = None
        self._closing_timer: IDelayedCall | None = None
        self._last_received = 0.0
        self._ping_token = 0
        self._writes_blocked = False
        self._requests_blocked = False
        self._reading_paused = False
        #: Over mutual TLS: whether the TLS handshake is through.
        self._tls_done = False
        #: Whether this is the transport's producer (``_produce``).
        self._producing = False

    @property
    def last_received(self) -> float:
        """When this connection last received anything (pongs included)."""
        return self._last_received

    @property
    def peer_node_id(self) -> str | None:
        """The peer's node id, once the handshake has established it."""
        outcome = self.handshake.outcome
        return outcome.peer_node_id if isinstance(outcome, Established) else None

    @property
    def in_flight(self) -> int:
        """This side's requests waiting for answers."""
        return len(self._requests)

    # -- connection ----------------------------------------------------------------------

    def connectionMade(self) -> None:
        transport = self.transport
        assert transport is not None
        no_delay(transport)
        if not self.handshake.mutual_tls:
            self._produce()
        self._last_received = self._clock.seconds()
        self._handshake_timer = self._clock.callLater(
            self._settings.handshake_timeout_s, self._handshake_timed_out
        )
        self._send_all(self.handshake.start())

    def _produce(self) -> None:
        """Be the transport's streaming producer: it pauses us when the peer stops reading.
        Over TLS, only once the TLS handshake is through: until then the TLS layer holds what
        we write (the Hello) and pauses its producer for it, and a paused listener would stop
        reading the very handshake that would let it resume."""
        self.transport.registerProducer(self, True)  # type: ignore[union-attr]
        self._producing = True

    def handshakeCompleted(self) -> None:
        """The TLS handshake is through: the peer's certificate, verified, names what it names."""
        self._tls_done = True
        self._produce()
        transport = self.transport
        certificate = transport.getPeerCertificate()  # type: ignore[union-attr]
        self.handshake.certified(
            frozenset() if certificate is None else certificate_uris(certificate.to_cryptography())
        )

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        was = self.state
        self.state = LinkState.CLOSED
        self._inbox.clear()
        for timer in (self._handshake_timer, self._liveness_timer, self._closing_timer):
            if timer is not None and timer.active():
                timer.cancel()
        self._handshake_timer = self._liveness_timer = self._closing_timer = None
        peer = self.handshake.peer_node_id
        if was is LinkState.HANDSHAKING and isinstance(reason.value, SSL.Error):
            self._tls_failed(reason.value)
        elif was is LinkState.HANDSHAKING:
            log.warn(
                "Peer connection {peer_address} lost during the handshake: {why}",
                peer_address=self._peer_address(),
                why=reason.getErrorMessage(),
            )
        elif was is LinkState.ESTABLISHED:
            log.info(
                "Peer link with node {peer_node_id} at {peer_address} lost: {why}",
                peer_node_id=peer,
                peer_address=self._peer_address(),
                why=reason.getErrorMessage(),
            )
        self._requests.fail_all(
            PeerError(PeerReason.UNREACHABLE, f"the connection to node {peer!r} was lost")
        )
        serving, self._serving = self._serving, {}
        for handling in serving.values():
            handling.cancel()
        if self._observed_open:
            self._observed_open = False
            self._observer.closed()
        self._on_ended(self)

    def _tls_failed(self, error: SSL.Error) -> None:
        reasons = openssl_reasons(error)
        fields = {
            "peer_address": self._peer_address(),
            "role": self.handshake.role.value,
            "reason": reasons,
        }
        # What the peer refused arrives as its TLS alert; what this side refused, as OpenSSL's
        # own reason (certificate verify failed, peer did not return a certificate...).
        if "alert" in reasons:
            log.error(
                "The peer at {peer_address} refused this node's TLS handshake ({role}): {reason}",
                **fields,
            )
        else:
            log.error(
                "Refused the TLS handshake of the peer at {peer_address} ({role}): {reason}",
                **fields,
            )
            self._observer.refused("tls")

    def close(self) -> None:
        """End the connection (its requests waiting for answers fail with ``unreachable``)."""
        if self.state is not LinkState.CLOSED:
            self.state = LinkState.CLOSED
            self._close_transport()

    def _close_transport(self) -> None:
        """Close once what was written is out, but for at most ``CLOSE_GRACE_SECONDS``; at once
        while a TLS handshake is under way."""
        transport = self.transport
        if transport is None:
            return
        if self.handshake.mutual_tls and not self._tls_done:
            self._abort()
            return
        if self._producing:
            # A TLS layer holds its close back for as long as a producer is registered.
            self._producing = False
            transport.unregisterProducer()  # type: ignore[attr-defined]
        transport.loseConnection()
        if self._closing_timer is None:
            self._closing_timer = self._clock.callLater(CLOSE_GRACE_SECONDS, self._abort)

    def _abort(self) -> None:
        self._closing_timer = None
        transport = self.transport
        abort = getattr(transport, "abortConnection", None)
        if abort is not None:
            abort()
        elif transport is not None:
            transport.loseConnection()

    def _peer_address(self) -> str:
        transport = self.transport
        return str(transport.getPeer()) if transport is not None else "(none)"

    def _send_all(self, messages: Iterable[PeerMessage]) -> None:
        for message in messages:
            self._write(encode(message))

    def _write(self, frame: bytes) -> None:
        transport = self.transport
        if transport is None:
            return
        transport.write(frame)
        self._observer.bytes("out", len(frame))

    # -- flow control (IPushProducer) ----------------------------------------------------

    def pauseProducing(self) -> None:
        self._writes_blocked = True
        self._update_reading()

    def resumeProducing(self) -> None:
        self._writes_blocked = False
        self._update_reading()
        self._process()

    def stopProducing(self) -> None:
        """The transport is going away; ``connectionLost`` cleans up."""

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or self.state is LinkState.CLOSED:
            return
        # Only a side that serves requests stops reading for its writes: the requesting side
        # must go on reading the answers that free the peer's buffers.
        pause = self._requests_blocked or (self._writes_blocked and self._handler is not None)
        if pause == self._reading_paused:
            return
        self._reading_paused = pause
        if pause:
            transport.pauseProducing()  # type: ignore[attr-defined]
        else:
            # The silence while this side did not read says nothing about the peer.
            self._last_received = self._clock.seconds()
            transport.resumeProducing()  # type: ignore[attr-defined]

    # -- input ---------------------------------------------------------------------------

    def dataReceived(self, data: bytes) -> None:
        self._observer.bytes("in", len(data))
        if self.state is LinkState.CLOSED:
            return
        self._last_received = self._clock.seconds()
        try:
            messages = self._decoder.feed(data)
        except PeerCodecError as error:
            self._protocol_error(error.reason, error.detail)
            return
        self._inbox.extend(messages)
        self._process()
        if self.state is LinkState.HANDSHAKING and self._decoder.buffered > MAX_HANDSHAKE_BUFFER:
            # A peer not yet authenticated may not make this side hold a large frame.
            self._protocol_error(
                PeerReason.FRAME_TOO_LARGE,
                f"more than {MAX_HANDSHAKE_BUFFER} bytes of a frame during the handshake",
            )

    def _process(self) -> None:
        """Handle queued messages in order while nothing holds them back."""
        inbox = self._inbox
        while inbox and self.state is not LinkState.CLOSED:
            if self.state is LinkState.HANDSHAKING:
                self._handshake_step(inbox.popleft())
                continue
            if isinstance(inbox[0], Request) and len(self._serving) >= self._settings.max_inbound:
                self._requests_blocked = True
                self._update_reading()
                return
            self._handle(inbox.popleft())

    def _protocol_error(self, reason: PeerReason, detail: str) -> None:
        """The peer broke the protocol (or the handshake timed out): tell it why, then close."""
        if self.state is LinkState.HANDSHAKING:
            self._send_all(self.handshake.fail(reason, detail))
            self._handshake_ended()
            return
        log.warn(
            "Dropping the peer link with node {peer_node_id} at {peer_address}: {reason}: {detail}",
            peer_node_id=self.peer_node_id,
            peer_address=self._peer_address(),
            reason=str(reason),
            detail=detail,
        )
        self._send_all([Refuse(reason, detail)])
        self.close()

    # -- handshake -----------------------------------------------------------------------

    def _handshake_step(self, message: PeerMessage) -> None:
        self._send_all(self.handshake.receive(message))
        self._handshake_ended()

    def _handshake_ended(self) -> None:
        outcome = self.handshake.outcome
        if outcome is None:
            return
        if self._handshake_timer is not None and self._handshake_timer.active():
            self._handshake_timer.cancel()
        self._handshake_timer = None
        if isinstance(outcome, Refused):
            self._refused(outcome)
        else:
            self._established(outcome)

    def _refused(self, outcome: Refused) -> None:
        if not outcome.by_peer:
            wrong = outcome.reason == PeerReason.WRONG_CERTIFICATE
            self._observer.refused("certificate" if wrong else "handshake")
        fields = {
            "peer_node_id": outcome.peer_node_id,
            "peer_address": self._peer_address(),
            "role": self.handshake.role.value,
            "reason": outcome.reason,
            "detail": outcome.detail,
        }
        if outcome.by_peer:
            log.error(
                "Peer node {peer_node_id} at {peer_address} refused this node ({role}):"
                " {reason}: {detail}",
                **fields,
            )
        else:
            log.error(
                "Refused peer node {peer_node_id} at {peer_address} ({role}): {reason}: {detail}",
                **fields,
            )
        self.close()

    def _established(self, outcome: Established) -> None:
        self.state = LinkState.ESTABLISHED
        log.info(
            "Peer link with node {peer_node_id} at {peer_address} established ({role})",
            peer_node_id=outcome.peer_node_id,
            peer_address=self._peer_address(),
            role=self.handshake.role.value,
        )
        self._last_received = self._clock.seconds()
        self._schedule_liveness()
        self._observed_open = True
        self._observer.opened()
        self._on_established(self)

    def _handshake_timed_out(self) -> None:
        self._handshake_timer = None
        if self.state is LinkState.HANDSHAKING:
            seconds = self._settings.handshake_timeout_s
            self._protocol_error(PeerReason.TIMEOUT, f"no handshake within {seconds} seconds")

    # -- liveness ------------------------------------------------------------------------

    def _schedule_liveness(self) -> None:
        self._liveness_timer = self._clock.callLater(
            self._settings.ping_interval_s, self._check_liveness
        )

    def _check_liveness(self) -> None:
        self._liveness_timer = None
        if self.state is not LinkState.ESTABLISHED:
            return
        now = self._clock.seconds()
        if self._reading_paused:
            self._last_received = now
        silent = now - self._last_received
        if silent >= self._settings.dead_after_s:
            log.warn(
                "Peer node {peer_node_id} at {peer_address} sent nothing for {seconds} seconds:"
                " dropping the link",
                peer_node_id=self.peer_node_id,
                peer_address=self._peer_address(),
                seconds=silent,
            )
            self.state = LinkState.CLOSED
            self._abort()
            return
        if silent >= self._settings.ping_interval_s:
            self._ping_token = (self._ping_token + 1) & 0xFFFFFFFFFFFFFFFF
            self._send_all([Ping(self._ping_token)])
        self._schedule_liveness()

    # -- established ---------------------------------------------------------------------

    def _handle(self, message: PeerMessage) -> None:
        match message:
            case Request():
                self._serve(message)
            case Response(correlation_id, payload, error):
                self._requests.answered(correlation_id, payload, error)
            case Ping(token):
                self._send_all([Pong(token)])
            case Pong():
                pass
            case Refuse(reason, detail):
                log.warn(
                    "Peer node {peer_node_id} at {peer_address} closed the link: {reason}:"
                    " {detail}",
                    peer_node_id=self.peer_node_id,
                    peer_address=self._peer_address(),
                    reason=reason,
                    detail=detail,
                )
                self.close()
            case _:
                self._protocol_error(
                    PeerReason.UNEXPECTED_MESSAGE,
                    f"{type(message).__name__} after the handshake",
                )

    def request(self, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        """Send a request; the Deferred fires with the ok payload or fails with ``PeerError``.

        Past its lane's room a request is held back (up to ``max_queued_bytes``) and sent in
        order as answers come (``logbroker.peer.window``)."""
        if self.state is not LinkState.ESTABLISHED:
            return fail(PeerError(PeerReason.UNREACHABLE, "the peer link is not established"))
        if _REQUEST_HEAD + len(payload) > self._settings.max_frame_size:
            return fail(
                PeerError(
                    PeerReason.FRAME_TOO_LARGE,
                    f"a request of {4 + _REQUEST_HEAD + len(payload)} bytes exceeds the maximum"
                    f" frame of {self._settings.max_frame_size}",
                )
            )
        return self._requests.request(op, payload, self.peer_node_id)

    def _send_request(self, correlation_id: int, op: PeerOp, payload: bytes) -> None:
        self._write(encode(Request(correlation_id, op, payload)))

    def _serve(self, request: Request) -> None:
        correlation_id = request.correlation_id
        if correlation_id in self._serving:
            self._protocol_error(
                PeerReason.UNEXPECTED_MESSAGE,
                f"request {correlation_id} reuses the id of a request still in flight",
            )
            return
        handler = self._handler
        if handler is None:
            self._answer_error(correlation_id, PeerReason.UNEXPECTED_MESSAGE)
            return
        try:
            op = PeerOp(request.op)
        except ValueError:
            self._answer_error(correlation_id, PeerReason.UNKNOWN_OP)
            return
        peer = self.peer_node_id
        assert peer is not None
        handling = maybeDeferred(handler, peer, op, request.payload)
        self._serving[correlation_id] = handling

        def ok(payload: bytes) -> Response:
            if not isinstance(payload, bytes):
                raise TypeError(f"the handler answered {type(payload).__name__}, not bytes")
            if len(payload) + _RESPONSE_HEAD > self._settings.max_frame_size:
                raise ValueError(f"an answer of {len(payload)} bytes exceeds the maximum frame")
            return Response(correlation_id, payload)

        def error(failure: Failure) -> Response | None:
            if self.state is LinkState.CLOSED and isinstance(failure.value, CancelledError):
                return None  # cancelled with its connection: there is no one to answer
            reason = getattr(failure.value, "reason", None)
            if not isinstance(reason, str) or not reason:
                log.failure(
                    "A peer {op} request from node {peer_node_id} failed unexpectedly",
                    failure,
                    op=op.name.lower(),
                    peer_node_id=peer,
                )
                reason = PeerReason.INTERNAL_ERROR
            return Response(correlation_id, error=str(reason))

        def answer(response: Response | None) -> None:
            self._serving.pop(correlation_id, None)
            if response is not None:
                self._answer(response)
                self._request_finished()

        # An answer that cannot be sent (not bytes, too large) fails like the handler would.
        handling.addCallback(ok).addErrback(error).addCallback(answer)

    def _answer(self, response: Response) -> None:
        if self.state is LinkState.ESTABLISHED:
            self._send_all([response])

    def _answer_error(self, correlation_id: int, reason: str) -> None:
        self._answer(Response(correlation_id, error=str(reason)))

    def _request_finished(self) -> None:
        if self._requests_blocked and len(self._serving) <= self._settings.max_inbound // 2:
            self._requests_blocked = False
            self._update_reading()
            self._process()
