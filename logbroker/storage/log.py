"""The per-range log: durable appends, reads, rolling, sealing, trimming, verification, and what
a replica of a replicated range needs (epochs and fencing, segments with gaps, sealing to a given
length, installing sealed segments, a commit index).

A ``RangeLog`` owns one range directory. It lives in the reactor thread and never blocks: every
write, fsync, seal, trim, delete and verification is a job on the injected ``Executor``, and at
most one job per log is in flight, so the file sees appends in offset order. Appends queue up
while a job runs and go out together in the next one: one write and one fsync cover all of them,
up to ``flush_max_records`` records. An append's Deferred fires only after the fsync that covers
it has returned. Reads that return a Deferred (``read_chunks``, ``read_raw_async``) read and check
files on a reader executor, outside that queue.

With ``group_commit`` on, an append is parked for up to ``group_commit_interval_ms`` (counted from
when it was queued, even behind a running job) so that more can join it; ``flush_max_records``
parked records flush at once. Whether on or off, an append that would take the parked and
in-flight records past ``max_inflight_records`` fails at once with ``OverloadedError``.

A failed write, fsync or seal fails every append it covered and every append queued behind
it, and takes the log out of service (``LogFailedError``): after a failed fsync the kernel may
already have dropped the dirty pages, so nothing more is trusted until recovery reopens the log.

The work is split by responsibility: ``_state`` (segments and offsets), ``_planner`` (when to
write, pure), ``_pipeline`` (the job queue), ``_operations`` (segment operations), ``_reads``
(the read path) and ``_jobs`` (the blocking parts). This module assembles them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from logbroker.records import ProducerStamp, Record, StoredRecord
from logbroker.storage._atomic import AtomicWrites
from logbroker.storage._digests import CopyDigests, CopyFiles, digest_copies
from logbroker.storage._executor import Executor
from logbroker.storage._flush import SharedFlush
from logbroker.storage._format import Damage, encode_batch, stamp_batch
from logbroker.storage._fs import FileSystem
from logbroker.storage._handles import OpenFiles
from logbroker.storage._operations import SegmentOperations
from logbroker.storage._pipeline import Append, WritePipeline
from logbroker.storage._reads import LogReader
from logbroker.storage._segment import (
    IntegrityEvent,
    RecoveredLog,
    Segment,
    SegmentInfo,
    Verification,
    recover_log,
    verify_peer_batches,
)
from logbroker.storage._state import LogState
from logbroker.storage._values import (
    DEFAULT_SEGMENT_MAX_BYTES,
    MAX_SEGMENT_BYTES,
    Appended,
    BatchSlice,
    Fenced,
    Flush,
    FramedRecords,
    LogConfig,
    Written,
)
from logbroker.storage.errors import (
    FencedError,
    NotContiguousError,
    SegmentNotFoundError,
    StorageError,
)

__all__ = [
    "DEFAULT_SEGMENT_MAX_BYTES",
    "MAX_SEGMENT_BYTES",
    "Appended",
    "BatchSlice",
    "Fenced",
    "Flush",
    "FramedRecords",
    "LogConfig",
    "RangeLog",
    "Written",
]

log = Logger()

#: How much of the log ``recent_stamps`` reads by default. A client retries a produce for at most
#: 30 s, and only one whose answer did not come: after a restart or failover, one in flight when
#: the range stopped (at most ``wire.PRODUCER_WINDOW``, 32, per producer). So the stamps a rebuilt
#: table needs are at the very end of the log: the last write jobs before the stop (at most 8000
#: records each, ``LogConfig.flush_max_records``) and, on a replicated range, what was not
#: committed yet. 16 MiB holds the last few jobs of records of up to a couple of KiB, and the
#: whole 30 s of a range taking up to 500 KiB/s. It is read in one pass in a reader thread when a
#: range first needs its table: about 10 ms for batches of many records, 0.4 s for 16 MiB of
#: one-record batches (Python walks each batch header), which is why it is not larger.
RECENT_STAMPS_BYTES = 16 * 1024 * 1024


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
        reader: Executor | None = None,
        sealer: Executor | None = None,
        shared_flush: SharedFlush | None = None,
        open_files: OpenFiles | None = None,
    ) -> None:
        self.directory = directory
        self._state = LogState(
            directory,
            recovered,
            replicated=config.replicated,
            start_offset=start_offset,
            on_integrity_event=on_integrity_event,
            on_sealed=on_sealed,
            open_files=open_files,
        )
        self._pipeline = WritePipeline(
            self._state,
            fs=fs,
            clock=clock,
            executor=executor,
            sealer=sealer or executor,
            config=config,
            on_flushed=on_flushed,
            shared_flush=shared_flush,
        )
        self._operations = SegmentOperations(
            self._state,
            self._pipeline,
            fs=fs,
            executor=executor,
            reader=reader or executor,
            sealer=sealer or executor,
            atomic=AtomicWrites(fs, executor, shared_flush),
        )
        self._reads = LogReader(self._state, fs, reader or executor)
        self._fs = fs
        self._reader = reader or executor
        for event in recovered.events:
            self._state.report(event)
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
        # A crash may have come before the seal of a segment that rolled over was durable.
        self._pipeline.seal_behind()

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
        reader: Executor | None = None,
        sealer: Executor | None = None,
        shared_flush: SharedFlush | None = None,
        open_files: OpenFiles | None = None,
    ) -> Deferred[RangeLog]:
        """Recover ``directory`` (created if missing) in a writer thread and return its log.

        ``start_offset`` is where an empty range starts; a range with segments continues
        where its last segment ends. ``on_sealed`` hears of every seal this log decides,
        whether ``roll`` asked for it or the segment reached the roll size (the control plane
        records them); not of ``seal_copy`` or ``install_segment``, which follow a seal the
        control plane already holds. ``on_flushed`` hears of every write and fsync that
        completed, once per job (not per append), with or without group commit. ``reader`` is
        the executor for ``read_chunks`` and ``read_raw_async`` (default: ``executor``);
        ``sealer`` the one for the seals behind the appends, which read back whole segments
        (default: ``executor``; the broker gives them a thread of their own, so that they never
        hold every writer thread while a new segment's file waits to be made).
        With ``shared_flush``, a write job does not fsync its segment: the flush makes it
        durable together with other logs' writes (``logbroker.storage._flush``). With
        ``open_files``, the log's open segment files count in the node's budget, which closes
        them while idle (``logbroker.storage._handles``).
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
                reader=reader,
                sealer=sealer,
                shared_flush=shared_flush,
                open_files=open_files,
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
        reader: Executor | None = None,
        sealer: Executor | None = None,
        shared_flush: SharedFlush | None = None,
        open_files: OpenFiles | None = None,
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
            reader=reader,
            sealer=sealer,
            shared_flush=shared_flush,
            open_files=open_files,
        )

    # -- positions ---------------------------------------------------------------------------

    @property
    def _segments(self) -> list[Segment]:
        # The segment table, for tests that reach into a segment's open files.
        return self._state.segments

    @property
    def start_offset(self) -> int:
        """The first offset still stored (later than 0 once retention deleted segments)."""
        return self._state.start_offset

    @property
    def end_offset(self) -> int:
        """The offset readers see up to: ``min(committed_offset, durable_offset)``. Reads,
        bounds and long polls stop here, and before rot (records after damage are durable but
        unreadable in this copy)."""
        return self._state.end_offset

    @property
    def durable_offset(self) -> int:
        """The offset after the last record fsynced here."""
        return self._state.durable_offset

    @property
    def committed_offset(self) -> int:
        """Without ``replicated``: the durable offset. With it: what ``commit`` last set (at
        recovery: the end of the last sealed segment), which may be past what this copy holds."""
        return self._state.committed_offset

    @property
    def next_offset(self) -> int:
        """The offset the next append will take (appends not yet durable included)."""
        return self._state.next_offset

    @property
    def active_bytes(self) -> int:
        """The verified length of the active segment (0 without one): for an owner that decides
        itself when segments end (``auto_roll`` off)."""
        active = self._state.active
        return active.readable_end if active is not None else 0

    @property
    def failed(self) -> bool:
        """Out of service since a write or fsync failed: appends are refused."""
        return self._pipeline.failure is not None

    def return_to_service(self) -> Deferred[bool]:
        """Take appends again after a failed write or fsync, once a probe write and fsync
        succeed: the active segment is cut back to what was acknowledged first. ``False``
        while the probe fails, or when the failure left more in doubt than the active
        segment's tail (then only a restart's recovery brings the range back)."""
        return self._pipeline.return_to_service()

    def segments(self) -> list[SegmentInfo]:
        return [segment.info() for segment in self._state.segments]

    def segment(self, base_offset: int) -> SegmentInfo | None:
        """The segment at ``base_offset``, if this log holds one (found by bisection: a range
        of many segments is not listed whole to find one)."""
        try:
            return self._state.find(base_offset).info()
        except SegmentNotFoundError:
            return None

    def segment_epoch(self, base_offset: int) -> int:
        """The replication epoch of a segment (0 unless fenced or started at another).

        ``SegmentNotFoundError`` for a segment this log does not hold; ``FencedError`` when
        the epoch is unknown (its marker is unreadable) until the segment is fenced again.
        """
        epoch = self._state.epoch_of(base_offset)
        if epoch is None:
            raise FencedError(
                f"the epoch of segment {base_offset} in {self.directory} is unknown (its epoch "
                "marker is unreadable); fence the segment again"
            )
        return epoch

    def segment_data_epoch(self, base_offset: int) -> int:
        """The epoch of the primary whose records a segment's bytes are: the epoch the copy was
        started at, or trimmed empty and fenced at with one given (``fence``); a fence of a
        copy holding records leaves it as it was. A sealed copy's is its sealed epoch.

        Errors as ``segment_epoch``'s.
        """
        data_epoch = self._state.data_epoch_of(base_offset)
        if data_epoch is None:
            raise FencedError(
                f"the data epoch of segment {base_offset} in {self.directory} is unknown (its "
                "epoch marker is unreadable); fence the segment again"
            )
        return data_epoch

    def commit(self, offset: int) -> None:
        """Readers of a replicated log may see records below ``offset`` (once durable here).

        Moves forward only: a lower offset changes nothing. It may be past this copy's durable
        end (a follower hears of commits before it holds the records). Without ``replicated``,
        the committed offset is the durable one and this changes nothing.
        """
        if offset > self._state.committed:
            self._state.committed = offset

    # -- appends -----------------------------------------------------------------------------

    def refusal(self, count: int) -> StorageError | None:
        """The error an append of ``count`` records would fail with at once, if any: lets a
        caller writing to several logs refuse the whole write before any part of it is stored."""
        return self._pipeline.refusal(count)

    def write(
        self,
        records: Sequence[Record] | FramedRecords,
        stamp: ProducerStamp | None = None,
        epoch: int | None = None,
    ) -> Written:
        """Take ``records`` as one batch: their offsets and stored bytes at once (what a primary
        streams to its followers while the local fsync runs), and a Deferred that fires once
        they are durable here. With ``stamp`` (the produce's, ``produce_idempotent``), the
        batch carries it, for ``recent_stamps`` to find. With ``epoch`` (the writing primary's),
        refused with ``FencedError`` when the segment was fenced at a later one: a primary that
        another node took the segment over from writes nothing more even into its own copy.

        Raises the refusal (a ``StorageError``, as ``refusal`` gives it) instead of taking
        them, and ``ValueError`` for no records.
        """
        if epoch is not None:
            fenced = self._fenced_out(epoch)
            if fenced is not None:
                raise fenced
        append = self._write(records, stamp)
        return Written(append.base_offset, append.record_count, append.data, append.deferred)

    def append(
        self, records: Sequence[Record] | FramedRecords, stamp: ProducerStamp | None = None
    ) -> Deferred[Appended]:
        """Append ``records`` as one batch (carrying ``stamp``, if given, as ``write`` does);
        fires once they are durable, with their offsets."""
        try:
            return self._write(records, stamp).deferred
        except (ValueError, StorageError) as error:
            return fail(error)

    def _write(
        self, records: Sequence[Record] | FramedRecords, stamp: ProducerStamp | None
    ) -> Append:
        if not records:
            raise ValueError("append needs at least one record")
        refusal = self._pipeline.refusal(len(records))
        if refusal is not None:
            raise refusal
        base = self._state.next_offset
        if isinstance(records, FramedRecords):
            data = records.frame(base)
        else:
            data = encode_batch(base, records)
        if stamp is not None:
            data = stamp_batch(data, stamp)
        append = Append(base, len(records), data)
        self._pipeline.enqueue(append)
        return append

    def append_raw(
        self, base_offset: int, data: bytes, epoch: int | None = None
    ) -> Deferred[Appended]:
        """Append whole batches as a primary sent them (replication), after verifying them.

        With ``epoch`` (the primary's), refused with ``FencedError`` when the segment the
        batches go to was fenced or started at a later epoch.
        """
        state = self._state
        if base_offset != state.next_offset:
            return fail(
                NotContiguousError(
                    f"{self.directory} ends at offset {state.next_offset}; "
                    f"batches for offset {base_offset} do not follow it"
                )
            )
        if epoch is not None:
            fenced = self._fenced_out(epoch)
            if fenced is not None:
                return fail(fenced)
        try:
            batches = verify_peer_batches(data, base_offset)
        except StorageError as error:
            return fail(error)
        count = batches[-1].next_offset - base_offset
        refusal = self._pipeline.refusal(count)
        if refusal is not None:
            return fail(refusal)
        append = Append(base_offset, count, bytes(data))
        self._pipeline.enqueue(append)
        return append.deferred

    def _fenced_out(self, epoch: int) -> FencedError | None:
        base = self._state.appending_base()
        current = self._state.epochs.get(base, 0) if base is not None else 0
        # An unknown epoch (None) is ``refusal``'s to refuse, whatever the epoch.
        if current is None or epoch >= current:
            return None
        return FencedError(
            f"segment {base} of {self.directory} is fenced at epoch {current}; appends of "
            f"epoch {epoch} are refused"
        )

    # -- segments ----------------------------------------------------------------------------

    def roll(self) -> Deferred[SegmentInfo | None]:
        """Seal the active segment after the appends queued before this call.

        Fires with the sealed segment (its record count and byte size go to the control
        plane), or ``None`` when there was nothing to seal. The next append starts a new
        segment. Not for a replicated log (``seal_copy`` and ``start_segment`` are).
        """
        return self._operations.roll()

    def seals_settled(self) -> Deferred[None]:
        """Fire once every segment that rolled over is sealed (its ``on_sealed`` hook called),
        or the last seal tried failed, and no copy seal runs behind the appends (``seal_copy``):
        what a stopping node waits for before its control plane closes, so that a clean stop
        leaves every rolled segment sealed and recorded."""
        return self._pipeline.seals_settled()

    def delete_segment(self, base_offset: int) -> Deferred[None]:
        """Delete a segment that is no longer appended to (retention, or repair of a copy).

        The last segment of a range is never deleted: its file name (or seal) is where the
        range's end offset survives a restart.
        """
        return self._operations.delete_segment(base_offset)

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
        return self._operations.trim(base_offset, byte_size)

    def verify_segment(self, base_offset: int) -> Deferred[Verification]:
        """Check every checksum of a segment (and a sealed one's recorded size and count).

        Never changes the file. Damage found is reported as an integrity event, and reads of
        the segment stop before it from then on. A sealed segment is checked on a reader
        thread, beside the range's writes (fails ``SegmentNotFoundError`` if it is deleted or
        replaced meanwhile); another waits for the writes before it.
        """
        return self._operations.verify_segment(base_offset)

    def check_files(self) -> Deferred[list[tuple[int, Damage]]]:
        """Compare each sealed segment's files on disk with its seal (on a reader thread): a
        ``.log`` deleted or of another size than sealed, or a seal marker deleted, while this
        log still holds the segment, is reported as damage (reads stop before it) and returned
        with the segment's base offset."""
        return self._operations.check_files()

    def fence(
        self, base_offset: int, epoch: int, data_epoch: int | None = None
    ) -> Deferred[Fenced]:
        """Fence a segment copy at ``epoch``: refuse appends of older epochs to it.

        Refused with ``FencedError`` when ``epoch`` is older than the copy's. Otherwise the
        epoch holds at once (``append_raw`` of an older epoch is refused from this call on) and
        is written durably after the appends queued before this call; then it fires with the
        copy's durable next offset and verified length.

        The copy's data epoch (``segment_data_epoch``) stays what it was while it holds
        records: a fence does not make an older primary's records the new epoch's. A copy
        holding none takes ``data_epoch``, or the fence's epoch when that is not given;
        ``data_epoch`` for a copy holding records is refused (``SegmentStateError``).
        """
        return self._operations.fence(base_offset, epoch, data_epoch)

    def start_segment(
        self, base_offset: int, epoch: int, data_epoch: int | None = None
    ) -> Deferred[SegmentInfo]:
        """Start a new segment at ``base_offset`` and ``epoch``: a primary opening one, or a
        follower about to receive its first bytes.

        After the appends queued before it, the active segment (if any) is closed (readable,
        no longer appended to); the new segment's epoch marker and file are created durably,
        and it becomes the active segment. Appends made from this call on take offsets from
        ``base_offset``. There may be a gap before it (segments held by other nodes). Refused
        with ``SegmentStateError`` when the log already holds or was given offsets at or past
        ``base_offset``, except for the active segment while it is still empty: then only its
        epoch changes (``FencedError`` if that is older). Its data epoch is ``data_epoch``, or
        ``epoch`` when that is not given.
        """
        return self._operations.start_segment(base_offset, epoch, data_epoch)

    def seal_copy(
        self,
        base_offset: int,
        record_count: int,
        byte_size: int,
        *,
        epoch: int,
        behind: bool = False,
    ) -> Deferred[SegmentInfo]:
        """Make this copy match a seal the control plane holds, at the epoch it records for the
        segment, after the appends queued before it.

        A copy holding more verified bytes is cut back to ``byte_size`` first (under ``trim``'s
        rules: never rot before that length, only at a batch boundary). Then its sidecars are
        written, each derived from the sealed bytes (read back) and ``epoch`` alone, so that
        every copy of the segment holds the same files: its epoch marker (at ``epoch``), its
        index and its seal marker; and it is sealed. A copy with fewer verified bytes, or
        another record count, is refused with ``SegmentStateError`` (fetch it whole:
        ``install_segment``); one already sealed here at that count and size is answered at
        once. The next segment is not started: sealing the active segment leaves the log
        without one until ``start_segment``, and appends made while it is pending are refused.

        With ``behind``, a copy that holds exactly the seal's bytes is answered once it is
        closed (``CLOSED``, with its records committed), and its sidecars are written behind
        the appends, so that the next segment need not wait for them (a full segment's read
        back takes tens of milliseconds, hundreds with many ranges sealing at once). Every
        other operation on the segment waits for them; a crash or a failure meanwhile leaves
        the copy closed, for healing to seal in place. ``seals_settled`` waits for them.
        """
        return self._operations.seal_copy(base_offset, record_count, byte_size, epoch, behind)

    def install_segment(
        self, base_offset: int, data: bytes, record_count: int, *, epoch: int
    ) -> Deferred[SegmentInfo]:
        """Add a whole sealed segment fetched from an intact replica (backfill, repair), at the
        epoch the control plane records for it.

        Every batch and record is verified first (as ``append_raw`` does; ``InvalidBatchError``
        otherwise), in a reader thread. Refused with ``SegmentStateError`` when its offsets
        overlap a segment this log holds, or lie past the active segment or past appends in
        flight. Its epoch marker (at ``epoch``), index, seal marker and log are written durably
        (a crash leaves nothing or the whole segment), the sidecars exactly as ``seal_copy``
        writes them, and it joins the log in offset order.
        """
        return self._operations.install_segment(base_offset, data, record_count, epoch)

    # -- reads -------------------------------------------------------------------------------

    def read_chunks(self, offset: int, max_bytes: int = 1024 * 1024) -> Deferred[list[BatchSlice]]:
        """The readable batches from the one holding ``offset`` on, up to about ``max_bytes``
        of the log (at least one batch, when there is one), read and checked in a reader
        thread. A batch may start before ``offset`` (skip its earlier records). Ends before
        damage and at ``end_offset``; an offset in a gap reads from the next segment."""
        return self._reads.read_chunks(offset, max_bytes)

    def read_raw_async(self, offset: int, max_bytes: int = 1024 * 1024) -> Deferred[bytes]:
        """``read_raw``, read and checked in a reader thread."""
        return self._reads.read_raw_async(offset, max_bytes)

    def recent_stamps(
        self, max_bytes: int = RECENT_STAMPS_BYTES
    ) -> Deferred[list[tuple[ProducerStamp, int, int]]]:
        """The stamps of the stamped batches among the log's last ``max_bytes`` durable bytes
        (the newest segments first, as far as it takes; from a batch start at or before where
        those bytes begin), each as ``(stamp, base offset, record count)``, in offset order:
        what a range's dedupe table is rebuilt from. Read and checked in a reader thread.

        Durable, committed or not: a replicated range's new primary asks once its claim has
        made its copy the one the range goes on from. Stops before damage, like every read.
        """
        return self._reads.recent_stamps(max_bytes)

    def read(
        self, offset: int, max_records: int = 1000, max_bytes: int = 1024 * 1024
    ) -> list[StoredRecord]:
        """Records from ``offset`` on, at most ``max_records`` and about ``max_bytes`` of keys
        and values (always at least one record if any is there), read in the calling thread.

        Only records below ``end_offset`` are returned. A damaged copy returns the records
        before the damage and nothing after, with no error.
        """
        return self._reads.read(offset, max_records, max_bytes)

    def read_raw(self, offset: int, max_bytes: int = 1024 * 1024) -> bytes:
        """Whole verified batches from the one holding ``offset`` on, for a following replica:
        durable ones, committed or not.

        Returns at least one batch when there is one, and stops at the end of a segment.
        """
        return self._reads.read_raw(offset, max_bytes)

    def copy_digests(
        self, after: int | None = None, max_bytes: int = 256 * 1024 * 1024, max_copies: int = 4096
    ) -> Deferred[tuple[list[CopyDigests], int]]:
        """The SHA-256 of each file of this log's segment copies whose base offset is above
        ``after`` (all with ``None``), in offset order, computed in a reader thread: at most
        ``max_copies`` copies, stopping once ``max_bytes`` of files are hashed (always at least
        one copy, when there is one); and the bytes hashed. The active copy is listed without
        digests. What ``logbroker cluster verify`` compares between nodes."""
        copies = [
            CopyFiles(segment.base_offset, segment.state, segment.stem)
            for segment in self._state.segments
            if after is None or segment.base_offset > after
        ]
        return self._reader.run(digest_copies, self._fs, copies, max_bytes, max_copies)

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> Deferred[None]:
        """Flush queued appends, wait for the writer, then close every file."""
        return self._pipeline.close()
