"""Taking a range's active segment over, and sealing it: how a node comes to lead a segment.

A node leads a segment only within one claim: the claim bumps the segment's epoch in the
control plane (a compare-and-swap: of two nodes racing, one wins), puts the claiming node first
in its replica set, and fences every replica at the new epoch, so that whoever led before can get
nothing more durable on a quorum. A node claims:

- when it is the segment's primary and does not lead it in this process (it restarted);
- when the segment's primary is dead and it is the first live replica (failover).

Fencing answers where each copy ends. Every acknowledged record is on a quorum, and any quorum
shares a copy with the fenced quorum, so the longest end among a quorum of answers holds every
acknowledged record (and maybe some that were never acknowledged: they are kept, harmlessly).
The claiming node fetches what its own copy lacks of that end, then leads the segment from there
(``SegmentLeader``), which brings a quorum to the same end. Then:

- if the segment holds records, it is **sealed** at that end (record count and byte size
  recorded in the control plane), the replicas are told to seal their copies (cutting what an
  older epoch left past the end, never rot), and a new segment is opened on the live members
  of the old replica set, completed by placement, with this node first;
- if it holds none, this node goes on leading it at the new epoch.

A roll (the active segment reached the roll size) seals and opens the next segment the same way,
without a claim: the leader drains (everything written is committed) first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import RangeRead, read_records
from logbroker.controlplane import (
    ControlPlane,
    ControlPlaneError,
    InvalidChangeError,
    SegmentMeta,
    SegmentState,
)
from logbroker.errors import Reason
from logbroker.peer.frames import PeerOp
from logbroker.peer.requester import PeerRequester
from logbroker.placement import (
    PlacementError,
    PlacementNode,
    PlacementRule,
    replace,
    segment_key,
)
from logbroker.replication.core.leader import ReplicationSettings
from logbroker.replication.core.quorum import CopyEnd
from logbroker.replication.primary import SegmentLeader
from logbroker.replication.replica_codec import (
    CopyOutcome,
    CopyStatus,
    FenceRequest,
    FetchRequest,
    ReplicateRequest,
    SealRequest,
    decode_status,
    encode_fence,
    encode_fetch,
    encode_replicate,
    encode_seal,
)
from logbroker.storage import BatchSlice, OpenLogs
from logbroker.storage._format import scan_batches

log = Logger()

#: The most bytes one fetch of another replica's copy asks for.
_MAX_FETCH = 1024 * 1024


@attrs.frozen
class ClaimContext:
    """What claims need of the node: who it is, how to reach copies, and who is alive."""

    node_id: str
    control: ControlPlane
    storage: OpenLogs
    #: Reaches every copy, this node's own included (``requester.Loopback``).
    requester: PeerRequester
    clock: IReactorTime
    settings: ReplicationSettings
    rule: PlacementRule
    live_nodes: Callable[[], Iterable[PlacementNode]]
    is_live: Callable[[str], bool]


class SegmentClaims:
    """Claims, seals and rolls the active segments this node comes to lead."""

    def __init__(self, context: ClaimContext) -> None:
        self._context = context

    @property
    def context(self) -> ClaimContext:
        return self._context

    def segments(self, range_id: str) -> list[SegmentMeta]:
        return self._context.control.segments(range_id)

    def read_copy(
        self, meta: SegmentMeta, offset: int, max_records: int, max_bytes: int
    ) -> Deferred[RangeRead]:
        """Records of sealed segment ``meta`` from ``offset``, read from another replica's copy:
        the first live one that holds them."""
        ctx = self._context
        holders = [node for node in meta.replicas if node != ctx.node_id and ctx.is_live(node)]

        def read_chunks(at: int, size: int) -> Deferred[list[BatchSlice]]:
            return Deferred.fromCoroutine(self._fetch_chunks(meta, holders, at, size))

        return read_records(read_chunks, offset, max_records, max_bytes)

    async def _fetch_chunks(
        self, meta: SegmentMeta, holders: list[str], offset: int, max_bytes: int
    ) -> list[BatchSlice]:
        ctx = self._context
        request = encode_fetch(
            FetchRequest(meta.range_id, meta.base_offset, offset, 0, min(max_bytes, _MAX_FETCH))
        )
        for node in holders:
            try:
                data = await ctx.requester.request(node, PeerOp.FETCH, request)
            except Exception as error:
                log.debug(
                    "Fetching {range_id}@{segment} from {node} failed: {error}",
                    range_id=meta.range_id,
                    segment=meta.base_offset,
                    node=node,
                    error=str(error),
                )
                continue
            chunks = batch_slices(data)
            if chunks:
                return chunks
        raise BrokerError(
            Reason.UNREACHABLE,
            f"no live replica of {meta.range_id}@{meta.base_offset} ({', '.join(meta.replicas)})"
            f" answered with its records from offset {offset}",
        )

    def active(self, range_id: str) -> SegmentMeta | None:
        segments = self._context.control.segments(range_id)
        return segments[-1] if segments else None

    def should_take_over(self, meta: SegmentMeta) -> bool:
        """Whether this node should claim ``meta`` without being asked: its primary is dead
        and this node is the first live member of its replica set."""
        ctx = self._context
        if ctx.node_id not in meta.replicas or meta.replicas[0] == ctx.node_id:
            return False
        if ctx.is_live(meta.replicas[0]):
            return False
        return next((n for n in meta.replicas if ctx.is_live(n)), None) == ctx.node_id

    def claim(self, range_id: str, on_commit: Callable[[int], None]) -> Deferred[SegmentLeader]:
        """Lead ``range_id``'s active segment (opening the next one first if the last is
        sealed); fails with a ``BrokerError`` when another node won, or no quorum answered."""
        return Deferred.fromCoroutine(self._claim(range_id, on_commit))

    async def _claim(self, range_id: str, on_commit: Callable[[int], None]) -> SegmentLeader:
        ctx = self._context
        meta = self.active(range_id)
        if meta is None:
            raise BrokerError(Reason.UNREACHABLE, f"range {range_id} has no segment yet")
        if meta.state is SegmentState.SEALED:
            # A roll that sealed the last segment stopped before opening the next one.
            return await self._open_next(
                meta, meta.base_offset + (meta.record_count or 0), on_commit
            )
        others = tuple(node for node in meta.replicas if node != ctx.node_id)
        if len(others) == len(meta.replicas):
            raise BrokerError(
                Reason.NOT_PRIMARY, f"{ctx.node_id} holds no copy of {range_id}@{meta.base_offset}"
            )
        claimed = attrs.evolve(meta, epoch=meta.epoch + 1, replicas=(ctx.node_id, *others))
        await self._record(claimed, "claim")
        log.info(
            "Claimed {range_id}@{segment} at epoch {epoch}",
            range_id=range_id,
            segment=meta.base_offset,
            epoch=claimed.epoch,
        )
        ends = await self._fence(claimed)
        log.debug(
            "Fenced {range_id}@{segment} at epoch {epoch}: copies end at {ends}",
            range_id=range_id,
            segment=meta.base_offset,
            epoch=claimed.epoch,
            ends=", ".join(f"{node} {end.offset}" for node, end in sorted(ends.items())),
        )
        own = await self._complete_own_copy(claimed, ends)
        ends[ctx.node_id] = own
        if own.offset == claimed.base_offset:
            # Nothing a quorum holds: lead it on at the new epoch, but only on copies known to
            # be empty. A replica that did not answer may hold bytes an older primary wrote at
            # these offsets (never acknowledged); it leaves the set, so that no copy of this
            # segment ever mixes two primaries' bytes.
            claimed = await self._keep_answered(claimed, set(ends))
            return self._leader(claimed, ends, on_commit)
        leader = self._leader(claimed, ends, on_commit)
        await leader.wait_committed(own.offset)
        return await self.roll(leader, on_commit)

    async def _keep_answered(self, meta: SegmentMeta, answered: set[str]) -> SegmentMeta:
        ctx = self._context
        if answered >= set(meta.replicas):
            return meta
        silent = set(meta.replicas) - answered
        candidates = [node for node in ctx.live_nodes() if node.node_id not in silent]
        kept = tuple(node for node in meta.replicas if node in answered)
        try:
            placement = replace(
                segment_key(meta.range_id, meta.base_offset), kept, candidates, ctx.rule
            )
        except PlacementError as error:
            raise BrokerError(error.reason, str(error)) from error
        updated = attrs.evolve(meta, replicas=placement.replicas)
        await self._record(updated, "re-placement")
        log.info(
            "Re-placed empty {range_id}@{segment} on {replicas} (without {silent})",
            range_id=meta.range_id,
            segment=meta.base_offset,
            replicas=",".join(placement.replicas),
            silent=",".join(sorted(silent)),
        )
        return updated

    async def _record(self, meta: SegmentMeta, what: str) -> None:
        try:
            await self._context.control.put_segment(meta)
        except InvalidChangeError as error:
            raise BrokerError(
                Reason.NOT_PRIMARY,
                f"the {what} of {meta.range_id}@{meta.base_offset} lost to another change: {error}",
            ) from error
        except ControlPlaneError as error:
            raise BrokerError(
                Reason.UNREACHABLE,
                f"the {what} of {meta.range_id}@{meta.base_offset} could not be recorded: {error}",
            ) from error

    async def _fence(self, meta: SegmentMeta) -> dict[str, CopyEnd]:
        """Fence every replica at ``meta.epoch``; the ends of those that answered, once a
        quorum has (``no_quorum`` otherwise)."""
        ctx = self._context
        request = encode_fence(FenceRequest(meta.range_id, meta.base_offset, meta.epoch))
        asked = [
            ctx.requester.request(node, PeerOp.FENCE, request)
            .addCallback(decode_status)
            .addTimeout(ctx.settings.ack_timeout_seconds, ctx.clock)
            for node in meta.replicas
        ]
        answers = await DeferredList(asked, consumeErrors=True)
        ends: dict[str, CopyEnd] = {}
        for node, (ok, answer) in zip(meta.replicas, answers, strict=True):
            if not ok:
                continue
            status: CopyStatus = answer
            if status.outcome is CopyOutcome.FENCED:
                raise BrokerError(
                    Reason.NOT_PRIMARY,
                    f"{meta.range_id}@{meta.base_offset}: {node} is fenced at epoch "
                    f"{status.epoch}, past this claim's {meta.epoch}",
                )
            if status.outcome is CopyOutcome.OK:
                ends[node] = CopyEnd(status.end_offset, status.end_position)
        if ctx.node_id not in ends or len(ends) < ctx.settings.quorum:
            raise BrokerError(
                Reason.NO_QUORUM,
                f"{meta.range_id}@{meta.base_offset}: {len(ends)} of {len(meta.replicas)} "
                f"replicas answered the fence, fewer than the quorum of {ctx.settings.quorum}",
            )
        return ends

    async def _complete_own_copy(self, meta: SegmentMeta, ends: dict[str, CopyEnd]) -> CopyEnd:
        """Fetch what this node's copy lacks of the longest end, from the copy that has it."""
        ctx = self._context
        own = ends[ctx.node_id]
        holder, best = max(ends.items(), key=lambda item: item[1].offset)
        while own.offset < best.offset:
            fetch = FetchRequest(
                meta.range_id,
                meta.base_offset,
                own.offset,
                own.position,
                ctx.settings.max_message_bytes,
            )
            data = await ctx.requester.request(holder, PeerOp.FETCH, encode_fetch(fetch))
            scan = scan_batches(data, 0, own.offset)
            if not scan.batches or scan.damage is not None:
                raise BrokerError(
                    Reason.UNREACHABLE,
                    f"{meta.range_id}@{meta.base_offset}: {holder} sent no whole batch from "
                    f"offset {own.offset}",
                )
            replicate = ReplicateRequest(
                meta.range_id,
                meta.base_offset,
                meta.epoch,
                own.offset,
                own.position,
                0,
                data[: scan.end],
            )
            answer = decode_status(
                await ctx.requester.request(
                    ctx.node_id, PeerOp.REPLICATE, encode_replicate(replicate)
                )
            )
            if answer.outcome is not CopyOutcome.OK:
                raise BrokerError(
                    Reason.UNREACHABLE,
                    f"{meta.range_id}@{meta.base_offset}: this node's copy refused what "
                    f"{holder} sent ({answer.outcome.name.lower()})",
                )
            own = CopyEnd(answer.end_offset, answer.end_position)
        return own

    def _leader(
        self, meta: SegmentMeta, ends: dict[str, CopyEnd], on_commit: Callable[[int], None]
    ) -> SegmentLeader:
        ctx = self._context
        copy = ctx.storage.logs[meta.range_id]
        return SegmentLeader(
            node_id=ctx.node_id,
            range_id=meta.range_id,
            segment=meta.base_offset,
            epoch=meta.epoch,
            replicas=meta.replicas,
            range_log=copy,
            copies=ends,
            requester=ctx.requester,
            clock=ctx.clock,
            settings=ctx.settings,
            is_live=ctx.is_live,
            on_commit=on_commit,
        )

    def roll(
        self, leader: SegmentLeader, on_commit: Callable[[int], None]
    ) -> Deferred[SegmentLeader]:
        """Seal ``leader``'s segment once everything written is committed, then open the next
        and lead it; the old leader stops."""
        return Deferred.fromCoroutine(self._roll(leader, on_commit))

    async def _roll(self, leader: SegmentLeader, on_commit: Callable[[int], None]) -> SegmentLeader:
        await leader.wait_committed(leader.written)
        meta = self.active(leader.range_id)
        if meta is None or meta.base_offset != leader.segment or meta.epoch != leader.epoch:
            raise BrokerError(
                Reason.NOT_PRIMARY,
                f"{leader.range_id}@{leader.segment} changed under its leader (now {meta!r})",
            )
        sealed = attrs.evolve(
            meta,
            state=SegmentState.SEALED,
            record_count=leader.written - leader.segment,
            byte_size=leader.position,
        )
        await self._record(sealed, "seal")
        leader.step_down(
            BrokerError(Reason.NOT_PRIMARY, f"{leader.range_id}@{leader.segment} is sealed")
        )
        log.info(
            "Sealed {range_id}@{segment}: {records} records, {size} bytes",
            range_id=sealed.range_id,
            segment=sealed.base_offset,
            records=sealed.record_count,
            size=sealed.byte_size,
        )
        await self._seal_copies(sealed)
        return await self._open_next(sealed, leader.written, on_commit)

    async def _seal_copies(self, sealed: SegmentMeta) -> None:
        """Tell every replica to seal its copy; this node's own must be sealed before the next
        segment starts here, the others catch up when they can (healing fetches short ones)."""
        ctx = self._context
        assert sealed.record_count is not None
        assert sealed.byte_size is not None
        request = encode_seal(
            SealRequest(
                sealed.range_id,
                sealed.base_offset,
                sealed.epoch,
                sealed.record_count,
                sealed.byte_size,
            )
        )
        for node in sealed.replicas:
            if node != ctx.node_id:
                ctx.requester.request(node, PeerOp.SEAL, request).addErrback(lambda _: None)
        answer = decode_status(await ctx.requester.request(ctx.node_id, PeerOp.SEAL, request))
        if answer.outcome is not CopyOutcome.OK:
            raise BrokerError(
                Reason.UNREACHABLE,
                f"this node's copy of {sealed.range_id}@{sealed.base_offset} could not be "
                f"sealed ({answer.outcome.name.lower()})",
            )

    async def _open_next(
        self, sealed: SegmentMeta, base: int, on_commit: Callable[[int], None]
    ) -> SegmentLeader:
        ctx = self._context
        keep = (ctx.node_id, *(node for node in sealed.replicas if node != ctx.node_id))
        try:
            placement = replace(
                segment_key(sealed.range_id, base), keep, ctx.live_nodes(), ctx.rule
            )
        except PlacementError as error:
            raise BrokerError(error.reason, str(error)) from error
        replicas = placement.replicas
        if replicas[0] != ctx.node_id:
            raise BrokerError(
                Reason.NOT_PRIMARY, f"{ctx.node_id} is not alive in its own membership view"
            )
        meta = SegmentMeta(sealed.range_id, base, SegmentState.ACTIVE, None, None, replicas, 0)
        await self._record(meta, "opening")
        fence = encode_fence(FenceRequest(meta.range_id, base, meta.epoch))
        answer = decode_status(await ctx.requester.request(ctx.node_id, PeerOp.FENCE, fence))
        if answer.outcome is not CopyOutcome.OK:
            raise BrokerError(
                Reason.UNREACHABLE,
                f"this node could not start its copy of {meta.range_id}@{base}",
            )
        log.info(
            "Opened {range_id}@{segment} on {replicas}",
            range_id=meta.range_id,
            segment=base,
            replicas=",".join(replicas),
        )
        return self._leader(meta, {ctx.node_id: CopyEnd(base, 0)}, on_commit)


def batch_slices(data: bytes) -> list[BatchSlice]:
    """The whole batches another replica sent, as reads take them (each verified by its own
    checksum; a damaged one ends the list)."""
    view = memoryview(data)
    return [BatchSlice(view, batch, True) for batch in scan_batches(view).batches]
