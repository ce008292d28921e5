"""Stamped appends to one range: the Twisted side of the dedupe in ``producers``.

``StampedAppends`` asks the range's ``ProducerTable`` about every stamped append: one already
stored is answered at once, one still being stored waits for the first try's outcome, and a new
one is stored (by whatever the range's handle stores with: its own log, or its replicas, the
stamp going along into the stored batch) and the table told how it ended.

A first try refused while its records may still be committed (``InDoubtError``: no quorum held
them in time, but they are in the log and replicating) is answered as refused, but its stamp
stays in flight until its fate is known: a retry meanwhile waits for it, and is acknowledged
without storing anything if the records were committed. Only a stamp whose records are known
not to be stored here (or whose fate this node no longer knows, having stopped leading the
range: then the next leader's table, rebuilt from its copy, decides) is forgotten.

Every handle that is a range's primary (``LocalRange``, the replicated range) appends through
one.

The table may have to be read back from the log first (``LocalRange`` after a restart): then it
is, when the first stamped append comes, and every append waits for it, in the order they came,
so that no stamped append is admitted by a table that does not know the log yet.
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure

from logbroker.broker.errors import BrokerError, InDoubtError
from logbroker.broker.producers import Admission, ProducerTable
from logbroker.errors import Reason
from logbroker.records import ProducerStamp, Records

#: Stores records, with the stamp of their produce if it has one, firing once they are durable
#: by the handle's rule.
Store = Callable[[Records, ProducerStamp | None], Deferred[object]]
#: Makes the range's table from the stamps its log holds.
Rebuild = Callable[[], Deferred[ProducerTable]]

_Held = tuple[Records, ProducerStamp | None, Store, Deferred[None]]


class StampedAppends:
    def __init__(self, producers: ProducerTable | Rebuild) -> None:
        """``producers`` is the range's table, or what makes it when the first stamped append
        comes (again after a failure, which fails the stamped appends that waited for it)."""
        self.producers: ProducerTable | None
        self._rebuild: Rebuild | None
        if isinstance(producers, ProducerTable):
            self.producers, self._rebuild = producers, None
        else:
            self.producers, self._rebuild = None, producers
        #: Appends waiting for the table while it is made, in the order they came.
        self._held: list[_Held] | None = None
        #: Retries of stamped appends in flight, by stamp: they get the first try's outcome.
        self._retries: dict[ProducerStamp, list[Deferred[None]]] = {}

    def append(self, records: Records, stamp: ProducerStamp | None, store: Store) -> Deferred[None]:
        if self._held is not None:
            return self._hold(records, stamp, store)
        if stamp is None:
            return store(records, None).addCallback(_nothing)
        producers = self.producers
        if producers is None:
            return self._hold(records, stamp, store)
        try:
            admission = producers.admit(stamp)
        except BrokerError as error:
            return fail(error)
        if admission is Admission.STORED:
            return succeed(None)
        if admission is Admission.IN_FLIGHT:
            retry: Deferred[None] = Deferred()
            self._retries[stamp].append(retry)
            return retry
        self._retries[stamp] = []
        return store(records, stamp).addBoth(self._outcome, producers, stamp)

    def _hold(self, records: Records, stamp: ProducerStamp | None, store: Store) -> Deferred[None]:
        """Wait for the table, starting to make it if no one has."""
        waiting: Deferred[None] = Deferred()
        starting = self._held is None
        if self._held is None:
            self._held = []
        self._held.append((records, stamp, store, waiting))
        if starting:
            assert self._rebuild is not None
            self._rebuild().addBoth(self._rebuilt)
        return waiting

    def _rebuilt(self, outcome: ProducerTable | Failure) -> None:
        """Let the appends that waited for the table go on, in order: the stamped ones fail
        with the rebuild's error if it failed, and the next stamped append tries again."""
        held, self._held = self._held or [], None
        if isinstance(outcome, ProducerTable):
            self.producers = outcome
        for records, stamp, store, waiting in held:
            if stamp is not None and isinstance(outcome, Failure):
                waiting.errback(outcome)
            else:
                self.append(records, stamp, store).chainDeferred(waiting)

    def _outcome(
        self, outcome: object, producers: ProducerTable, stamp: ProducerStamp
    ) -> Failure | None:
        """Tell the table how a stamped append ended, then the retries waiting for it."""
        if isinstance(outcome, Failure) and isinstance(outcome.value, InDoubtError):
            outcome.value.fate.addCallback(self._settled, producers, stamp)
            return outcome
        retries = self._retries.pop(stamp)
        if isinstance(outcome, Failure):
            producers.failed(stamp)
            for retry in retries:
                retry.errback(outcome)
            return outcome
        producers.stored(stamp)
        for retry in retries:
            retry.callback(None)
        return None

    def _settled(self, committed: bool, producers: ProducerTable, stamp: ProducerStamp) -> None:
        """The fate of a first try refused in doubt: its retries get it."""
        retries = self._retries.pop(stamp)
        if committed:
            producers.stored(stamp)
            for retry in retries:
                retry.callback(None)
            return
        producers.failed(stamp)
        unknown = BrokerError(
            Reason.NOT_PRIMARY,
            f"whether the first try of producer {stamp.producer_id:#018x} sequence "
            f"{stamp.sequence} was stored is known only to the range's next leader: retry",
        )
        for retry in retries:
            retry.errback(unknown)


def _nothing(_: object) -> None:
    return None
