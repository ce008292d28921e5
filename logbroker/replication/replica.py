"""A node's copies of the segments it replicates: the replica side of the replication ops,
driven by the rules in ``logbroker.replication.core.replica``.

``ReplicaServer`` answers what a segment's primary (or a node taking a segment over) asks of
this node's copy: take these bytes (``replicate``), refuse older epochs from now on (``fence``),
match this seal (``seal``), and send bytes from your copy (``fetch``), or only the records it
knows are committed (``read_committed``, for reads while a range's primary cannot serve them).
Every answer but those two is a ``CopyStatus``: the copy's epoch and durable end, and the
outcome. Each op is given the node that sent it (the peer link authenticated it; a node's
requests to itself come through ``Loopback`` with its own id).

A fence of a segment this node has no copy of yet creates an empty copy, so the epoch is on
disk before anything of the old primary can arrive. Requests for one range are taken one at a
time while a fence, a cut, a new segment or a seal is under way; appends themselves are
pipelined (the log orders and group-commits them). A seal (asked for, or made because the next
segment's first bytes or fence came first) holds them only until the copy is closed at the
sealed length: its sidecars are written behind the appends (``RangeLog.seal_copy`` with
``behind``), so that a roll's next segment does not wait for every copy's read back.
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
from logbroker.replication.core import replica as rules
from logbroker.replication.core.replica import CopyView, Step
from logbroker.replication.replica_codec import (
    CheckOutcome,
    CommittedRecords,
    CopyCheck,
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
    encode_check,
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
    SegmentNotFoundError,
    SegmentStateError,
    StorageError,
    Verification,
)

log = Logger()

#: ``(sending node id, payload) -> ok payload``: a node's handler of one replication op.
ReplicaOp = Callable[[str, bytes], Deferred[bytes]]


class _Tail:
    """Where a copy's bytes end once what it was sent is written (durable or not)."""

    __slots__ = ("next_offset", "position", "segment")

    def __init__(self, segment: int, next_offset: int, position: int) -> None:
        self.segment = segment
        self.next_offset = next_offset
        self.position = position


def find_copy(copy: RangeLog, segment: int) -> SegmentInfo | None:
    """This node's copy of the segment at ``segment``, if it holds one."""
    return copy.segment(segment)


def copy_epochs(copy: RangeLog, segment: int) -> tuple[int | None, int | None]:
    """The epoch of this node's copy of ``segment`` and the data epoch of its records (both
    ``None`` when its marker is unreadable, or there is no copy)."""
    try:
        return copy.segment_epoch(segment), copy.segment_data_epoch(segment)
    except StorageError:
        return None, None


def view_of(copy: RangeLog, segment: int) -> CopyView:
    """What the rules need to know of this node's copy of ``segment``."""
    info = find_copy(copy, segment)
    if info is None:
        return CopyView(None, None)
    active = info.state is CopyState.ACTIVE
    return CopyView(
        info.state,
        *copy_epochs(copy, segment),
        damaged=info.damage is not None,
        next_offset=info.next_offset,
        tail_offset=copy.next_offset if active else info.next_offset,
        tail_position=copy.active_bytes if active else info.byte_size,
        durable_offset=copy.durable_offset if active else info.next_offset,
    )


def record_of(control: ControlPlane, range_id: str, segment: int) -> SegmentMeta | None:
    """The control plane's record of segment ``segment`` of ``range_id``, as this node sees it."""
    return next((m for m in control.segments(range_id) if m.base_offset == segment), None)


class ReplicaServer:
    """Serves the replication ops for this node's copies (``ops`` maps each to its handler)."""

    def __init__(self, node_id: str, storage: OpenLogs, control: ControlPlane) -> None:
        self._node_id = node_id
        self._storage = storage
        self._control = control
        #: Per range: where its active copy's bytes end, including appends not yet durable.
        self._tails: dict[str, _Tail] = {}
        #: Per range: the fence, cut, new segment or seal under way; other requests wait.
        self._busy: dict[str, Deferred[None]] = {}

    @property
    def ops(self) -> dict[PeerOp, ReplicaOp]:
        return {
            PeerOp.REPLICATE: lambda sender, payload: self.replicate(
                sender, decode_replicate(payload)
            ),
            PeerOp.FENCE: lambda sender, payload: self.fence(decode_fence(payload)),
            PeerOp.SEAL: lambda sender, payload: self.seal(decode_seal(payload)),
            PeerOp.FETCH: lambda sender, payload: self.fetch(decode_fetch(payload)),
            PeerOp.READ_COMMITTED: lambda sender, payload: self.read_committed(
                decode_fetch(payload)
            ),
            PeerOp.VERIFY_COPY: lambda sender, payload: self.verify_copy(decode_fence(payload)),
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

    def _view(self, copy: RangeLog, range_id: str, segment: int) -> CopyView:
        view = view_of(copy, segment)
        if view.state is not CopyState.ACTIVE:
            return view
        tail = self._tail(copy, range_id, segment)
        return CopyView(
            view.state,
            view.epoch,
            view.data_epoch,
            damaged=view.damaged,
            next_offset=view.next_offset,
            tail_offset=tail.next_offset,
            tail_position=tail.position,
            durable_offset=view.durable_offset,
        )

    # -- replicate ------------------------------------------------------------------------------

    def replicate(self, sender: str, request: ReplicateRequest) -> Deferred[bytes]:
        return self._when_idle(
            request.range_id, lambda copy: self._replicate(copy, sender, request)
        )

    def _replicate(self, copy: RangeLog, sender: str, request: ReplicateRequest) -> Deferred[bytes]:
        range_id, segment = request.range_id, request.segment
        record = record_of(self._control, range_id, segment)
        decision = rules.replicate_step(
            self._view(copy, range_id, segment), request, sender, record
        )
        again: Callable[[], Deferred[bytes]] = lambda: self._replicate(copy, sender, request)  # noqa: E731
        if decision.step is Step.ANSWER:
            return succeed(self._status(copy, segment, decision.outcome))
        if decision.step is Step.UNAVAILABLE:
            raise BrokerError(
                Reason.UNREACHABLE,
                f"this node's copy of {range_id}@{segment} has an unknown epoch (its marker is "
                "unreadable): it takes nothing until it is fenced again",
            )
        if decision.step is Step.NOTE_COMMIT:
            copy.commit(rules.known_commit(request.commit, copy.durable_offset))
            return succeed(self._status(copy, segment, CopyOutcome.OK))
        if decision.step is Step.START:
            return self._exclusive_then(range_id, self._start(copy, request), again)
        if decision.step is Step.CUT:
            return self._exclusive_then(range_id, self._cut(copy, request), again)
        return self._append(copy, request, decision.epoch)

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
        one at the segment's base, fenced at the request's epoch, at its data epoch."""
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
            lambda _: copy.start_segment(segment, request.epoch, request.data_epoch)
        )

    def _close_active(self, copy: RangeLog, range_id: str, before: int) -> Deferred[object]:
        """Seal the copy's active segment to the length the control plane recorded, if it is
        sealed there; otherwise ``start_segment`` closes it as it is (healing comes later)."""
        active = next((s for s in copy.segments() if s.state is CopyState.ACTIVE), None)
        if active is None or active.base_offset >= before:
            return succeed(None)
        recorded = record_of(self._control, range_id, active.base_offset)
        if recorded is None or recorded.state is not SegmentState.SEALED:
            return succeed(None)
        if not rules.seals_in_place(view_of(copy, active.base_offset), recorded):
            # Its bytes may not be the sealed ones. Left closed, for healing to fetch whole.
            return succeed(None)
        assert recorded.record_count is not None
        assert recorded.byte_size is not None
        sealing = copy.seal_copy(
            active.base_offset,
            recorded.record_count,
            recorded.byte_size,
            epoch=recorded.epoch,
            behind=True,
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
        """Record the request's epoch, cut every byte of the copy (``Step.CUT``: another
        primary's records, wherever this request starts), then take the request's data epoch.
        In that order: a crash between two steps leaves the copy refusing older epochs, and
        never holding the other primary's records under this one's name."""
        range_id, segment = request.range_id, request.segment
        self._tails.pop(range_id, None)
        fenced = copy.fence(segment, request.epoch)
        fenced.addCallback(lambda _: copy.trim(segment, 0))
        return fenced.addCallback(lambda _: copy.fence(segment, request.epoch, request.data_epoch))

    def _tail(self, copy: RangeLog, range_id: str, segment: int) -> _Tail:
        tail = self._tails.get(range_id)
        if tail is None or tail.segment != segment or tail.next_offset < copy.next_offset:
            tail = self._tails[range_id] = _Tail(segment, copy.next_offset, copy.active_bytes)
        return tail

    def _append(self, copy: RangeLog, request: ReplicateRequest, epoch: int) -> Deferred[bytes]:
        tail = self._tail(copy, request.range_id, request.segment)
        try:
            durable = copy.append_raw(request.offset, request.data, epoch)
        except StorageError as error:
            return succeed(self._refused(copy, request, error))
        tail.next_offset = copy.next_offset
        tail.position = request.position + len(request.data)

        def stored(_: object) -> bytes:
            copy.commit(rules.known_commit(request.commit, copy.durable_offset))
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

    # -- fence and seal -------------------------------------------------------------------------

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
            view = view_of(copy, segment)
            if view.state is CopyState.SEALED:
                return succeed(self._status(copy, segment, CopyOutcome.OK))
            if view.state is None or view.epoch is None:
                return succeed(self._status(copy, segment, CopyOutcome.SHORT))
            if rules.older_epoch(request.epoch, view.epoch):
                return succeed(self._status(copy, segment, CopyOutcome.FENCED))
            if request.epoch != view.epoch or request.data_epoch != view.data_epoch:
                # This copy was not fenced at the sealing epoch, or holds another primary's
                # records than the sealed ones (it was fenced after the claim went on without
                # it). It is fetched whole instead.
                return succeed(self._status(copy, segment, CopyOutcome.SHORT))
            self._tails.pop(range_id, None)
            # Behind the appends: the next segment's first bytes need only the copy closed.
            work = copy.seal_copy(
                segment, request.record_count, request.byte_size, epoch=request.epoch, behind=True
            )

            def answered(result: object) -> bytes:
                if isinstance(result, Failure):
                    _expect(result, SegmentStateError)
                    return self._status(copy, segment, CopyOutcome.SHORT)
                return self._status(copy, segment, CopyOutcome.OK)

            return self._exclusive(range_id, work).addBoth(answered)

        return self._when_idle(request.range_id, seal)

    # -- reads of this node's copy ----------------------------------------------------------

    def fetch(self, request: FetchRequest) -> Deferred[bytes]:
        """Whatever the copy holds from ``request.offset``: only a copy at ``request.epoch``
        holding ``request.data_epoch``'s records whose node is in the segment's replica set is
        served."""

        def fetch(copy: RangeLog) -> Deferred[bytes]:
            view = view_of(copy, request.segment)
            record = record_of(self._control, request.range_id, request.segment)
            where = f"{request.range_id}@{request.segment}"
            if view.state is None:
                raise BrokerError(Reason.UNREACHABLE, f"this node holds no copy of {where}")
            if view.epoch != request.epoch or view.damaged:
                raise BrokerError(
                    Reason.NOT_PRIMARY,
                    f"this node's copy of {where} is at epoch {view.epoch}"
                    f"{' and damaged' if view.damaged else ''}, not at {request.epoch}",
                )
            if view.state is not CopyState.SEALED and view.data_epoch != request.data_epoch:
                # A sealed copy's records were checked at its seal (its data epoch is then
                # its epoch's).
                raise BrokerError(
                    Reason.NOT_PRIMARY,
                    f"this node's copy of {where} holds the records of epoch {view.data_epoch}, "
                    f"not of {request.data_epoch}",
                )
            if record is not None and self._node_id not in record.replicas:
                raise BrokerError(
                    Reason.NOT_PRIMARY,
                    f"this node is not in the replica set of {where}: its copy is stale",
                )
            if request.offset >= view.next_offset:
                return succeed(b"")
            return copy.read_raw_async(request.offset, request.max_bytes)

        return self._when_idle(request.range_id, fetch)

    def read_committed(self, request: FetchRequest) -> Deferred[bytes]:
        """Whole batches of this copy's committed records of ``request.segment`` from
        ``request.offset``, and where they end: for reads while the range's primary cannot
        serve them. Never a record the copy does not know is committed."""

        def read(copy: RangeLog) -> Deferred[bytes]:
            end = self.committed_end(copy, request.range_id, request.segment)
            if request.max_bytes == 0 or request.offset >= end:
                return succeed(encode_committed(CommittedRecords(end, b"")))

            def answer(chunks: list[BatchSlice]) -> bytes:
                data = _whole_batches(chunks, request.segment, end)
                return encode_committed(CommittedRecords(end, data))

            return copy.read_chunks(request.offset, request.max_bytes).addCallback(answer)

        return self._when_idle(request.range_id, read)

    def verify_copy(self, request: FenceRequest) -> Deferred[bytes]:
        """This node's own check of its sealed copy of ``request.segment`` at ``request.epoch``,
        read back whole (every checksum, and the count and size its seal recorded), for a
        node repairing its copy: only a copy found intact may be a repair's source. A copy
        found damaged here is marked so (reads stop before the damage) and repaired in turn."""

        def check(copy: RangeLog) -> Deferred[bytes]:
            view = view_of(copy, request.segment)
            record = record_of(self._control, request.range_id, request.segment)
            if (
                view.state is not CopyState.SEALED
                or view.epoch != request.epoch
                or record is None
                or self._node_id not in record.replicas
            ):
                return succeed(encode_check(CopyCheck(CheckOutcome.ABSENT, view.epoch or 0)))

            def checked(verification: Verification) -> bytes:
                damage = verification.damage
                if damage is not None:
                    return encode_check(
                        CopyCheck(CheckOutcome.DAMAGED, request.epoch, position=damage.position)
                    )
                return encode_check(
                    CopyCheck(
                        CheckOutcome.INTACT,
                        request.epoch,
                        verification.record_count,
                        verification.byte_size,
                    )
                )

            def gone(failure: Failure) -> bytes:
                _expect(failure, SegmentNotFoundError)
                return encode_check(CopyCheck(CheckOutcome.ABSENT, request.epoch))

            return copy.verify_segment(request.segment).addCallbacks(checked, gone)

        return self._log(request.range_id).addCallback(check)

    def committed_end(self, copy: RangeLog, range_id: str, segment: int) -> int:
        """Where this node's copy's records of ``segment`` known to be committed end."""
        record = record_of(self._control, range_id, segment)
        if record is None:
            return segment
        view = view_of(copy, segment)
        return rules.committed_end(view, record, self._node_id, copy.end_offset)

    # -- answers ----------------------------------------------------------------------------

    def _status(self, copy: RangeLog, segment: int, outcome: CopyOutcome) -> bytes:
        view = view_of(copy, segment)
        end_offset, end_position = view.durable_offset, view.tail_position
        if view.state is None:
            end_offset, end_position = segment, 0
        epoch = view.epoch or 0
        data_epoch = epoch if view.data_epoch is None else view.data_epoch
        return encode_status(
            CopyStatus(outcome, epoch, end_offset, end_position, data_epoch=data_epoch)
        )


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


def _expect(failure: Failure, kind: type[Exception]) -> Exception:
    """The failure's error if it is a ``kind``; otherwise the failure goes on as it is."""
    if not isinstance(failure.value, kind):
        failure.raiseException()
    return failure.value
