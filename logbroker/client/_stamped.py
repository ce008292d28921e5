"""The produces of one producer over Twisted: the sequence window, the stamp and the retries.

A produce takes the producer's next sequence once the window lets it go out, and keeps the
stamp it makes through every try; a try that fails in a way a try with the same stamp may cure
(``TryFailed.retried``) is tried again after the retry policy's back-off, on the client's clock.
What one try is differs between clients: one connection's ``produce_idempotent``
(``StampedProducer.produce``), or one share per leader (``logbroker.client._cluster``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from twisted.internet.defer import Deferred, TimeoutError, ensureDeferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from logbroker.client._errors import BrokerRefused, ConnectionClosed
from logbroker.client._retry import (
    RETRIED_REASONS,
    ProduceRetry,
    Retries,
    SequenceWindow,
    new_producer_id,
)
from logbroker.records import ProducerStamp, Record


class StampedClient(Protocol):
    """What a produce is tried through: a connection that sends one produce with a stamp
    (``BrokerClient``)."""

    #: Set once the broker said it does not know ``produce_idempotent``: not retried then.
    sends_plain_produce: bool

    def _produce_stamped(
        self, topic: str, records: tuple[Record, ...], stamp: ProducerStamp
    ) -> Deferred[int]: ...


class TryFailed(Exception):
    """One try of a produce failed with ``error``; ``retried`` says whether a try with the
    same stamp may cure it (else ``error`` is the produce's)."""

    def __init__(self, error: Exception, retried: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.retried = retried


_Client = TypeVar("_Client", bound=StampedClient)

#: One try of a produce with a stamp, given the produce's retries (None: not retried) and the
#: last try's error: fires with the count appended, or fails (``TryFailed`` to be retried).
Attempt = Callable[[ProducerStamp, Retries | None, Exception | None], Awaitable[int]]


class StampedProducer:
    """The produces of one producer (a client object) over Twisted: each takes the next
    sequence once the window lets it go out (produces beyond it wait, in order), and is tried,
    then retried with the same stamp as ``retry`` says, the back-off waited on ``clock``
    (``logbroker.client._retry``)."""

    def __init__(self, clock: IReactorTime, retry: ProduceRetry | None) -> None:
        self.producer_id = new_producer_id()
        self._clock = clock
        self._retry = retry
        self._window = SequenceWindow()
        #: Produces waiting for the window to let them out, oldest first.
        self._waiting: deque[Deferred[int]] = deque()
        self._admitting = False
        #: Produces waiting to be retried, and the timers that end their wait.
        self._sleeping: dict[Deferred[None], IDelayedCall] = {}

    def produce(
        self,
        topic: str,
        records: tuple[Record, ...],
        connection: Callable[[], Deferred[_Client]],
        *,
        reconnects: bool = False,
        give_up_after: float | None = None,
    ) -> Deferred[int]:
        """Produce ``records`` through ``connection()``'s client; with ``reconnects``, one whose
        connection was lost before its answer is retried too (through the next connection)."""

        async def attempt(
            stamp: ProducerStamp, retries: Retries | None, last: Exception | None
        ) -> int:
            client = await self._connected(connection, retries if reconnects else None, last)
            try:
                return await client._produce_stamped(topic, records, stamp)
            except BrokerRefused as refused:
                retried = refused.reason in RETRIED_REASONS
                raise TryFailed(refused, retried and not client.sends_plain_produce) from None
            except ConnectionClosed as closed:
                raise TryFailed(closed, reconnects and not client.sends_plain_produce) from None

        return self.produce_with(attempt, give_up_after)

    def produce_with(self, attempt: Attempt, give_up_after: float | None = None) -> Deferred[int]:
        """A produce whose every try is ``attempt``, with the next sequence's stamp; no retry
        starts later than ``give_up_after`` seconds (default: the policy's) after the first
        try."""
        return ensureDeferred(self._produce(attempt, give_up_after))

    def interrupt(self, error: Exception) -> None:
        """Fail with ``error``, now, the produces waiting to be retried: there is no connection
        to retry them through any more."""
        sleeping, self._sleeping = self._sleeping, {}
        for waiting, timer in sleeping.items():
            timer.cancel()
            waiting.errback(error)

    async def _produce(self, attempt: Attempt, give_up_after: float | None) -> int:
        sequence = await self._sequence()
        try:
            stamp = ProducerStamp(self.producer_id, sequence)
            retries = None
            if self._retry is not None:
                retries = Retries(self._retry, self._clock.seconds(), give_up_after)
            last: Exception | None = None
            while True:
                try:
                    return await attempt(stamp, retries, last)
                except TryFailed as failed:
                    if retries is None or not failed.retried:
                        raise failed.error from None
                    delay = retries.next_delay(self._clock.seconds())
                    if delay is None:
                        raise failed.error from None
                    last = failed.error
                await self._sleep(delay)
        finally:
            self._window.finish(sequence)
            self._admit_waiting()

    async def _connected(
        self,
        connection: Callable[[], Deferred[_Client]],
        retries: Retries | None,
        last: Exception | None,
    ) -> _Client:
        """The client to try through; with ``retries``, waited for no longer than they last."""
        if retries is None:
            return await connection()
        remaining = retries.remaining(self._clock.seconds())
        try:
            return await connection().addTimeout(remaining, self._clock)
        except TimeoutError:
            if last is not None:
                raise last from None
            raise ConnectionClosed(
                f"no connection to the broker within {remaining:.3g} s"
            ) from None

    def _sequence(self) -> Deferred[int]:
        if not self._waiting:
            sequence = self._window.take()
            if sequence is not None:
                return succeed(sequence)
        waiting: Deferred[int] = Deferred(self._waiting.remove)
        self._waiting.append(waiting)
        return waiting

    def _admit_waiting(self) -> None:
        # Not re-entered: a produce let out here may finish at once (its connection is closed),
        # and let out the next from inside this loop.
        if self._admitting:
            return
        self._admitting = True
        try:
            while self._waiting:
                sequence = self._window.take()
                if sequence is None:
                    return
                self._waiting.popleft().callback(sequence)
        finally:
            self._admitting = False

    def _sleep(self, delay: float) -> Deferred[None]:
        waiting: Deferred[None] = Deferred(lambda cancelled: self._sleeping.pop(cancelled).cancel())
        self._sleeping[waiting] = self._clock.callLater(delay, self._woken, waiting)
        return waiting

    def _woken(self, waiting: Deferred[None]) -> None:
        del self._sleeping[waiting]
        waiting.callback(None)
