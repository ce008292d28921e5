"""The long polls a node has on its peers (``logbroker.cluster.remote_waits``): shared per
offset, at most ``MAX_WAITS_PER_PEER`` asked of one peer, never in the way of forwarded
produces."""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred, fail

from logbroker.cluster.forwarding import ForwardedRange
from logbroker.cluster.remote_waits import MAX_WAITS_PER_PEER, RemoteWaits
from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.link import PeerSettings
from logbroker.peer.range_ops import decode_read_request
from logbroker.peer.window import PeerError
from tests.unit.broker.test_ranges import RANGE, records
from tests.unit.cluster.test_forwarding import Nodes, has_result
from tests.unit.storage.helpers import failure_of, result_of


class _Requester:
    """Holds every request it is asked until the test answers it; fails them at once once
    ``down``."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int, Deferred[bytes]]] = []
        self.down = False

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        assert op is PeerOp.READ
        if self.down:
            return fail(PeerError(PeerReason.UNREACHABLE, f"node {node_id!r}: no link"))
        asked: Deferred[bytes] = Deferred()
        self.asked.append((node_id, decode_read_request(payload).from_offset, asked))
        return asked

    def offsets(self, node_id: str) -> list[int]:
        return [offset for node, offset, _ in self.asked if node == node_id]


def test_fetches_waiting_on_one_offset_share_one_remote_wait() -> None:
    requester = _Requester()
    waits = RemoteWaits(requester)
    handles = [ForwardedRange(RANGE, "b", requester, waits) for _ in range(3)]

    waiting = [handle.wait(7, 30_000) for handle in handles]
    other = handles[0].wait(8, 30_000)

    assert requester.offsets("b") == [7, 8]
    waiting[0].cancel()  # one fetch goes away; the others still wait
    failure_of(waiting[0]).trap(CancelledError)
    requester.asked[0][2].callback(b"")
    assert [has_result(w) for w in waiting[1:]] == [True, True]
    assert not has_result(other)


def test_a_wait_nobody_waits_on_any_more_is_kept_until_its_answer_and_joined_meanwhile() -> None:
    requester = _Requester()
    waits = RemoteWaits(requester)

    gone = waits.wait("b", RANGE, 8, 30_000)
    gone.cancel()
    failure_of(gone).trap(CancelledError)
    # Still asked of the peer (which holds it, and the link's room with it): it counts.
    assert not requester.asked[0][2].called
    assert waits.asked_of("b") == 1

    again = waits.wait("b", RANGE, 8, 30_000)  # joins the one under way
    assert requester.offsets("b") == [8]
    requester.asked[0][2].callback(b"")
    assert has_result(again)
    assert waits.asked_of("b") == 0


def test_past_its_share_of_a_peer_a_wait_is_held_until_one_of_that_peer_s_ends() -> None:
    requester = _Requester()
    waits = RemoteWaits(requester, max_per_peer=2)

    first, second, third, fourth = (waits.wait("b", RANGE, offset, 5_000) for offset in range(4))
    elsewhere = waits.wait("c", RANGE, 0, 5_000)

    assert requester.offsets("b") == [0, 1]
    assert requester.offsets("c") == [0]  # another peer has its own share
    third.cancel()  # held, and given up on: never asked
    failure_of(third).trap(CancelledError)

    requester.asked[0][2].callback(b"")
    assert has_result(first)
    assert requester.offsets("b") == [0, 1, 3]  # the next held one still wanted
    assert not has_result(fourth)
    assert not has_result(second)
    assert not has_result(elsewhere)
    assert waits.asked_of("b") == 2


def test_held_waits_whose_peer_fails_them_at_once_are_all_released_without_recursion() -> None:
    requester = _Requester()
    waits = RemoteWaits(requester, max_per_peer=1)
    held = [waits.wait("b", RANGE, offset, 5_000) for offset in range(5_001)]

    requester.down = True  # each one asked from now on fails at once
    requester.asked[0][2].errback(PeerError(PeerReason.UNREACHABLE, "the link dropped"))

    assert all(has_result(each) for each in held)
    assert waits.asked_of("b") == 0
    # A fetch that waits with no link is released at once, to read again and be told why.
    assert has_result(waits.wait("b", RANGE, 0, 5_000))


def test_the_share_of_waits_leaves_room_for_forwarded_produces() -> None:
    assert PeerSettings().max_in_flight > MAX_WAITS_PER_PEER


def test_a_produce_forwarded_past_hundreds_of_long_polls_on_its_primary_is_acknowledged() -> None:
    """More idle offsets long-polled through a node than the forwarded lane's room: the
    waits take their share of it, and a produce forwarded to the same primary still goes at
    once (the primary's clock never moves: were it behind the waits, it would never go)."""
    nodes = Nodes()
    waits = RemoteWaits(nodes.link.connections)
    forwarded = ForwardedRange(RANGE, "b", nodes.link.connections, waits)
    polls = PeerSettings().max_in_flight + 44
    waiting = [forwarded.wait(1_000 + offset, 5_000) for offset in range(polls)]
    nodes.settle()
    assert waits.asked_of("b") == MAX_WAITS_PER_PEER

    appending = forwarded.append(records(b"a", b"b"))
    nodes.settle()

    assert result_of(appending) is None
    assert not any(has_result(each) for each in waiting)
    nodes.link.close()
