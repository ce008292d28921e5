"""``logbroker._deferreds.gather``: every result in order, or the first failure itself."""

from __future__ import annotations

from twisted.internet.defer import Deferred, fail, succeed
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
