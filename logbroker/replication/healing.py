"""Healing this node's copies: bring them back to what the control plane says, without the
operator.

Each node runs ``Healer.tick`` periodically (``logbroker.replication.replica_sets`` does the
same for the replica sets themselves). A tick looks at every segment of the ranges that may
need it: those whose records changed since the last tick, those it left with copies missing or
stale, and every range now and then (``FULL_LOOK_SECONDS``) and when the membership changed:

- **Its own copies.** A sealed segment whose replica set names this node must be held here
  whole, at the segment's epoch: a copy still open, written at that epoch (by the primary that
  sealed it: ``core.replica.seals_in_place``) and long enough is sealed in place (what lies
  past the sealed length was never acknowledged); a copy that is missing,
  short, damaged or of another epoch is fetched whole from a live replica that holds it (at the
  segment's epoch) and installed, replacing whatever copies overlap it here. Fetches run in
  parallel, across ranges, bounded by the bytes in flight (``max_fetch_bytes``; one at least),
  and each one that ends starts the next: a node back from a long absence is whole again at
  the speed of its disk and link, not at one segment a tick.
- **Stale copies.** A copy of a segment sealed on a replica set without this node (it was
  dropped from it, or the copy was left behind by a takeover) is served and believed by no one
  (``core.replica.trusted``); once every member of the set holds the segment whole, it is
  deleted.

``missing`` lists, after each tick, the sealed segments this node should hold and does not yet
(the ``copy_health`` peer op reports it to the others, for the under-replicated count).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

from twisted.internet.defer import Deferred, DeferredLock, succeed
from twisted.logger import Logger

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.maintenance.slices import Slices
from logbroker.peer.frames import PeerOp
from logbroker.replication.core import replica as rules
from logbroker.replication.looks import RangesToLookAt
from logbroker.replication.replica import view_of
from logbroker.replication.replica_codec import FetchRequest, decode_committed, encode_fetch
from logbroker.replication.takeover import ClaimContext
from logbroker.storage import CopyState, RangeLog, SegmentInfo, StorageError
from logbroker.storage._format import scan_batches

log = Logger()

#: The most bytes one fetch of a sealed copy asks for.
FETCH_BYTES = 1024 * 1024
#: The bytes of whole sealed copies being fetched at once, by default.
MAX_FETCH_BYTES = 64 * 1024 * 1024

#: How often a tick looks at every range. In between it looks at the ranges whose records
#: changed since the last tick, and at those it left with copies missing or stale; and at every
#: range when the membership changed. Anything else that changes a copy (damage found by a
#: read) is seen within this time.
FULL_LOOK_SECONDS = 10.0

#: ``(range id, base offset)``: a segment.
SegmentKey = tuple[str, int]


class Healer:
    def __init__(self, context: ClaimContext, max_fetch_bytes: int = MAX_FETCH_BYTES) -> None:
        self._context = context
        self._max_fetch_bytes = max_fetch_bytes
        #: Sealed segments this node should hold whole and does not, as of the last tick.
        self.missing: set[SegmentKey] = set()
        #: Waiting for the first tick to have looked (``looked``).
        self._looking: list[Deferred[None]] | None = []
        #: Copies being healed (sealed in place or fetched), and the bytes being fetched.
        self._healing: set[SegmentKey] = set()
        self._fetching_bytes = 0
        #: Fetches waiting for room in the budget, in the order found.
        self._queue: list[SegmentMeta] = []
        #: Copies that could not be healed here yet (no live holder), not to be logged twice.
        self._reported: set[SegmentKey] = set()
        #: Per range: held while a fetched copy is put in place. Fetches run in parallel, but
        #: each install decides what is in its way from the log as the previous one left it
        #: (two deciding at once would each start or delete segments the other did not see).
        self._placing: dict[str, DeferredLock] = {}
        #: Told of a sealed copy of this node's found damaged: a repair (``repair``) decides
        #: whether another copy qualifies to replace it, and fetches it through ``refetch``.
        #: Without one, healing fetches it like any copy it lacks.
        self.on_damaged: Callable[[SegmentMeta, SegmentInfo], None] | None = None
        #: What a tick looks at: besides the ranges whose records changed, those with copies
        #: missing (``missing``) or left behind (``_left_behind``).
        self._looks = RangesToLookAt(
            context.control, context.clock, context.live_nodes, FULL_LOOK_SECONDS
        )
        self._left_behind: set[str] = set()

    def _unfinished(self) -> Iterable[str]:
        return itertools.chain((range_id for range_id, _ in self.missing), self._left_behind)

    @property
    def fetching_bytes(self) -> int:
        return self._fetching_bytes

    def tick(self, range_ids: Sequence[str]) -> Deferred[None]:
        return Deferred.fromCoroutine(self._tick(range_ids))

    async def _tick(self, range_ids: Sequence[str]) -> None:
        ctx = self._context
        # Every range with a copy missing is looked at again: the whole of what is missing is
        # found anew, and the fetches queued.
        missing: set[SegmentKey] = set()
        self._queue = []
        slices = Slices(ctx.clock)
        for range_id in self._looks.take(range_ids, self._unfinished):
            await slices.next()
            metas = ctx.control.segments(range_id)
            # Most ranges have no segment sealed without this node: their copies are not read.
            behind = any(rules.left_behind(meta, ctx.node_id) for meta in metas)
            if behind:
                self._left_behind.add(range_id)
            else:
                self._left_behind.discard(range_id)
            copy = ctx.storage.logs.get(range_id)
            if any(ctx.node_id in meta.replicas for meta in metas):
                if copy is None:
                    copy = await ctx.storage.open_range(range_id)
                for meta in self._unhealed(copy, metas):
                    missing.add((meta.range_id, meta.base_offset))
                    self._heal(copy, meta)
            if behind and copy is not None:
                await self._drop_stale(copy, metas)
        self.missing = missing
        self._start_fetches()
        waiting, self._looking = self._looking, None
        for waiter in waiting or ():
            waiter.callback(None)

    def looked(self) -> Deferred[None]:
        """Fires once a tick has looked at every range (at once if one has): until then,
        ``missing`` knows nothing."""
        if self._looking is None:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._looking.append(waiter)
        return waiter

    # -- this node's copies -------------------------------------------------------------------

    def _unhealed(self, copy: RangeLog, metas: Sequence[SegmentMeta]) -> list[SegmentMeta]:
        """The sealed segments naming this node that it does not hold whole and trusted."""
        node_id = self._context.node_id
        found = []
        for meta in metas:
            if meta.state is not SegmentState.SEALED or node_id not in meta.replicas:
                continue
            if not meta.record_count:
                continue
            view = view_of(copy, meta.base_offset)
            if view.state is CopyState.SEALED and rules.trusted(view, meta, node_id):
                continue
            found.append(meta)
        return found

    def _heal(self, copy: RangeLog, meta: SegmentMeta) -> None:
        key = (meta.range_id, meta.base_offset)
        if key in self._healing:
            return
        info = copy.segment(meta.base_offset)
        assert meta.byte_size is not None
        if (
            info is not None
            and info.damage is None
            and info.state is not CopyState.SEALED
            and info.byte_size >= meta.byte_size
            and rules.seals_in_place(view_of(copy, meta.base_offset), meta)
        ):
            self._healing.add(key)
            self._seal_in_place(copy, meta).addBoth(self._healed, key, 0)
            return
        if (
            info is not None
            and info.damage is not None
            and info.state is CopyState.SEALED
            and self.on_damaged is not None
        ):
            self.on_damaged(meta, info)
            return
        self._queue.append(meta)

    def _seal_in_place(self, copy: RangeLog, meta: SegmentMeta) -> Deferred[object]:
        assert meta.record_count is not None
        assert meta.byte_size is not None
        where = f"{meta.range_id}@{meta.base_offset}"

        def sealed(_: object) -> None:
            log.info("Sealed this node's copy of {segment} as recorded", segment=where)

        def failed(failure: object) -> None:
            # Fetched whole at the next tick instead.
            log.warn("Sealing the copy of {segment} failed: {error}", segment=where, error=failure)

        sealing = copy.seal_copy(
            meta.base_offset, meta.record_count, meta.byte_size, epoch=meta.epoch
        )
        return sealing.addCallbacks(sealed, failed)

    def _start_fetches(self) -> None:
        """Start the queued fetches the budget has room for (one at least)."""
        queue, self._queue = self._queue, []
        for index, meta in enumerate(queue):
            key = (meta.range_id, meta.base_offset)
            if key in self._healing:
                continue
            assert meta.byte_size is not None
            size = meta.byte_size
            if self._healing and self._fetching_bytes + size > self._max_fetch_bytes:
                self._queue = queue[index:]
                return
            self._healing.add(key)
            self._fetching_bytes += size
            fetching = Deferred.fromCoroutine(self._fetch_and_install(meta))
            fetching.addBoth(self._healed, key, size)

    def _healed(self, outcome: object, key: SegmentKey, size: int) -> None:
        self._healing.discard(key)
        self._fetching_bytes -= size
        if outcome is True:
            self.missing.discard(key)
        self._start_fetches()

    def refetch(self, meta: SegmentMeta, sources: Sequence[str]) -> Deferred[bool]:
        """Fetch the whole sealed copy of ``meta`` from the first of ``sources`` that sends it
        whole, and put it in place of this node's (a repair): ``True`` once it is in place,
        ``False`` if no source sent it whole, or healing is fetching it already."""
        key = (meta.range_id, meta.base_offset)
        if key in self._healing:
            return succeed(False)
        self._healing.add(key)
        fetching = Deferred.fromCoroutine(self._fetch_and_install(meta, sources))

        def done(outcome: object) -> object:
            self._healing.discard(key)
            if outcome is True:
                self.missing.discard(key)
            return outcome

        return fetching.addBoth(done)

    async def _fetch_and_install(
        self, meta: SegmentMeta, sources: Sequence[str] | None = None
    ) -> bool:
        ctx = self._context
        assert meta.record_count is not None
        data = await self._fetch_whole(meta, sources)
        if data is None:
            return False
        copy = ctx.storage.logs.get(meta.range_id)
        if copy is None:
            return False  # closed meanwhile (the node is stopping)
        placing = self._placing.setdefault(meta.range_id, DeferredLock())
        try:
            async with placing:
                await self._make_room(copy, meta)
                await copy.install_segment(
                    meta.base_offset, data, meta.record_count, epoch=meta.epoch
                )
        except StorageError as error:
            self._report(meta, f"the whole copy cannot be put in place here ({error})")
            return False
        self._reported.discard((meta.range_id, meta.base_offset))
        log.info(
            "Fetched {range_id}@{segment} whole ({size} bytes) from a replica: this node's copy"
            " is complete",
            range_id=meta.range_id,
            segment=meta.base_offset,
            size=len(data),
        )
        return True

    async def _make_room(self, copy: RangeLog, meta: SegmentMeta) -> None:
        """Clear the way for the whole copy of ``meta``: delete every copy this node holds that
        overlaps its offsets, its own (short, damaged, or written at another epoch) copy of it
        included.

        Another copy in the way holds only bytes nobody acknowledged past its own sealed end
        (an older primary's, written while this node was cut off; or a segment this node was
        dropped from when it was taken over empty): deleting it loses nothing, and healing
        fetches it whole if this node should hold it. A log installs segments only before its
        active one, and never deletes its last one (its name keeps the range's end across a
        restart); a node that was down while the range moved on often holds an early copy
        last, still active. That one is emptied, and the segment that follows ``meta`` started
        after it, empty, at the epoch the control plane has for it (it takes that segment's
        first bytes from its primary, if it is one of its replicas)."""
        assert meta.record_count is not None
        end = meta.base_offset + meta.record_count
        held = copy.segments()
        in_the_way = [
            s
            for s in held
            if s.base_offset == meta.base_offset
            or (s.base_offset < end and s.next_offset > meta.base_offset)
        ]
        last = held[-1] if held else None
        if last is not None and last.base_offset < end:
            if last in in_the_way and last.state is not CopyState.SEALED:
                await copy.trim(last.base_offset, 0)
            # A sealed copy last (its range idle since) is not emptied: once the next segment
            # is started after it, it is deleted with the others in the way.
            after = next(
                (m for m in self._context.control.segments(meta.range_id) if m.base_offset == end),
                None,
            )
            await copy.start_segment(end, after.epoch if after is not None else 0)
        for segment in in_the_way:
            if segment.base_offset in {s.base_offset for s in copy.segments()}:
                await copy.delete_segment(segment.base_offset)

    async def _fetch_whole(
        self, meta: SegmentMeta, sources: Sequence[str] | None = None
    ) -> bytes | None:
        """The whole sealed copy of ``meta``, from the first of ``sources`` (by default its
        live replicas) that sends it whole and verified."""
        ctx = self._context
        assert meta.record_count is not None
        end = meta.base_offset + meta.record_count
        if sources is None:
            sources = [n for n in meta.replicas if n != ctx.node_id and ctx.is_live(n)]
        for holder in sources:
            parts: list[bytes] = []
            offset = meta.base_offset
            try:
                while offset < end:
                    request = FetchRequest(
                        meta.range_id,
                        meta.base_offset,
                        meta.epoch,
                        offset,
                        0,
                        FETCH_BYTES,
                        data_epoch=meta.records_epoch,
                    )
                    data = await ctx.requester.request(holder, PeerOp.FETCH, encode_fetch(request))
                    scan = scan_batches(data, 0, offset)
                    if not scan.batches or scan.damage is not None:
                        break
                    parts.append(data[: scan.end])
                    offset = scan.batches[-1].next_offset
            except Exception as error:
                log.debug(
                    "Fetching {range_id}@{segment} from {holder} failed: {error}",
                    range_id=meta.range_id,
                    segment=meta.base_offset,
                    holder=holder,
                    error=str(error),
                )
                continue
            whole = b"".join(parts)
            if offset == end and len(whole) == meta.byte_size:
                return whole
        self._report(meta, "no live replica holds it whole")
        return None

    def _report(self, meta: SegmentMeta, why: str) -> None:
        key = (meta.range_id, meta.base_offset)
        if key not in self._reported:
            self._reported.add(key)
            log.warn(
                "This node's copy of {range_id}@{segment} cannot be healed yet: {why}",
                range_id=meta.range_id,
                segment=meta.base_offset,
                why=why,
            )

    # -- stale copies ---------------------------------------------------------------------------

    async def _drop_stale(self, copy: RangeLog, metas: Sequence[SegmentMeta]) -> None:
        """Delete this node's copies of segments sealed on replica sets without it, once every
        member holds the segment whole."""
        ctx = self._context
        by_base = {meta.base_offset: meta for meta in metas}
        for info in copy.segments():
            meta = by_base.get(info.base_offset)
            if meta is None or not _holds_bytes(info):
                continue
            if not rules.stale(view_of(copy, info.base_offset), meta, ctx.node_id):
                continue
            key = (meta.range_id, meta.base_offset)
            if key in self._healing or not await self._members_hold_whole(meta):
                continue
            await self._delete(copy, info, meta)

    async def _members_hold_whole(self, meta: SegmentMeta) -> bool:
        ctx = self._context
        assert meta.record_count is not None
        end = meta.base_offset + meta.record_count
        probe = encode_fetch(
            FetchRequest(meta.range_id, meta.base_offset, meta.epoch, meta.base_offset, 0, 0)
        )
        for member in meta.replicas:
            try:
                answer = decode_committed(
                    await ctx.requester.request(member, PeerOp.READ_COMMITTED, probe)
                )
            except Exception:
                return False
            if answer.end_offset < end:
                return False
        return True

    async def _delete(self, copy: RangeLog, info: SegmentInfo, meta: SegmentMeta) -> None:
        """Delete a stale copy; the range's last segment (its name keeps where the range
        ends) is emptied instead, or, if it is sealed here, first followed by an empty one."""
        last = copy.segments()[-1]
        try:
            if info.base_offset == last.base_offset:
                if info.state is not CopyState.SEALED:
                    await copy.trim(info.base_offset, 0)
                    self._deleted(meta)
                    return
                await copy.start_segment(info.next_offset, 0)
            await copy.delete_segment(info.base_offset)
        except StorageError as error:
            log.warn(
                "Deleting the stale copy of {range_id}@{segment} failed: {error}",
                range_id=meta.range_id,
                segment=meta.base_offset,
                error=str(error),
            )
            return
        self._deleted(meta)

    def _deleted(self, meta: SegmentMeta) -> None:
        log.info(
            "Deleted this node's stale copy of {range_id}@{segment}: it is sealed on {replicas},"
            " which hold it whole",
            range_id=meta.range_id,
            segment=meta.base_offset,
            replicas=",".join(meta.replicas),
        )


def _holds_bytes(info: SegmentInfo) -> bool:
    return info.byte_size > 0 or info.state is CopyState.SEALED
