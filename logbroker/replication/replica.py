"""A node's copies of the segments it replicates: the replica side of the replication ops.

``ReplicaServer`` answers what a segment's primary (or a node taking a segment over) asks of
this node's copy: take these bytes (``replicate``), refuse older epochs from now on (``fence``),
match this seal (``seal``), and send bytes from your copy (``fetch``), or only the records it
knows are committed (``read_committed``, for reads while a range's primary cannot serve them).
Every answer but those two is a ``CopyStatus``: the copy's epoch and durable end, and the
outcome.

The rules that make a quorum's acknowledgement mean something:

- **Epochs only go up.** A request carrying an older epoch than the copy's is refused
  (``fenced``), so once a node taking over has fenced a quorum, the old primary can get nothing
  more durable on a quorum. A fence of a segment this node has no copy of yet creates an empty
  copy, so the epoch is on disk before anything of the old primary can arrive.
- **Contiguity.** Bytes are taken only where the copy ends (same offset and byte position);
  otherwise the answer is ``mismatch`` with where the copy's bytes end (written, if not all
  durable yet), and the primary sends from there. A resend of bytes the copy holds (after a
  lost answer) is answered so too, and stores nothing twice.
- **An older epoch's tail goes.** Bytes a copy holds past where a newer epoch's primary starts
  sending were written under an older epoch and never reached a quorum (the node that took over
  started from the longest end of a quorum, which holds every acknowledged record): they are
  cut back before the new bytes are stored. Rot is never cut (the storage engine refuses).

Requests for one range are taken one at a time while a fence, a cut, a new segment or a seal
is under way; appends themselves are pipelined (the log orders and group-commits them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.broker.errors import BrokerError
from logbroker.controlplane import ControlPlane, SegmentMeta, SegmentState
from logbroker.errors import Reason
from logbroker.peer.frames import PeerOp
from logbroker.replication.replica_codec import (
    CommittedRecords,
    CopyOutcome,
    CopyStatus,
    FenceRequest,
    FetchRequest,
    ReplicateRequest,
    SealRequest,
    decode_fence,
    decode_fetch,
    decode_replicate,
    decode_seal,
    encode_committed,
    encode_status,
)
from logbroker.storage import (
    BatchSlice,
    CopyState,
    FencedError,
    OpenLogs,
    RangeLog,
    SegmentInfo,
    SegmentStateError,
    StorageError,
)

log = Logger()


class _Tail:
    """Where a copy's bytes end once what it was sent is written (durable or not)."""

    __slots__ = ("next_offset", "position", "segment")

    def __init__(self, segment: int, next_offset: int, position: int) -> None:
        self.segment = segment
        self.next_offset = next_offset
        self.position = position


class ReplicaServer:
    """Serves the replication ops for this node's copies (``ops`` maps each to its handler)."""

    def __init__(self, storage: OpenLogs, control: ControlPlane) -> None:
        self._storage = storage
        self._control = control
        #: Per range: where its active copy's bytes end, including appends not yet durable.
        self._tails: dict[str, _Tail] = {}
        #: Per range: the fence, cut, new segment or seal under way; other requests wait.
        self._busy: dict[str, Deferred[None]] = {}

    @property
    def ops(self) -> dict[PeerOp, Callable[[bytes], Deferred[bytes]]]:
        return {
            PeerOp.REPLICATE: lambda payload: self.replicate(decode_replicate(payload)),
            PeerOp.FENCE: lambda payload: self.fence(decode_fence(payload)),
            PeerOp.SEAL: lambda payload: self.seal(decode_seal(payload)),
            PeerOp.FETCH: lambda payload: self.fetch(decode_fetch(payload)),
            PeerOp.READ_COMMITTED: lambda payload: self.read_committed(decode_fetch(payload)),
        }

    # -- one request at a time per range while the copy changes shape --------------------------

    def _when_idle(
        self, range_id: str, then: Callable[[RangeLog], Deferred[bytes]]
    ) -> Deferred[bytes]:
        def run(_: object) -> Deferred[bytes]:
            return self._log(range_id).addCallback(then)

        busy = self._busy.get(range_id)
        if busy is None:
            return run(None)
        waiter: Deferred[None] = Deferred()
        busy.addBoth(lambda _: waiter.callback(None))
        return waiter.addCallback(run)

    def _exclusive(self, range_id: str, work: Deferred[Any]) -> Deferred[Any]:
        """Hold ``range_id``'s other requests until ``work`` is done."""
        done: Deferred[None] = Deferred()
        self._busy[range_id] = done

        def release(result: object) -> object:
            if self._busy.get(range_id) is done:
                del self._busy[range_id]
            done.callback(None)
            return result

        return work.addBoth(release)

    def _log(self, range_id: str) -> Deferred[RangeLog]:
        opened = self._storage.logs.get(range_id)
        if opened is not None:
            return succeed(opened)
        return self._storage.open_range(range_id)

    # -- the ops --------------------------------------------------------------------------------

    def replicate(self, request: ReplicateRequest) -> Deferred[bytes]:
        return self._when_idle(request.range_id, lambda copy: self._replicate(copy, request))

    def _replicate(self, copy: RangeLog, request: ReplicateRequest) -> Deferred[bytes]:
        range_id, segment = request.range_id, request.segment
        info = find_copy(copy, segment)
        if not request.data:
            return succeed(self._commit_notice(copy, info, request))
        if info is None or info.state is not CopyState.ACTIVE:
            if info is not None and info.state is CopyState.SEALED:
                # The segment is over: whoever still sends to it is stale.
                return succeed(self._status(copy, segment, CopyOutcome.FENCED))
            return self._exclusive_then(
                range_id, self._start(copy, request), lambda: self._replicate(copy, request)
            )
        epoch = copy.segment_epoch(segment)
        if request.epoch < epoch:
            return succeed(self._status(copy, segment, CopyOutcome.FENCED))
        tail = self._tail(copy, range_id, segment)
        if request.offset == tail.next_offset and request.position == tail.position:
            return self._append(copy, request, tail)
        if request.offset < tail.next_offset and request.epoch > epoch:
            return self._exclusive_then(
                range_id,
                self._cut(copy, request),
                lambda: self._replicate(copy, request),
            )
        return succeed(self._written_status(copy, tail, CopyOutcome.MISMATCH))

    def _commit_notice(
        self, copy: RangeLog, info: SegmentInfo | None, request: ReplicateRequest
    ) -> bytes:
        """A replicate request without data: the primary has nothing more to send for now,
        only how far the range is committed. A copy appending to the segment at the primary's
        epoch holds a prefix of what that primary wrote, so its records up to there are
        committed; any other copy has nothing to note."""
        segment = request.segment
        if info is not None and info.state is CopyState.ACTIVE:
            epoch = copy.segment_epoch(segment)
            if request.epoch < epoch:
                return self._status(copy, segment, CopyOutcome.FENCED)
            if request.epoch == epoch:
                copy.commit(min(request.commit, copy.durable_offset))
        return self._status(copy, segment, CopyOutcome.OK)

    def _exclusive_then(
        self, range_id: str, work: Deferred[Any], then: Callable[[], Deferred[bytes]]
    ) -> Deferred[bytes]:
        def done(result: object) -> Deferred[bytes] | bytes:
            if isinstance(result, bytes):
                # The work answered the request itself (a refusal).
                return result
            return then()

        return self._exclusive(range_id, work).addCallback(done)

    def _start(self, copy: RangeLog, request: ReplicateRequest) -> Deferred[object]:
        """The first bytes of a segment this node holds no active copy of: close whatever
        copy was active (sealing it to its recorded length if it is sealed already) and start
        one at the segment's base, fenced at the request's epoch."""
        range_id, segment = request.range_id, request.segment
        if find_copy(copy, segment) is not None:
            # A closed copy of this very segment (it found rot, or recovery closed it): it
            # takes nothing more; healing fetches the segment whole once it is sealed.
            raise BrokerError(
                Reason.UNREACHABLE,
                f"this node's copy of {range_id}@{segment} is closed and takes no appends",
            )
        self._tails.pop(range_id, None)
        return self._close_active(copy, range_id, segment).addCallback(
            lambda _: copy.start_segment(segment, request.epoch)
        )

    def _close_active(self, copy: RangeLog, range_id: str, before: int) -> Deferred[object]:
        """Seal the copy's active segment to the length the control plane recorded, if it is
        sealed there; otherwise ``start_segment`` closes it as it is (healing comes later)."""
        active = next((s for s in copy.segments() if s.state is CopyState.ACTIVE), None)
        if active is None or active.base_offset >= before:
            return succeed(None)
        recorded = next(
            (
                meta
                for meta in self._control.segments(range_id)
                if meta.base_offset == active.base_offset
            ),
            None,
        )
        if recorded is None or recorded.state is not SegmentState.SEALED:
            return succeed(None)
        if not same_epoch(copy, recorded):
            # Written under another epoch than the one it was sealed at: its bytes may not be
            # the sealed ones. Left closed, for healing to fetch whole.
            return succeed(None)
        assert recorded.record_count is not None
        assert recorded.byte_size is not None
        sealing = copy.seal_copy(
            active.base_offset, recorded.record_count, recorded.byte_size, epoch=recorded.epoch
        )

        def short(failure: Failure) -> None:
            # Fewer bytes than were sealed: left closed, for healing to fetch whole.
            _expect(failure, SegmentStateError)
            log.info(
                "Copy of {range_id}@{segment} is shorter than its seal; it waits for healing",
                range_id=range_id,
                segment=active.base_offset,
            )

        return sealing.addErrback(short)

    def _cut(self, copy: RangeLog, request: ReplicateRequest) -> Deferred[object]:
        """Record the newer epoch, then cut the older epoch's tail back to where the new
        primary sends from."""
        self._tails.pop(request.range_id, None)
        fenced = copy.fence(request.segment, request.epoch)
        return fenced.addCallback(lambda _: copy.trim(request.segment, request.position))

    def _tail(self, copy: RangeLog, range_id: str, segment: int) -> _Tail:
        tail = self._tails.get(range_id)
        if tail is None or tail.segment != segment or tail.next_offset < copy.next_offset:
            tail = self._tails[range_id] = _Tail(segment, copy.next_offset, copy.active_bytes)
        return tail

    def _append(self, copy: RangeLog, request: ReplicateRequest, tail: _Tail) -> Deferred[bytes]:
        try:
            durable = copy.append_raw(request.offset, request.data, request.epoch)
        except StorageError as error:
            return succeed(self._refused(copy, request, error))
        tail.next_offset = copy.next_offset
        tail.position = request.position + len(request.data)

        def stored(_: object) -> bytes:
            copy.commit(min(request.commit, copy.durable_offset))
            return self._status(copy, request.segment, CopyOutcome.OK)

        def failed(failure: Failure) -> bytes:
            self._tails.pop(request.range_id, None)
            return self._refused(copy, request, _expect(failure, StorageError))

        return durable.addCallbacks(stored, failed)

    def _refused(self, copy: RangeLog, request: ReplicateRequest, error: Exception) -> bytes:
        if isinstance(error, FencedError):
            return self._status(copy, request.segment, CopyOutcome.FENCED)
        raise BrokerError(
            Reason.UNREACHABLE,
            f"this node's copy of {request.range_id}@{request.segment} refused the bytes: {error}",
        )

    def fence(self, request: FenceRequest) -> Deferred[bytes]:
        def fence(copy: RangeLog) -> Deferred[bytes]:
            range_id, segment = request.range_id, request.segment
            self._tails.pop(range_id, None)
            info = find_copy(copy, segment)
            if info is None:
                # Nothing of this segment here yet: an empty copy carries the epoch, so that
                # nothing of an older primary is taken after this answer.
                work = self._close_active(copy, range_id, segment).addCallback(
                    lambda _: copy.start_segment(segment, request.epoch)
                )
            else:
                work = copy.fence(segment, request.epoch)

            def answered(result: object) -> bytes:
                if isinstance(result, Failure):
                    _expect(result, FencedError)
                    return self._status(copy, segment, CopyOutcome.FENCED)
                return self._status(copy, segment, CopyOutcome.OK)

            return self._exclusive(range_id, work).addBoth(answered)

        return self._when_idle(request.range_id, fence)

    def seal(self, request: SealRequest) -> Deferred[bytes]:
        def seal(copy: RangeLog) -> Deferred[bytes]:
            range_id, segment = request.range_id, request.segment
            info = find_copy(copy, segment)
            if info is not None and info.state is CopyState.SEALED:
                return succeed(self._status(copy, segment, CopyOutcome.OK))
            if info is None:
                return succeed(self._status(copy, segment, CopyOutcome.SHORT))
            if request.epoch < copy.segment_epoch(segment):
                return succeed(self._status(copy, segment, CopyOutcome.FENCED))
            if request.epoch > copy.segment_epoch(segment):
                # This copy was not fenced at the sealing epoch: its bytes may be another
                # primary's. It is fetched whole instead.
                return succeed(self._status(copy, segment, CopyOutcome.SHORT))
            self._tails.pop(range_id, None)
            work = copy.seal_copy(
                segment, request.record_count, request.byte_size, epoch=request.epoch
            )

            def answered(result: object) -> bytes:
                if isinstance(result, Failure):
                    _expect(result, SegmentStateError)
                    return self._status(copy, segment, CopyOutcome.SHORT)
                return self._status(copy, segment, CopyOutcome.OK)

            return self._exclusive(range_id, work).addBoth(answered)

        return self._when_idle(request.range_id, seal)

    def fetch(self, request: FetchRequest) -> Deferred[bytes]:
        def fetch(copy: RangeLog) -> Deferred[bytes]:
            info = find_copy(copy, request.segment)
            if info is None:
                raise BrokerError(
                    Reason.UNREACHABLE,
                    f"this node holds no copy of {request.range_id}@{request.segment}",
                )
            if request.offset >= info.next_offset:
                return succeed(b"")
            return copy.read_raw_async(request.offset, request.max_bytes)

        return self._when_idle(request.range_id, fetch)

    def read_committed(self, request: FetchRequest) -> Deferred[bytes]:
        """Whole batches of this copy's committed records of ``request.segment`` from
        ``request.offset``, and where they end: for reads while the range's primary cannot
        serve them. Never a record the copy does not know is committed."""

        def read(copy: RangeLog) -> Deferred[bytes]:
            end = self._committed_end(copy, request.range_id, request.segment)
            if request.max_bytes == 0 or request.offset >= end:
                return succeed(encode_committed(CommittedRecords(end, b"")))

            def answer(chunks: list[BatchSlice]) -> bytes:
                data = _whole_batches(chunks, request.segment, end)
                return encode_committed(CommittedRecords(end, data))

            return copy.read_chunks(request.offset, request.max_bytes).addCallback(answer)

        return self._when_idle(request.range_id, read)

    def _committed_end(self, copy: RangeLog, range_id: str, segment: int) -> int:
        """Where this copy's records of ``segment`` that are known to be committed end.

        A copy sealed here holds its segment whole. Any other copy counts only if it was fenced
        at the segment's epoch: each segment is written by one primary (a claim of a segment
        that holds records seals it), so such a copy is a prefix of what that primary wrote,
        while a copy left at an older epoch may hold bytes nobody acknowledged. Of such a copy,
        a sealed segment's records up to its sealed end are committed; of the active segment,
        those below the commit index its primary last sent.
        """
        info = find_copy(copy, segment)
        meta = next((m for m in self._control.segments(range_id) if m.base_offset == segment), None)
        if info is None or meta is None:
            return segment
        if info.state is CopyState.SEALED:
            return info.next_offset
        if not same_epoch(copy, meta):
            return segment
        appending = info.state is CopyState.ACTIVE
        if meta.state is SegmentState.SEALED:
            assert meta.record_count is not None
            known = copy.end_offset if appending else info.next_offset
            return min(known, segment + meta.record_count)
        # The active segment: only a copy still appending to it has heard its commit index.
        return copy.end_offset if appending else segment

    # -- answers ----------------------------------------------------------------------------

    def _status(self, copy: RangeLog, segment: int, outcome: CopyOutcome) -> bytes:
        info = find_copy(copy, segment)
        end_offset = info.next_offset if info is not None else segment
        end_position = info.byte_size if info is not None else 0
        if info is not None and info.state is CopyState.ACTIVE:
            end_offset, end_position = copy.durable_offset, copy.active_bytes
        epoch = copy.segment_epoch(segment) if info is not None else 0
        return encode_status(CopyStatus(outcome, epoch, end_offset, end_position))

    def _written_status(self, copy: RangeLog, tail: _Tail, outcome: CopyOutcome) -> bytes:
        epoch = copy.segment_epoch(tail.segment)
        return encode_status(CopyStatus(outcome, epoch, tail.next_offset, tail.position))


def _whole_batches(chunks: list[BatchSlice], segment: int, end: int) -> bytes:
    """The stored bytes of the leading ``chunks`` that are whole, verified batches of
    ``segment`` below ``end``."""
    parts = []
    for chunk in chunks:
        batch = chunk.batch
        if not chunk.verified or batch.base_offset < segment or batch.next_offset > end:
            break
        parts.append(chunk.view[batch.position : batch.end])
    return b"".join(parts)


def find_copy(copy: RangeLog, segment: int) -> SegmentInfo | None:
    """This node's copy of the segment at ``segment``, if it holds one."""
    return next((s for s in copy.segments() if s.base_offset == segment), None)


def holds_whole(copy: RangeLog, segment: int, end: int) -> bool:
    """Whether this node's copy of the segment at ``segment`` is readable up to ``end``."""
    info = find_copy(copy, segment)
    return info is not None and info.damage is None and info.next_offset >= end


def _expect(failure: Failure, kind: type[Exception]) -> Exception:
    """The failure's error if it is a ``kind``; otherwise the failure goes on as it is."""
    if not isinstance(failure.value, kind):
        failure.raiseException()
    return failure.value


def same_epoch(copy: RangeLog, meta: SegmentMeta) -> bool:
    """Whether this copy of ``meta``'s segment was fenced at the epoch its record has: only
    then are its bytes the ones the segment's primary of that epoch wrote, to be sealed in
    place. A copy left at an older epoch (its node was down when the segment was taken over)
    may hold bytes an older primary wrote and nobody acknowledged: it is fetched whole."""
    try:
        return copy.segment_epoch(meta.base_offset) == meta.epoch
    except FencedError:
        return False
