"""The request window of one peer connection (``logbroker.peer.window``) when the connection
ends: what each waiting or held-back request's caller sees, also when one caller's callbacks
give up on another request of the same window."""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred

from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.window import PeerError, RequestWindow


def _window(sent: list[int]) -> RequestWindow:
    return RequestWindow(
        lambda correlation_id, op, payload: sent.append(correlation_id),
        max_in_flight=1,
        reserved_in_flight=1,
        max_queued_bytes=1 << 20,
    )


def _outcomes(deferred: Deferred[bytes]) -> list[object]:
    seen: list[object] = []
    deferred.addBoth(seen.append)
    return seen


def test_when_the_connection_ends_each_request_fails_once_even_if_a_caller_gave_up_on_one() -> None:
    sent: list[int] = []
    window = _window(sent)
    first = window.request(PeerOp.READ, b"a", "n2")
    second = window.request(PeerOp.REPLICATE, b"b", "n2")  # another lane: sent too
    held = window.request(PeerOp.READ, b"c", "n2")  # the read lane is full: held back
    assert len(sent) == 2
    # The first one's caller gives up on the others when it fails (as a DeferredList that
    # fails on the first error, or a timeout, does).
    first.addErrback(lambda failure: (second.cancel(), held.cancel(), failure)[-1])
    seen = [_outcomes(deferred) for deferred in (first, second, held)]

    window.fail_all(PeerError(PeerReason.UNREACHABLE, "the connection was lost"))

    first_outcome, second_outcome, held_outcome = (outcomes[0] for outcomes in seen)
    assert isinstance(first_outcome.value, PeerError)  # type: ignore[attr-defined]
    assert isinstance(second_outcome.value, CancelledError)  # type: ignore[attr-defined]
    assert isinstance(held_outcome.value, CancelledError)  # type: ignore[attr-defined]
    assert all(len(outcomes) == 1 for outcomes in seen)
    assert len(window) == 0


def test_a_request_after_the_connection_ended_starts_a_clean_window() -> None:
    sent: list[int] = []
    window = _window(sent)
    lost = _outcomes(window.request(PeerOp.READ, b"a", "n2"))
    window.fail_all(PeerError(PeerReason.UNREACHABLE, "the connection was lost"))

    again = window.request(PeerOp.READ, b"b", "n2")

    assert isinstance(lost[0].value, PeerError)  # type: ignore[attr-defined]
    assert len(sent) == 2, "the lane's room is back: the new request goes out at once"
    assert not again.called
