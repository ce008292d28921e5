"""The per-range log: durable appends, reads, rolling, sealing, trimming and verification.

A ``RangeLog`` owns one range directory. It lives in the reactor thread and never blocks: every
write, fsync, seal, trim, delete and verification is a job on the injected ``Executor``, and at
most one job per log is in flight, so the file sees appends in offset order. Appends queue up
while a job runs and go out together in the next one: one write and one fsync cover all of them,
up to ``flush_max_records`` records. An append's Deferred fires only after the fsync that covers
it has returned.

With ``group_commit`` on, an append is parked for up to ``group_commit_interval_ms`` (counted from
when it was queued, even behind a running job) so that more can join it; ``flush_max_records``
parked records flush at once. Whether on or off, an append that would take the parked and
in-flight records past ``max_inflight_records`` fails at once with ``OverloadedError``.

A failed write, fsync, seal or trim fails every append it covered and every append queued behind
it, and takes the log out of service (``LogFailedError``): after a failed fsync the kernel may
already have dropped the dirty pages, so nothing more is trusted until recovery reopens the log.
"""

from __future__ import annotations

import bisect
import posixpath
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import attrs
from twisted.internet.defer import Deferred, fail, maybeDeferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.records import Record, StoredRecord
from logbroker.storage._executor import Executor
from logbroker.storage._format import (
    BATCH_HEADER_SIZE,
    MIN_BATCH_SIZE,
    BatchInfo,
    Damage,
    DamageReason,
    IndexEntry,
    Seal,
    batch_length,
    check_batch_records,
    encode_batch,
    encode_index,
    encode_seal,
    iter_batch_records,
    iter_valid_records,
    scan_batches,
)
from logbroker.storage._fs import AppendFile, FileSystem, ReadFile
from logbroker.storage._segment import (
    INDEX_SUFFIX,
    LOG_SUFFIX,
    SEAL_SUFFIX,
    CopyState,
    IntegrityEvent,
    RecoveredLog,
    Segment,
    SegmentInfo,
    Verification,
    build_index,
    recover_log,
    segment_stem,
    verify_segment_bytes,
)
from logbroker.storage.errors import (
    InvalidBatchError,
    LogClosedError,
    LogFailedError,
    NotContiguousError,
    OffsetOutOfRangeError,
    OverloadedError,
    SegmentNotFoundError,
    SegmentStateError,
    StorageError,
)

_T = TypeVar("_T")

DEFAULT_SEGMENT_MAX_BYTES = 64 * 1024 * 1024
MAX_SEGMENT_BYTES = 0xFFFFFFFF
_FIRST_READ_WINDOW = 16 * 1024
_READ_WINDOW = 64 * 1024

log = Logger()


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

    @roll_bytes.validator
    def _check_roll_bytes(self, attribute: attrs.Attribute[int], value: int) -> None:
        if not MIN_BATCH_SIZE <= value <= MAX_SEGMENT_BYTES:
            raise ValueError(
                f"roll_bytes must be between {MIN_BATCH_SIZE} and {MAX_SEGMENT_BYTES}, not {value}"
            )


@attrs.frozen
class BatchSlice:
    """Stored bytes holding records: a whole batch whose checksum verified, or (``verified``
    false) the readable part of a damaged region, whose records must be checked one by one."""

    view: memoryview
    batch: BatchInfo
    verified: bool

    def records(self) -> Iterator[StoredRecord]:
        """The records it holds that pass their checks, in offset order."""
        if self.verified:
            return iter_batch_records(self.view, self.batch)
        return iter_valid_records(self.view, 0, len(self.view), self.batch.base_offset)

    @property
    def records_region(self) -> tuple[int, int]:
        """Where a verified batch's record frames lie in ``view``: ``[start, end)``."""
        return self.batch.position + BATCH_HEADER_SIZE, self.batch.end


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


def _base(segment: Segment) -> int:
    return segment.base_offset


class _Append:
    __slots__ = ("base_offset", "data", "deferred", "record_count")

    def __init__(self, base_offset: int, record_count: int, data: bytes) -> None:
        self.base_offset = base_offset
        self.record_count = record_count
        self.data = data
        self.deferred: Deferred[Appended] = Deferred()


class _Control:
    """A roll, trim or delete, run in queue order between appends."""

    __slots__ = ("deferred", "start")

    def __init__(self, start: Callable[[], Deferred[object]]) -> None:
        self.start = start
        self.deferred: Deferred[object] = Deferred()


@attrs.frozen
class _SealPlan:
    """Files to write when the active segment seals."""

    stem: str
    index: bytes
    seal: bytes


def _create_segment(fs: FileSystem, directory: str, path: str) -> AppendFile:
    """Create a new segment file; it is not durable until its directory entry is."""
    writer = fs.create_append(path)
    try:
        fs.sync_dir(directory)
    except BaseException:
        writer.close()
        raise
    return writer


def _roll_job(fs: FileSystem, directory: str, plan: _SealPlan, next_path: str) -> AppendFile:
    """Seal a segment and create the next one.

    Index first, then the marker: a marker on disk always has its index beside it. The next
    segment's file is created at once, so the range's end offset stays on disk (in that file's
    name) even if retention later deletes every sealed segment.
    """
    fs.write_atomic(plan.stem + INDEX_SUFFIX, plan.index)
    fs.write_atomic(plan.stem + SEAL_SUFFIX, plan.seal)
    return _create_segment(fs, directory, next_path)


def _write_job(
    fs: FileSystem,
    directory: str,
    seal_plan: _SealPlan | None,
    path: str,
    writer: AppendFile | None,
    new_segment: bool,
    data: bytes,
) -> tuple[AppendFile, float]:
    """Append ``data`` to the segment at ``path`` (sealing the previous one first, if planned)
    and fsync it; return the file and the seconds it all took. ``writer`` is the segment's open
    file; without one, a new segment's file is created (never an existing one reused) and a
    recovered segment's file is opened."""
    started = time.monotonic()
    opened = writer is None
    if seal_plan is not None:
        writer = _roll_job(fs, directory, seal_plan, path)
    elif writer is None:
        writer = _create_segment(fs, directory, path) if new_segment else fs.open_append(path)
    try:
        writer.write(data)
        writer.sync()
    except BaseException:
        if opened:
            writer.close()
        raise
    return writer, time.monotonic() - started


def _delete_files(fs: FileSystem, directory: str, stem: str) -> None:
    # The log goes first: recovery removes sidecars whose log is gone.
    for suffix in (LOG_SUFFIX, INDEX_SUFFIX, SEAL_SUFFIX):
        if fs.exists(stem + suffix):
            fs.remove(stem + suffix)
    fs.sync_dir(directory)


def _trim_job(
    fs: FileSystem, path: str, base_offset: int, byte_size: int, last: bool
) -> list[BatchInfo]:
    if byte_size == 0 and not last:
        # A copy that holds nothing committed is removed, not left as an empty file; the
        # range's last segment is kept (empty), for its name records where the range ends.
        _delete_files(fs, posixpath.dirname(path), path.removesuffix(LOG_SUFFIX))
        return []
    reader = fs.open_read(path)
    try:
        data = reader.read(0, byte_size)
    finally:
        reader.close()
    scan = scan_batches(data, 0, base_offset)
    if len(data) != byte_size or scan.damage is not None:
        raise SegmentStateError(
            f"{path}: the first {byte_size} bytes are not whole, verified batches; refusing to trim"
        )
    fs.truncate(path, byte_size)
    return scan.batches


def _verify_job(
    fs: FileSystem, path: str, limit: int | None, base: int, seal: Seal | None
) -> Verification:
    data = fs.read_file(path)
    if limit is not None:
        data = data[:limit]
    return verify_segment_bytes(data, base, seal)


class RangeLog:
    """The durable log of one range. Open it with ``RangeLog.open``."""

    def __init__(
        self,
        directory: str,
        recovered: RecoveredLog,
        *,
        fs: FileSystem,
        clock: IReactorTime,
        executor: Executor,
        config: LogConfig,
        on_integrity_event: Callable[[IntegrityEvent], None],
        on_sealed: Callable[[SegmentInfo], None],
        on_flushed: Callable[[Flush], None],
        start_offset: int,
    ) -> None:
        self.directory = directory
        self._fs = fs
        self._clock = clock
        self._executor = executor
        self._config = config
        self._on_integrity_event = on_integrity_event
        self._on_sealed = on_sealed
        self._on_flushed = on_flushed
        #: In base-offset order; bisected by ``_base``.
        self._segments = recovered.segments
        last = self._segments[-1] if self._segments else None
        self._active = last if last is not None and last.state is CopyState.ACTIVE else None
        #: The offset the next append takes (appends in flight included).
        self._next_offset = last.end_offset if last is not None else start_offset
        #: The offset after the last durable record: the log end readers see.
        self._durable_offset = self._next_offset
        self._queue: deque[_Append | _Control] = deque()
        self._queued_controls = 0
        #: Trims asked for and not finished: appends wait for none of them, they are refused.
        self._pending_trims = 0
        self._parked_records = 0
        self._inflight_records = 0
        self._job_running = False
        #: Append outcomes to deliver, in offset order (see ``_settle``).
        self._outcomes: deque[tuple[Deferred[Any], Appended | Exception]] = deque()
        self._settling = False
        self._timer: IDelayedCall | None = None
        self._timer_fired = False
        self._closing = False
        self._closed = False
        self._close_waiters: list[Deferred[None]] = []
        self._failure: Failure | None = None
        for event in recovered.events:
            self._report(event)
        for name in recovered.removed:
            log.info("Removed leftover file {name} in {directory}", name=name, directory=directory)
        for note in recovered.notes:
            log.warn("Recovery of {directory}: {note}", directory=directory, note=note)
        for path, old_size, new_size in recovered.truncated:
            log.info(
                "Recovery dropped a torn tail of {path}: {dropped} bytes after the last "
                "CRC-valid frame at byte {position}",
                path=path,
                dropped=old_size - new_size,
                position=new_size,
            )

    @classmethod
    def open(
        cls,
        directory: str,
        *,
        fs: FileSystem,
        clock: IReactorTime,
        executor: Executor,
        config: LogConfig | None = None,
        on_integrity_event: Callable[[IntegrityEvent], None] = lambda event: None,
        on_sealed: Callable[[SegmentInfo], None] = lambda info: None,
        on_flushed: Callable[[Flush], None] = lambda flush: None,
        start_offset: int = 0,
    ) -> Deferred[RangeLog]:
        """Recover ``directory`` (created if missing) in a writer thread and return its log.

        ``start_offset`` is where an empty range starts; a range with segments continues
        where its last segment ends. ``on_sealed`` hears of every seal, whether ``roll`` asked
        for it or the segment reached the roll size (the control plane records them).
        ``on_flushed`` hears of every write and fsync that completed, once per job (not per
        append), with or without group commit.
        """

        def opened(recovered: RecoveredLog) -> RangeLog:
            return cls(
                directory,
                recovered,
                fs=fs,
                clock=clock,
                executor=executor,
                config=config or LogConfig(),
                on_integrity_event=on_integrity_event,
                on_sealed=on_sealed,
                on_flushed=on_flushed,
                start_offset=start_offset,
            )

        return executor.run(recover_log, fs, directory).addCallback(opened)

    @classmethod
    def recover(
        cls,
        directory: str,
        *,
        fs: FileSystem,
        clock: IReactorTime,
        executor: Executor,
        config: LogConfig | None = None,
        on_integrity_event: Callable[[IntegrityEvent], None] = lambda event: None,
        on_sealed: Callable[[SegmentInfo], None] = lambda info: None,
        on_flushed: Callable[[Flush], None] = lambda flush: None,
        start_offset: int = 0,
    ) -> RangeLog:
        """Like ``open``, but recover in the calling thread: for start-up, before the reactor
        runs, so that a range that cannot be recovered stops the broker before it serves."""
        return cls(
            directory,
            recover_log(fs, directory),
            fs=fs,
            clock=clock,
            executor=executor,
            config=config or LogConfig(),
            on_integrity_event=on_integrity_event,
            on_sealed=on_sealed,
            on_flushed=on_flushed,
            start_offset=start_offset,
        )

    # -- positions ---------------------------------------------------------------------------

    @property
    def start_offset(self) -> int:
        """The first offset still stored (later than 0 once retention deleted segments)."""
        return self._segments[0].base_offset if self._segments else self._durable_offset

    @property
    def end_offset(self) -> int:
        """The offset after the last durable record: reads reach up to here, except past rot
        (records after damage are durable but unreadable in this copy)."""
        return self._durable_offset

    @property
    def next_offset(self) -> int:
        """The offset the next append will take (appends not yet durable included)."""
        return self._next_offset

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def segments(self) -> list[SegmentInfo]:
        return [segment.info() for segment in self._segments]

    # -- appends -----------------------------------------------------------------------------

    def refusal(self, count: int) -> StorageError | None:
        """The error an append of ``count`` records would fail with at once, if any: lets a
        caller writing to several logs refuse the whole write before any part of it is stored."""
        return self._refuse_append(count)

    def _refuse_append(self, count: int) -> StorageError | None:
        if self._failure is not None:
            return LogFailedError(
                f"{self.directory} is out of service after a write error "
                f"({self._failure.getErrorMessage()}); restart to recover it"
            )
        if self._closing:
            return LogClosedError(f"{self.directory} is closed")
        if self._pending_trims:
            return SegmentStateError(
                f"{self.directory} is being trimmed back to a sealed length; append again after"
            )
        waiting = self._parked_records + self._inflight_records
        if waiting + count > self._config.max_inflight_records:
            return OverloadedError(
                f"{waiting} records already wait for their fsync in {self.directory} "
                f"(limit {self._config.max_inflight_records}); retry later"
            )
        return None

    def append(self, records: Sequence[Record]) -> Deferred[Appended]:
        """Append ``records`` as one batch; fires once they are durable, with their offsets."""
        if not records:
            return fail(ValueError("append needs at least one record"))
        refusal = self._refuse_append(len(records))
        if refusal is not None:
            return fail(refusal)
        data = encode_batch(self._next_offset, records)
        return self._enqueue(_Append(self._next_offset, len(records), data))

    def append_raw(self, base_offset: int, data: bytes) -> Deferred[Appended]:
        """Append whole batches as a primary sent them (replication), after verifying them."""
        if base_offset != self._next_offset:
            return fail(
                NotContiguousError(
                    f"{self.directory} ends at offset {self._next_offset}; "
                    f"batches for offset {base_offset} do not follow it"
                )
            )
        scan = scan_batches(data, 0, base_offset)
        damage = scan.damage
        if damage is None:
            # Bytes from a peer are not trusted on the batch checksum alone: every record must
            # pass its own, carry its offset and decode exactly.
            damage = next(filter(None, (check_batch_records(data, b) for b in scan.batches)), None)
        if damage is not None or not scan.batches:
            where = damage.position if damage is not None else 0
            return fail(InvalidBatchError(f"replicated bytes fail verification at byte {where}"))
        count = scan.batches[-1].next_offset - base_offset
        refusal = self._refuse_append(count)
        if refusal is not None:
            return fail(refusal)
        return self._enqueue(_Append(base_offset, count, bytes(data)))

    def _enqueue(self, append: _Append) -> Deferred[Appended]:
        self._next_offset += append.record_count
        self._parked_records += append.record_count
        self._queue.append(append)
        self._kick()
        return append.deferred

    # -- the writer --------------------------------------------------------------------------

    def _flush_due(self) -> bool:
        if not self._config.group_commit or self._closing or self._timer_fired:
            return True
        if self._parked_records >= self._config.flush_max_records:
            return True
        return self._queued_controls > 0

    def _kick(self) -> None:
        if not self._queue:
            return
        if self._job_running:
            # The parking time of appends queued behind a running job starts now, not after it.
            self._start_timer()
            return
        head = self._queue[0]
        if isinstance(head, _Control):
            self._queue.popleft()
            self._queued_controls -= 1
            self._job_running = True
            # Whatever starting the operation raises fails that operation, never the queue.
            maybeDeferred(head.start).addBoth(self._control_done, head)
            return
        if not self._flush_due():
            self._start_timer()
            return
        self._start_write()

    def _start_timer(self) -> None:
        if self._config.group_commit and self._timer is None and not self._timer_fired:
            self._timer = self._clock.callLater(
                self._config.group_commit_interval_ms / 1000.0, self._timer_expired
            )

    def _timer_expired(self) -> None:
        self._timer = None
        self._timer_fired = True
        self._kick()

    def _seal_plan(self, segment: Segment) -> tuple[_SealPlan, Seal]:
        seal = Seal(
            segment.base_offset,
            segment.next_offset - segment.base_offset,
            segment.readable_end,
            int(self._clock.seconds() * 1000),
        )
        plan = _SealPlan(
            segment.stem, encode_index(segment.base_offset, segment.index), encode_seal(seal)
        )
        return plan, seal

    def _segment_path(self, base_offset: int) -> str:
        return f"{self.directory}/{segment_stem(base_offset)}{LOG_SUFFIX}"

    def _start_write(self) -> None:
        target = self._active
        first = self._queue[0]
        assert isinstance(first, _Append)
        sealing: tuple[_SealPlan, Segment, Seal] | None = None
        if target is not None and target.damage is not None:
            # Rot was found in the active segment: it takes no more appends.
            target.state = CopyState.CLOSED
            if target.writer is not None:
                target.writer.close()
                target.writer = None
            self._active = target = None
        elif (
            target is not None
            and target.readable_end > 0
            and target.readable_end + len(first.data) > self._config.roll_bytes
        ):
            plan, seal = self._seal_plan(target)
            sealing = (plan, target, seal)
            target = None
        position = target.readable_end if target is not None else 0
        taken: list[_Append] = []
        size = records = 0
        while self._queue and isinstance(self._queue[0], _Append):
            candidate = self._queue[0]
            if taken and (
                position + size + len(candidate.data) > self._config.roll_bytes
                or records + candidate.record_count > self._config.flush_max_records
            ):
                break
            taken.append(candidate)
            self._queue.popleft()
            size += len(candidate.data)
            records += candidate.record_count
        self._parked_records -= records
        self._inflight_records += records
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # Appends left behind by a roll are due at once; appends arriving later start a new wait.
        self._timer_fired = bool(self._queue) and isinstance(self._queue[0], _Append)
        path = target.path if target is not None else self._segment_path(taken[0].base_offset)
        data = taken[0].data if len(taken) == 1 else b"".join(item.data for item in taken)
        self._job_running = True
        job = self._executor.run(
            _write_job,
            self._fs,
            self.directory,
            sealing[0] if sealing is not None else None,
            path,
            target.writer if target is not None else None,
            target is None,
            data,
        )
        job.addCallbacks(
            self._write_done,
            self._write_failed,
            callbackArgs=(taken, target, sealing, records),
            errbackArgs=(taken, records),
        )

    def _apply_seal(self, segment: Segment, seal: Seal, next_writer: AppendFile) -> SegmentInfo:
        """A seal is durable and the next segment's file exists: switch to it."""
        if segment.writer is not None:
            segment.writer.close()
            segment.writer = None
        segment.state = CopyState.SEALED
        segment.seal = seal
        segment.has_marker = True
        self._start_segment(seal.next_offset, next_writer)
        log.info(
            "Sealed segment {path}: {records} records, {size} bytes",
            path=segment.path,
            records=seal.record_count,
            size=seal.byte_size,
        )
        info = segment.info()
        self._call_hook(self._on_sealed, info)
        return info

    def _start_segment(self, base: int, writer: AppendFile) -> Segment:
        segment = Segment(base, self._segment_path(base), CopyState.ACTIVE, 0, base, base, [], None)
        segment.writer = writer
        self._segments.append(segment)
        self._active = segment
        return segment

    def _write_done(
        self,
        written: tuple[AppendFile, float],
        taken: list[_Append],
        target: Segment | None,
        sealing: tuple[_SealPlan, Segment, Seal] | None,
        records: int,
    ) -> None:
        writer, seconds = written
        self._call_hook(self._on_flushed, Flush(records, seconds))
        if sealing is not None:
            _, sealed, seal = sealing
            self._apply_seal(sealed, seal, writer)
        if target is None:
            # The roll above started the segment; otherwise this write created its file.
            target = self._active if sealing is not None else None
        if target is None:
            target = self._start_segment(taken[0].base_offset, writer)
        target.writer = writer
        end = taken[-1].base_offset + taken[-1].record_count
        target.end_offset = self._durable_offset = end
        self._inflight_records -= records
        outcomes: list[Appended | StorageError] = []
        if target.damage is None:
            for item in taken:
                batch = BatchInfo(
                    target.readable_end, len(item.data), item.base_offset, item.record_count
                )
                build_index([batch], target.index)
                target.readable_end = batch.end
                outcomes.append(Appended(item.base_offset, item.record_count))
            target.next_offset = end
        else:
            # Rot was found in this segment while the write was in flight. The records are on
            # disk but after the damage, where no read reaches them: fail them so the producer
            # retries into a healthy segment. Their offsets are never reused.
            error = StorageError(
                f"{target.path} was found damaged at byte {target.damage.position} while this "
                "append was being written after it; the append was not stored readably, retry it"
            )
            outcomes = [error] * len(taken)
        # With a full job's worth of appends already queued, the next write starts before the
        # acknowledgements run, so the disk is not idle while their callbacks (often new
        # appends, each encoded on this thread) run. Otherwise acknowledge while the writer
        # still counts as busy: appends that callbacks issue all queue up and go out together
        # in the next job, instead of the first one going alone.
        next_job_full = (
            bool(self._queue)
            and isinstance(self._queue[0], _Append)
            and self._parked_records >= self._config.flush_max_records
        )
        self._outcomes.extend(
            (item.deferred, outcome) for item, outcome in zip(taken, outcomes, strict=True)
        )
        if next_job_full:
            self._job_running = False
            try:
                self._after_job()
            finally:
                self._settle()
        else:
            self._settle()
            self._job_running = False
            self._after_job()

    def _settle(self) -> None:
        """Fire queued append outcomes in order. Outcomes queued by a job that finished while
        these callbacks ran (an executor may fire at once) wait their turn behind them."""
        if self._settling:
            return
        self._settling = True
        try:
            while self._outcomes:
                deferred, outcome = self._outcomes.popleft()
                if isinstance(outcome, Exception):
                    deferred.errback(outcome)
                else:
                    deferred.callback(outcome)
        finally:
            self._settling = False

    def _write_failed(self, failure: Failure, taken: list[_Append], records: int) -> None:
        self._inflight_records -= records
        self._take_out_of_service(failure, taken)
        self._job_running = False
        self._after_job()

    def _take_out_of_service(self, failure: Failure, covered: list[_Append]) -> None:
        """A write, fsync or seal failed: what reached the disk is unknown until recovery."""
        self._failure = failure
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._active is not None:
            self._active.state = CopyState.CLOSED
        queued, self._queue = list(self._queue), deque()
        self._queued_controls = 0
        self._parked_records = 0
        log.failure(
            "A write, fsync or seal failed in {directory}; {count} appends fail and the range "
            "is out of service until restart",
            failure,
            directory=self.directory,
            count=len(covered) + sum(isinstance(item, _Append) for item in queued),
        )
        error = LogFailedError(
            f"a write, fsync or seal failed in {self.directory}: {failure.getErrorMessage()}"
        )
        self._outcomes.extend((item.deferred, error) for item in [*covered, *queued])
        self._settle()

    def _control_done(self, result: object, control: _Control) -> None:
        if isinstance(result, Failure):
            control.deferred.errback(result)
        else:
            control.deferred.callback(result)
        self._job_running = False
        self._after_job()

    def _after_job(self) -> None:
        if self._closing and not self._queue and not self._job_running:
            if not self._closed:
                self._finish_close()
        else:
            self._kick()

    def _run_control(self, start: Callable[[], Deferred[object]]) -> Deferred[object]:
        if self._failure is not None:
            return fail(LogFailedError(f"{self.directory} is out of service after a write error"))
        if self._closing:
            return fail(LogClosedError(f"{self.directory} is closed"))
        control = _Control(start)
        self._queue.append(control)
        self._queued_controls += 1
        self._kick()
        return control.deferred

    # -- sealing, trimming, deleting -----------------------------------------------------------

    def roll(self) -> Deferred[SegmentInfo | None]:
        """Seal the active segment after the appends queued before this call.

        Fires with the sealed segment (its record count and byte size go to the control
        plane), or ``None`` when there was nothing to seal. The next append starts a new segment.
        """

        def start() -> Deferred[object]:
            active = self._active
            if active is None or active.readable_end == 0 or active.damage is not None:
                return succeed(None)
            plan, seal = self._seal_plan(active)
            rolled = self._executor.run(
                _roll_job, self._fs, self.directory, plan, self._segment_path(seal.next_offset)
            )

            def failed(failure: Failure) -> Failure:
                self._take_out_of_service(failure, [])
                return failure

            return rolled.addCallbacks(
                lambda writer: self._apply_seal(active, seal, writer), failed
            )

        return self._run_control(start)  # type: ignore[return-value]

    def _find(self, base_offset: int) -> Segment:
        slot = bisect.bisect_left(self._segments, base_offset, key=_base)
        if slot == len(self._segments) or self._segments[slot].base_offset != base_offset:
            raise SegmentNotFoundError(f"{self.directory} has no segment at offset {base_offset}")
        return self._segments[slot]

    def delete_segment(self, base_offset: int) -> Deferred[None]:
        """Delete a segment that is no longer appended to (retention, or repair of a copy).

        The last segment of a range is never deleted: its file name (or seal) is where the
        range's end offset survives a restart.
        """

        def start() -> Deferred[object]:
            segment = self._find(base_offset)
            if segment is self._segments[-1]:
                raise SegmentStateError(
                    f"{segment.path} is the last segment of its range; it cannot be deleted"
                )
            if segment.reader is not None:
                segment.reader.close()
                segment.reader = None
            self._segments.remove(segment)
            return self._executor.run(_delete_files, self._fs, self.directory, segment.stem)

        return self._run_control(start)  # type: ignore[return-value]

    def trim(self, base_offset: int, byte_size: int) -> Deferred[SegmentInfo]:
        """Cut an unsealed copy back to ``byte_size``: bytes past a sealed length were never
        acknowledged. Refused, changing nothing, on a copy with its own seal marker, on rot
        before that length, and on a length that is not the end of a verified batch. Rot past
        the length is in bytes the sealed segment never held, and goes with them. Trimming a
        copy to 0 bytes removes its files, except the range's last segment, which stays as an
        empty active segment (its name records where the range ends). Appends made before the
        trim go first; appends made while it is pending are refused (they would hold offsets
        past its end). A trim whose I/O fails takes the range out of service.
        """

        def start() -> Deferred[object]:
            segment = self._find(base_offset)
            if segment.has_marker:
                raise SegmentStateError(
                    f"{segment.path} carries its own seal marker; never trimmed"
                )
            if segment.damage is not None and segment.damage.position < byte_size:
                raise SegmentStateError(
                    f"{segment.path} is damaged at byte {segment.damage.position} "
                    f"({segment.damage.reason.value}); rot is never trimmed"
                )
            if byte_size > segment.readable_end:
                raise SegmentStateError(
                    f"{segment.path} holds {segment.readable_end} verified bytes, "
                    f"fewer than {byte_size}"
                )
            last = segment is self._segments[-1]
            if segment.writer is not None:
                segment.writer.close()
                segment.writer = None
            if segment.reader is not None:
                segment.reader.close()
                segment.reader = None
            before = (segment.state, segment.readable_end, self._active)
            if segment is self._active:
                self._active = None
            segment.state = CopyState.CLOSED
            # Reads must not reach bytes the trim is about to cut.
            segment.readable_end = byte_size

            def trimmed(batches: list[BatchInfo]) -> SegmentInfo:
                segment.next_offset = segment.end_offset = (
                    batches[-1].next_offset if batches else segment.base_offset
                )
                segment.index = build_index(batches)
                segment.damage = None
                if last:
                    self._next_offset = self._durable_offset = segment.next_offset
                if byte_size == 0 and last:
                    segment.state = CopyState.ACTIVE
                    self._active = segment
                info = segment.info()
                if byte_size == 0 and not last:
                    self._segments.remove(segment)
                return info

            def failed(failure: Failure) -> Failure:
                if isinstance(failure.value, SegmentStateError):
                    # Refused before the file was touched: nothing changed.
                    segment.state, segment.readable_end, self._active = before
                else:
                    self._take_out_of_service(failure, [])
                return failure

            return self._executor.run(
                _trim_job, self._fs, segment.path, base_offset, byte_size, last
            ).addCallbacks(trimmed, failed)

        def finished(result: object) -> object:
            self._pending_trims -= 1
            return result

        trimming = self._run_control(start)
        if not trimming.called:
            self._pending_trims += 1
            trimming.addBoth(finished)
        return trimming  # type: ignore[return-value]

    # -- verification ------------------------------------------------------------------------

    def verify_segment(self, base_offset: int) -> Deferred[Verification]:
        """Check every checksum of a segment (and a sealed one's recorded size and count).

        Never changes the file. Damage found is reported as an integrity event, and reads of
        the segment stop before it from then on.
        """

        def start() -> Deferred[object]:
            segment = self._find(base_offset)
            limit = None if segment.state is not CopyState.ACTIVE else segment.readable_end

            def checked(result: Verification) -> Verification:
                if result.damage is not None:
                    self._found_damage(segment, result.damage)
                return result

            return self._executor.run(
                _verify_job, self._fs, segment.path, limit, base_offset, segment.seal
            ).addCallback(checked)

        return self._run_control(start)  # type: ignore[return-value]

    def _found_damage(self, segment: Segment, damage: Damage) -> None:
        segment.readable_end = min(segment.readable_end, damage.position)
        if segment.damage is not None:
            # Already reported and counted for this copy; only narrow what reads may reach.
            return
        segment.damage = damage
        self._report(
            IntegrityEvent(
                damage.reason,
                segment.path,
                segment.base_offset,
                damage.position,
                segment.has_marker,
            )
        )

    def _report(self, event: IntegrityEvent) -> None:
        if event.counted:
            log.error(
                "Integrity failure in {segment} at byte {position}: {reason}; the copy is "
                "damaged and reads stop before that byte. Frames after it are kept for salvage.",
                segment=event.segment,
                position=event.position,
                reason=event.reason.value,
                base_offset=event.base_offset,
                sealed=event.sealed,
            )
        else:
            log.info(
                "Torn tail in {segment} at byte {position} (crash recovery; never acknowledged)",
                segment=event.segment,
                position=event.position,
            )
        self._call_hook(self._on_integrity_event, event)

    def _call_hook(self, hook: Callable[[_T], None], value: _T) -> None:
        """Tell the owner of this log something; a failing hook is logged, never fatal here."""
        try:
            hook(value)
        except Exception:
            log.failure("A storage hook failed in {directory}", directory=self.directory)

    # -- reads -------------------------------------------------------------------------------

    def _reader(self, segment: Segment) -> ReadFile:
        if segment.reader is None:
            segment.reader = self._fs.open_read(segment.path)
        return segment.reader

    def _index_entry(self, segment: Segment, offset: int) -> IndexEntry:
        entries = segment.index
        slot = bisect.bisect_right(entries, offset, key=lambda entry: entry.offset) - 1
        return entries[slot] if slot >= 0 else IndexEntry(segment.base_offset, 0)

    def _batches(
        self, segment: Segment, offset: int, want_bytes: int
    ) -> Iterator[tuple[memoryview, BatchInfo, bool]]:
        """Yield verified batches that hold ``offset`` or later, as (view, batch, whole).

        A batch found damaged is yielded once with ``whole`` false (its records before the
        damage still verify on their own), then iteration stops.
        """
        entry = self._index_entry(segment, offset)
        position, expected = entry.position, entry.offset
        # Start small (a read often wants a few records) and grow towards what was asked for.
        window = _FIRST_READ_WINDOW
        while position < segment.readable_end:
            wanted = min(window, segment.readable_end - position)
            data = self._reader(segment).read(position, wanted)
            if len(data) < wanted:
                # The file is shorter than the bytes it verified or was sealed with: acknowledged
                # bytes are gone (truncated or deleted under the broker).
                self._found_damage(segment, Damage(position + len(data), DamageReason.SIZE))
                data = data[: segment.readable_end - position]
            window = min(2 * window, max(want_bytes, _READ_WINDOW))
            view = memoryview(data)
            scan = scan_batches(view, 0, expected)
            for batch in scan.batches:
                if batch.next_offset > offset:
                    yield view, batch, True
            if scan.batches:
                expected = scan.batches[-1].next_offset
            damage = scan.damage
            window_start, position = position, position + scan.end
            if damage is None:
                continue
            if damage.torn:
                needed = batch_length(data[scan.end :]) or BATCH_HEADER_SIZE
                if (
                    needed > len(data) - scan.end
                    and window_start + len(data) < segment.readable_end
                ):
                    # The read window ended inside a batch; read that batch whole next time.
                    window = max(window, needed)
                    continue
                # Every byte below the readable end was verified when it was written or
                # recovered, so a frame that now looks cut short, or zeros, is rot: unless it
                # is only the known damage of this copy, seen again at its readable end.
                if segment.damage is None:
                    damage = Damage(damage.position, DamageReason.HEADER)
            if not damage.torn:
                self._found_damage(segment, Damage(window_start + damage.position, damage.reason))
            # Records of the damaged batch that end before the damage still verify on their own.
            stop = min(len(data), segment.readable_end - window_start)
            if stop - scan.end > BATCH_HEADER_SIZE:
                yield view[scan.end : stop], BatchInfo(0, stop - scan.end, expected, 0), False
            return

    def read(
        self, offset: int, max_records: int = 1000, max_bytes: int = 1024 * 1024
    ) -> list[StoredRecord]:
        """Records from ``offset`` on, at most ``max_records`` and about ``max_bytes`` of keys
        and values (always at least one record if any is there).

        Only durable records are returned. A damaged copy returns the records before the damage
        and nothing after, with no error.
        """
        records: list[StoredRecord] = []
        budget = max_bytes
        for chunk in self.read_batches(offset, max_bytes):
            for stored in chunk.records():
                if stored.offset < offset:
                    continue
                records.append(stored)
                budget -= len(stored.record.value) + len(stored.record.key or b"")
                if len(records) >= max_records or budget <= 0:
                    return records
        return records

    def read_batches(self, offset: int, max_bytes: int = 1024 * 1024) -> Iterator[BatchSlice]:
        """The durable batches from the one holding ``offset`` on, in order, reading about
        ``max_bytes`` of the log at a time: what ``read`` decodes, for callers that want the
        bytes (a batch may start before ``offset``; skip its earlier records). Ends before any
        damage, like ``read``."""
        if offset < self.start_offset:
            raise OffsetOutOfRangeError(offset, self.start_offset, self.end_offset)
        slot = max(0, bisect.bisect_right(self._segments, offset, key=_base) - 1)
        for segment in self._segments[slot:]:
            if segment.next_offset <= offset and segment.damage is None:
                continue
            for view, batch, whole in self._batches(segment, offset, max_bytes):
                yield BatchSlice(view, batch, whole)
            if segment.damage is not None or segment.next_offset < segment.end_offset:
                return
            offset = segment.next_offset

    def read_raw(self, offset: int, max_bytes: int = 1024 * 1024) -> bytes:
        """Whole verified batches from the one holding ``offset`` on, for a following replica.

        Returns at least one batch when there is one, and stops at the end of a segment.
        """
        if offset < self.start_offset:
            raise OffsetOutOfRangeError(offset, self.start_offset, self.end_offset)
        slot = max(0, bisect.bisect_right(self._segments, offset, key=_base) - 1)
        if slot >= len(self._segments):
            return b""
        parts: list[bytes] = []
        size = 0
        for view, batch, whole in self._batches(self._segments[slot], offset, max_bytes):
            if not whole or (parts and size + batch.length > max_bytes):
                break
            parts.append(bytes(view[batch.position : batch.end]))
            size += batch.length
        return b"".join(parts)

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> Deferred[None]:
        """Flush queued appends, wait for the writer, then close every file."""
        if self._closed:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._close_waiters.append(waiter)
        if not self._closing:
            self._closing = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._after_job()
        return waiter

    def _finish_close(self) -> None:
        for segment in self._segments:
            for handle in (segment.writer, segment.reader):
                if handle is not None:
                    handle.close()
            segment.writer = segment.reader = None
        self._closed = True
        waiters, self._close_waiters = self._close_waiters, []
        for waiter in waiters:
            waiter.callback(None)
