"""Reads of a range's committed records from its segments' copies, for when its primary cannot
serve them.

A range is read through the primary of its active segment. When that primary is lost and no
quorum is left to take the segment over (two nodes of three down), or this node has lost its
membership lease, the records already committed are still on the copies of the live nodes:
``CommittedCopies`` reads them there, this node's own copy first (through ``Loopback``), then
each live replica's, with the ``read_committed`` op. A copy answers only with records it knows
are committed (``ReplicaServer.read_committed``), so a read never shows a record that a later
takeover could drop. A replica learns the commit index from the primary's next message, so the
records acknowledged in the primary's last moments show only once the range is taken over.
A node whose view of the control plane is catching up with etcd refuses a read that finds
nothing (``unreachable``, to retry) rather than say the range ends where its view does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import deferLater
from twisted.logger import Logger

from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import Bounds, RangeRead, read_records
from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.errors import Reason
from logbroker.peer.frames import PeerOp
from logbroker.replication.replica_codec import (
    CommittedRecords,
    FetchRequest,
    decode_committed,
    encode_fetch,
)
from logbroker.replication.takeover import ClaimContext
from logbroker.storage import BatchSlice
from logbroker.storage._format import scan_batches

log = Logger()

#: The most bytes one ``read_committed`` asks a copy for.
_MAX_READ = 1024 * 1024
#: How long a long poll on copies waits before the fetch reads them again: nothing wakes it
#: (there is no primary to say a record arrived), and a range being taken over comes back
#: within about this long.
POLL_SECONDS = 0.5


@attrs.frozen
class SegmentRead:
    """Where a read of a range from an offset goes: the one segment holding it (``None``:
    nothing to read there), the offset to read from, and at most how many records."""

    segment: SegmentMeta | None
    offset: int
    max_records: int

    def nothing(self) -> Deferred[RangeRead]:
        return succeed(RangeRead((), 0, self.offset, 0))


def segment_read(segments: Sequence[SegmentMeta], offset: int, max_records: int) -> SegmentRead:
    """A read of the range whose segments are ``segments`` from ``offset`` (or from its start,
    if that is later), kept within one segment: a sealed one's end bounds its records."""
    if not segments:
        return SegmentRead(None, offset, 0)
    offset = max(offset, segments[0].base_offset)
    meta = next((m for m in reversed(segments) if m.base_offset <= offset), segments[0])
    if meta.state is SegmentState.SEALED:
        assert meta.record_count is not None
        end = meta.base_offset + meta.record_count
        if offset >= end:
            # Past the last record of a segment sealed empty-ended: the next one starts here.
            return SegmentRead(None, offset, 0)
        max_records = min(max_records, end - offset)
    return SegmentRead(meta, offset, max_records)


class CommittedCopies:
    """Committed records of any range, from the live copies of its segments."""

    def __init__(self, context: ClaimContext) -> None:
        self._context = context

    def read(
        self, range_id: str, offset: int, max_records: int, max_bytes: int
    ) -> Deferred[RangeRead]:
        """Committed records from ``offset``, within the one segment holding it. Nothing found
        while this node's view of the control plane is catching up with etcd is refused
        ``unreachable``: the view may end before segments it does not know yet, and "no
        records" would say the range ends there."""
        plan = segment_read(self._context.control.segments(range_id), offset, max_records)
        meta = plan.segment
        reading: Deferred[RangeRead]
        if meta is None:
            reading = plan.nothing()
        else:

            def read_chunks(at: int, size: int) -> Deferred[list[BatchSlice]]:
                return Deferred.fromCoroutine(self._chunks(meta, at, size))

            reading = read_records(read_chunks, plan.offset, plan.max_records, max_bytes)
        return reading.addCallback(self._unless_stale, range_id, plan.offset)

    def _unless_stale(self, read: RangeRead, range_id: str, offset: int) -> RangeRead:
        if read.count == 0 and not self._context.control_follows():
            raise BrokerError(
                Reason.UNREACHABLE,
                f"range {range_id}: this node's view of the control plane is catching up with"
                f" etcd, so it cannot tell yet whether records follow offset {offset}; retry",
            )
        return read

    def bounds(self, range_id: str) -> Deferred[Bounds]:
        """From the first segment's start to the end of the committed records a live copy
        holds: at least the range's end, not always all of it (``end_known`` false) while
        the last segment is active."""
        return Deferred.fromCoroutine(self._bounds(range_id))

    def wait(self, offset: int, wait_ms: int) -> Deferred[None]:
        """A long poll's wait: a short pause, after which the fetch reads the copies again."""
        delay = min(max(wait_ms, 0) / 1000.0, POLL_SECONDS)
        return deferLater(self._context.clock, delay, lambda: None)

    async def _bounds(self, range_id: str) -> Bounds:
        segments = self._context.control.segments(range_id)
        if not segments:
            return Bounds(0, 0)
        start, last = segments[0].base_offset, segments[-1]
        if last.state is SegmentState.SEALED:
            assert last.record_count is not None
            return Bounds(start, last.base_offset + last.record_count)
        ends = [answer.end_offset async for answer in self._answers(last, last.base_offset, 0)]
        if not ends:
            raise self._unreachable(last, last.base_offset)
        return Bounds(start, max(ends), end_known=False)

    async def _chunks(self, meta: SegmentMeta, offset: int, max_bytes: int) -> list[BatchSlice]:
        answered = False
        async for answer in self._answers(meta, offset, min(max_bytes, _MAX_READ)):
            answered = True
            chunks = batch_slices(answer.data)
            if chunks:
                return chunks
        if not answered:
            raise self._unreachable(meta, offset)
        # Every live copy ends here: nothing more is known to be committed yet.
        return []

    async def _answers(
        self, meta: SegmentMeta, offset: int, max_bytes: int
    ) -> AsyncIterator[CommittedRecords]:
        """What each live holder of ``meta``'s segment answers, this node first; holders that
        cannot be reached are passed over."""
        ctx = self._context
        request = encode_fetch(
            FetchRequest(meta.range_id, meta.base_offset, meta.epoch, offset, 0, max_bytes)
        )
        holders = sorted(
            (node for node in meta.replicas if node == ctx.node_id or ctx.is_live(node)),
            key=lambda node: node != ctx.node_id,
        )
        for node in holders:
            try:
                payload = await ctx.requester.request(node, PeerOp.READ_COMMITTED, request)
                answer = decode_committed(payload)
            except Exception as error:
                log.debug(
                    "Reading committed records of {range_id}@{segment} on {node} failed: {error}",
                    range_id=meta.range_id,
                    segment=meta.base_offset,
                    node=node,
                    error=str(error),
                )
                continue
            yield answer

    def _unreachable(self, meta: SegmentMeta, offset: int) -> BrokerError:
        return BrokerError(
            Reason.UNREACHABLE,
            f"range {meta.range_id} has no primary that can serve it, and no live copy of "
            f"{meta.range_id}@{meta.base_offset} ({', '.join(meta.replicas)}) answered for "
            f"offset {offset}",
        )


def batch_slices(data: bytes) -> list[BatchSlice]:
    """The whole batches another copy sent, as reads take them (each verified by its own
    checksum; a damaged one ends the list)."""
    view = memoryview(data)
    return [BatchSlice(view, batch, True) for batch in scan_batches(view).batches]
