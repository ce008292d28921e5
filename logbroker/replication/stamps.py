"""The producer stamps a range's new primary rebuilds its dedupe table from.

A node that claims a range must know every stamp among the range's recent produces (the last
``RECENT_STAMPS_BYTES`` of the range, which holds the produces in flight when the range
stopped), or a retry of one of them would be stored twice. Its own copy of the active segment
is complete after the claim, but a node holds only the segments whose replica sets name it: the
segments before may have been placed elsewhere (a cluster larger than the replication factor,
or replica sets rolled onto other nodes while some were down). ``recent_range_stamps`` reads
the stamps from this node's log when it holds those segments whole (the usual case), and
otherwise reads each segment from a live copy that holds it (this node's own where it can) with
the ``fetch`` op.
"""

from __future__ import annotations

from twisted.internet.defer import Deferred

from logbroker.broker.errors import BrokerError
from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.errors import Reason
from logbroker.peer.frames import PeerOp
from logbroker.records import ProducerStamp
from logbroker.replication.core import replica as rules
from logbroker.replication.replica import view_of
from logbroker.replication.replica_codec import FetchRequest, encode_fetch
from logbroker.replication.takeover import ClaimContext
from logbroker.storage import RangeLog
from logbroker.storage._format import scan_batches
from logbroker.storage.log import RECENT_STAMPS_BYTES

#: ``(stamp, base offset, record count)`` of each stamped batch, in offset order.
Stamps = list[tuple[ProducerStamp, int, int]]

#: The most bytes one fetch asks a copy for.
_MAX_FETCH = 1024 * 1024


def recent_range_stamps(
    context: ClaimContext, copy: RangeLog, range_id: str, max_bytes: int = RECENT_STAMPS_BYTES
) -> Deferred[Stamps]:
    """The stamps of the range's last ``max_bytes`` or so, wherever its segments are."""
    return Deferred.fromCoroutine(_recent(context, copy, range_id, max_bytes))


async def _recent(context: ClaimContext, copy: RangeLog, range_id: str, max_bytes: int) -> Stamps:
    recent = _recent_segments(context.control.segments(range_id), copy.active_bytes, max_bytes)
    if all(_held_whole(context, copy, meta) for meta, _ in recent):
        return await copy.recent_stamps(max_bytes)
    stamps: Stamps = []
    for meta, start in recent:
        stamps.extend(await _segment_stamps(context, copy, meta, start))
    return stamps


def _recent_segments(
    segments: list[SegmentMeta], active_bytes: int, max_bytes: int
) -> list[tuple[SegmentMeta, int]]:
    """The newest segments holding the last ``max_bytes`` of the range, oldest first, each
    with the offset to read it from: the oldest is read only in part, from about where those
    bytes start (estimated from its sealed size and count)."""
    recent: list[tuple[SegmentMeta, int]] = []
    left = max_bytes
    for meta in reversed(segments):
        if left <= 0:
            break
        if meta.state is SegmentState.ACTIVE:
            size = active_bytes
            start = meta.base_offset
        else:
            assert meta.record_count is not None
            assert meta.byte_size is not None
            size = meta.byte_size
            skipped = max(size - left, 0) * meta.record_count // max(size, 1)
            start = meta.base_offset + skipped
        recent.append((meta, start))
        left -= size
    recent.reverse()
    return recent


def _held_whole(context: ClaimContext, copy: RangeLog, meta: SegmentMeta) -> bool:
    """Whether this node's copy of ``meta``'s segment is to be believed whole (the active
    segment's is, after this node's claim); a stale copy is not."""
    end = meta.base_offset + (meta.record_count or 0)
    return rules.holds_whole(view_of(copy, meta.base_offset), meta, context.node_id, end)


async def _segment_stamps(
    context: ClaimContext, copy: RangeLog, meta: SegmentMeta, offset: int
) -> Stamps:
    """The stamps of ``meta``'s segment from ``offset``, read from one copy that holds it."""
    if _held_whole(context, copy, meta):
        holders = [context.node_id]
    else:
        holders = [n for n in meta.replicas if n != context.node_id and context.is_live(n)]
    for node in holders:
        try:
            return await _read_stamps(context, node, meta, offset)
        except Exception:  # a copy that cannot be read: the next holder
            continue
    raise BrokerError(
        Reason.UNREACHABLE,
        f"no live copy of {meta.range_id}@{meta.base_offset} ({', '.join(meta.replicas)}) "
        "could be read for the producer stamps a new primary must know",
    )


async def _read_stamps(context: ClaimContext, node: str, meta: SegmentMeta, offset: int) -> Stamps:
    end = None
    if meta.state is SegmentState.SEALED:
        assert meta.record_count is not None
        end = meta.base_offset + meta.record_count
    stamps: Stamps = []
    while end is None or offset < end:
        request = FetchRequest(
            meta.range_id,
            meta.base_offset,
            meta.epoch,
            offset,
            0,
            _MAX_FETCH,
            data_epoch=meta.records_epoch,
        )
        data = await context.requester.request(node, PeerOp.FETCH, encode_fetch(request))
        batches = scan_batches(data).batches
        if not batches:
            break
        for batch in batches:
            if end is not None and batch.base_offset >= end:
                return stamps
            if batch.stamp is not None and batch.next_offset > offset:
                stamps.append((batch.stamp, batch.base_offset, batch.record_count))
        offset = batches[-1].next_offset
    return stamps
