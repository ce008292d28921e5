"""The range log's job queue: appends and control operations, one job at a time, in order.

Appends queue up while a job runs and go out together in the next one: one write and one fsync
cover all of them. When to write and what each write takes is the ``CommitPlanner``'s answer;
this module carries it out with the injected clock and executor, and acknowledges each append
only after the fsync that covers it, in offset order.

With a ``SharedFlush`` (one sync for every range's writes), a write to the active segment is
written ahead: it is handed to the flush, whose next round writes and syncs it, and its job ends
when that round starts. A write that would wait for a round takes its appends only when that
round starts (``SharedFlush.join_next_round``), so that it carries every append that came while
the round before ran, and goes while the writes ahead of it wait for their syncs. Rounds end in
the order they ran and write a file's bytes in the order they were handed over, so the
acknowledgements stay in offset order. Anything that changes the segment itself (a roll, a new
segment, a seal, trim or fence) waits until every write ahead of it is durable (decision 0023).

A failed write, fsync or seal fails every append it covered and every append and operation
queued behind it, and takes the log out of service (``LogFailedError``): after a failed fsync the
kernel may already have dropped the dirty pages, so nothing more is trusted until recovery
reopens the log.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, fail, maybeDeferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.storage._comeback import Comeback
from logbroker.storage._executor import Executor
from logbroker.storage._flush import SharedFlush
from logbroker.storage._format import BatchInfo
from logbroker.storage._fs import AppendFile, FileSystem
from logbroker.storage._jobs import (
    _write_job,
)
from logbroker.storage._planner import (
    FLUSH_NOW,
    WAIT,
    ArmTimer,
    CommitPlanner,
    RunControl,
    Step,
    Write,
)
from logbroker.storage._seals_behind import CopySealsBehind, SealsBehind
from logbroker.storage._segment import CopyState, Segment, build_index
from logbroker.storage._state import LogState, call_hook
from logbroker.storage._values import MAX_SEGMENT_BYTES, Appended, Flush, LogConfig
from logbroker.storage.errors import (
    FencedError,
    LogClosedError,
    LogFailedError,
    OverloadedError,
    SegmentStateError,
    StorageError,
)

log = Logger()


class Append:
    """An append taken by the log: its offsets and bytes, acknowledged through ``deferred``."""

    __slots__ = ("base_offset", "data", "deferred", "record_count")

    def __init__(self, base_offset: int, record_count: int, data: bytes) -> None:
        self.base_offset = base_offset
        self.record_count = record_count
        self.data = data
        self.deferred: Deferred[Appended] = Deferred()


class _Ahead:
    """A write handed to the shared flush: where it goes, and its flush's outcome once known
    (the seconds its round took, or the failure)."""

    __slots__ = ("outcome", "target", "write", "writer")

    def __init__(self, write: Write[Append], target: Segment, writer: AppendFile) -> None:
        self.write = write
        self.target = target
        self.writer = writer
        self.outcome: float | Failure | None = None


class _Control:
    """A roll, trim, fence or other operation, run in queue order between appends."""

    __slots__ = ("deferred", "start")

    def __init__(self, start: Callable[[], Deferred[object]]) -> None:
        self.start = start
        self.deferred: Deferred[object] = Deferred()


class WritePipeline:
    """The job queue of one range log (see the module docstring)."""

    def __init__(
        self,
        state: LogState,
        *,
        fs: FileSystem,
        clock: IReactorTime,
        executor: Executor,
        config: LogConfig,
        on_flushed: Callable[[Flush], None],
        shared_flush: SharedFlush | None = None,
        sealer: Executor | None = None,
    ) -> None:
        self._state = state
        self._fs = fs
        self._clock = clock
        self._executor = executor
        #: Makes written appends durable together with other logs' (else each job fsyncs).
        self._shared_flush = shared_flush
        self._on_flushed = on_flushed
        self._max_inflight_records = config.max_inflight_records
        self._planner: CommitPlanner[Append, _Control] = CommitPlanner(
            group_commit=config.group_commit,
            interval=config.group_commit_interval_ms / 1000.0,
            flush_max_records=config.flush_max_records,
            max_inflight_records=config.max_inflight_records,
            roll_bytes=config.roll_bytes if config.auto_roll else MAX_SEGMENT_BYTES,
        )
        self._timer: IDelayedCall | None = None
        # A job in flight, or appends queued for the next one, may use the writer: the node's
        # open-file budget closes it only while neither is so.
        state.files.writer_in_use = lambda: not self._planner.idle or bool(self._ahead)
        #: Writes written ahead (their job ended) whose flush has not ended yet, oldest first,
        #: and their bytes, which the active segment holds past ``readable_end``.
        self._ahead: deque[_Ahead] = deque()
        self._ahead_bytes = 0
        #: A control operation the planner let run while writes were ahead: it runs once
        #: they are durable.
        self._held: _Control | None = None
        #: A write waits for the shared flush's next round to start (``join_next_round``).
        self._joining = False
        #: Control operations due to start, and whether ``_run_control`` is starting them
        #: already, further up the stack (see there).
        self._controls_due: deque[_Control] = deque()
        self._starting_controls = False
        #: Append outcomes to deliver, in offset order (see ``_settle``).
        self._outcomes: deque[tuple[Deferred[Any], Appended | Exception]] = deque()
        self._settling = False
        self._closing = False
        self._closed = False
        self._close_waiters: list[Deferred[None]] = []
        self.failure: Failure | None = None
        self._comeback = Comeback(state, fs, executor, lambda: self.failure is not None)
        self._seals = SealsBehind(state, fs, sealer or executor)
        #: A replica's copy seals made behind its appends (``seal_copy(..., behind=True)``).
        self.copy_seals = CopySealsBehind()
        self._seals_closing: Deferred[None] | None = None
        #: Trims and seals that cut back the segment appends go to, asked for and not finished:
        #: appends wait for none of them, they are refused.
        self.pending_cuts = 0

    # -- taking work -------------------------------------------------------------------------

    def refusal(self, count: int) -> StorageError | None:
        """Why an append of ``count`` records would be refused now, if it would."""
        state = self._state
        if self.failure is not None:
            return LogFailedError(
                f"{state.directory} is out of service after a write error "
                f"({self.failure.getErrorMessage()}); it takes appends again once the disk"
                " takes a probe write and fsync"
            )
        if self._closing:
            return LogClosedError(f"{state.directory} is closed")
        if self.pending_cuts:
            return SegmentStateError(
                f"{state.directory} is being cut back to a sealed length; append again after"
            )
        if state.replicated and (
            state.appending_base() is None
            or (
                state.starting is None
                and state.active is not None
                and state.active.damage is not None
            )
        ):
            return SegmentStateError(
                f"{state.directory} has no active segment to append to; start one with "
                "start_segment"
            )
        if state.epochs:
            base = state.appending_base()
            if base is not None and base in state.epochs and state.epochs[base] is None:
                return FencedError(
                    f"the epoch of segment {base} in {state.directory} is unknown (its epoch "
                    "marker is unreadable); fence the segment again before appending"
                )
        if self._planner.overloaded(count):
            return OverloadedError(
                f"{self._planner.waiting_records} records already wait for their fsync in "
                f"{state.directory} (limit {self._max_inflight_records}); retry later"
            )
        return None

    def enqueue(self, append: Append) -> None:
        self._state.next_offset += append.record_count
        now = self._clock.seconds()
        step = self._planner.append(append, append.record_count, len(append.data), now)
        if step is not WAIT:
            self._drive(step)

    def control_refusal(self) -> StorageError | None:
        if self.failure is not None:
            return LogFailedError(f"{self._state.directory} is out of service after a write error")
        if self._closing:
            return LogClosedError(f"{self._state.directory} is closed")
        return None

    def run_control(self, start: Callable[[], Deferred[Any]]) -> Deferred[Any]:
        """Run ``start`` (which starts an operation and returns its Deferred) after every job
        queued before it. Whatever ``start`` raises fails that operation, never the queue."""
        refusal = self.control_refusal()
        if refusal is not None:
            return fail(refusal)
        control = _Control(start)
        self._drive(self._planner.control(control, self._clock.seconds()))
        return control.deferred

    # -- carrying out the planner's steps ----------------------------------------------------

    def _drive(self, step: Step[_Control]) -> None:
        if step is WAIT:
            return
        if isinstance(step, ArmTimer):
            self._timer = self._clock.callLater(step.delay, self._timer_expired)
        elif isinstance(step, RunControl):
            if self._ahead:
                self._held = step.control
            else:
                self._run_control(step.control)
        elif self._joining:
            return  # the write that waits for the next round takes these appends too
        elif (
            (flush := self._shared_flush) is not None and flush.running and self._may_write_ahead()
        ):
            # Its round could only be the next one: take the appends when it starts.
            self._joining = True
            flush.join_next_round(self._join_round)
        elif not self._ahead or self._may_write_ahead():
            # Else the write goes once the writes ahead are durable (``_after_ahead``).
            self._start_write()

    def _join_round(self) -> None:
        """The shared flush's next round starts: the write that waited for it takes what
        is queued now (the queue may have changed meanwhile: a failure drains it)."""
        self._joining = False
        step = self._planner.step(self._clock.seconds())
        if step is FLUSH_NOW and (not self._ahead or self._may_write_ahead()):
            self._start_write()
        else:
            self._drive(step)

    def _run_control(self, control: _Control) -> None:
        # A control that ends at once (one refused, or with nothing to do) starts the next one
        # from its own callbacks: with a long queue of them, each start one frame deeper, a
        # log ran out of stack (a RecursionError in the soak), and the control it was ending
        # never finished, so its range took no more writes. The ones due while a start is
        # under way further up the stack are started from there, one after the other.
        self._controls_due.append(control)
        if self._starting_controls:
            return
        self._starting_controls = True
        try:
            while self._controls_due:
                due = self._controls_due.popleft()
                maybeDeferred(due.start).addBoth(self._control_done, due)
        finally:
            self._starting_controls = False

    def _may_write_ahead(self) -> bool:
        """Whether the next write may go out with writes ahead of it not yet durable: it only
        appends to the active segment, as they did."""
        target = self._state.active
        return (
            self._shared_flush is not None
            and self.failure is None
            and target is not None
            and target.damage is None
            and target.writer is not None
            and not self._planner.would_roll(target.readable_end + self._ahead_bytes)
        )

    def _timer_expired(self) -> None:
        self._timer = None
        self._drive(self._planner.timer_fired(self._clock.seconds()))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _after_job(self, step: Step[_Control]) -> None:
        if self._closing and self._planner.idle and not self._ahead:
            if not self._closed:
                self._finish_close()
        else:
            self._drive(step)

    def _job_finished(self) -> None:
        self._after_job(self._planner.job_finished(self._clock.seconds()))

    def _start_write(self) -> None:
        state = self._state
        target = state.active
        if target is not None and target.damage is not None:
            # Rot was found in the active segment: it takes no more appends.
            state.close_active()
            target = None
        write = self._planner.take(
            target.readable_end + self._ahead_bytes if target is not None else None
        )
        self._cancel_timer()
        if state.replicated and (target is None or write.roll):
            # A replicated log starts segments only through start_segment.
            self._refuse_write(write, target)
            return
        taken = write.appends
        rolled_from: Segment | None = None
        if write.roll:
            # The full segment is sealed behind the appends, once this write is durable in
            # the next one (``SealsBehind``).
            assert target is not None
            rolled_from, target = target, None
            state.rolling_to = taken[0].base_offset
        path = target.path if target is not None else state.segment_path(taken[0].base_offset)
        data = taken[0].data if len(taken) == 1 else b"".join(item.data for item in taken)
        writer = target.writer if target is not None else None
        if self._shared_flush is not None and target is not None and writer is not None:
            self._write_ahead(write, target, writer, data, self._shared_flush)
            return
        job = self._executor.run(
            _write_job,
            self._fs,
            state.directory,
            path,
            writer,
            target is None,
            data,
            self._shared_flush is None,
        )
        if self._shared_flush is not None:
            job.addCallback(self._flush_written, self._shared_flush, opened=writer is None)
        job.addCallbacks(
            self._write_done,
            self._write_failed,
            callbackArgs=(write, target, rolled_from),
            errbackArgs=(write,),
        )

    @staticmethod
    def _flush_written(
        written: tuple[AppendFile, float], flush: SharedFlush, opened: bool
    ) -> Deferred[tuple[AppendFile, float]]:
        writer, seconds = written

        def flushed(waited: float) -> tuple[AppendFile, float]:
            return writer, seconds + waited

        def failed(failure: Failure) -> Failure:
            if opened:
                # The job opened it for these appends; the log never sees it.
                writer.close()
            return failure

        return flush.flush(writer).addCallbacks(flushed, failed)

    def _write_ahead(
        self,
        write: Write[Append],
        target: Segment,
        writer: AppendFile,
        data: bytes,
        flush: SharedFlush,
    ) -> None:
        """Hand a write to the active segment to the shared flush, whose next round writes and
        syncs it; the job ends when that round starts, so that the appends that come after go
        together in the next write, into the next round, while it waits."""
        ahead = _Ahead(write, target, writer)
        self._ahead.append(ahead)
        self._ahead_bytes += write.size
        flush.write(writer, data, taken=self._job_finished).addBoth(self._flush_ended, ahead)

    def _flush_ended(self, outcome: float | Failure, ahead: _Ahead) -> None:
        """A write ahead is durable (the seconds its round took) or failed. Its outcome waits
        for those of the writes before it: they are settled in the order they were written."""
        ahead.outcome = outcome
        while self._ahead and self._ahead[0].outcome is not None:
            ended = self._ahead.popleft()
            self._ahead_bytes -= ended.write.size
            self._settle_ahead(ended)
        self._after_ahead()

    def _settle_ahead(self, ahead: _Ahead) -> None:
        outcome, write = ahead.outcome, ahead.write
        if self.failure is not None:
            self._fail_ahead(write)
        elif isinstance(outcome, Failure):
            self._planner.written(write.records)
            self.take_out_of_service(outcome, write.appends)
        else:
            assert outcome is not None
            self._complete((ahead.writer, outcome), write, ahead.target, None)
            self._settle()

    def _fail_ahead(self, write: Write[Append]) -> None:
        """``write`` was written after a write, fsync or seal failed: it fails with them."""
        assert self.failure is not None
        self._planner.written(write.records)
        error = self._failed_error(self.failure)
        self._outcomes.extend((item.deferred, error) for item in write.appends)
        self._settle()

    def _failed_error(self, failure: Failure) -> LogFailedError:
        return LogFailedError(
            f"a write, fsync or seal failed in {self._state.directory}: {failure.getErrorMessage()}"
        )

    def _after_ahead(self) -> None:
        """Once no write is ahead, what waited for that goes: a held control operation, a
        write that rolls or starts a segment, or the close."""
        if self._ahead:
            return
        held, self._held = self._held, None
        if held is not None and self.failure is not None:
            # It was queued behind the write that failed: it fails with it, as it would have
            # had it still been queued.
            held.deferred.errback(self._failed_error(self.failure))
            self._job_finished()
        elif held is not None:
            self._run_control(held)
        elif not self._planner.running:
            self._after_job(self._planner.step(self._clock.seconds()))

    def _refuse_write(self, write: Write[Append], target: Segment | None) -> None:
        directory = self._state.directory
        if target is None:
            reason = f"{directory} has no healthy active segment; start one with start_segment"
        else:
            reason = (
                f"{target.path} is full ({target.readable_end} bytes, the format's limit); "
                "seal it and start the next segment"
            )
        error = SegmentStateError(f"{reason}; the append was not stored, retry it")
        self._planner.written(write.records)
        self._outcomes.extend((item.deferred, error) for item in write.appends)
        self._settle()
        self._job_finished()

    def _write_done(
        self,
        written: tuple[AppendFile, float],
        write: Write[Append],
        target: Segment | None,
        rolled_from: Segment | None,
    ) -> None:
        self._complete(written, write, target, rolled_from)
        if rolled_from is not None:
            self._seals.start()
        # With a full job's worth of appends already queued, the next write starts before the
        # acknowledgements run, so the disk is not idle while their callbacks (often new
        # appends, each encoded on this thread) run. Otherwise acknowledge while the writer
        # still counts as busy: appends that callbacks issue all queue up and go out together
        # in the next job, instead of the first one going alone.
        if self._planner.full_write_waiting():
            try:
                self._job_finished()
            finally:
                self._settle()
        else:
            self._settle()
            self._job_finished()

    def _complete(
        self,
        written: tuple[AppendFile, float],
        write: Write[Append],
        target: Segment | None,
        rolled_from: Segment | None,
    ) -> None:
        """``write`` is durable: the segment takes its appends, whose outcomes are queued."""
        state = self._state
        writer, seconds = written
        taken = write.appends
        call_hook(state.directory, self._on_flushed, Flush(write.records, seconds))
        if rolled_from is not None:
            target = state.roll_over(rolled_from, writer)
        elif target is None:
            target = state.add_active(taken[0].base_offset, writer)
        else:
            state.files.attach_writer(target, writer)
        end = taken[-1].base_offset + taken[-1].record_count
        target.end_offset = state.durable_offset = end
        self._planner.written(write.records)
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
        self._outcomes.extend(
            (item.deferred, outcome) for item, outcome in zip(taken, outcomes, strict=True)
        )

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

    def _write_failed(self, failure: Failure, write: Write[Append]) -> None:
        self._planner.written(write.records)
        self.take_out_of_service(failure, write.appends)
        self._job_finished()

    def take_out_of_service(self, failure: Failure, covered: list[Append]) -> None:
        """A write, fsync or seal failed: what reached the disk is unknown until recovery."""
        state = self._state
        self.failure = failure
        self._cancel_timer()
        if state.active is not None:
            state.active.state = CopyState.CLOSED
        queued = self._planner.drain()
        log.failure(
            "A write, fsync or seal failed in {directory}; {count} appends fail and the range "
            "is out of service until a probe write and fsync succeed again (or a restart)",
            failure,
            directory=state.directory,
            count=len(covered) + sum(isinstance(item, Append) for item in queued),
        )
        error = self._failed_error(failure)
        self._outcomes.extend((item.deferred, error) for item in [*covered, *queued])
        self._settle()

    def return_to_service(self) -> Deferred[bool]:
        """After a failed write, fsync, seal or segment start: once a probe write and fsync
        succeed, put right what the failure left in doubt and take appends again (``True``);
        ``False`` while the disk still fails, or (until a restart) when more is in doubt than
        a return can settle (``Comeback.attempt``)."""
        if self.failure is None:
            return succeed(True)
        if self._closing or not self._planner.idle or self._ahead:
            return succeed(False)
        return self._comeback.attempt().addCallbacks(self._back_in_service, self._still_failing)

    def _back_in_service(self, target: Segment | None) -> bool:
        if target is None:
            return False
        self.failure = None
        self._seals.start()
        log.info(
            "{directory} is back in service: a probe write and fsync succeeded, and its"
            " active segment holds exactly what was acknowledged ({offset} records)",
            directory=self._state.directory,
            offset=target.next_offset,
        )
        return True

    def _still_failing(self, failure: Failure) -> bool:
        log.info(
            "{directory} stays out of service: {error}",
            directory=self._state.directory,
            error=failure.getErrorMessage(),
        )
        return False

    def _control_done(self, result: object, control: _Control) -> None:
        if isinstance(result, Failure):
            control.deferred.errback(result)
        else:
            control.deferred.callback(result)
        self._job_finished()

    # -- shutdown ----------------------------------------------------------------------------

    def close(self) -> Deferred[None]:
        """Flush queued appends, wait for the running job, then close every file."""
        if self._closed:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._close_waiters.append(waiter)
        if not self._closing:
            self._closing = True
            self._planner.close()
            self._cancel_timer()
            self._after_job(self._planner.step(self._clock.seconds()))
        return waiter

    def seal_behind(self) -> None:
        """Seal the segments that rolled over and are not sealed yet (after recovery)."""
        self._seals.start()

    def seals_settled(self) -> Deferred[None]:
        """Fire once no seal behind the appends runs or will start (``SealsBehind.settled``),
        and no copy seal runs behind them."""
        return self._seals.settled().addCallback(lambda _: self.copy_seals.settled())

    def _finish_close(self) -> None:
        # A seal behind the appends reads its segment and writes its sidecars: it ends first.
        # (No copy seal starts once the log is closing: every operation is refused.)
        if self._seals_closing is None:
            closing = self._seals.close().addCallback(lambda _: self.copy_seals.settled())
            self._seals_closing = closing.addCallback(self._close_files)

    def _close_files(self, _: object) -> None:
        for segment in self._state.segments:
            self._state.files.close_all(segment)
        self._closed = True
        waiters, self._close_waiters = self._close_waiters, []
        for waiter in waiters:
            waiter.callback(None)
