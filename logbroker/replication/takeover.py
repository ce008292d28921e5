"""Claiming a range's active segment, sealing it and opening the next: carried out here, decided
in ``logbroker.replication.core.claims`` (whose docstring gives the rules).

``SegmentClaims`` records claims, seals, openings and steps aside in the control plane, each a
compare-and-swap against the record this node read; fences the replicas; completes this node's
copy from the copy that ends longest; and starts the ``SegmentLeader``. A node without its
membership lease claims nothing: every step checks the lease first, so a node resumed after a
stall acts on none of the work it had queued.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from logbroker.broker.errors import BrokerError, InDoubtError
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
from logbroker.placement import PlacementError, PlacementNode, PlacementRule
from logbroker.replication.core import claims
from logbroker.replication.core.actions import ReplicationSettings, StepDown
from logbroker.replication.core.claims import Ends, FencedOut, NoQuorum
from logbroker.replication.core.quorum import CopyEnd
from logbroker.replication.primary import ParkedReplicas, SegmentLeader
from logbroker.replication.replica import find_copy
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
from logbroker.storage import OpenLogs
from logbroker.storage._format import scan_batches

log = Logger()


def ignore_leadership(range_id: str, segment: int, epoch: int, node_id: str) -> None:
    pass


def ignore_commit(range_id: str, offset: int) -> None:
    pass


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
    #: Whether this node holds its membership lease now.
    holds_lease: Callable[[], bool] = lambda: True
    #: Whether this node's view of the control plane follows etcd now (not stale after etcd
    #: was out of reach): claims are decided on it.
    control_follows: Callable[[], bool] = lambda: True
    #: When the peer link last heard from a node (``None``: never, or no link).
    heard_at: Callable[[str], float | None] = lambda node: None
    #: Told of every leadership this node begins: ``(range id, segment, epoch, node id)``.
    on_lead: Callable[[str, int, int, str], None] = ignore_leadership
    #: Told whenever a range's commit index moves on this node: ``(range id, offset)``.
    on_commit: Callable[[str, int], None] = ignore_commit
    #: The dead replicas this node's leaders wait for (``LeadRanges.sweep`` resumes them).
    parked: ParkedReplicas = attrs.Factory(ParkedReplicas)

    def heard_recently(self, node: str) -> bool:
        """Whether the peer link heard from ``node`` within a lease TTL."""
        heard = self.heard_at(node)
        ttl = self.settings.ack_timeout_seconds
        return heard is not None and self.clock.seconds() - heard < ttl


class WaitingForMembers(BrokerError):
    """A claim not made: too few members of the segment's replica set are alive."""


class _OwnCopyRefused(BrokerError):
    """This node's copy could not be brought to the longest end: it is damaged."""


#: ``(leader, step) -> None``: told when a leader this node started stops.
OnStepDown = Callable[[SegmentLeader, StepDown], None]


class SegmentClaims:
    """Claims, seals and rolls the active segments this node comes to lead."""

    def __init__(self, context: ClaimContext) -> None:
        self._context = context

    @property
    def context(self) -> ClaimContext:
        return self._context

    def segments(self, range_id: str) -> list[SegmentMeta]:
        return self._context.control.segments(range_id)

    def active(self, range_id: str) -> SegmentMeta | None:
        return self._context.control.last_segment(range_id)

    def should_take_over(self, meta: SegmentMeta) -> bool:
        """Whether this node should claim ``meta`` without being asked: its primary is dead
        and this node is the first live member of its replica set."""
        ctx = self._context
        return claims.should_take_over(meta, ctx.node_id, ctx.is_live)

    # -- claims -----------------------------------------------------------------------------

    def claim(
        self, range_id: str, on_commit: Callable[[int], None], on_step_down: OnStepDown
    ) -> Deferred[SegmentLeader]:
        """Lead ``range_id``'s active segment (opening the next one first if the last is
        sealed); fails with a ``BrokerError`` when another node won, no quorum answered, or
        this node stepped aside."""
        return Deferred.fromCoroutine(self._claim(range_id, on_commit, on_step_down))

    async def _claim(
        self, range_id: str, on_commit: Callable[[int], None], on_step_down: OnStepDown
    ) -> SegmentLeader:
        ctx = self._context
        self._require_lease(range_id)
        meta = self.active(range_id)
        if meta is None:
            raise BrokerError(Reason.UNREACHABLE, f"range {range_id} has no segment yet")
        if meta.state is SegmentState.SEALED:
            # A roll that sealed the last segment stopped before opening the next one.
            return await self._open_next(meta, on_commit, on_step_down)
        where = f"{range_id}@{meta.base_offset}"
        own = find_copy(ctx.storage.logs[range_id], meta.base_offset)
        if own is not None and own.damage is not None:
            await self.step_aside(meta, "this node's copy of it is damaged")
            raise BrokerError(Reason.NOT_PRIMARY, f"this node's copy of {where} is damaged")
        claim = claims.claimed(meta, ctx.node_id)
        if claim is None:
            raise BrokerError(Reason.NOT_PRIMARY, f"{ctx.node_id} holds no copy of {where}")
        if not claims.live_quorum(meta, ctx.is_live, ctx.settings.quorum):
            raise WaitingForMembers(
                Reason.NO_QUORUM,
                f"{where}: only {', '.join(n for n in meta.replicas if ctx.is_live(n)) or 'none'}"
                f" of its replicas {', '.join(meta.replicas)} are alive, fewer than the quorum"
                f" of {ctx.settings.quorum}; it is claimed once enough of them are back",
            )
        await self._record(claim, "claim", expected=meta)
        self._require_lease(range_id)
        fenced = await self._fence(claim)
        ends, data_epoch = dict(fenced.ends), fenced.data_epoch
        if any(end.offset > claim.base_offset for end in ends.values()):
            # Only where records are at stake: a node taking over or opening thousands of
            # empty ranges would write a line for each (6% of its time at 40,000 ranges).
            log.info(
                "Claimed {segment} at epoch {epoch} (its primary was {primary}): copies end at"
                " {ends}",
                segment=where,
                epoch=claim.epoch,
                primary=meta.replicas[0],
                ends=", ".join(f"{node} {end.offset}" for node, end in sorted(ends.items())),
            )
        holder, best = claims.seal_point(ends, ctx.node_id)
        try:
            ends[ctx.node_id] = await self._complete_own_copy(
                claim, ends[ctx.node_id], holder, best, data_epoch
            )
        except _OwnCopyRefused as refused:
            await self.step_aside(claim, str(refused))
            raise
        self._require_lease(range_id)
        own_end = ends[ctx.node_id]
        if own_end.offset == claim.base_offset:
            # Nothing a quorum holds: lead it on at the new epoch, on the copies that answered.
            claim = await self._keep_answered(claim, ends)
            return self._leader(claim, ends, on_commit, on_step_down, claim.epoch)
        leader = self._leader(claim, ends, on_commit, on_step_down, data_epoch)
        try:
            await leader.wait_committed(own_end.offset)
        except InDoubtError as short:
            # The others cannot take the seal point's records now (a copy damaged, or out of
            # reach since the fence).
            known = ctx.storage.logs[range_id].committed_offset
            if not claims.seals_in_doubt(own_end.offset, known):
                # Some of them may be on this copy alone: sealed, they would be readable and
                # could be lost with it. The range waits for a quorum (the claim is tried again
                # after a backoff), as it would for any record no quorum holds.
                leader.step_down(BrokerError(Reason.NO_QUORUM, f"{where} was not sealed"))
                raise BrokerError(
                    Reason.NO_QUORUM,
                    f"{where}: no quorum took its records from {known} to {own_end.offset}"
                    f" within the ack timeout, so it is not sealed yet ({short})",
                ) from short
            # Every one of them is known committed (a quorum held them before this claim),
            # and all are in this copy, durable: it is sealed here all the same, so that the
            # range takes produces again (on a new segment) and healing copies the sealed
            # segment to its replicas.
            log.warn(
                "Sealing {segment} at {end} though only this copy holds it whole yet: {why}",
                segment=where,
                end=own_end.offset,
                why=str(short),
            )
        return await self._seal_and_open(leader, on_commit, on_step_down)

    async def _keep_answered(self, meta: SegmentMeta, ends: dict[str, CopyEnd]) -> SegmentMeta:
        ctx = self._context
        try:
            kept = claims.kept_answered(meta, ends, ctx.live_nodes(), ctx.rule)
        except PlacementError as error:
            raise BrokerError(error.reason, str(error)) from error
        if kept == meta:
            return meta
        await self._record(kept, "re-placement", expected=meta)
        log.info(
            "Re-placed empty {range_id}@{segment} on {replicas} (without {silent})",
            range_id=meta.range_id,
            segment=meta.base_offset,
            replicas=",".join(kept.replicas),
            silent=",".join(sorted(set(meta.replicas) - set(ends))),
        )
        return kept

    def step_aside(self, meta: SegmentMeta, why: str) -> Deferred[None]:
        """Move this node to the end of ``meta``'s replica set (if the record is still
        ``meta``), so that the next member leads it."""
        return Deferred.fromCoroutine(self._step_aside(meta, why))

    async def _step_aside(self, meta: SegmentMeta, why: str) -> None:
        aside = claims.stepped_aside(meta, self._context.node_id)
        await self._record(aside, "step aside", expected=meta)
        log.warn(
            "Stepped aside from {range_id}@{segment} ({why}): its replica set is now {replicas}",
            range_id=meta.range_id,
            segment=meta.base_offset,
            why=why,
            replicas=",".join(aside.replicas),
        )

    def resign(self, leader: SegmentLeader, why: str) -> Deferred[None]:
        """Step aside from the segment ``leader`` led, if the control plane still has this
        node leading it at that epoch."""
        meta = self.active(leader.range_id)
        ctx = self._context
        if (
            meta is None
            or meta.base_offset != leader.segment
            or meta.epoch != leader.epoch
            or meta.replicas[0] != ctx.node_id
        ):
            return Deferred.fromCoroutine(_nothing())
        return self.step_aside(meta, why)

    async def _record(self, meta: SegmentMeta, what: str, *, expected: SegmentMeta | None) -> None:
        change = self._context.control.put_segment(meta, expected=expected)
        await _recorded(change, meta, what)

    async def _record_together(
        self, changes: list[tuple[SegmentMeta, SegmentMeta | None]], what: str
    ) -> None:
        """Record ``changes`` (``(meta, expected)``) in one control-plane change."""
        await _recorded(self._context.control.put_segments(changes), changes[0][0], what)

    def _require_lease(self, range_id: str) -> None:
        if not self._context.holds_lease():
            raise BrokerError(
                Reason.UNREACHABLE,
                f"this node holds no membership lease, so it claims nothing ({range_id})",
            )
        if not self._context.control_follows():
            raise BrokerError(
                Reason.UNREACHABLE,
                f"this node's view of the control plane is catching up with etcd, so it claims"
                f" nothing yet ({range_id})",
            )

    async def _fence(self, meta: SegmentMeta) -> Ends:
        """Fence every replica at ``meta.epoch``; the ends of those that answered, once a
        quorum has (``no_quorum`` otherwise, stepping aside if this node seems cut off)."""
        ctx = self._context
        request = encode_fence(FenceRequest(meta.range_id, meta.base_offset, meta.epoch))
        asked = [
            ctx.requester.request(node, PeerOp.FENCE, request)
            .addCallback(decode_status)
            .addTimeout(ctx.settings.ack_timeout_seconds, ctx.clock)
            for node in meta.replicas
        ]
        answers = await DeferredList(asked, consumeErrors=True)
        statuses: dict[str, CopyStatus | None] = {
            node: answer if ok else None
            for node, (ok, answer) in zip(meta.replicas, answers, strict=True)
        }
        outcome = claims.fence_outcome(meta, statuses, ctx.node_id, ctx.settings.quorum)
        where = f"{meta.range_id}@{meta.base_offset}"
        if isinstance(outcome, FencedOut):
            raise BrokerError(
                Reason.NOT_PRIMARY,
                f"{where}: {outcome.node} is fenced at epoch {outcome.epoch}, past this claim's "
                f"{meta.epoch}",
            )
        if isinstance(outcome, NoQuorum):
            refusal = BrokerError(
                Reason.NO_QUORUM,
                f"{where}: {outcome.answered} of {len(meta.replicas)} replicas answered the "
                f"fence, fewer than the quorum of {ctx.settings.quorum}",
            )
            if claims.steps_aside_after(
                outcome, meta, ctx.settings.quorum, ctx.is_live, ctx.heard_recently
            ):
                await self.step_aside(
                    meta, f"it cannot reach {', '.join(outcome.silent)}, which are alive"
                )
            raise refusal
        assert isinstance(outcome, Ends)
        return outcome

    async def _complete_own_copy(
        self, meta: SegmentMeta, own: CopyEnd, holder: str, best: CopyEnd, data_epoch: int
    ) -> CopyEnd:
        """Fetch what this node's copy lacks of the longest end, from the copy that has it
        (its records are ``data_epoch``'s: this node's copy, if it holds another primary's,
        cuts them first)."""
        ctx = self._context
        where = f"{meta.range_id}@{meta.base_offset}"
        while own.offset < best.offset:
            fetch = FetchRequest(
                meta.range_id,
                meta.base_offset,
                meta.epoch,
                own.offset,
                own.position,
                ctx.settings.max_message_bytes,
                data_epoch=data_epoch,
            )
            data = await ctx.requester.request(holder, PeerOp.FETCH, encode_fetch(fetch))
            scan = scan_batches(data, 0, own.offset)
            if not scan.batches or scan.damage is not None:
                raise BrokerError(
                    Reason.UNREACHABLE,
                    f"{where}: {holder} sent no whole batch from offset {own.offset}",
                )
            replicate = ReplicateRequest(
                meta.range_id,
                meta.base_offset,
                meta.epoch,
                own.offset,
                own.position,
                0,
                data[: scan.end],
                data_epoch=data_epoch,
            )
            try:
                answer = decode_status(
                    await ctx.requester.request(
                        ctx.node_id, PeerOp.REPLICATE, encode_replicate(replicate)
                    )
                )
            except BrokerError as error:
                raise _OwnCopyRefused(
                    Reason.NOT_PRIMARY, f"this node's copy of {where} refused: {error}"
                ) from error
            if answer.outcome is not CopyOutcome.OK:
                raise _OwnCopyRefused(
                    Reason.NOT_PRIMARY,
                    f"this node's copy of {where} refused what {holder} sent "
                    f"({answer.outcome.name.lower()})",
                )
            own = CopyEnd(answer.end_offset, answer.end_position)
        return own

    def _leader(
        self,
        meta: SegmentMeta,
        ends: dict[str, CopyEnd],
        on_commit: Callable[[int], None],
        on_step_down: OnStepDown,
        data_epoch: int,
    ) -> SegmentLeader:
        """Lead ``meta`` (its copies ending at ``ends``, of the records of ``data_epoch``'s
        primary)."""
        ctx = self._context
        ctx.on_lead(meta.range_id, meta.base_offset, meta.epoch, ctx.node_id)

        def committed(index: int) -> None:
            ctx.on_commit(meta.range_id, index)
            on_commit(index)

        leader = SegmentLeader(
            node_id=ctx.node_id,
            range_id=meta.range_id,
            segment=meta.base_offset,
            epoch=meta.epoch,
            data_epoch=data_epoch,
            replicas=meta.replicas,
            range_log=ctx.storage.logs[meta.range_id],
            copies=ends,
            requester=ctx.requester,
            clock=ctx.clock,
            settings=ctx.settings,
            is_live=ctx.is_live,
            on_commit=committed,
            holds_lease=ctx.holds_lease,
            on_step_down=on_step_down,
            parked=ctx.parked,
        )
        # What the copies already hold on a quorum is committed from the start.
        ctx.on_commit(meta.range_id, leader.commit)
        return leader

    # -- rolls ------------------------------------------------------------------------------

    def roll(
        self, leader: SegmentLeader, on_commit: Callable[[int], None], on_step_down: OnStepDown
    ) -> Deferred[SegmentLeader]:
        """Seal ``leader``'s segment once everything written is committed, then open the next
        and lead it; the old leader stops."""
        return Deferred.fromCoroutine(self._roll(leader, on_commit, on_step_down))

    async def _roll(
        self, leader: SegmentLeader, on_commit: Callable[[int], None], on_step_down: OnStepDown
    ) -> SegmentLeader:
        await leader.wait_committed(leader.written)
        return await self._seal_and_open(leader, on_commit, on_step_down)

    async def _seal_and_open(
        self, leader: SegmentLeader, on_commit: Callable[[int], None], on_step_down: OnStepDown
    ) -> SegmentLeader:
        """Seal ``leader``'s segment at what it wrote and open the next (one control-plane
        change), seal this node's copy, then lead the next segment."""
        ctx = self._context
        self._require_lease(leader.range_id)
        meta = self.active(leader.range_id)
        if (
            meta is None
            or meta.base_offset != leader.segment
            or meta.epoch != leader.epoch
            or meta.replicas[0] != ctx.node_id
        ):
            raise BrokerError(
                Reason.NOT_PRIMARY,
                f"{leader.range_id}@{leader.segment} changed under its leader (now {meta!r})",
            )
        sealed = claims.sealed(meta, leader.written, leader.position, leader.data_epoch)
        opening = self._next_segment(sealed)
        await self._record_together([(sealed, meta), (opening, None)], "seal")
        leader.step_down(
            BrokerError(Reason.NOT_PRIMARY, f"{leader.range_id}@{leader.segment} is sealed"),
            logged=True,
        )
        # The next segment starts here only once this node's copy of the last is sealed.
        await self._seal_copies(sealed)
        return await self._lead_opened(opening, on_commit, on_step_down, after=sealed)

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
                data_epoch=sealed.records_epoch,
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
        self, sealed: SegmentMeta, on_commit: Callable[[int], None], on_step_down: OnStepDown
    ) -> SegmentLeader:
        self._require_lease(sealed.range_id)
        opening = self._next_segment(sealed)
        await self._record(opening, "opening", expected=None)
        return await self._lead_opened(opening, on_commit, on_step_down)

    def _next_segment(self, sealed: SegmentMeta) -> SegmentMeta:
        ctx = self._context
        try:
            meta = claims.next_segment(sealed, ctx.node_id, ctx.live_nodes(), ctx.rule)
        except PlacementError as error:
            raise BrokerError(error.reason, str(error)) from error
        if meta is None:
            raise BrokerError(
                Reason.NOT_PRIMARY, f"{ctx.node_id} is not alive in its own membership view"
            )
        return meta

    async def _lead_opened(
        self,
        meta: SegmentMeta,
        on_commit: Callable[[int], None],
        on_step_down: OnStepDown,
        after: SegmentMeta | None = None,
    ) -> SegmentLeader:
        """Start this node's copy of the segment ``meta`` it recorded opening, and lead it;
        ``after``: the segment this node sealed to open it (said in the same log line)."""
        ctx = self._context
        base = meta.base_offset
        fence = encode_fence(FenceRequest(meta.range_id, base, meta.epoch))
        answer = decode_status(await ctx.requester.request(ctx.node_id, PeerOp.FENCE, fence))
        if answer.outcome is not CopyOutcome.OK:
            raise BrokerError(
                Reason.UNREACHABLE,
                f"this node could not start its copy of {meta.range_id}@{base}",
            )
        replicas = ",".join(meta.replicas)
        if after is None:
            log.info(
                "Opened {range_id}@{segment} on {replicas}",
                range_id=meta.range_id,
                segment=base,
                replicas=replicas,
            )
        else:
            log.info(
                "Sealed {range_id}@{sealed}: {records} records, {size} bytes; opened"
                " {range_id}@{segment} on {replicas}",
                range_id=meta.range_id,
                sealed=after.base_offset,
                records=after.record_count,
                size=after.byte_size,
                segment=base,
                replicas=replicas,
            )
        return self._leader(
            meta, {ctx.node_id: CopyEnd(base, 0)}, on_commit, on_step_down, meta.epoch
        )


async def _recorded(change: Deferred[None], meta: SegmentMeta, what: str) -> None:
    """Wait for ``change`` of ``meta``'s record; a ``BrokerError`` saying why it failed."""
    try:
        await change
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


async def _nothing() -> None:
    return None
