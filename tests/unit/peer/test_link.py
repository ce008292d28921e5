"""The peer protocol (``logbroker.peer.link``): one connection over a
``StringTransport`` or a connected pair (``twisted.test.iosim``), and ``PeerConnections`` over a
fake endpoint. Time is a ``Clock``; nothing sleeps, nothing touches a socket."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.test.iosim import FakeTransport, IOPump, connect
from zope.interface import implementer

from logbroker.peer.connections import PeerConnections, PeerServerFactory
from logbroker.peer.frames import (
    PROTOCOL_VERSION,
    Hello,
    PeerFrameDecoder,
    PeerMessage,
    PeerOp,
    PeerReason,
    Ping,
    Pong,
    Proof,
    Refuse,
    Request,
    Response,
    Welcome,
    encode,
)
from logbroker.peer.handshake import Handshake, PeerIdentity, Refused, Role, proof_mac
from logbroker.peer.link import (
    CLOSE_GRACE_SECONDS,
    MAX_HANDSHAKE_BUFFER,
    REFUSALS,
    LinkState,
    PeerProtocol,
    PeerSettings,
    RequestHandler,
)
from logbroker.peer.range_ops import AppendRequest, decode_append_request, encode_append_request
from logbroker.peer.window import PeerError

SECRET = b"cluster secret"
#: Where the dialing node's connections come from.
DIALER_ADDRESS = IPv4Address("TCP", "10.0.0.1", 40000)
SETTINGS = PeerSettings(
    handshake_timeout_s=10.0,
    max_in_flight=4,
    reserved_in_flight=2,
    max_queued_bytes=10,
    max_inbound=10,
    ping_interval_s=5.0,
    dead_after_s=15.0,
)


def identity(node_id: str, cluster_id: str = "c1", secret: bytes = SECRET) -> PeerIdentity:
    return PeerIdentity(cluster_id, node_id, secret)


class Handler:
    """Serves requests by hand: each waits until the test answers it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, PeerOp, bytes, Deferred[bytes]]] = []

    def __call__(self, peer: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        answer: Deferred[bytes] = Deferred()
        self.calls.append((peer, op, payload, answer))
        return answer

    def answer(self, index: int, payload: bytes) -> None:
        self.calls[index][3].callback(payload)


class Seen:
    """A ``PeerObserver`` that counts: connections open now, ever opened, and bytes."""

    def __init__(self) -> None:
        self.open = 0
        self.opened_total = 0
        self.moved = {"in": 0, "out": 0}
        self.refusals: list[str] = []

    def opened(self) -> None:
        self.open += 1
        self.opened_total += 1

    def closed(self) -> None:
        assert self.open > 0, "closed without being opened"
        self.open -= 1

    def bytes(self, direction: str, n: int) -> None:
        self.moved[direction] += n

    def refused(self, reason: str) -> None:
        assert reason in REFUSALS
        self.refusals.append(reason)


class Result:
    """What a Deferred fired with, caught so that no failure goes unhandled."""

    def __init__(self, deferred: Deferred[Any]) -> None:
        self.value: object = None
        self.error: BaseException | None = None
        self.fired = False
        deferred.addCallbacks(self._ok, self._failed)

    def _ok(self, value: object) -> None:
        self.fired, self.value = True, value

    def _failed(self, failure: Failure) -> None:
        self.fired, self.error = True, failure.value

    @property
    def reason(self) -> str:
        assert isinstance(self.error, PeerError), self.error
        return self.error.reason


class Pair:
    """A dialer (node a) and a listener (node b, serving with ``handler``), connected."""

    def __init__(
        self,
        clock: Clock,
        *,
        dialer: PeerIdentity | None = None,
        listener: PeerIdentity | None = None,
        settings: PeerSettings = SETTINGS,
    ) -> None:
        self.clock = clock
        self.handler = Handler()
        self.dialer_seen, self.listener_seen = Seen(), Seen()
        self.dialer = PeerProtocol(
            Handshake(Role.DIALER, dialer or identity("a"), expected_peer="b"),
            clock,
            settings,
            observer=self.dialer_seen,
        )
        self.listener = PeerProtocol(
            Handshake(Role.LISTENER, listener or identity("b")),
            clock,
            settings,
            handler=self.handler,
            observer=self.listener_seen,
        )
        self.pump: IOPump = connect(
            self.listener,
            FakeTransport(self.listener, isServer=True),
            self.dialer,
            FakeTransport(self.dialer, isServer=False),
            clock=clock,
        )

    def flush(self) -> None:
        self.pump.flush()


@pytest.fixture
def clock() -> Iterator[Clock]:
    clock = Clock()
    yield clock
    assert clock.getDelayedCalls() == [], "a timer outlived its connection"


def close(pair: Pair) -> None:
    pair.dialer.close()
    pair.flush()


def errors_with(logged: list[dict[str, Any]], **fields: object) -> list[dict[str, Any]]:
    return [e for e in logged if all(e.get(k) == v for k, v in fields.items())]


# -- handshake over a connected pair ---------------------------------------------------------


def test_both_sides_establish(clock: Clock) -> None:
    pair = Pair(clock)
    assert pair.dialer.state is pair.listener.state is LinkState.ESTABLISHED
    assert pair.dialer.peer_node_id == "b"
    assert pair.listener.peer_node_id == "a"
    close(pair)
    assert pair.dialer.state is pair.listener.state is LinkState.CLOSED


@pytest.mark.parametrize(
    ("dialer", "reason"),
    [
        (identity("a", cluster_id="c2"), PeerReason.WRONG_CLUSTER),
        (identity("a", secret=b"wrong"), PeerReason.BAD_CREDENTIALS),
        (identity("b"), PeerReason.SAME_NODE_ID),
    ],
)
def test_a_refused_peer_is_logged_with_its_reason_and_closed(
    clock: Clock, logged_errors: list[dict[str, Any]], dialer: PeerIdentity, reason: PeerReason
) -> None:
    pair = Pair(clock, dialer=dialer)
    assert pair.dialer.state is pair.listener.state is LinkState.CLOSED
    assert pair.pump.clientIO.disconnected
    assert pair.pump.serverIO.disconnected
    [refusal] = errors_with(logged_errors, role="listener")
    assert refusal["reason"] == reason
    assert refusal["detail"]
    assert "{reason}" in refusal["log_format"]
    assert errors_with(logged_errors, role="dialer")
    # Counted by each side that refused, not by a side that was refused.
    assert pair.listener_seen.refusals == ["handshake"]
    dialer_outcome = pair.dialer.handshake.outcome
    assert isinstance(dialer_outcome, Refused)
    assert pair.dialer_seen.refusals == ([] if dialer_outcome.by_peer else ["handshake"])
    # A request never goes out on a refused connection.
    assert Result(pair.dialer.request(PeerOp.APPEND, b"")).reason == PeerReason.UNREACHABLE
    logged_errors.clear()


def test_the_handshake_times_out(clock: Clock, logged_errors: list[dict[str, Any]]) -> None:
    protocol = PeerProtocol(Handshake(Role.LISTENER, identity("b")), clock, SETTINGS)
    transport = StringTransport()
    protocol.makeConnection(transport)
    clock.advance(SETTINGS.handshake_timeout_s - 0.001)
    assert not transport.disconnecting
    clock.advance(0.001)
    sent = PeerFrameDecoder().feed(transport.value())
    assert isinstance(sent[0], Hello)
    assert sent[-1] == Refuse(PeerReason.TIMEOUT, "no handshake within 10.0 seconds")
    assert transport.disconnecting
    [logged] = logged_errors
    assert logged["reason"] == PeerReason.TIMEOUT
    logged_errors.clear()
    protocol.connectionLost(Failure(ConnectionRefusedError()))


def test_an_incompatible_version_is_refused(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    protocol = PeerProtocol(Handshake(Role.LISTENER, identity("b")), clock, SETTINGS)
    transport = StringTransport()
    protocol.makeConnection(transport)
    transport.clear()
    protocol.dataReceived(encode(Hello(PROTOCOL_VERSION + 1, "c1", "a", b"n" * 32)))
    [refusal] = PeerFrameDecoder().feed(transport.value())
    assert isinstance(refusal, Refuse)
    assert refusal.reason == PeerReason.INCOMPATIBLE_VERSION
    assert transport.disconnecting
    [logged] = logged_errors
    assert logged["reason"] == PeerReason.INCOMPATIBLE_VERSION
    assert logged["peer_node_id"] == "a"
    logged_errors.clear()
    protocol.connectionLost(Failure(ConnectionRefusedError()))


def test_an_oversized_frame_in_the_handshake_is_refused(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    protocol = PeerProtocol(Handshake(Role.LISTENER, identity("b")), clock, SETTINGS)
    transport = StringTransport()
    protocol.makeConnection(transport)
    transport.clear()
    protocol.dataReceived(b"GET / HTTP/1.1\r\n")
    [refusal] = PeerFrameDecoder().feed(transport.value())
    assert isinstance(refusal, Refuse)
    assert refusal.reason == PeerReason.FRAME_TOO_LARGE
    assert logged_errors[0]["reason"] == PeerReason.FRAME_TOO_LARGE
    logged_errors.clear()
    protocol.connectionLost(Failure(ConnectionRefusedError()))


def test_an_unauthenticated_peer_cannot_make_this_side_buffer_a_large_frame(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    protocol = PeerProtocol(Handshake(Role.LISTENER, identity("b")), clock, SETTINGS)
    transport = StringTransport()
    protocol.makeConnection(transport)
    transport.clear()
    protocol.dataReceived(b"\x01\x00\x00\x00" + b"\x05" * (MAX_HANDSHAKE_BUFFER - 4))
    assert not transport.disconnecting
    protocol.dataReceived(b"\x05")
    [refusal] = PeerFrameDecoder().feed(transport.value())
    assert isinstance(refusal, Refuse)
    assert refusal.reason == PeerReason.FRAME_TOO_LARGE
    assert transport.disconnecting
    assert logged_errors[0]["reason"] == PeerReason.FRAME_TOO_LARGE
    logged_errors.clear()
    protocol.connectionLost(Failure(ConnectionRefusedError()))


def test_a_connection_lost_in_the_handshake_is_not_an_error(clock: Clock) -> None:
    protocol = PeerProtocol(Handshake(Role.LISTENER, identity("b")), clock, SETTINGS)
    protocol.makeConnection(StringTransport())
    protocol.connectionLost(Failure(ConnectionRefusedError()))
    assert protocol.state is LinkState.CLOSED


# -- one side over a StringTransport, the other by hand ---------------------------------------


class Remote:
    """The dialing peer played by the test: a real ``Handshake``, frames by hand."""

    def __init__(
        self,
        clock: Clock,
        settings: PeerSettings = SETTINGS,
        handler: RequestHandler | None = None,
    ) -> None:
        self.handler = Handler()
        self.seen = Seen()
        self.protocol = PeerProtocol(
            Handshake(Role.LISTENER, identity("b")),
            clock,
            settings,
            handler=handler or self.handler,
            observer=self.seen,
        )
        self.transport = StringTransport()
        self.protocol.makeConnection(self.transport)
        self.handshake = Handshake(Role.DIALER, identity("a"), nonce=b"d" * 32)
        self.decoder = PeerFrameDecoder()

    def handshake_bytes(self) -> bytes:
        """The dialer's whole handshake, computed against the listener's Hello."""
        [listener_hello] = self.received()
        assert isinstance(listener_hello, Hello)
        [hello] = self.handshake.start()
        assert isinstance(hello, Hello)
        mac = proof_mac(SECRET, Role.DIALER, "c1", "a", listener_hello.nonce, hello.nonce)
        return encode(hello) + encode(Proof(mac)) + encode(Welcome())

    def establish(self) -> None:
        self.protocol.dataReceived(self.handshake_bytes())
        assert self.protocol.state is LinkState.ESTABLISHED
        self.transport.clear()

    def received(self) -> list[PeerMessage]:
        data = self.transport.value()
        self.transport.clear()
        return self.decoder.feed(data)

    def responses(self) -> list[Response]:
        messages = self.received()
        assert all(isinstance(message, Response) for message in messages), messages
        return cast(list[Response], messages)

    def end(self) -> None:
        self.protocol.connectionLost(Failure(ConnectionRefusedError()))


@pytest.mark.parametrize("chunking", ["whole", "split", "byte-at-a-time"])
def test_any_chunking_of_the_input_gives_the_same_answers(clock: Clock, chunking: str) -> None:
    remote = Remote(clock)
    requests = b"".join(
        encode(Request(i, PeerOp.APPEND, encode_append_request(AppendRequest("r", 1, b"x" * i))))
        for i in range(3)
    )
    stream = remote.handshake_bytes() + requests + encode(Ping(9))
    if chunking == "whole":
        pieces = [stream]
    elif chunking == "split":
        pieces = [stream[:7], stream[7:60], stream[60:]]
    else:
        pieces = [stream[i : i + 1] for i in range(len(stream))]
    for piece in pieces:
        remote.protocol.dataReceived(piece)
    served = [decode_append_request(payload).records for _, _, payload, _ in remote.handler.calls]
    assert served == [b"", b"x", b"xx"]
    for index in range(3):
        remote.handler.answer(index, bytes([index]))
    messages = remote.received()
    assert [type(message) for message in messages[:2]] == [Proof, Welcome]
    assert messages[2:] == [
        Pong(9),
        Response(0, b"\x00"),
        Response(1, b"\x01"),
        Response(2, b"\x02"),
    ]
    remote.end()


def test_answers_go_out_in_the_order_the_handler_finishes(clock: Clock) -> None:
    remote = Remote(clock)
    remote.establish()
    for correlation_id in (10, 11, 12):
        remote.protocol.dataReceived(encode(Request(correlation_id, PeerOp.READ, b"q")))
    assert [peer for peer, _, _, _ in remote.handler.calls] == ["a", "a", "a"]
    remote.handler.answer(2, b"twelve")
    remote.handler.answer(0, b"ten")
    remote.handler.answer(1, b"eleven")
    assert remote.responses() == [
        Response(12, b"twelve"),
        Response(10, b"ten"),
        Response(11, b"eleven"),
    ]
    remote.end()


class Refusal(Exception):
    reason = "not_primary"


def test_a_handler_error_with_a_reason_is_answered_with_it(clock: Clock) -> None:
    remote = Remote(clock)
    remote.establish()
    remote.protocol.dataReceived(encode(Request(1, PeerOp.APPEND, b"")))
    remote.handler.calls[0][3].errback(Refusal("elsewhere"))
    assert remote.responses() == [Response(1, error="not_primary")]
    remote.end()


def test_any_other_handler_error_is_logged_and_answered_internal_error(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    remote = Remote(clock)
    remote.establish()
    remote.protocol.dataReceived(encode(Request(1, PeerOp.READ, b"")))
    remote.handler.calls[0][3].errback(ZeroDivisionError("oops"))
    assert remote.responses() == [Response(1, error=PeerReason.INTERNAL_ERROR)]
    [logged] = logged_errors
    assert logged["op"] == "read"
    assert logged["peer_node_id"] == "a"
    logged_errors.clear()
    remote.end()


def test_a_handler_that_raises_at_once_is_answered_too(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    def raising(peer: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        raise KeyError(payload)

    remote = Remote(clock, handler=raising)
    remote.establish()
    remote.protocol.dataReceived(encode(Request(5, PeerOp.APPEND, b"k")))
    assert remote.responses() == [Response(5, error=PeerReason.INTERNAL_ERROR)]
    assert len(logged_errors) == 1
    logged_errors.clear()
    remote.end()


@pytest.mark.parametrize(
    "payload", [pytest.param("text", id="not-bytes"), pytest.param(b"x" * 100, id="too-large")]
)
def test_an_answer_that_cannot_be_sent_is_answered_internal_error(
    clock: Clock, logged_errors: list[dict[str, Any]], payload: object
) -> None:
    remote = Remote(clock, PeerSettings(max_frame_size=100))
    remote.establish()
    remote.protocol.dataReceived(encode(Request(1, PeerOp.READ, b"")))
    remote.handler.calls[0][3].callback(cast(bytes, payload))
    assert remote.responses() == [Response(1, error=PeerReason.INTERNAL_ERROR)]
    assert len(logged_errors) == 1
    logged_errors.clear()
    remote.end()


def test_an_unknown_op_is_answered_unknown_op(clock: Clock) -> None:
    remote = Remote(clock)
    remote.establish()
    remote.protocol.dataReceived(encode(Request(3, 200, b"")))
    assert remote.responses() == [Response(3, error=PeerReason.UNKNOWN_OP)]
    assert remote.handler.calls == []
    remote.end()


def test_reading_pauses_past_the_inbound_bound_and_resumes(clock: Clock) -> None:
    settings = PeerSettings(max_inbound=2)
    remote = Remote(clock, settings)
    remote.establish()
    remote.protocol.dataReceived(
        b"".join(encode(Request(i, PeerOp.APPEND, b"")) for i in range(4)) + encode(Ping(1))
    )
    assert len(remote.handler.calls) == 2
    assert remote.transport.producerState == "paused"
    # A paused connection's silence says nothing about the peer: it is not dropped as dead.
    clock.advance(settings.dead_after_s + settings.ping_interval_s)
    assert not remote.transport.disconnecting
    # Reading resumes once half the bound is free; the next request fills it again.
    remote.handler.answer(0, b"")
    assert len(remote.handler.calls) == 3
    assert remote.transport.producerState == "paused"
    remote.handler.answer(1, b"")
    assert len(remote.handler.calls) == 4
    assert remote.transport.producerState == "producing"
    remote.handler.answer(2, b"")
    remote.handler.answer(3, b"")
    assert [m.correlation_id for m in remote.received() if isinstance(m, Response)] == [0, 1, 2, 3]
    remote.end()


def test_a_serving_side_stops_reading_while_its_peer_does_not_read(clock: Clock) -> None:
    remote = Remote(clock)
    remote.establish()
    remote.protocol.pauseProducing()  # the transport's write buffer is full
    assert remote.transport.producerState == "paused"
    remote.protocol.resumeProducing()
    assert remote.transport.producerState == "producing"
    remote.end()


def test_a_requesting_side_reads_on_while_its_writes_are_blocked(clock: Clock) -> None:
    pair = Pair(clock)
    pair.dialer.pauseProducing()
    results = [Result(pair.dialer.request(PeerOp.READ, b""))]
    pair.flush()
    pair.handler.answer(0, b"answer")
    pair.flush()
    assert results[0].value == b"answer"
    close(pair)


def test_a_malformed_frame_after_the_handshake_drops_the_link(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    remote = Remote(clock)
    remote.establish()
    remote.protocol.dataReceived(b"\x00\x00\x00\x01\x09")
    [refusal] = remote.received()
    assert isinstance(refusal, Refuse)
    assert refusal.reason == PeerReason.MALFORMED_MESSAGE
    assert remote.transport.disconnecting
    assert logged_errors == []  # a warning: the link comes back by itself
    remote.end()


def test_a_handshake_message_after_the_handshake_drops_the_link(clock: Clock) -> None:
    remote = Remote(clock)
    remote.establish()
    remote.protocol.dataReceived(encode(Welcome()))
    [refusal] = remote.received()
    assert refusal == Refuse(PeerReason.UNEXPECTED_MESSAGE, "Welcome after the handshake")
    remote.end()


def test_a_close_that_does_not_finish_is_aborted(clock: Clock) -> None:
    remote = Remote(clock)
    remote.establish()
    remote.protocol.close()
    assert remote.transport.disconnecting
    assert not remote.transport.disconnected
    clock.advance(CLOSE_GRACE_SECONDS)
    assert remote.transport.disconnected  # StringTransport's mark of abortConnection
    remote.end()


# -- requests over a connected pair ----------------------------------------------------------


def test_pipelined_requests_complete_out_of_order(clock: Clock) -> None:
    pair = Pair(clock)
    results = [Result(pair.dialer.request(PeerOp.APPEND, bytes([i]))) for i in range(3)]
    pair.flush()
    assert [payload for _, _, payload, _ in pair.handler.calls] == [b"\x00", b"\x01", b"\x02"]
    pair.handler.answer(1, b"one")
    pair.flush()
    assert [r.value for r in results] == [None, b"one", None]
    pair.handler.answer(2, b"two")
    pair.handler.answer(0, b"zero")
    pair.flush()
    assert [r.value for r in results] == [b"zero", b"one", b"two"]
    assert pair.dialer.in_flight == 0
    close(pair)


def test_an_error_response_fails_the_request_with_its_reason(clock: Clock) -> None:
    pair = Pair(clock)
    result = Result(pair.dialer.request(PeerOp.APPEND, b""))
    pair.flush()
    pair.handler.calls[0][3].errback(Refusal())
    pair.flush()
    assert result.reason == "not_primary"
    close(pair)


def test_requests_past_the_in_flight_bound_are_held_back_and_go_out_in_order(clock: Clock) -> None:
    pair = Pair(clock)
    waiting = [Result(pair.dialer.request(PeerOp.READ, b"")) for _ in range(SETTINGS.max_in_flight)]
    held = [Result(pair.dialer.request(PeerOp.READ, bytes([n]) * 4)) for n in range(2)]
    # Past the bytes held back (8 of 10), a request is refused at once.
    refused = Result(pair.dialer.request(PeerOp.READ, b"xyz"))
    assert refused.reason == PeerReason.OVERLOADED
    assert "held back" in str(refused.error)
    pair.flush()
    assert len(pair.handler.calls) == SETTINGS.max_in_flight
    assert not any(result.fired for result in held)

    pair.handler.answer(0, b"")
    pair.flush()
    assert waiting[0].fired
    assert [call[2] for call in pair.handler.calls[SETTINGS.max_in_flight :]] == [b"\x00" * 4]
    # Room for one more held back; a new request goes behind the one still held.
    later = Result(pair.dialer.request(PeerOp.READ, b"late"))
    pair.handler.answer(1, b"")
    pair.handler.answer(2, b"")
    pair.flush()
    sent = [call[2] for call in pair.handler.calls[SETTINGS.max_in_flight :]]
    assert sent == [b"\x00" * 4, b"\x01" * 4, b"late"]
    pair.handler.answer(SETTINGS.max_in_flight, b"first held")
    pair.flush()
    assert held[0].value == b"first held"
    close(pair)
    assert held[1].reason == later.reason == PeerReason.UNREACHABLE


def test_a_request_held_back_and_cancelled_is_never_sent(clock: Clock) -> None:
    pair = Pair(clock)
    for _ in range(SETTINGS.max_in_flight):
        Result(pair.dialer.request(PeerOp.READ, b""))
    given_up = pair.dialer.request(PeerOp.READ, b"gone")
    kept = Result(pair.dialer.request(PeerOp.READ, b"kept"))
    cancelled = Result(given_up)
    given_up.cancel()
    assert isinstance(cancelled.error, CancelledError)
    pair.flush()
    pair.handler.answer(0, b"")
    pair.flush()
    assert [call[2] for call in pair.handler.calls[SETTINGS.max_in_flight :]] == [b"kept"]
    close(pair)
    assert kept.reason == PeerReason.UNREACHABLE


def test_fences_and_seals_have_room_of_their_own_past_the_in_flight_bound(clock: Clock) -> None:
    # A node leading thousands of ranges fills the bound with replication: the fences and
    # seals that let ranges be led at all must still go.
    pair = Pair(clock)
    data = [Result(pair.dialer.request(PeerOp.REPLICATE, b"")) for _ in range(4)]
    assert len(data) == SETTINGS.max_in_flight
    data.append(Result(pair.dialer.request(PeerOp.REPLICATE, b"held back")))

    fence = Result(pair.dialer.request(PeerOp.FENCE, b""))
    seal = Result(pair.dialer.request(PeerOp.SEAL, b""))
    assert not fence.fired
    assert not seal.fired
    # Past their room, claims' requests are held back in order, not refused: a node taking
    # over thousands of ranges fences more copies at once than the room.
    later_fence = Result(pair.dialer.request(PeerOp.FENCE, b"f"))
    assert not later_fence.fired
    pair.flush()
    assert len(pair.handler.calls) == SETTINGS.max_in_flight + SETTINGS.reserved_in_flight
    assert b"held back" not in [call[2] for call in pair.handler.calls], "the fences went first"
    assert b"f" not in [call[2] for call in pair.handler.calls]
    fence_call = next(i for i, call in enumerate(pair.handler.calls) if call[1] is PeerOp.FENCE)
    pair.handler.answer(fence_call, b"fenced")
    pair.flush()
    assert fence.value == b"fenced"
    assert pair.handler.calls[-1][2] == b"f", "sent once the first fence answered"
    close(pair)
    assert {r.reason for r in [*data, seal, later_fence]} == {PeerReason.UNREACHABLE}


def test_forwarded_requests_never_hold_back_replication(clock: Clock) -> None:
    # Serving a forwarded produce takes a replication back from the serving node: were they
    # to share the room, produces forwarded both ways would each wait for a replication held
    # back behind the others, and no produce would finish before it timed out.
    pair = Pair(clock)
    forwarded = [Result(pair.dialer.request(PeerOp.APPEND, b"")) for _ in range(4)]
    assert len(forwarded) == SETTINGS.max_in_flight
    later = Result(pair.dialer.request(PeerOp.STAMPED_APPEND, b"late"))

    replicated = [Result(pair.dialer.request(PeerOp.REPLICATE, bytes([n]))) for n in range(4)]
    fetched = Result(pair.dialer.request(PeerOp.FETCH, b"held"))
    pair.flush()
    sent = [call[2] for call in pair.handler.calls]
    assert sent == [b""] * 4 + [b"\x00", b"\x01", b"\x02", b"\x03"]

    # Each lane's answers make room in that lane only, in order.
    pair.handler.answer(4, b"replicated")
    pair.flush()
    assert replicated[0].value == b"replicated"
    assert [call[2] for call in pair.handler.calls[8:]] == [b"held"]
    assert pair.handler.calls[8][1] == PeerOp.FETCH
    pair.handler.answer(0, b"appended")
    pair.flush()
    assert forwarded[0].value == b"appended"
    assert [call[1] for call in pair.handler.calls[9:]] == [PeerOp.STAMPED_APPEND]
    close(pair)
    assert {r.reason for r in [*forwarded[1:], later, fetched]} == {PeerReason.UNREACHABLE}


def test_a_dropped_connection_fails_outstanding_requests_with_unreachable(clock: Clock) -> None:
    pair = Pair(clock)
    results = [Result(pair.dialer.request(PeerOp.APPEND, b"")) for _ in range(3)]
    pair.flush()
    handling = [answer for _, _, _, answer in pair.handler.calls]
    pair.pump.serverIO.loseConnection()  # the listener's side goes away
    pair.flush()
    assert [r.reason for r in results] == [PeerReason.UNREACHABLE] * 3
    assert "'b'" in str(results[0].error)
    # The handler's work for a gone peer is cancelled (so never answered).
    assert all(answer.called for answer in handling)
    assert Result(pair.dialer.request(PeerOp.APPEND, b"")).reason == PeerReason.UNREACHABLE


def test_a_request_larger_than_a_frame_fails_at_once(clock: Clock) -> None:
    pair = Pair(clock, settings=PeerSettings(max_frame_size=64))
    result = Result(pair.dialer.request(PeerOp.APPEND, b"x" * 64))
    assert result.reason == PeerReason.FRAME_TOO_LARGE
    close(pair)


def test_a_cancelled_request_ignores_its_late_answer(clock: Clock) -> None:
    pair = Pair(clock)
    request = pair.dialer.request(PeerOp.READ, b"")
    cancelled = Result(request)
    request.cancel()
    assert isinstance(cancelled.error, CancelledError)
    assert pair.dialer.in_flight == 1, "the peer still holds it"
    pair.flush()
    pair.handler.answer(0, b"late")
    pair.flush()
    assert pair.dialer.in_flight == 0
    assert pair.dialer.state is LinkState.ESTABLISHED
    close(pair)


def test_requests_given_up_on_keep_their_room_until_the_peer_answers_them(clock: Clock) -> None:
    # A peer cut off for a few seconds keeps its connection: had each ack timeout given its
    # request's room to the next, every timeout would have written another room's worth into
    # the socket, all handed to the peer at once when the link heals.
    pair = Pair(clock)
    given_up = [pair.dialer.request(PeerOp.REPLICATE, bytes([n])) for n in range(4)]
    assert len(given_up) == SETTINGS.max_in_flight
    for request in given_up:
        request.addErrback(lambda failure: failure.trap(CancelledError))
        request.cancel()
    later = [Result(pair.dialer.request(PeerOp.REPLICATE, b"later")) for _ in range(2)]
    pair.flush()
    assert [call[2] for call in pair.handler.calls] == [b"\x00", b"\x01", b"\x02", b"\x03"]

    # The peer answers the first it was given (its answer ignored): one room, one more sent.
    pair.handler.answer(0, b"late")
    pair.flush()
    assert [call[2] for call in pair.handler.calls[4:]] == [b"later"]
    assert not any(result.fired for result in later)
    pair.handler.answer(4, b"now")
    pair.flush()
    assert later[0].value == b"now"
    close(pair)
    assert later[1].reason == PeerReason.UNREACHABLE


# -- liveness --------------------------------------------------------------------------------


def test_an_idle_link_pings_and_stays_up(clock: Clock) -> None:
    pair = Pair(clock)
    for _ in range(10):
        clock.advance(SETTINGS.ping_interval_s)
        pair.flush()
    assert pair.dialer.state is pair.listener.state is LinkState.ESTABLISHED
    close(pair)


def test_a_dead_peer_is_detected_within_a_bounded_time(clock: Clock) -> None:
    pair = Pair(clock)
    results = [Result(pair.dialer.request(PeerOp.READ, b""))]
    # The listener goes silent: nothing it writes reaches the dialer any more. The dialer pings
    # it, hears nothing, and drops the link within dead_after + ping_interval.
    while clock.seconds() < SETTINGS.dead_after_s - 1:
        clock.advance(1)
    assert not pair.pump.clientIO.disconnecting
    sent = PeerFrameDecoder().feed(b"".join(pair.pump.clientIO.stream))
    assert [type(message) for message in sent] == [Request, Ping, Ping]
    while clock.seconds() < SETTINGS.dead_after_s + SETTINGS.ping_interval_s:
        clock.advance(1)
    assert pair.pump.clientIO.disconnecting
    pair.flush()
    assert pair.dialer.state is LinkState.CLOSED
    assert results[0].reason == PeerReason.UNREACHABLE


def test_pings_are_only_sent_on_an_idle_link(clock: Clock) -> None:
    remote = Remote(clock)
    remote.establish()
    clock.advance(SETTINGS.ping_interval_s - 1)
    remote.protocol.dataReceived(encode(Pong(0)))  # traffic
    clock.advance(1)
    assert remote.received() == []
    clock.advance(SETTINGS.ping_interval_s)
    [ping] = remote.received()
    assert isinstance(ping, Ping)
    remote.end()


# -- the accepting side's factory -------------------------------------------------------------


def test_a_newer_connection_from_a_node_replaces_the_older(clock: Clock) -> None:
    factory = PeerServerFactory(identity("b"), clock, Handler(), SETTINGS)
    pumps = []
    for _ in range(2):
        listener = factory.buildProtocol(None)
        dialer = PeerProtocol(Handshake(Role.DIALER, identity("a")), clock, SETTINGS)
        pumps.append(
            connect(
                listener,
                FakeTransport(listener, isServer=True),
                dialer,
                FakeTransport(dialer, isServer=False),
                clock=clock,
            )
        )
    first, second = pumps
    first.flush()
    assert cast(PeerProtocol, first.server).state is LinkState.CLOSED
    assert cast(PeerProtocol, second.server).state is LinkState.ESTABLISHED
    assert factory.connections == {second.server}
    factory.close_all()
    second.flush()
    assert factory.connections == set()


# -- PeerConnections -------------------------------------------------------------------------


@implementer(IStreamClientEndpoint)
class FakeEndpoint:
    """Connects to a ``PeerServerFactory`` through an iosim pump; or refuses."""

    def __init__(self, clock: Clock, server: PeerServerFactory) -> None:
        self.clock = clock
        self.server = server
        self.pumps: list[IOPump] = []
        self.refuse = False

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        if self.refuse:
            return fail(ConnectionRefusedError())
        client = factory.buildProtocol(None)
        server = self.server.buildProtocol(DIALER_ADDRESS)
        assert client is not None
        assert server is not None
        pump = connect(
            server,
            FakeTransport(server, isServer=True),
            client,
            FakeTransport(client, isServer=False),
            greet=False,
            clock=self.clock,
        )
        self.pumps.append(pump)
        return succeed(client)

    def flush(self) -> None:
        for pump in self.pumps:
            pump.flush()


class Cluster:
    def __init__(self, clock: Clock, listener: PeerIdentity | None = None) -> None:
        self.handler = Handler()
        self.listener_seen, self.dialer_seen = Seen(), Seen()
        server = PeerServerFactory(
            listener or identity("b"), clock, self.handler, SETTINGS, observer=self.listener_seen
        )
        self.endpoint = FakeEndpoint(clock, server)
        self.dialed: list[str] = []

        def endpoint_for(node_id: str) -> IStreamClientEndpoint:
            self.dialed.append(node_id)
            return self.endpoint

        self.connections = PeerConnections(
            identity("a"),
            clock,
            endpoint_for,
            SETTINGS,
            retry_policy=lambda attempt: attempt,
            observer=self.dialer_seen,
        )


def test_an_unknown_peer_is_unreachable_at_once(clock: Clock) -> None:
    cluster = Cluster(clock)
    result = Result(cluster.connections.request("z", PeerOp.READ, b""))
    assert result.reason == PeerReason.UNREACHABLE
    assert "not a known peer" in str(result.error)


def test_requests_go_over_the_established_link(clock: Clock) -> None:
    cluster = Cluster(clock)
    connections = cluster.connections
    connections.add_peer("b")
    # Before the service runs, and before the handshake is through: unreachable at once.
    assert Result(connections.request("b", PeerOp.READ, b"")).reason == PeerReason.UNREACHABLE
    connections.startService()
    assert Result(connections.request("b", PeerOp.READ, b"")).reason == PeerReason.UNREACHABLE
    cluster.endpoint.flush()
    assert connections.established("b") is not None
    result = Result(connections.request("b", PeerOp.APPEND, b"payload"))
    cluster.endpoint.flush()
    assert cluster.handler.calls[0][:3] == ("a", PeerOp.APPEND, b"payload")
    cluster.handler.answer(0, b"done")
    cluster.endpoint.flush()
    assert result.value == b"done"
    stopped = Result(connections.stopService())
    cluster.endpoint.flush()
    assert stopped.fired
    assert stopped.error is None


def test_the_link_comes_back_after_a_drop(clock: Clock) -> None:
    cluster = Cluster(clock)
    connections = cluster.connections
    connections.add_peer("b")
    connections.startService()
    cluster.endpoint.flush()
    waiting = Result(connections.request("b", PeerOp.READ, b""))
    cluster.endpoint.flush()
    cluster.endpoint.pumps[0].serverIO.loseConnection()
    cluster.endpoint.flush()
    assert waiting.reason == PeerReason.UNREACHABLE
    # Disconnected: unreachable at once, never waiting for the next connection.
    assert Result(connections.request("b", PeerOp.READ, b"")).reason == PeerReason.UNREACHABLE
    clock.advance(1)  # the retry policy's first delay
    cluster.endpoint.flush()
    assert len(cluster.endpoint.pumps) == 2
    again = Result(connections.request("b", PeerOp.READ, b""))
    cluster.endpoint.flush()
    cluster.handler.answer(1, b"back")
    cluster.endpoint.flush()
    assert again.value == b"back"
    connections.stopService()
    cluster.endpoint.flush()


def test_failed_connection_attempts_back_off(clock: Clock) -> None:
    cluster = Cluster(clock)
    cluster.endpoint.refuse = True
    connections = cluster.connections
    connections.add_peer("b")
    connections.startService()
    [retry] = clock.getDelayedCalls()
    assert retry.getTime() == 1
    clock.advance(1)
    [retry] = clock.getDelayedCalls()
    assert retry.getTime() == 1 + 2
    cluster.endpoint.refuse = False
    clock.advance(2)
    cluster.endpoint.flush()
    assert connections.established("b") is not None
    connections.stopService()
    cluster.endpoint.flush()


def test_a_refused_connection_is_reported_with_when_the_attempt_began(clock: Clock) -> None:
    cluster = Cluster(clock)
    reported: list[tuple[str, float]] = []
    connections = PeerConnections(
        identity("a"),
        clock,
        lambda node_id: cluster.endpoint,
        SETTINGS,
        on_refused=lambda node_id, began: reported.append((node_id, began)),
    )
    connections.add_peer("b")
    connections.startService()
    cluster.endpoint.flush()
    assert connections.established("b") is not None
    clock.advance(5)
    cluster.endpoint.refuse = True  # b's process is gone: nothing listens on its port
    cluster.endpoint.pumps[0].serverIO.loseConnection()
    cluster.endpoint.flush()
    assert reported == []  # a lost link alone is no proof: a network can drop it

    # The default policy tries a lost link again within a fifth of a second (and a bit).
    [retry] = clock.getDelayedCalls()
    assert 0.2 <= retry.getTime() - clock.seconds() <= 0.3
    clock.advance(retry.getTime() - clock.seconds())
    assert reported == [("b", retry.getTime())]
    [retry] = clock.getDelayedCalls()
    assert 0.4 <= retry.getTime() - clock.seconds() <= 0.5  # then it backs off
    connections.stopService()


def test_refused_handshakes_back_off_too(clock: Clock, logged_errors: list[dict[str, Any]]) -> None:
    """Each refused connection counts as a failed attempt, though it connected."""
    cluster = Cluster(clock, listener=identity("b", cluster_id="c2"))
    connections = cluster.connections
    connections.add_peer("b")
    connections.startService()
    delays = []
    for _ in range(3):
        cluster.endpoint.flush()
        [retry] = clock.getDelayedCalls()
        delays.append(retry.getTime() - clock.seconds())
        clock.advance(delays[-1])
    assert delays == [2, 3, 4]
    assert {e["reason"] for e in logged_errors} == {PeerReason.WRONG_CLUSTER}
    logged_errors.clear()
    cluster.endpoint.flush()
    connections.stopService()
    cluster.endpoint.flush()
    logged_errors.clear()


def test_the_dialed_node_must_be_the_one_that_answers(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    cluster = Cluster(clock, listener=identity("c"))
    cluster.connections.add_peer("b")
    cluster.connections.startService()
    cluster.endpoint.flush()
    assert cluster.connections.established("b") is None
    assert {e["reason"] for e in logged_errors} == {PeerReason.UNEXPECTED_NODE}
    logged_errors.clear()
    cluster.connections.stopService()


def test_peers_are_added_and_removed(clock: Clock) -> None:
    cluster = Cluster(clock)
    connections = cluster.connections
    connections.startService()
    connections.add_peer("b")
    connections.add_peer("b")
    assert cluster.dialed == ["b"]
    assert connections.peers == {"b"}
    cluster.endpoint.flush()
    assert connections.established("b") is not None
    removed = Result(connections.remove_peer("b"))
    cluster.endpoint.flush()
    assert removed.fired
    assert connections.peers == frozenset()
    assert Result(connections.request("b", PeerOp.READ, b"")).reason == PeerReason.UNREACHABLE
    with pytest.raises(ValueError, match="this node"):
        connections.add_peer("a")
    connections.stopService()


# -- what the observer hears ------------------------------------------------------------------


def test_an_established_connection_is_opened_and_closed_once_on_each_side(clock: Clock) -> None:
    pair = Pair(clock)
    assert (pair.dialer_seen.open, pair.listener_seen.open) == (1, 1)
    result = Result(pair.dialer.request(PeerOp.APPEND, b"payload"))
    pair.flush()
    pair.handler.answer(0, b"done")
    pair.flush()
    assert result.value == b"done"

    close(pair)
    for seen in (pair.dialer_seen, pair.listener_seen):
        assert (seen.open, seen.opened_total) == (0, 1)
    # Every byte one side wrote, framing and handshake included, the other read.
    assert pair.dialer_seen.moved["out"] == pair.listener_seen.moved["in"] > len(b"payload")
    assert pair.listener_seen.moved["out"] == pair.dialer_seen.moved["in"] > len(b"done")


@pytest.mark.parametrize("ending", ["closed here", "closed there", "lost", "peer dead"])
def test_a_connection_is_closed_once_however_it_ends(clock: Clock, ending: str) -> None:
    pair = Pair(clock)
    if ending == "closed here":
        pair.dialer.close()
        pair.dialer.close()
    elif ending == "lost":
        pair.pump.serverIO.loseConnection()
    elif ending == "peer dead":
        # Nothing pumped: the dialer hears nothing and drops the link.
        while pair.dialer.state is LinkState.ESTABLISHED:
            clock.advance(1)
    else:
        pair.listener.close()
    pair.flush()
    assert pair.dialer.state is pair.listener.state is LinkState.CLOSED
    for seen in (pair.dialer_seen, pair.listener_seen):
        assert (seen.open, seen.opened_total) == (0, 1)


def test_a_refused_connection_is_never_opened_but_its_bytes_count(
    clock: Clock, logged_errors: list[dict[str, Any]]
) -> None:
    pair = Pair(clock, dialer=identity("a", cluster_id="c2"))
    logged_errors.clear()
    assert pair.dialer.state is pair.listener.state is LinkState.CLOSED
    for seen in (pair.dialer_seen, pair.listener_seen):
        assert seen.opened_total == 0
        assert seen.open == 0
    assert pair.dialer_seen.moved["out"] == pair.listener_seen.moved["in"] > 0


def test_a_connection_lost_in_the_handshake_is_never_opened(clock: Clock) -> None:
    seen = Seen()
    protocol = PeerProtocol(Handshake(Role.LISTENER, identity("b")), clock, SETTINGS, observer=seen)
    transport = StringTransport()
    protocol.makeConnection(transport)
    protocol.connectionLost(Failure(ConnectionRefusedError()))
    assert (seen.opened_total, seen.open) == (0, 0)
    assert seen.moved == {"in": 0, "out": len(transport.value())}


@pytest.mark.parametrize("chunking", ["whole", "byte-at-a-time"])
def test_bytes_count_what_the_transport_carried(clock: Clock, chunking: str) -> None:
    remote = Remote(clock)
    hello = len(remote.transport.value())  # the listener's, read by handshake_bytes
    stream = remote.handshake_bytes() + encode(Request(1, PeerOp.READ, b"r")) + encode(Ping(3))
    pieces = [stream] if chunking == "whole" else [stream[i : i + 1] for i in range(len(stream))]
    for piece in pieces:
        remote.protocol.dataReceived(piece)
    remote.handler.answer(0, b"answer")
    written = hello + len(remote.transport.value())
    assert remote.seen.moved == {"in": len(stream), "out": written}
    assert remote.seen.open == 1
    remote.end()
    assert remote.seen.open == 0


def test_the_factory_and_the_links_give_their_connections_the_observer(clock: Clock) -> None:
    cluster = Cluster(clock)
    connections = cluster.connections
    connections.add_peer("b")
    connections.startService()
    cluster.endpoint.flush()
    assert (cluster.dialer_seen.open, cluster.listener_seen.open) == (1, 1)
    cluster.endpoint.pumps[0].serverIO.loseConnection()
    cluster.endpoint.flush()
    assert (cluster.dialer_seen.open, cluster.listener_seen.open) == (0, 0)
    clock.advance(1)  # the retry policy's first delay
    cluster.endpoint.flush()
    assert (cluster.dialer_seen.open, cluster.listener_seen.open) == (1, 1)
    assert cluster.dialer_seen.opened_total == 2
    connections.stopService()
    cluster.endpoint.flush()
    assert (cluster.dialer_seen.open, cluster.listener_seen.open) == (0, 0)
    assert cluster.dialer_seen.moved["out"] == cluster.listener_seen.moved["in"] > 0
    assert cluster.listener_seen.moved["out"] == cluster.dialer_seen.moved["in"] > 0
