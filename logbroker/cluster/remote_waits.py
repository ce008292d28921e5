"""The long polls a node has on its peers: ``RemoteWaits``.

A fetch with a wait, through a node that does not lead its range, waits on the range's primary
(``ForwardedRange.wait``): one peer request (``PeerOp.READ`` with a ``wait_ms``) that the
primary answers once a record reaches the offset, or when the wait runs out. Every fetch of this
node waiting on the same offset of the same range shares that one request.

Those requests travel in the peer link's forwarded lane, beside forwarded produces and reads
(``logbroker.peer.window``), and hold their room for as long as they wait. Unbounded, a node
through which consumers long-poll more idle ranges of one primary than the lane's room
(``PeerSettings.max_in_flight``, 256) filled the lane with waits: every produce it forwarded to
that primary was held back behind them, for up to ``MAX_REMOTE_WAIT_MS``. So at most
``MAX_WAITS_PER_PEER`` (half the room) are asked of one peer at once; past that a wait is held
here, in the order asked, until one of that peer's ends. A request is never given up on before
its answer, even when every fetch waiting on it has gone: the window keeps its room until the
peer answers anyway, and counting it until then keeps the bound exact (a fetch that comes for
the same offset meanwhile joins it).
"""

from __future__ import annotations

from collections import deque

from twisted.internet.defer import Deferred

from logbroker.peer.frames import PeerOp
from logbroker.peer.range_ops import ReadRequest, encode_read_request
from logbroker.peer.requester import PeerRequester
from logbroker.records import MAX_U64

#: The longest a long poll waits on a primary in one request. A waiting fetch asks again when it
#: runs out; what a forwarding node stops waiting for is held on the primary at most this long.
MAX_REMOTE_WAIT_MS = 5_000
#: The most long polls asked of one peer at once: half the forwarded lane's room
#: (``PeerSettings.max_in_flight``), so forwarded produces and reads always have the other half.
MAX_WAITS_PER_PEER = 128

#: ``(primary, range id, offset)``: what one long poll waits for.
_WaitKey = tuple[str, str, int]


class RemoteWaits:
    def __init__(self, requester: PeerRequester, max_per_peer: int = MAX_WAITS_PER_PEER) -> None:
        self._requester = requester
        self._max_per_peer = max_per_peer
        #: Every long poll asked or held here, by what it waits for.
        self._shared: dict[_WaitKey, _SharedWait] = {}
        #: Per peer: the long polls asked of it and not answered yet.
        self._asked: dict[str, int] = {}
        #: Per peer: the long polls held here until one of those ends, in the order asked.
        self._held: dict[str, deque[_WaitKey]] = {}
        self._asking_held: set[str] = set()

    def wait(self, primary: str, range_id: str, offset: int, wait_ms: int) -> Deferred[None]:
        """Fires once ``primary`` answered a long poll at ``offset`` of ``range_id`` (a record
        is there, or the wait ran out, or it failed: the fetch reads again and decides)."""
        key = (primary, range_id, offset)
        shared = self._shared.get(key)
        if shared is not None:
            return shared.join()
        shared = self._shared[key] = _SharedWait(min(max(wait_ms, 0), MAX_REMOTE_WAIT_MS))
        # Joined before it is asked: a request that fails at once (no link) releases it.
        joined = shared.join()
        if self._asked.get(primary, 0) < self._max_per_peer:
            self._ask(key, shared)
        else:
            self._held.setdefault(primary, deque()).append(key)
        return joined

    def asked_of(self, primary: str) -> int:
        """The long polls asked of ``primary`` and not answered yet."""
        return self._asked.get(primary, 0)

    def _ask(self, key: _WaitKey, shared: _SharedWait) -> None:
        primary, range_id, offset = key
        request = ReadRequest(
            range_id, min(max(offset, 0), MAX_U64), max_records=0, max_bytes=0, wait_ms=shared.ms
        )
        self._asked[primary] = self._asked.get(primary, 0) + 1
        asked = self._requester.request(primary, PeerOp.READ, encode_read_request(request))
        asked.addBoth(self._answered, key, shared)

    def _answered(self, outcome: object, key: _WaitKey, shared: _SharedWait) -> None:
        # An answer, a timeout or a failure alike: the fetches read again and decide.
        primary = key[0]
        if self._shared.get(key) is shared:
            del self._shared[key]
        self._asked[primary] -= 1
        shared.release()
        self._ask_held(primary)

    def _ask_held(self, primary: str) -> None:
        # Not again from within: a request that fails at once (the link just dropped) ends in
        # here, and would ask the next one a stack frame deeper, for every one held.
        if primary in self._asking_held:
            return
        self._asking_held.add(primary)
        held = self._held.get(primary)
        while held and self._asked[primary] < self._max_per_peer:
            key = held.popleft()
            shared = self._shared[key]
            if shared.wanted:
                self._ask(key, shared)
            else:  # every fetch waiting on it gave up while it was held
                del self._shared[key]
        if not held:
            self._held.pop(primary, None)
        self._asking_held.discard(primary)


class _SharedWait:
    """One long poll and the fetches waiting on it."""

    def __init__(self, ms: int) -> None:
        self.ms = ms
        self._waiting: list[Deferred[None]] = []

    @property
    def wanted(self) -> bool:
        return bool(self._waiting)

    def join(self) -> Deferred[None]:
        waiting: Deferred[None] = Deferred(self._leave)
        self._waiting.append(waiting)
        return waiting

    def _leave(self, cancelled: Deferred[None]) -> None:
        if cancelled in self._waiting:
            self._waiting.remove(cancelled)

    def release(self) -> None:
        waiting, self._waiting = self._waiting, []
        for each in waiting:
            each.callback(None)
