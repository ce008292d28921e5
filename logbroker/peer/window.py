"""This side's requests on one peer connection: their correlation ids, the room each kind has,
and those held back until there is room.

Requests go out in three lanes, each with its own room (requests waiting for answers):

* **Forwarded** client requests (``FORWARDED_OPS``: a produce, a read, a group request a node
  passes to the one that serves the range or group): ``max_in_flight``, then held back in order.
* **Internal** requests (replication, fetches, reads of committed records, digests):
  ``max_in_flight`` of their own, then held back in order.
* **Claims'** fences and seals (``RESERVED_OPS``): ``reserved_in_flight``, then held back in
  order. A node taking over thousands of ranges runs a thousand claims at once
  (``leading.MAX_SWEEP_CLAIMS``), each fencing every copy: refused ``overloaded`` past the room,
  as they once were, two thirds of the claims of a 40,000-range failover failed their fence at
  once (``bench/cluster_scale.py``), each an epoch spent and a retry after a back-off. A claim
  gives up on a fence held back too long like on any other (its ack timeout cancels it).

Why the lanes: serving a forwarded request can take requests of the serving node's own (its
leader replicates the records to this node; a range not led yet is claimed first), while
serving an internal request takes none. Had forwarded and internal requests shared the room, two
nodes forwarding hundreds of produces to each other filled both windows with produces, each
waiting for a replication held back behind the others on the other window, until the
produces timed out one by one (``bench/cluster_scale.py`` with its probe at 512 produces in
flight: no topic writable for ten minutes after the kill). Internal requests never wait behind
forwarded ones, and fences and seals never behind data, so the chain always ends. A peer's
``max_inbound`` is above the three rooms together, so a well-behaved side is never paused.

What is held back is bounded by ``max_queued_bytes`` over all lanes; past it a request is
refused ``overloaded``. A request has no deadline of its own: a caller that needs one cancels
it, and its late answer is ignored. A request given up on after it was sent keeps its room until
that answer comes (or the connection ends): the peer still holds it and works on it. Were its
room given to the next one at once, a peer cut off for less than the link's ``dead_after_s``
(the connection survives, what is written waits in the socket) would be sent a room's worth
again at every ack timeout of the callers, and be handed all of it together when the link heals:
more requests at once than its ``max_inbound``, for work nobody waits for any more.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs
from twisted.internet.defer import Deferred, fail

from logbroker.peer.frames import PeerOp, PeerReason

#: Client requests a node forwards to the node that serves them.
FORWARDED_OPS = frozenset(
    {PeerOp.APPEND, PeerOp.STAMPED_APPEND, PeerOp.READ, PeerOp.BOUNDS, PeerOp.GROUP}
)
#: Requests of claims and seals, with ``reserved_in_flight`` of their own.
RESERVED_OPS = frozenset({PeerOp.FENCE, PeerOp.SEAL})

_MAX_CORRELATION_ID = 0xFFFFFFFF


class PeerError(Exception):
    """A peer request that failed: ``reason`` is a ``PeerReason`` or the peer's reason string."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else str(reason))
        self.reason = reason
        self.detail = detail


@attrs.define(eq=False)
class _Lane:
    name: str
    #: Requests of this lane that may wait for answers at once.
    room: int
    waiting: int = 0
    held: deque[_Request] = attrs.field(factory=deque)


@attrs.define(eq=False)
class _Request:
    lane: _Lane
    op: PeerOp
    payload: bytes
    answer: Deferred[bytes] = attrs.field(init=False)
    #: Set once it is sent.
    correlation_id: int | None = None


class RequestWindow:
    """The requests of one connection's side (see the module docstring). ``send`` writes a
    request out: ``(correlation id, op, payload)``."""

    def __init__(
        self,
        send: Callable[[int, PeerOp, bytes], None],
        *,
        max_in_flight: int,
        reserved_in_flight: int,
        max_queued_bytes: int,
    ) -> None:
        self._send_frame = send
        self._max_queued_bytes = max_queued_bytes
        self._forwarded = _Lane("forwarded", max_in_flight)
        self._internal = _Lane("internal", max_in_flight)
        self._claims = _Lane("claims", reserved_in_flight)
        #: Requests sent and waiting for answers, by correlation id.
        self._sent: dict[int, _Request] = {}
        self._held_bytes = 0
        self._last_correlation_id = 0

    def __len__(self) -> int:
        """Requests sent and waiting for answers."""
        return len(self._sent)

    def _lane_of(self, op: PeerOp) -> _Lane:
        if op in FORWARDED_OPS:
            return self._forwarded
        if op in RESERVED_OPS:
            return self._claims
        return self._internal

    def request(self, op: PeerOp, payload: bytes, peer: str | None) -> Deferred[bytes]:
        """Send ``op`` now if its lane has room, else hold it back (or refuse it); the Deferred
        fires with the ok payload or fails with ``PeerError``. ``peer`` names the node in
        refusals."""
        lane = self._lane_of(op)
        request = _Request(lane, op, payload)
        request.answer = Deferred(lambda _: self._cancel(request))
        # Behind what the lane holds back already: a lane's requests go out in order.
        if lane.waiting < lane.room and not lane.held:
            self._send(request)
            return request.answer
        if self._held_bytes + len(payload) > self._max_queued_bytes:
            return fail(
                PeerError(
                    PeerReason.OVERLOADED,
                    f"{lane.room} {lane.name} requests are waiting for node {peer!r} already,"
                    f" and {self._held_bytes} bytes are held back",
                )
            )
        lane.held.append(request)
        self._held_bytes += len(payload)
        return request.answer

    def answered(self, correlation_id: int, payload: bytes, error: str | None) -> None:
        """The peer answered ``correlation_id``: its room goes to the next one held back; the
        answer is ignored if its caller gave up on it."""
        request = self._sent.pop(correlation_id, None)
        if request is None:
            return
        request.lane.waiting -= 1
        self._send_held(request.lane)
        if request.answer.called:
            return
        if error is None:
            request.answer.callback(payload)
        else:
            request.answer.errback(PeerError(error, "answered by the peer"))

    def fail_all(self, error: PeerError) -> None:
        """The connection ended: every request waiting or held back fails with ``error``."""
        sent, self._sent = self._sent, {}
        held: list[_Request] = []
        for lane in (self._forwarded, self._internal, self._claims):
            held.extend(lane.held)
            lane.held.clear()
            lane.waiting = 0
        self._held_bytes = 0
        for request in [*sent.values(), *held]:
            # An earlier one's callbacks may have given up on (cancelled) this one already.
            if not request.answer.called:
                request.answer.errback(error)

    def _send(self, request: _Request) -> None:
        request.correlation_id = correlation_id = self._next_correlation_id()
        self._sent[correlation_id] = request
        request.lane.waiting += 1
        self._send_frame(correlation_id, request.op, request.payload)

    def _send_held(self, lane: _Lane) -> None:
        while lane.held and lane.waiting < lane.room:
            request = lane.held.popleft()
            self._held_bytes -= len(request.payload)
            self._send(request)

    def _cancel(self, request: _Request) -> None:
        """Its caller gave up on a request: one held back is not sent; one sent keeps its room
        until the peer answers it (see the module docstring), and the answer is ignored."""
        lane = request.lane
        # Not held any more once sent, or once the connection ended (``fail_all``).
        if request.correlation_id is None and request in lane.held:
            lane.held.remove(request)
            self._held_bytes -= len(request.payload)

    def _next_correlation_id(self) -> int:
        candidate = self._last_correlation_id
        while True:
            candidate = candidate + 1 if candidate < _MAX_CORRELATION_ID else 0
            if candidate not in self._sent:
                self._last_correlation_id = candidate
                return candidate
