"""A range log's way back into service after a failed write, fsync, seal or segment start.

Each case has its job (``logbroker.storage._jobs``): a probe write and fsync beside the
segments first, so nothing is tried while the disk still fails, then what the failure left in
doubt is put right on disk. The job's result is applied here, in the reactor thread, only if
the log is still as it was when the job started (the failure not cleared meanwhile, the same
segment last).
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.internet.defer import Deferred, succeed

from logbroker.storage._executor import Executor
from logbroker.storage._format import EpochMarker
from logbroker.storage._fs import AppendFile, FileSystem
from logbroker.storage._jobs import _back_in_service_job, _finish_start_job, _reopen_job
from logbroker.storage._segment import CopyState, Segment
from logbroker.storage._state import LogState


class Comeback:
    """Puts right what a failure left in doubt in one range log, so it can take appends."""

    def __init__(
        self,
        state: LogState,
        fs: FileSystem,
        executor: Executor,
        still_failed: Callable[[], bool],
    ) -> None:
        self._state = state
        self._fs = fs
        self._executor = executor
        self._still_failed = still_failed

    def attempt(self) -> Deferred[Segment | None]:
        """The segment that takes appends again, the log's offsets set from it, or ``None``
        when the failure left more in doubt than a return can settle (a seal marker written,
        a newer segment file, rot in the segment): the log then waits for a restart. Fails
        while the disk still fails the probe.

        - After a failed write or fsync, the active segment is cut back to what was durable
          (and the file of the segment a failed roll was making is removed).
        - After a seal or trim of the last segment that failed midway, the segment is taken as
          its file now holds it (whatever the cut reached was never committed).
        - After a segment start that failed midway, the start is made again.

        A replicated copy is then brought back in step by its primary (a claim fences it and
        completes it), as after any gap."""
        state = self._state
        target = state.active
        # A seal or trim of the last segment closes it while it runs (``_cut_back``).
        cut = (
            target is None and bool(state.segments) and state.segments[-1].state is CopyState.CLOSED
        )
        if cut:
            target = state.segments[-1]
        if state.starting is not None:
            if state.start_on_disk:
                return self._finish_start(state.starting)
            # The start was still queued behind the operation that failed: it never touched
            # the disk, and its caller was told it failed, so it is forgotten.
            state.forget_start()
        if target is None or target.damage is not None or target.has_marker:
            return succeed(None)
        if cut:
            return self._reopen(target)
        return self._cut_back(target)

    def _cut_back(self, target: Segment) -> Deferred[Segment | None]:
        state = self._state
        state.files.close_writer(target)
        rolling_to = state.rolling_to
        checking = self._executor.run(
            _back_in_service_job,
            self._fs,
            state.directory,
            target.path,
            target.readable_end,
            None if rolling_to is None else state.segment_path(rolling_to),
        )

        def checked(back: bool) -> Segment | None:
            if not back or not self._still_failed() or state.active is not target:
                return None
            state.rolling_to = None
            target.state = CopyState.ACTIVE
            target.end_offset = target.next_offset
            state.next_offset = state.durable_offset = target.next_offset
            return target

        return checking.addCallback(checked)

    def _finish_start(self, base_offset: int) -> Deferred[Segment | None]:
        """``start_segment`` failed midway (the previous segment is closed, the new one's
        marker or file not durable): the same start again, so that the log is as that start
        would have left it (``_finish_start_job``)."""
        state = self._state
        epoch = state.epochs.get(base_offset)
        if epoch is None:
            return succeed(None)
        marker = EpochMarker(base_offset, epoch, state.data_epochs.get(base_offset, epoch))
        finishing = self._executor.run(
            _finish_start_job, self._fs, state.directory, state.segment_path(base_offset), marker
        )

        def finished(writer: AppendFile | None) -> Segment | None:
            if writer is None:
                return None
            if not self._still_failed() or state.starting != base_offset or state.active:
                writer.close()
                return None
            segment = state.add_active(base_offset, writer)
            state.next_offset = state.durable_offset = base_offset
            state.starting = None
            state.start_on_disk = False
            return segment

        return finishing.addCallback(finished)

    def _reopen(self, target: Segment) -> Deferred[Segment | None]:
        state = self._state
        reopening = self._executor.run(
            _reopen_job, self._fs, state.directory, target.path, target.base_offset
        )

        def reopened(found: Segment | None) -> Segment | None:
            if (
                found is None
                or not self._still_failed()
                or state.active is not None
                or state.segments[-1] is not target
            ):
                return None
            target.state = CopyState.ACTIVE
            target.readable_end = found.readable_end
            target.next_offset = target.end_offset = found.next_offset
            target.index = found.index
            target.generation += 1
            state.active = target
            state.next_offset = state.durable_offset = found.next_offset
            return target

        return reopening.addCallback(reopened)
