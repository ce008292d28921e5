"""The range log's segment operations: roll, trim, delete, verify, and the replica's own (fence,
start a segment, seal a copy to a given length, install a sealed segment from a peer).

Each is a control job in the log's queue: it runs after every append and operation queued before
it, its checks see the log as those left it, and its blocking part runs through the executor.
An operation refused by its checks changes nothing; one whose I/O fails after it changed files
takes the log out of service (recovery then reads back what is on disk), except where noted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs
from twisted.internet.defer import Deferred, fail, maybeDeferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.storage._atomic import AtomicWrites
from logbroker.storage._executor import Executor
from logbroker.storage._format import (
    MIN_BATCH_SIZE,
    BatchInfo,
    Damage,
    DamageReason,
    EpochMarker,
    encode_epoch,
)
from logbroker.storage._fs import AppendFile, FileSystem
from logbroker.storage._jobs import (
    Rolled,
    _delete_files,
    _files_on_disk_job,
    _install_job,
    _roll_job,
    _trim_job,
    _verify_job,
    _verify_sealed_job,
    _write_index_job,
    check_install,
    cut_to_seal,
    plan_seal,
)
from logbroker.storage._pipeline import WritePipeline
from logbroker.storage._seals_behind import awaits_seal, first_awaiting_seal
from logbroker.storage._segment import (
    EPOCH_SUFFIX,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    CopyState,
    IntegrityEvent,
    Sealed,
    Segment,
    SegmentInfo,
    Verification,
    build_index,
)
from logbroker.storage._state import LogState
from logbroker.storage._values import Fenced
from logbroker.storage.errors import (
    FencedError,
    SegmentNotFoundError,
    SegmentStateError,
    StorageError,
)

log = Logger()

_MAX_EPOCH = 2**64 - 1

_T = TypeVar("_T")


def _check_epoch(epoch: int) -> None:
    if not 0 <= epoch <= _MAX_EPOCH:
        raise ValueError(f"an epoch is between 0 and {_MAX_EPOCH}, not {epoch}")


class SegmentOperations:
    """The control operations of one range log (see the module docstring)."""

    def __init__(
        self,
        state: LogState,
        pipeline: WritePipeline,
        *,
        fs: FileSystem,
        executor: Executor,
        reader: Executor,
        atomic: AtomicWrites,
        sealer: Executor | None = None,
    ) -> None:
        self._state = state
        self._pipeline = pipeline
        self._fs = fs
        self._executor = executor
        self._reader = reader
        #: Where a copy's seal behind the appends reads it back.
        self._sealer = sealer or executor
        #: Where epoch markers, sidecars and new segment files are written durably.
        self._atomic = atomic

    def _run_control_on(self, base_offset: int, start: Callable[[], Deferred[_T]]) -> Deferred[_T]:
        """``run_control`` of an operation on the segment at ``base_offset``: it starts once
        that copy's seal behind the appends, if one runs, has ended (it writes the copy's
        files). Only a second operation on a copy just sealed so waits in the queue."""
        copy_seals = self._pipeline.copy_seals
        return self._pipeline.run_control(lambda: copy_seals.after(base_offset, start))

    def _out_of_service(self, failure: Failure) -> Failure:
        self._pipeline.take_out_of_service(failure, [])
        return failure

    # -- rolling, deleting, verifying ----------------------------------------------------------

    def roll(self) -> Deferred[SegmentInfo | None]:
        state = self._state
        if state.replicated:
            return fail(
                SegmentStateError(
                    f"{state.directory} is a replica: its segments end with seal_copy and "
                    "start with start_segment, never with roll"
                )
            )

        def start() -> Deferred[SegmentInfo | None]:
            # A segment that rolled over is sealed first: seals are recorded in order.
            return self._pipeline.seals_settled().addCallback(lambda _: roll_now())

        def roll_now() -> Deferred[SegmentInfo | None]:
            active = state.active
            if active is None or active.readable_end == 0 or active.damage is not None:
                return succeed(None)
            waiting = first_awaiting_seal(state)
            if waiting is not None:
                raise SegmentStateError(
                    f"the seal of {waiting.path}, which rolled over before, failed; it is tried"
                    " again at the next roll or return to service: roll again once it is sealed"
                )
            plan = plan_seal(active)
            next_path = state.segment_path(active.next_offset)
            job = self._executor.run(_roll_job, self._fs, state.directory, plan, next_path)

            def rolled(result: tuple[AppendFile, Rolled]) -> SegmentInfo:
                writer, roll = result
                return state.apply_seal(active, roll.sealed, roll.damage, writer)

            return job.addCallbacks(rolled, self._out_of_service)

        return self._pipeline.run_control(start)

    def delete_segment(self, base_offset: int) -> Deferred[None]:
        state = self._state

        def start() -> Deferred[None]:
            segment = state.find(base_offset)
            if segment is state.segments[-1]:
                raise SegmentStateError(
                    f"{segment.path} is the last segment of its range; it cannot be deleted"
                )
            if awaits_seal(state, segment):
                # Its records are acknowledged and nothing else holds them yet.
                raise SegmentStateError(
                    f"{segment.path} rolled over and waits for its seal; it cannot be deleted"
                    " before it is sealed"
                )
            if segment.reader is not None:
                segment.reader.close()
                segment.reader = None
            state.remove(segment)
            return self._executor.run(_delete_files, self._fs, state.directory, segment.stem)

        return self._run_control_on(base_offset, start)

    def verify_segment(self, base_offset: int) -> Deferred[Verification]:
        state = self._state
        try:
            found = state.find(base_offset)
        except SegmentNotFoundError as error:
            return fail(error)
        if found.state is CopyState.SEALED:
            return self._verify_sealed(found)

        def start() -> Deferred[Verification]:
            segment = state.find(base_offset)
            limit = None if segment.state is not CopyState.ACTIVE else segment.readable_end

            def checked(result: Verification) -> Verification:
                if result.damage is not None:
                    state.found_damage(segment, result.damage)
                return result

            return self._executor.run(
                _verify_job, self._fs, segment.path, limit, base_offset, segment.seal
            ).addCallback(checked)

        return self._pipeline.run_control(start)

    def _verify_sealed(self, segment: Segment) -> Deferred[Verification]:
        """A sealed copy's bytes never change: they are checked on a reader thread beside the
        range's writes, not between them (in the write pipeline, the scrub's check of a 64 MB
        segment held the range's appends for its whole length). A copy deleted or replaced
        meanwhile (retention, a repair) is reported as gone, and its result dropped."""
        state = self._state

        def current() -> bool:
            return state.holds(segment)

        def gone() -> SegmentNotFoundError:
            return SegmentNotFoundError(
                f"segment {segment.base_offset} of {state.directory} was removed while it was"
                " checked"
            )

        def checked(result: Verification) -> Verification | Deferred[Verification]:
            if not current():
                raise gone()
            if result.damage is None and segment.damage is not None:
                # Its bytes verify, but the copy is known damaged otherwise (its seal marker
                # gone from disk): never reported whole.
                return attrs.evolve(result, damage=segment.damage)
            if result.damage is not None:
                state.found_damage(segment, result.damage)
            elif result.rebuilt_index is not None:
                rewriting = self._rewrite_index(segment, result.rebuilt_index, current)
                return rewriting.addCallback(lambda _: result)
            return result

        def failed(failure: Failure) -> Failure:
            if isinstance(failure.value, OSError) and not current():
                raise gone()
            return failure

        checking = self._reader.run(
            _verify_sealed_job, self._fs, segment.path, segment.base_offset, segment.seal
        )
        return checking.addCallbacks(checked, failed)

    def check_files(self) -> Deferred[list[tuple[int, Damage]]]:
        """Each sealed copy's files on disk against its seal (physical healing's check): a
        ``.log`` gone or of another size than sealed, or a seal marker gone, is damage to the
        copy, reported as any other (reads stop before it). What was found, by base offset."""
        state = self._state
        sealed = [
            s
            for s in state.segments
            if s.state is CopyState.SEALED and s.seal is not None and s.damage is None
        ]
        if not sealed:
            return succeed([])

        def compared(on_disk: list[tuple[int | None, bool]]) -> list[tuple[int, Damage]]:
            found = []
            for segment, (size, marked) in zip(sealed, on_disk, strict=True):
                assert segment.seal is not None
                expected = segment.seal.byte_size
                if segment.damage is not None or not state.holds(segment):
                    continue  # found meanwhile, or deleted or replaced while looked at
                if size != expected:
                    damage = Damage(min(size or 0, expected), DamageReason.SIZE)
                elif not marked:
                    damage = Damage(expected, DamageReason.METADATA)
                else:
                    continue
                state.found_damage(segment, damage)
                found.append((segment.base_offset, damage))
            return found

        looking = self._reader.run(_files_on_disk_job, self._fs, [s.path for s in sealed])
        return looking.addCallback(compared)

    def _rewrite_index(
        self, segment: Segment, index: bytes, current: Callable[[], bool]
    ) -> Deferred[None]:
        """Put the index rebuilt from a sealed copy's intact log in place of its sidecar (in
        the write pipeline, so that no delete or install of the copy runs meanwhile)."""
        index_path = segment.path.removesuffix(LOG_SUFFIX) + INDEX_SUFFIX
        self._state.report(
            IntegrityEvent(
                DamageReason.INDEX, index_path, segment.base_offset, 0, segment.has_marker
            )
        )

        def write() -> Deferred[None]:
            if not current():
                return succeed(None)
            return self._executor.run(_write_index_job, self._fs, segment.path, index)

        def failed(failure: Failure) -> None:
            log.warn(
                "Could not write the rebuilt index {path}: {error}; it is rebuilt again at the"
                " next check",
                path=index_path,
                error=failure.getErrorMessage(),
            )

        return self._pipeline.run_control(write).addErrback(failed)

    # -- cutting back ----------------------------------------------------------------------

    def _cut_back(
        self,
        base_offset: int,
        byte_size: int,
        check: Callable[[Segment], SegmentInfo | None],
        run: Callable[[Segment, bool, int], Deferred[Any]],
        finish: Callable[[Segment, bool, Any], SegmentInfo],
        *,
        blocks_appends: bool,
        behind: bool = False,
    ) -> Deferred[SegmentInfo]:
        """Cut a copy back to ``byte_size`` (trim, seal_copy): the rules both keep.

        ``check`` refuses (raising ``SegmentStateError``) or answers at once; then the copy is
        closed to appends and reads, ``run(segment, last, held)`` (``held``: its verified bytes
        before the cut) does the I/O and ``finish`` applies the result. With
        ``blocks_appends``, appends made while it is pending are refused (they would hold
        offsets past its end). With ``behind``, a copy that needs no cut (it holds exactly
        ``byte_size`` verified bytes) is answered once it is closed, and ``run`` and
        ``finish`` go on behind the appends (``CopySealsBehind``).
        """
        state = self._state

        def start() -> Deferred[SegmentInfo]:
            segment = state.find(base_offset)
            answer = check(segment)
            if answer is not None:
                return succeed(answer)
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
            last = segment is state.segments[-1]
            state.files.close_all(segment)
            held = segment.readable_end
            before = (segment.state, held, state.active)
            if segment is state.active:
                state.active = None
            segment.state = CopyState.CLOSED
            # Reads must not reach bytes about to be cut, nor report their loss as damage.
            segment.readable_end = byte_size
            segment.generation += 1
            if behind and held == byte_size:
                self._seal_behind(segment, run, finish)
                return succeed(segment.info())

            def failed(failure: Failure) -> Failure:
                if isinstance(failure.value, SegmentStateError):
                    # Refused before the file was touched: nothing changed.
                    segment.state, segment.readable_end, state.active = before
                    return failure
                return self._out_of_service(failure)

            return maybeDeferred(run, segment, last, held).addCallbacks(
                lambda result: finish(segment, last, result), failed
            )

        def finished(result: object) -> object:
            self._pipeline.pending_cuts -= 1
            return result

        cutting: Deferred[SegmentInfo] = self._run_control_on(base_offset, start)
        if blocks_appends and not cutting.called:
            self._pipeline.pending_cuts += 1
            cutting.addBoth(finished)
        return cutting

    def _seal_behind(
        self,
        segment: Segment,
        run: Callable[[Segment, bool, int], Deferred[Any]],
        finish: Callable[[Segment, bool, Any], SegmentInfo],
    ) -> None:
        """Go on with the closed ``segment``'s seal behind the appends: the segment it ends
        where it is (no cut), so only its sidecars are left to write."""
        state = self._state
        # Its records are committed: the control plane holds the seal being made here.
        state.sealed_through(segment.next_offset)
        held = segment.readable_end

        def sealed(result: Any) -> None:
            if state.holds(segment) and segment.state is CopyState.CLOSED:
                # Appends may have started the next segment meanwhile: whether this one is
                # last is told now.
                finish(segment, segment is state.segments[-1], result)

        def failed(failure: Failure) -> None:
            log.failure(
                "Sealing {path} behind the appends failed; it stays closed (readable, taking no"
                " appends) until healing seals it as recorded or fetches it whole",
                failure,
                path=segment.path,
            )

        sealing = maybeDeferred(run, segment, False, held).addCallbacks(sealed, failed)
        self._pipeline.copy_seals.run(segment.base_offset, sealing)

    def _moved_end(self, segment: Segment, last: bool) -> None:
        """The last segment was cut: the range continues where it now ends."""
        if last and self._state.starting is None:
            self._state.next_offset = self._state.durable_offset = segment.next_offset

    def trim(self, base_offset: int, byte_size: int) -> Deferred[SegmentInfo]:
        state = self._state
        was_active = False

        def check(segment: Segment) -> None:
            nonlocal was_active
            if segment.has_marker:
                raise SegmentStateError(
                    f"{segment.path} carries its own seal marker; never trimmed"
                )
            was_active = segment is state.active

        def run(segment: Segment, last: bool, held: int) -> Deferred[list[BatchInfo]]:
            return self._executor.run(
                _trim_job, self._fs, segment.path, base_offset, byte_size, last
            )

        def finish(segment: Segment, last: bool, batches: list[BatchInfo]) -> SegmentInfo:
            segment.next_offset = segment.end_offset = (
                batches[-1].next_offset if batches else segment.base_offset
            )
            segment.index = build_index(batches)
            segment.damage = None
            self._moved_end(segment, last)
            # A replica's active copy cut back to where a newer primary sends from goes on
            # taking appends; so does a range's last segment emptied (its name is its end).
            if (byte_size == 0 and last) or (was_active and state.replicated):
                segment.state = CopyState.ACTIVE
                state.active = segment
            info = segment.info()
            if byte_size == 0 and not last:
                state.remove(segment)
            return info

        return self._cut_back(base_offset, byte_size, check, run, finish, blocks_appends=True)

    def seal_copy(
        self, base_offset: int, record_count: int, byte_size: int, epoch: int, behind: bool
    ) -> Deferred[SegmentInfo]:
        if record_count < 1 or byte_size < MIN_BATCH_SIZE:
            return fail(
                ValueError(
                    f"a sealed segment holds at least one record, not {record_count} records in "
                    f"{byte_size} bytes; trim a copy that holds nothing committed to 0 bytes"
                )
            )
        try:
            _check_epoch(epoch)
        except ValueError as error:
            return fail(error)
        state = self._state
        if behind and self._pipeline.copy_seals.sealing(base_offset):
            # Sealed behind the appends already (the next segment's first bytes asked for it
            # before the seal did): closed at that seal, which the control plane holds.
            closed = state.find(base_offset).info()
            if (closed.record_count, closed.byte_size) == (record_count, byte_size):
                return succeed(closed)

        def check(segment: Segment) -> SegmentInfo | None:
            seal = segment.seal
            if not segment.has_marker:
                if segment.readable_end == byte_size and segment.damage is None:
                    held = segment.next_offset - base_offset
                    if held != record_count:
                        raise SegmentStateError(
                            f"{segment.path} holds {held} records in its {byte_size} bytes, "
                            f"not the {record_count} of the seal; fetch the segment whole"
                        )
                return None
            if (
                seal is not None
                and segment.damage is None
                and (seal.record_count, seal.byte_size) == (record_count, byte_size)
            ):
                return segment.info()
            raise SegmentStateError(
                f"{segment.path} carries its own seal marker, which does not match a seal at "
                f"{record_count} records and {byte_size} bytes; fetch the segment whole"
            )

        def run(segment: Segment, last: bool, held: int) -> Deferred[Sealed]:
            # The sidecars come from the sealed bytes, read back, never from the index built
            # as appends arrived: every copy writes the same ones. Behind the appends (no cut:
            # ``_cut_back``), on the sealer's thread.
            executor = self._sealer if behind and held == byte_size else self._executor
            cutting = executor.run(
                cut_to_seal, self._fs, segment.path, base_offset, record_count, byte_size, epoch
            )

            def cut(result: tuple[Sealed, list[tuple[str, bytes]]]) -> Deferred[Sealed]:
                sealed, sidecars = result
                return self._atomic.replace(sidecars).addCallback(lambda _: sealed)

            return cutting.addCallback(cut)

        def finish(segment: Segment, last: bool, sealed: Sealed) -> SegmentInfo:
            segment.seal, segment.index = sealed.seal, sealed.index
            segment.has_marker = True
            segment.state = CopyState.SEALED
            segment.damage = None
            segment.next_offset = segment.end_offset = base_offset + record_count
            state.set_epochs(base_offset, epoch, epoch)
            self._moved_end(segment, last)
            state.sealed_through(segment.next_offset)
            return segment.info()

        # Only cutting the segment appends go to changes where they go.
        blocks = base_offset == state.appending_base() or (
            state.starting is None
            and bool(state.segments)
            and state.segments[-1].base_offset == base_offset
        )
        return self._cut_back(
            base_offset, byte_size, check, run, finish, blocks_appends=blocks, behind=behind
        )

    # -- epochs and segments of a replica ----------------------------------------------------

    def _write_epoch(self, base_offset: int) -> Deferred[None]:
        """Make the copy's epochs durable as they are when the write runs, not as they were when
        it was queued: a fence's write queued while a seal of the copy was under way put the
        records' older data epoch back over the seal's marker, and that sealed copy's marker
        was unlike the other copies' (simulation seed 106, with the membership's keepalives
        timed otherwise)."""
        state = self._state
        segment = state.find(base_offset)
        epoch, data_epoch = state.epoch_of(base_offset), state.data_epoch_of(base_offset)
        if epoch is None or data_epoch is None:
            # Unknown only for a marker found unreadable at recovery, until a fence or a start
            # sets it, and both do before they queue this write.
            return fail(
                SegmentStateError(f"segment {base_offset} of {state.directory} has no known epoch")
            )
        marker = encode_epoch(EpochMarker(base_offset, epoch, data_epoch))
        return self._atomic.replace([(segment.stem + EPOCH_SUFFIX, marker)])

    def _holds_records(self, base_offset: int) -> bool:
        """Whether any record (durable or not) has taken an offset in the segment."""
        state = self._state
        if base_offset == state.appending_base():
            return state.next_offset > base_offset
        return state.find(base_offset).next_offset > base_offset

    def fence(self, base_offset: int, epoch: int, data_epoch: int | None) -> Deferred[Fenced]:
        state = self._state
        try:
            _check_epoch(epoch)
            refusal = self._pipeline.control_refusal()
            if refusal is not None:
                raise refusal
            current = state.epoch_of(base_offset)
            holds_records = self._holds_records(base_offset)
            if data_epoch is not None:
                _check_epoch(data_epoch)
                if holds_records:
                    raise SegmentStateError(
                        f"segment {base_offset} of {state.directory} holds records: they keep "
                        f"the data epoch they were written at; trim it to 0 bytes first"
                    )
        except (ValueError, StorageError) as error:
            return fail(error)
        if current is not None and epoch < current:
            return fail(
                FencedError(
                    f"segment {base_offset} of {state.directory} is fenced at epoch {current}; "
                    f"epoch {epoch} is older"
                )
            )
        if data_epoch is None:
            # A copy holding no record is nobody's yet: it takes the fence's epoch. One holding
            # records keeps theirs (an unknown one, with the marker unreadable, is the fence's:
            # the records are checksummed, but whose they are was lost with the marker).
            known = state.data_epoch_of(base_offset) if holds_records else None
            data_epoch = epoch if known is None else known
        # At once: appends of older epochs are refused from now on, not from when it is durable.
        state.set_epochs(base_offset, epoch, data_epoch)

        def start() -> Deferred[Fenced]:
            segment = state.find(base_offset)
            return self._write_epoch(base_offset).addCallback(
                lambda _: Fenced(base_offset, epoch, segment.next_offset, segment.readable_end)
            )

        return self._run_control_on(base_offset, start)

    def start_segment(
        self, base_offset: int, epoch: int, data_epoch: int | None
    ) -> Deferred[SegmentInfo]:
        state = self._state
        data_epoch = epoch if data_epoch is None else data_epoch
        try:
            _check_epoch(epoch)
            _check_epoch(data_epoch)
            refusal = self._pipeline.control_refusal()
            if refusal is not None:
                raise refusal
        except (ValueError, StorageError) as error:
            return fail(error)
        if base_offset == state.appending_base() and state.next_offset == base_offset:
            return self._restart_empty(base_offset, epoch, data_epoch)
        if base_offset < state.next_offset:
            return fail(
                SegmentStateError(
                    f"{state.directory} holds offsets up to {state.next_offset}; a segment "
                    f"cannot start at {base_offset}, before that"
                )
            )
        # At once: appends made from now on take offsets in the new segment.
        state.next_offset = base_offset
        state.starting = base_offset
        state.set_epochs(base_offset, epoch, data_epoch)
        path = state.segment_path(base_offset)
        marker = encode_epoch(EpochMarker(base_offset, epoch, data_epoch))

        def create() -> Deferred[AppendFile]:
            # The marker first: a crash before the log file is made leaves a marker without its
            # log, which recovery removes, so the segment either does not exist or exists at
            # its epoch.
            state.close_active()
            state.start_on_disk = True
            stem = path.removesuffix(LOG_SUFFIX)
            writing = self._atomic.replace([(stem + EPOCH_SUFFIX, marker)])
            return writing.addCallback(lambda _: self._atomic.create(path))

        def started(writer: AppendFile) -> SegmentInfo:
            segment = state.add_active(base_offset, writer)
            state.durable_offset = base_offset
            if state.starting == base_offset:
                state.starting = None
                state.start_on_disk = False
            return segment.info()

        def start() -> Deferred[SegmentInfo]:
            return maybeDeferred(create).addCallbacks(started, self._out_of_service)

        return self._pipeline.run_control(start)

    def _restart_empty(
        self, base_offset: int, epoch: int, data_epoch: int
    ) -> Deferred[SegmentInfo]:
        """``start_segment`` of the segment appends already go to, still empty: only its epochs
        change."""
        state = self._state
        current = state.epochs.get(base_offset, 0)
        if current is not None and epoch < current:
            return fail(
                FencedError(
                    f"segment {base_offset} of {state.directory} is at epoch {current}; it "
                    f"cannot start again at epoch {epoch}, which is older"
                )
            )
        state.set_epochs(base_offset, epoch, data_epoch)

        def start() -> Deferred[SegmentInfo]:
            return self._write_epoch(base_offset).addCallback(
                lambda _: state.find(base_offset).info()
            )

        return self._pipeline.run_control(start)

    def install_segment(
        self, base_offset: int, data: bytes, record_count: int, epoch: int
    ) -> Deferred[SegmentInfo]:
        refusal = self._pipeline.control_refusal()
        if refusal is not None:
            return fail(refusal)
        try:
            _check_epoch(epoch)
        except ValueError as error:
            return fail(error)
        end = base_offset + record_count
        conflict = self._install_conflict(base_offset, end)
        if conflict is not None:
            return fail(SegmentStateError(conflict))
        data = bytes(data)
        # Verified in a reader thread first: every record of a whole segment is checked, and
        # the log's appends need not wait for that.
        checking = self._reader.run(check_install, data, base_offset, record_count)
        return checking.addCallback(
            lambda sealed: self._run_control_on(
                base_offset, lambda: self._install(data, sealed, epoch)
            )
        )

    def _install(self, data: bytes, sealed: Sealed, epoch: int) -> Deferred[SegmentInfo]:
        state = self._state
        seal, index = sealed.seal, sealed.index
        conflict = self._install_conflict(seal.base_offset, seal.next_offset)
        if conflict is not None:
            raise SegmentStateError(conflict)
        path = state.segment_path(seal.base_offset)

        def installed(_: None) -> SegmentInfo:
            segment = Segment(
                seal.base_offset,
                path,
                CopyState.SEALED,
                seal.byte_size,
                seal.next_offset,
                seal.next_offset,
                index,
                seal,
                has_marker=True,
            )
            state.insert(segment)
            state.set_epochs(seal.base_offset, epoch, epoch)
            if seal.next_offset > state.next_offset:
                state.next_offset = state.durable_offset = seal.next_offset
            state.sealed_through(seal.next_offset)
            return segment.info()

        # A failed install leaves the log as it was: what it wrote is either removed by recovery
        # or the whole segment, which recovery then finds.
        return self._executor.run(_install_job, self._fs, path, data, sealed, epoch).addCallback(
            installed
        )

    def _install_conflict(self, base_offset: int, end: int) -> str | None:
        """Why a sealed segment of offsets ``[base_offset, end)`` cannot join this log, if so."""
        state = self._state
        for segment in state.segments:
            # An empty segment at the same base overlaps nothing but holds the file's name.
            same_name = segment.base_offset == base_offset
            if same_name or (segment.base_offset < end and base_offset < segment.end_offset):
                return (
                    f"{state.directory}: the segment of offsets {base_offset} to {end} "
                    f"overlaps {segment.path} (offsets {segment.base_offset} to "
                    f"{segment.end_offset})"
                )
        appending = state.appending_base()
        if appending is not None and end > appending:
            return (
                f"{state.directory}: the segment of offsets {base_offset} to {end} would lie "
                f"past the active segment, which starts at {appending}"
            )
        if end > state.next_offset and state.next_offset != state.durable_offset:
            return (
                f"{state.directory}: the segment of offsets {base_offset} to {end} would lie "
                f"past appends in flight (up to offset {state.next_offset}); install it after"
            )
        return None
