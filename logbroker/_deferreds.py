"""Small Deferred helpers shared by the broker core, the cluster, security and storage."""

from __future__ import annotations

from typing import Any, TypeVar

from twisted.internet.defer import Deferred
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
    ``FirstError``); the other failures are consumed. Cancelling it cancels every one of
    ``deferreds`` still waiting.

    What ``gatherResults(deferreds, consumeErrors=True)`` does, with one callback on each of
    ``deferreds`` and no ``DeferredList``: a produce gathers its range shares on every request,
    and at one record a request that machinery was a visible part of the reactor's time."""

    def cancel(_: Deferred[list[_T]]) -> None:
        for deferred in deferreds:
            deferred.cancel()

    gathered: Deferred[list[_T]] = Deferred(cancel)
    results: list[Any] = [None] * len(deferreds)
    waiting = len(deferreds)

    def settle(outcome: Any, index: int) -> Any:
        nonlocal waiting
        if isinstance(outcome, Failure):
            if not gathered.called:
                gathered.errback(outcome)
            return None
        results[index] = outcome
        waiting -= 1
        if not waiting and not gathered.called:
            gathered.callback(results)
        return outcome

    if not deferreds:
        gathered.callback(results)
    for index, deferred in enumerate(deferreds):
        deferred.addBoth(settle, index)
    return gathered
