"""Which stamped produces a range has stored: the dedupe behind ``produce_idempotent``.

One ``ProducerTable`` per range, on its primary. For each producer id it remembers a window of
the producer's latest sequences at this range (``wire.PRODUCER_WINDOW``, 32, of them: those above
``highest - window``, ``highest`` being the latest the range has seen) and what became of each:
still being stored (or refused while its records could still be committed: in doubt), or
stored. An append known to have failed is forgotten, so that its retry is stored anew.

Why a window in sequence numbers is enough: a producer sends sequence ``s`` only once every
produce up to ``s - window`` has finished (docs/protocol.md), so every produce it may still retry
is within the window of every range it went to. A sequence at or below ``highest - window`` is a
retry of a produce its producer had given up on, or comes from a producer that breaks that rule:
the range cannot tell whether it stored it, and says so (``sequence_too_old``) rather than store
it again or claim it did.

Memory is bounded: at most ``window`` sequences per producer, and at most ``max_producers``
producers per range (``MAX_PRODUCERS``, 10 000), the least recently seen forgotten first. A
producer with an append in flight at the range is never forgotten (there are at most as many as
the range takes records in flight), so a retry that races its first try always finds it. One
forgotten after its first try finished, and retried after that, is stored again: that takes
10 000 other producers writing to the one range between a produce and its retry, which the
clients make within 30 seconds.

The table lives in memory, and the log carries what it needs to be rebuilt: every stamped append
is stored as a batch that holds its stamp (docs/storage-format.md, "Stamped batch"). ``rebuild``
makes the table of a range from the stamps its log gives back (``RangeLog.recent_stamps``), all
of them stored: a single node's range does so when it takes its first stamped append after
opening, a replicated range's new primary after its claim and before it takes appends. So a
retry after a restart or a failover is answered as stored, as long as its first try is among
the stamps read back (the newest 16 MiB of the log by default, which holds the produces in
flight when a range stops: ``logbroker.storage.log.RECENT_STAMPS_BYTES``).

Pure: no Twisted, no I/O. ``StampedAppends`` (in every handle that is a range's primary) asks it
about every stamped append and tells it how each one it let through ended.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from enum import Enum, auto

from logbroker.broker.errors import BrokerError
from logbroker.errors import Reason
from logbroker.records import ProducerStamp
from logbroker.wire import PRODUCER_WINDOW

#: Producers one range remembers; past it, the least recently seen is forgotten.
MAX_PRODUCERS = 10_000


class Admission(Enum):
    """What to do with a stamped append."""

    #: Not seen: store it, then tell the table how that went (``stored`` or ``failed``).
    NEW = auto()
    #: Its first try is still being stored: wait for it, and answer what it is answered.
    IN_FLIGHT = auto()
    #: Stored already: acknowledge it, and store nothing.
    STORED = auto()


class _State(Enum):
    IN_FLIGHT = auto()
    STORED = auto()


class _Producer:
    """One producer's window at one range."""

    __slots__ = ("entries", "highest", "in_flight")

    def __init__(self) -> None:
        #: The latest sequence this range has seen from the producer (-1: none yet).
        self.highest = -1
        self.entries: dict[int, _State] = {}
        #: Entries in flight: a producer with any is not forgotten.
        self.in_flight = 0

    def add(self, sequence: int, state: _State, window: int) -> None:
        self.entries[sequence] = state
        if state is _State.IN_FLIGHT:
            self.in_flight += 1
        self.highest = max(self.highest, sequence)
        if len(self.entries) > window:
            # What remains is within (highest - window, highest]: at most ``window`` entries.
            floor = self.highest - window
            for old in [s for s in self.entries if s <= floor]:
                self.remove(old)

    def remove(self, sequence: int) -> None:
        if self.entries.pop(sequence) is _State.IN_FLIGHT:
            self.in_flight -= 1


class ProducerTable:
    """The recent stamped appends of one range, per producer (see the module docstring)."""

    def __init__(self, window: int = PRODUCER_WINDOW, max_producers: int = MAX_PRODUCERS) -> None:
        if window < 1:
            raise ValueError(f"a producer window holds at least 1 sequence, not {window}")
        if max_producers < 1:
            raise ValueError(f"a producer table holds at least 1 producer, not {max_producers}")
        self._window = window
        self._max_producers = max_producers
        #: Least recently seen first.
        self._producers: OrderedDict[int, _Producer] = OrderedDict()

    @classmethod
    def rebuild(
        cls,
        found: Iterable[tuple[ProducerStamp, int, int]],
        window: int = PRODUCER_WINDOW,
        max_producers: int = MAX_PRODUCERS,
    ) -> ProducerTable:
        """The table of a range whose log holds the stamped batches ``found``, each as
        ``(stamp, base_offset, record_count)``, in any order: every one is stored, and the
        latest in the log (the highest base offset) are the most recently seen. Only the stamps
        and their order matter to the table; the record count is what the log gives along."""
        table = cls(window, max_producers)
        for stamp, _, _ in sorted(found, key=lambda batch: batch[1]):
            producer = table._producer(stamp.producer_id)
            if stamp.sequence > producer.highest - window:
                producer.add(stamp.sequence, _State.STORED, window)
        return table

    def __len__(self) -> int:
        """Producers remembered."""
        return len(self._producers)

    def admit(self, stamp: ProducerStamp) -> Admission:
        """What to do with an append stamped ``stamp``; a ``NEW`` one is in flight from now on.
        Raises ``BrokerError`` ``sequence_too_old`` for a sequence older than the producer's
        window here."""
        producer = self._producer(stamp.producer_id)
        sequence = stamp.sequence
        if sequence <= producer.highest - self._window:
            raise BrokerError(
                Reason.SEQUENCE_TOO_OLD,
                f"sequence {sequence} of producer {stamp.producer_id:#018x} is older than the"
                f" {self._window} latest this range remembers (up to {producer.highest}):"
                " whether it was stored cannot be told, so it is not stored again",
            )
        state = producer.entries.get(sequence)
        if state is _State.STORED:
            return Admission.STORED
        if state is _State.IN_FLIGHT:
            return Admission.IN_FLIGHT
        producer.add(sequence, _State.IN_FLIGHT, self._window)
        return Admission.NEW

    def stored(self, stamp: ProducerStamp) -> None:
        """The append ``admit`` let through as ``NEW`` is durable: its retries are not stored."""
        producer = self._producers.get(stamp.producer_id)
        if producer is not None and producer.entries.get(stamp.sequence) is _State.IN_FLIGHT:
            producer.entries[stamp.sequence] = _State.STORED
            producer.in_flight -= 1

    def failed(self, stamp: ProducerStamp) -> None:
        """The append ``admit`` let through as ``NEW`` failed: a retry is stored anew."""
        producer = self._producers.get(stamp.producer_id)
        if producer is not None and producer.entries.get(stamp.sequence) is _State.IN_FLIGHT:
            producer.remove(stamp.sequence)

    def _producer(self, producer_id: int) -> _Producer:
        """The producer's window, made the most recently seen (and made, if new)."""
        producer = self._producers.get(producer_id)
        if producer is not None:
            self._producers.move_to_end(producer_id)
            return producer
        if len(self._producers) >= self._max_producers:
            self._forget_one()
        producer = self._producers[producer_id] = _Producer()
        return producer

    def _forget_one(self) -> None:
        """Forget the least recently seen producer with nothing in flight here (if all have
        something in flight, the table holds one more for now)."""
        for producer_id, producer in self._producers.items():
            if not producer.in_flight:
                del self._producers[producer_id]
                return
