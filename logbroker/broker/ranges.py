"""How the broker reaches a range, wherever its data lives: the ``RangeHandle`` seam.

The broker core routes records to ranges and reads ranges back; it does not know whether a
range's active segment is in this process (``LocalRange``, over a ``RangeLog``), on another node
(a forwarder over the peer link) or replicated to a quorum (the replicated range). Each handle
keeps its own rule for when an append is durable and what a read may see; the core only waits
for the Deferreds. A ``RangeDirectory`` hands out the handle of each range.

Every handle answers in the broker's terms: refusals and failures are ``BrokerError`` with the
reason the client is told (``overloaded``, ``unreachable``...), never a storage error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn, Protocol

import attrs
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.broker.errors import BrokerError
from logbroker.broker.producers import ProducerTable
from logbroker.broker.stamped import StampedAppends
from logbroker.errors import Reason
from logbroker.records import ProducerStamp, Records
from logbroker.storage import (
    Appended,
    BatchSlice,
    LogFailedError,
    OpenLogs,
    OverloadedError,
    RangeLog,
    StorageError,
)
from logbroker.transcode import encode_stored, storable, wire_records

log = Logger()


@attrs.frozen
class Bounds:
    """The offsets a range can be read from: ``[start, end)`` (start moves up with retention)."""

    start: int
    end: int
    #: False when ``end`` is only the least the range holds: read from copies of a range whose
    #: primary cannot answer, which may not know of the last records committed. A position a
    #: cursor names past it may still be real.
    end_known: bool = True


@attrs.frozen
class RangeRead:
    """Records of one range in the client protocol's record encoding, ready to send."""

    #: ``count`` records, in pieces to send as they are (not copied into one string).
    data: tuple[bytes, ...]
    count: int
    #: Where the next read of the range goes on from.
    next_offset: int
    #: Key and value bytes taken (what the fetch's byte budget counts).
    size: int


class RangeHandle(Protocol):
    """One range, as the broker core reaches it."""

    @property
    def range_id(self) -> str: ...

    def refusal(self, count: int) -> BrokerError | None:
        """Why an append of ``count`` records would be refused right now, if it would: asked
        of every range a produce goes to before any is written, so a refusal stores nothing."""

    def append(self, records: Records, stamp: ProducerStamp | None = None) -> Deferred[None]:
        """Store ``records``; fires once they are durable by the handle's rule. With ``stamp``
        (this range's share of a ``produce_idempotent``), the range's primary stores them only
        if it has not stored that stamp yet (``logbroker.broker.producers``): a retry gets its
        first try's outcome."""

    def bounds(self) -> Deferred[Bounds]:
        """The range's readable offsets."""

    def read(self, offset: int, max_records: int, max_bytes: int) -> Deferred[RangeRead]:
        """Records from ``offset`` (or from the start, if that is later), at most
        ``max_records``, stopping once ``max_bytes`` of keys and values are taken (at least one
        record, if there is one)."""

    def wait(self, offset: int, wait_ms: int) -> Deferred[None]:
        """Fires once the range holds a record at ``offset`` or later, whichever node's client
        produced it (a long poll). It may fire earlier, without one (after ``wait_ms``, or when
        the range cannot be reached): the caller reads again, and bounds the wait itself.
        Cancelling it stops the wait."""


class RangeDirectory(Protocol):
    """Where the broker core finds the handle of each range."""

    def handle(self, range_id: str) -> RangeHandle:
        """The range's handle; ``BrokerError`` (``unreachable``) if it cannot be reached."""

    def open(self, range_ids: Sequence[str]) -> Deferred[None]:
        """Make the ranges reachable (a new range's storage is created where it lives)."""


class LocalRange:
    """A range whose log is open in this process: an append is durable once fsynced here.

    Stamped appends go through ``producers``, the range's ``ProducerTable``; unless it is given,
    the table is rebuilt from the stamps the log holds (``RangeLog.recent_stamps``) when the
    first stamped append comes, and appends wait for that (``StampedAppends``). So a retry of a
    produce stored before a restart is not stored again."""

    def __init__(
        self, range_id: str, range_log: RangeLog, producers: ProducerTable | None = None
    ) -> None:
        self._range_id = range_id
        self._log = range_log
        self._stamped = StampedAppends(producers if producers is not None else self._rebuild)
        #: Long polls waiting for a record at an offset, woken by the appends that reach it.
        self._waiting: dict[Deferred[None], int] = {}

    @property
    def range_id(self) -> str:
        return self._range_id

    def refusal(self, count: int) -> BrokerError | None:
        refused = self._log.refusal(count)
        return None if refused is None else _storage_error(refused)

    def append(self, records: Records, stamp: ProducerStamp | None = None) -> Deferred[None]:
        return self._stamped.append(records, stamp, self._store)

    def _store(self, records: Records, stamp: ProducerStamp | None) -> Deferred[object]:
        stored = self._log.append(storable(records), stamp)
        stored.addCallbacks(self._appended, self._append_failed)
        return stored  # type: ignore[return-value]

    def _rebuild(self) -> Deferred[ProducerTable]:
        return self._log.recent_stamps().addCallbacks(ProducerTable.rebuild, self._rebuild_failed)

    def _rebuild_failed(self, failure: Failure) -> NoReturn:
        log.error(
            "Reading back the producer stamps stored in {range_id} failed: {error}",
            range_id=self._range_id,
            error=failure.getErrorMessage(),
        )
        raise BrokerError(
            Reason.UNREACHABLE,
            f"{self._range_id} could not read back which stamped produces it stored "
            f"({failure.getErrorMessage()}), so it takes none for now; retry",
        )

    def _appended(self, appended: Appended) -> Appended:
        self.wake()
        return appended

    def wake(self) -> None:
        """Wake the long polls the range's readable end has passed: after an append here, or
        when replication moved the commit index."""
        end = self._log.end_offset
        woken = [waiting for waiting, offset in self._waiting.items() if offset < end]
        for waiting in woken:
            del self._waiting[waiting]
            waiting.callback(None)

    def wait(self, offset: int, wait_ms: int) -> Deferred[None]:
        # Only a record can wake it: the caller's own timer ends a wait that finds none.
        if self._log.end_offset > offset:
            return succeed(None)
        waiting: Deferred[None] = Deferred(self._forget)
        self._waiting[waiting] = offset
        return waiting

    def _forget(self, cancelled: Deferred[None]) -> None:
        self._waiting.pop(cancelled, None)

    def _append_failed(self, failure: Failure) -> NoReturn:
        error = failure.value
        if isinstance(error, StorageError):
            # Shed load is not a failure; a log out of service said so once, when it failed.
            if not isinstance(error, OverloadedError | LogFailedError):
                log.error(
                    "A produce to {range_id} failed in storage: {error}",
                    range_id=self._range_id,
                    error=error,
                )
            raise _storage_error(error)
        failure.raiseException()

    def bounds(self) -> Deferred[Bounds]:
        return succeed(Bounds(self._log.start_offset, self._log.end_offset))

    def read(self, offset: int, max_records: int, max_bytes: int) -> Deferred[RangeRead]:
        offset = max(offset, self._log.start_offset)
        return read_records(self._log.read_chunks, offset, max_records, max_bytes)


#: ``(offset, max_bytes) -> the batches from the one holding offset on``, about ``max_bytes``
#: of them (``RangeLog.read_chunks``, or a replica's copy fetched over the peer link).
ChunkReader = Callable[[int, int], Deferred[list[BatchSlice]]]


def read_records(
    read_chunks: ChunkReader, offset: int, max_records: int, max_bytes: int
) -> Deferred[RangeRead]:
    """Records from ``offset`` in the client protocol's encoding, read through ``read_chunks``:
    at most ``max_records``, stopping once ``max_bytes`` of keys and values are taken."""
    parts: list[bytes] = []
    count = 0
    budget = max_bytes
    # Log bytes to read (in a reader thread): first enough for a small fetch, then what the
    # rest of the budget needs at the ratio of log bytes to keys and values seen.
    window = min(max_bytes, 64 * 1024)

    def transcode(chunks: list[BatchSlice]) -> Deferred[RangeRead] | RangeRead:
        nonlocal count, budget, offset, window
        read = taken_here = 0
        for chunk in chunks:
            if chunk.verified:
                start, end = chunk.records_region
                data, taken, offset, used = wire_records(
                    chunk.view, start, end, offset, max_records - count, budget
                )
                read += chunk.batch.length
            else:
                data, taken, offset, used = encode_stored(
                    chunk.records(), offset, max_records - count, budget
                )
            parts.append(data)
            count += taken
            budget -= used
            taken_here += used
            if count >= max_records or budget <= 0:
                break
        else:
            # Only verified batches say the log goes on after them (not damage, nor the end
            # of what readers may see).
            if chunks and chunks[-1].verified:
                window = max(2 * window, budget * read // max(taken_here, 1))
                return read_chunks(offset, window).addCallback(transcode)
        return RangeRead(tuple(parts), count, offset, max_bytes - budget)

    return read_chunks(offset, window).addCallback(transcode)


class LocalRanges:
    """The ``RangeDirectory`` of a single node: every range is a ``LocalRange`` on ``storage``."""

    def __init__(self, storage: OpenLogs) -> None:
        self._storage = storage
        self._handles: dict[str, LocalRange] = {}
        #: Ranges being opened, and who waits for each, in the order they asked: one open per
        #: range however many ask, and its waiters go on in that order (appends keep theirs).
        self._opening: dict[str, list[Deferred[None]]] = {}

    def handle(self, range_id: str) -> RangeHandle:
        handle = self._handles.get(range_id)
        if handle is None:
            range_log = self._storage.logs.get(range_id)
            if range_log is None:
                raise BrokerError(Reason.UNREACHABLE, f"range {range_id} is not open on this node")
            handle = self._handles[range_id] = LocalRange(range_id, range_log)
        return handle

    def prepare(self, range_id: str) -> Deferred[None]:
        return self.open([range_id])

    def open(self, range_ids: Sequence[str]) -> Deferred[None]:
        missing = [r for r in range_ids if r not in self._storage.logs]
        opened = [self._open(range_id) for range_id in missing]
        return gatherResults(opened, consumeErrors=True).addCallback(_nothing)

    def _open(self, range_id: str) -> Deferred[None]:
        waiter: Deferred[None] = Deferred()
        waiting = self._opening.get(range_id)
        if waiting is not None:
            waiting.append(waiter)
            return waiter
        self._opening[range_id] = [waiter]
        self._storage.open_range(range_id).addBoth(self._opened, range_id)
        return waiter

    def _opened(self, outcome: object, range_id: str) -> None:
        for waiter in self._opening.pop(range_id):
            if isinstance(outcome, Failure):
                waiter.errback(outcome)
            else:
                waiter.callback(None)


def _nothing(_: object) -> None:
    return None


def _storage_error(error: StorageError) -> BrokerError:
    if isinstance(error, OverloadedError):
        return BrokerError(Reason.OVERLOADED, str(error))
    if isinstance(error, LogFailedError):
        # Its own reason: the broker is not going away, this range's disk failed it.
        return BrokerError(Reason.STORAGE_UNAVAILABLE, f"storage refused the append: {error}")
    return BrokerError(Reason.UNREACHABLE, f"storage refused the append: {error}")
