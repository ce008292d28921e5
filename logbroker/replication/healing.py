"""Healing: bring the copies back to what the control plane says, without the operator.

Each node runs ``Healer.tick`` periodically. One tick does at most one piece of each kind of
work, so a node that comes back after a long absence catches up without starving its clients:

- **Its own copies.** A sealed segment whose replica set names this node must be held here
  whole: a copy still open is sealed to the recorded length (what lies past it was never
  acknowledged); a copy that is missing, or shorter than the seal, is fetched whole from a live
  replica that holds it and installed.
- **Replica sets it leads.** The active segment of a range this node leads is rolled when its
  replica set is short of the replication factor (it was placed while nodes were down) or names
  a node dead for longer than ``replace_after``, and enough nodes are alive for a fuller set:
  the next segment is placed on the live nodes.
- **Dead replicas** (the chores lease holder only). A sealed segment whose replica set names a
  node dead for longer than ``replace_after`` gets that node replaced (``placement.replace``) in
  the control plane; the new member fetches the segment at its next tick. So the replication
  factor is restored for data already written, not just for new segments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.peer.frames import PeerOp
from logbroker.placement import PlacementError, replace, segment_key
from logbroker.replication.leading import LeadRanges
from logbroker.replication.replica import same_epoch
from logbroker.replication.replica_codec import FetchRequest, encode_fetch
from logbroker.replication.takeover import ClaimContext
from logbroker.storage import CopyState, RangeLog, SegmentInfo, StorageError
from logbroker.storage._format import scan_batches

log = Logger()

#: The most bytes one fetch of a sealed copy asks for.
_FETCH_BYTES = 1024 * 1024


class Healer:
    def __init__(
        self,
        context: ClaimContext,
        lead: LeadRanges,
        replace_after_seconds: float,
        holds_chores: Callable[[], bool],
    ) -> None:
        self._context = context
        self._lead = lead
        self._replace_after = replace_after_seconds
        self._holds_chores = holds_chores
        #: When each node was first seen dead (by this node), for ``replace_after``.
        self._dead_since: dict[str, float] = {}
        #: Copies that could not be healed here yet (no live holder), not to be logged twice.
        self._reported: set[tuple[str, int]] = set()

    def tick(self, range_ids: Sequence[str]) -> Deferred[None]:
        return Deferred.fromCoroutine(self._tick(range_ids))

    async def _tick(self, range_ids: Sequence[str]) -> None:
        ctx = self._context
        segments = {range_id: ctx.control.segments(range_id) for range_id in range_ids}
        self._note_deaths(node for metas in segments.values() for m in metas for node in m.replicas)
        for range_id, metas in segments.items():
            if await self._heal_own_copy(range_id, metas):
                break
        self._roll_weak_sets()
        if self._holds_chores():
            for metas in segments.values():
                if await self._replace_dead_replica(metas):
                    break

    # -- who is dead, and for how long -------------------------------------------------------

    def _note_deaths(self, nodes: Iterable[str]) -> None:
        now = self._context.clock.seconds()
        for node in set(nodes):
            if self._context.is_live(node):
                self._dead_since.pop(node, None)
            else:
                self._dead_since.setdefault(node, now)

    def _long_dead(self, node: str) -> bool:
        since = self._dead_since.get(node)
        return since is not None and self._context.clock.seconds() - since >= self._replace_after

    # -- this node's copies -------------------------------------------------------------------

    async def _heal_own_copy(self, range_id: str, metas: Sequence[SegmentMeta]) -> bool:
        """Heal the first sealed segment of ``range_id`` this node should hold and does not (a
        copy that cannot be healed yet is passed over); answers whether one was healed."""
        ctx = self._context
        wanted = [
            m
            for m in metas
            if m.state is SegmentState.SEALED and ctx.node_id in m.replicas and m.record_count
        ]
        if not wanted:
            return False
        copy = ctx.storage.logs.get(range_id)
        if copy is None:
            copy = await ctx.storage.open_range(range_id)
        held = {info.base_offset: info for info in copy.segments()}
        for meta in wanted:
            info = held.get(meta.base_offset)
            if info is not None and info.state is CopyState.SEALED and info.damage is None:
                continue
            if await self._heal(copy, meta, info, metas):
                return True
        return False

    async def _heal(
        self,
        copy: RangeLog,
        meta: SegmentMeta,
        info: SegmentInfo | None,
        metas: Sequence[SegmentMeta],
    ) -> bool:
        assert meta.record_count is not None
        assert meta.byte_size is not None
        where = f"{meta.range_id}@{meta.base_offset}"
        if (
            info is not None
            and info.damage is None
            and info.byte_size >= meta.byte_size
            and same_epoch(copy, meta)
        ):
            try:
                await copy.seal_copy(
                    meta.base_offset, meta.record_count, meta.byte_size, epoch=meta.epoch
                )
                log.info("Sealed this node's copy of {segment} as recorded", segment=where)
                return True
            except StorageError as error:
                log.warn(
                    "Sealing the copy of {segment} failed: {error}", segment=where, error=error
                )
        data = await self._fetch_whole(meta)
        if data is None:
            return False
        try:
            await self._make_room(copy, meta, metas)
            await copy.install_segment(meta.base_offset, data, meta.record_count, epoch=meta.epoch)
        except StorageError as error:
            self._report(meta, f"the whole copy cannot be put in place here ({error})")
            return False
        self._reported.discard((meta.range_id, meta.base_offset))
        log.info(
            "Fetched {segment} whole ({size} bytes) from a replica: this node's copy is complete",
            segment=where,
            size=len(data),
        )
        return True

    async def _make_room(
        self, copy: RangeLog, meta: SegmentMeta, metas: Sequence[SegmentMeta]
    ) -> None:
        """Clear the way for the whole copy of ``meta``: delete every copy this node holds that
        overlaps its offsets, its own (short, or written at another epoch) copy of it included.

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
            if last in in_the_way:
                await copy.trim(last.base_offset, 0)
            after = next((m for m in metas if m.base_offset == end), None)
            await copy.start_segment(end, after.epoch if after is not None else 0)
        for segment in in_the_way:
            await copy.delete_segment(segment.base_offset)

    async def _fetch_whole(self, meta: SegmentMeta) -> bytes | None:
        ctx = self._context
        assert meta.record_count is not None
        end = meta.base_offset + meta.record_count
        for holder in (n for n in meta.replicas if n != ctx.node_id and ctx.is_live(n)):
            parts: list[bytes] = []
            offset = meta.base_offset
            try:
                while offset < end:
                    request = FetchRequest(meta.range_id, meta.base_offset, offset, 0, _FETCH_BYTES)
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

    # -- replica sets ---------------------------------------------------------------------------

    def _roll_weak_sets(self) -> None:
        ctx = self._context
        live = sum(1 for node in ctx.live_nodes() if node.alive)
        factor = ctx.settings.replication_factor
        for handle in self._lead.leading():
            leader = handle.leader
            if leader is None or leader.written == leader.segment:
                continue
            members = [n for n in leader.replicas if not self._long_dead(n)]
            if len(members) >= factor or live <= len(members):
                continue
            log.info(
                "Rolling {range_id}: its active segment is on {replicas}, fewer than {factor}"
                " live replicas; the next one is placed on the live nodes",
                range_id=handle.range_id,
                replicas=",".join(leader.replicas),
                factor=factor,
            )
            handle.roll()

    async def _replace_dead_replica(self, metas: Sequence[SegmentMeta]) -> bool:
        ctx = self._context
        for meta in metas:
            if meta.state is not SegmentState.SEALED:
                continue
            if not any(self._long_dead(node) for node in meta.replicas):
                continue
            try:
                placement = replace(
                    segment_key(meta.range_id, meta.base_offset),
                    meta.replicas,
                    ctx.live_nodes(),
                    ctx.rule,
                )
            except PlacementError:
                continue
            if set(placement.replicas) == set(meta.replicas):
                continue
            updated = SegmentMeta(
                meta.range_id,
                meta.base_offset,
                meta.state,
                meta.record_count,
                meta.byte_size,
                placement.replicas,
                meta.epoch,
            )
            await ctx.control.put_segment(updated)
            log.info(
                "Replaced the dead replicas of {range_id}@{segment}: now on {replicas}",
                range_id=meta.range_id,
                segment=meta.base_offset,
                replicas=",".join(placement.replicas),
            )
            return True
        return False
