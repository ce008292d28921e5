"""Small Deferred helpers shared by the broker core, the cluster, security and storage."""

from __future__ import annotations

from typing import Any, TypeVar

from twisted.internet.defer import Deferred, FirstError, gatherResults
from twisted.python.failure import Failure

_T = TypeVar("_T")


def detached(source: Deferred[_T]) -> Deferred[_T]:
    """A Deferred with ``source``'s result whose cancellation does not reach ``source``: for
    work that must finish (and say so to whoever else waits on it, such as a long poll woken by
    a stored append) even when the one who asked went away."""
    result: Deferred[_T] = Deferred()

    def forward(outcome: Any) -> None:
        if not result.called:
            if isinstance(outcome, Failure):
                result.errback(outcome)
            else:
                result.callback(outcome)

    source.addBoth(forward)
    return result


def gather(deferreds: list[Deferred[_T]]) -> Deferred[list[_T]]:
    """All the results, in order, or the first failure itself (not wrapped in a
    ``FirstError``); the other failures are consumed."""
    return gatherResults(deferreds, consumeErrors=True).addErrback(_first_failure)


def _first_failure(failure: Failure) -> Failure:
    error = failure.value
    return error.subFailure if isinstance(error, FirstError) else failure
