"""The value objects of the range log's API: its configuration and what its operations answer."""

from __future__ import annotations

import abc
import itertools
from collections.abc import Iterator

import attrs
from twisted.internet.defer import Deferred

from logbroker.records import StoredRecord
from logbroker.storage._format import (
    MIN_BATCH_SIZE,
    BatchInfo,
    iter_batch_records,
    iter_valid_records,
)

DEFAULT_SEGMENT_MAX_BYTES = 64 * 1024 * 1024
#: Index entries hold 32-bit byte positions.
MAX_SEGMENT_BYTES = 0xFFFFFFFF


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, not {value}")


@attrs.frozen
class LogConfig:
    """How a range log rolls and commits; built from ``SVC_*`` settings by ``logbroker.config``."""

    roll_bytes: int = attrs.field(default=DEFAULT_SEGMENT_MAX_BYTES)
    group_commit: bool = False
    group_commit_interval_ms: int = attrs.field(default=5, validator=_positive)
    flush_max_records: int = attrs.field(default=8000, validator=_positive)
    max_inflight_records: int = attrs.field(default=200_000, validator=_positive)
    #: Seal the active segment and start the next one when a write would take it past
    #: ``roll_bytes``. Off, the owner decides when segments end (``active_bytes`` tells it how
    #: large the active one is); a segment still rolls at the format's limit of 4 GiB - 1.
    auto_roll: bool = True
    #: The log is one replica of a replicated range: readers see only what ``commit`` covers,
    #: and appends go only to a segment that ``start_segment`` (or recovery) made active.
    replicated: bool = attrs.field(default=False)

    @roll_bytes.validator
    def _check_roll_bytes(self, attribute: attrs.Attribute[int], value: int) -> None:
        if not MIN_BATCH_SIZE <= value <= MAX_SEGMENT_BYTES:
            raise ValueError(
                f"roll_bytes must be between {MIN_BATCH_SIZE} and {MAX_SEGMENT_BYTES}, not {value}"
            )

    @replicated.validator
    def _check_replicated(self, attribute: attrs.Attribute[bool], value: bool) -> None:
        if value and self.auto_roll:
            raise ValueError(
                "a replicated log never starts a segment by itself: set auto_roll=False "
                "(the primary ends segments through the control plane)"
            )


@attrs.frozen
class BatchSlice:
    """Stored bytes holding records: a whole batch whose checksum verified, or (``verified``
    false) a part of the log whose records must be checked one by one: the readable part of a
    damaged region, or a batch only partly committed (its records from ``limit`` on are not
    readable yet)."""

    view: memoryview
    batch: BatchInfo
    verified: bool
    limit: int | None = None

    def records(self) -> Iterator[StoredRecord]:
        """The records it holds that pass their checks, in offset order."""
        if self.verified:
            return iter_batch_records(self.view, self.batch)
        records = iter_valid_records(self.view, 0, len(self.view), self.batch.base_offset)
        limit = self.limit
        if limit is None:
            return records
        return itertools.takewhile(lambda stored: stored.offset < limit, records)

    @property
    def records_region(self) -> tuple[int, int]:
        """Where a verified batch's record frames lie in ``view``: ``[start, end)``."""
        return self.batch.records_start, self.batch.end


@attrs.frozen
class Flush:
    """One write and fsync of queued appends, as ``on_flushed`` hears of it."""

    records: int
    #: How long the writer thread took over the job (the write, the fsync, and a seal before
    #: them when the segment rolled), on its monotonic clock: disk time, without the wait for
    #: a free writer thread or for the reactor to take the result.
    seconds: float


@attrs.frozen
class Appended:
    """Where an acknowledged (durable) append landed."""

    base_offset: int
    record_count: int

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count


@attrs.frozen
class Written:
    """An append the log took: its offsets and stored bytes at once (what a primary sends to
    its followers), and ``durable``, which fires once they are fsynced here."""

    base_offset: int
    record_count: int
    data: bytes
    durable: Deferred[Appended] = attrs.field(eq=False, repr=False)


@attrs.frozen
class Fenced:
    """A segment copy fenced at ``epoch``: from then on it refuses appends of older epochs.
    ``end_offset`` and ``byte_size`` are its durable next offset and verified length once every
    append it took before the fence was written."""

    base_offset: int
    epoch: int
    end_offset: int
    byte_size: int


class FramedRecords(abc.ABC):
    """Records an append takes that frame themselves as one batch: a produce's records still
    in the client protocol's encoding (``logbroker.transcode.WireBatch``), which the log never
    decodes. A base class, not a Protocol: every append asks whether its records are these,
    and a runtime Protocol check costs microseconds where a class check costs nanoseconds."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """How many records."""

    @abc.abstractmethod
    def frame(self, base_offset: int) -> bytes:
        """The bytes ``encode_batch`` gives for the same records, the first taking
        ``base_offset``."""
