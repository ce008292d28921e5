"""``logbroker._deferreds.gather``: every result in order, or the first failure itself."""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.python.failure import Failure

from logbroker._deferreds import gather


def outcome(deferred: Deferred[list[int]]) -> list[object]:
    seen: list[object] = []
    deferred.addBoth(seen.append)
    return seen


def test_gather_fires_with_every_result_in_order() -> None:
    late: Deferred[int] = Deferred()
    gathered = outcome(gather([late, succeed(2)]))
    assert gathered == []
    late.callback(1)
    assert gathered == [[1, 2]]


def test_gather_fails_with_the_first_failure_itself_and_consumes_the_others() -> None:
    first: Deferred[int] = Deferred()
    second: Deferred[int] = fail(KeyError("second"))
    gathered = outcome(gather([first, second, fail(ValueError("third"))]))

    assert len(gathered) == 1
    failure = gathered[0]
    assert isinstance(failure, Failure)
    assert failure.check(KeyError), "not wrapped in a FirstError"
    first.callback(1)


def test_gather_of_nothing_fires_at_once_with_no_results() -> None:
    assert outcome(gather([])) == [[]]


def test_cancelling_gather_cancels_what_still_waits_and_fails_it_cancelled() -> None:
    cancelled: list[Deferred[int]] = []
    waiting: Deferred[int] = Deferred(cancelled.append)
    gathered = gather([succeed(1), waiting])
    seen = outcome(gathered)

    gathered.cancel()

    assert cancelled == [waiting]
    assert len(seen) == 1
    assert isinstance(seen[0], Failure)
    assert seen[0].check(CancelledError)


def test_a_failure_after_the_first_is_consumed_not_left_unhandled() -> None:
    late: Deferred[int] = Deferred()
    gathered = outcome(gather([fail(KeyError("first")), late]))
    late.errback(ValueError("second"))

    assert isinstance(gathered[0], Failure)
    assert gathered[0].check(KeyError)
    assert outcome(late) == [None], "the second failure was consumed"
