"""Repairing a damaged sealed copy from an intact one (the spec's "Integrity scrub", rules 2-5).

Damage in a sealed copy of this node's is found by the scrub, by healing (a copy found
damaged when it was opened or read) or by a read; each hands it to ``SegmentRepairs.repair``:

1. The segment's other live replicas are asked to read their own copies back whole
   (``verify_copy``). A copy qualifies only if it is intact and complete: its scan matches the
   record count and byte size the control plane recorded at sealing
   (``core.repair.qualifies``).
2. If none qualifies, nothing is deleted. When every other replica answered, the failure is
   logged loudly, naming the segment, the byte position and what each replica answered, and
   counted ``unrepairable``; it never clears by itself: the scrub finds and counts it again at
   each of its passes. When a replica could not answer (it is down, or did not answer within
   ``VERIFY_SECONDS``), it may hold an intact copy: nothing is decided or counted
   (``DEFERRED``), and the repair is tried again.
3. If one does, the repair goes on, traced as ``svc.scrub.repair`` (an OpenTelemetry span, and
   a structured log event of the same name). A node first in the segment's replica set moves
   itself to the end first, so that readers go to an intact copy. The whole copy is fetched
   from the first qualifying replica and verified record by record as it is installed in
   place of the damaged one (``Healer.refetch``; the damaged copy is deleted only once an
   intact one is here to replace it, never before), then read back whole once more: only then
   is it counted ``repaired``.

A copy waiting for a repair is not served: reads of its segment go to the other copies (a
damaged copy is not ``trusted``). One repair runs per segment at a time, and at most
``REPAIRS_AT_ONCE`` at all (each holds a segment's bytes while it fetches). A fetch that fails
defers the repair too. Damage found outside the scrub is handed to the repair again no sooner
than ``RETRY_DEFERRED_SECONDS`` after a deferral and ``RETRY_UNREPAIRABLE_SECONDS`` after an
unrepairable finding; the scrub's own checks always are.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from enum import Enum
from typing import Protocol

from opentelemetry import trace
from twisted.internet.defer import Deferred, DeferredSemaphore, gatherResults
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.controlplane import ControlPlaneError, SegmentMeta, SegmentState
from logbroker.peer.frames import PeerOp
from logbroker.replication.core import repair as rules
from logbroker.replication.healing import Healer
from logbroker.replication.replica import record_of
from logbroker.replication.replica_codec import (
    CopyCheck,
    FenceRequest,
    decode_check,
    encode_fence,
)
from logbroker.replication.takeover import ClaimContext
from logbroker.storage import (
    CopyState,
    DamageReason,
    IntegrityEvent,
    SegmentInfo,
    SegmentNotFoundError,
    StorageError,
)

log = Logger()
tracer = trace.get_tracer("logbroker.scrub")

#: ``(range id, base offset)``: a segment.
SegmentKey = tuple[str, int]


class RepairOutcome(Enum):
    REPAIRED = "repaired"
    UNREPAIRABLE = "unrepairable"
    #: Nothing to repair: the segment is gone, or no longer one whose replica set names this
    #: node (healing deletes a stale copy, it does not repair it).
    NOT_HELD = "not_held"
    #: Not decided now: a replica did not answer (or is down), the qualifying one did not send
    #: its copy whole, or healing is fetching the copy already. Not counted; tried again.
    DEFERRED = "deferred"


#: How long a replica has to read its copy back and answer.
VERIFY_SECONDS = 60.0
#: Repairs fetching at once (each holds up to a segment's bytes in memory).
REPAIRS_AT_ONCE = 4
#: After a repair deferred or found unrepairable, damage found outside the scrub (a read,
#: healing) is handed to the repair again no sooner than this; the scrub's checks always are.
RETRY_DEFERRED_SECONDS = 30.0
RETRY_UNREPAIRABLE_SECONDS = 300.0


class RepairMetrics(Protocol):
    def scrub_checked(self, result: str) -> None:
        """A damaged copy's outcome: ``repaired`` or ``unrepairable``."""


class SegmentRepairs:
    """Repairs this node's damaged sealed copies from its replicas' intact ones."""

    def __init__(self, context: ClaimContext, healer: Healer, metrics: RepairMetrics) -> None:
        self._context = context
        self._healer = healer
        self._metrics = metrics
        #: Repairs under way, by segment, with what waits for each: a second finding of the
        #: same damage waits for the repair under way.
        self._running: dict[SegmentKey, list[Deferred[RepairOutcome]]] = {}
        #: Segments found unrepairable, with where and why: for the dashboard, until repaired
        #: (or no longer held here).
        self.unrepairable: dict[SegmentKey, str] = {}
        #: When damage found outside the scrub may be handed to the repair again, by segment.
        self._next_try: dict[SegmentKey, float] = {}
        self._slots = DeferredSemaphore(REPAIRS_AT_ONCE)
        healer.on_damaged = self._found_by_healing

    def forget_missing(self, held: Collection[SegmentKey]) -> None:
        """Forget the findings about segments no longer ``held`` here (removed by retention,
        or dropped from this node)."""
        for key in [key for key in self.unrepairable if key not in held]:
            del self.unrepairable[key]
            self._next_try.pop(key, None)

    def repair(
        self, range_id: str, base_offset: int, position: int, why: str
    ) -> Deferred[RepairOutcome]:
        """Repair this node's copy of ``range_id@base_offset``, found damaged at byte
        ``position`` (``why`` says how)."""
        key = (range_id, base_offset)
        waiting = self._running.get(key)
        if waiting is not None:
            waiter: Deferred[RepairOutcome] = Deferred()
            waiting.append(waiter)
            return waiter
        self._running[key] = waiting = []
        started = self._slots.run(
            lambda: Deferred.fromCoroutine(self._repair(range_id, base_offset, position, why))
        )

        def finished(outcome: RepairOutcome | Failure) -> RepairOutcome | Failure:
            del self._running[key]
            now = self._context.clock.seconds()
            if outcome is RepairOutcome.DEFERRED:
                self._next_try[key] = now + RETRY_DEFERRED_SECONDS
            elif outcome is RepairOutcome.UNREPAIRABLE:
                self._next_try[key] = now + RETRY_UNREPAIRABLE_SECONDS
            else:
                self._next_try.pop(key, None)
            for waiter in waiting:
                if isinstance(outcome, Failure):
                    waiter.errback(outcome)
                else:
                    waiter.callback(outcome)
            return outcome

        return started.addBoth(finished)

    def damage_found(self, range_id: str, event: IntegrityEvent) -> None:
        """A range log found damage (a read, a verification): a sealed copy's is repaired at
        once, not at the scrub's next turn (after this turn of the reactor: the log is still
        in the middle of the read that found it)."""
        if not event.counted or event.reason is DamageReason.INDEX:
            return  # a torn active tail is crash recovery; an index is rebuilt where it is
        self._context.clock.callLater(0, self._repair_found, range_id, event)

    def _repair_found(self, range_id: str, event: IntegrityEvent) -> None:
        copy = self._context.storage.logs.get(range_id)
        info = None if copy is None else copy.segment(event.base_offset)
        if info is None or info.state is not CopyState.SEALED:
            return  # healing looks at copies not sealed here (or opened meanwhile)
        self._repair_soon(range_id, event.base_offset, event.position, event.reason)

    def _found_by_healing(self, meta: SegmentMeta, info: SegmentInfo) -> None:
        if info.damage is not None:
            damage = info.damage
            self._repair_soon(meta.range_id, meta.base_offset, damage.position, damage.reason)

    def _repair_soon(
        self, range_id: str, base_offset: int, position: int, reason: DamageReason
    ) -> None:
        """Repair damage found outside the scrub, unless a repair of it runs already or it was
        found unrepairable (the scrub's next check tries it again)."""
        key = (range_id, base_offset)
        if key in self._running or self._context.clock.seconds() < self._next_try.get(key, 0.0):
            return
        why = f"it failed verification when read ({reason.value})"
        repairing = self.repair(range_id, base_offset, position, why)
        repairing.addErrback(
            lambda failure: log.failure("Repairing {segment} failed", failure, segment=_name(*key))
        )

    async def _repair(
        self, range_id: str, base_offset: int, position: int, why: str
    ) -> RepairOutcome:
        ctx = self._context
        record = record_of(ctx.control, range_id, base_offset)
        if (
            record is None
            or record.state is not SegmentState.SEALED
            or ctx.node_id not in record.replicas
        ):
            self.unrepairable.pop((range_id, base_offset), None)
            return RepairOutcome.NOT_HELD
        checks = await self._checks(record)
        sources = rules.repair_sources(record, ctx.node_id, checks)
        if not sources:
            answers = "; ".join(
                f"{node} {rules.describe(checks.get(node), record)}"
                for node in record.replicas
                if node != ctx.node_id
            )
            if any(checks.get(n) is None for n in record.replicas if n != ctx.node_id):
                # A replica that could not say (down, or no answer in time) may hold an intact
                # copy: nothing is decided until it can.
                log.warn(
                    "Scrub: sealed segment {segment} is damaged at byte {position}: {why}. It"
                    " cannot be repaired now ({answers}); tried again later",
                    segment=_name(range_id, base_offset),
                    position=position,
                    why=why,
                    answers=answers,
                )
                return RepairOutcome.DEFERRED
            return self._unrepairable(
                record,
                position,
                f"{why}. No replica's copy qualifies to repair it from"
                f" ({answers or 'it has no other replica'})",
            )
        span = tracer.start_span(
            "svc.scrub.repair",
            attributes={
                "logbroker.segment": _name(range_id, base_offset),
                "logbroker.damage.position": position,
                "logbroker.node": ctx.node_id,
                "logbroker.repair.source": sources[0],
            },
        )
        try:
            outcome, detail = await self._replace(record, sources)
            span.set_attribute("logbroker.repair.outcome", outcome.value)
        finally:
            span.end()
        log.info(
            "svc.scrub.repair: {segment}, damaged at byte {position} ({why}): {outcome}, {detail}",
            event="svc.scrub.repair",
            segment=_name(range_id, base_offset),
            position=position,
            why=why,
            outcome=outcome.value,
            detail=detail,
            sources=",".join(sources),
        )
        if outcome is RepairOutcome.REPAIRED:
            self.unrepairable.pop((range_id, base_offset), None)
            self._metrics.scrub_checked(outcome.value)
        return outcome

    async def _checks(self, record: SegmentMeta) -> dict[str, CopyCheck | None]:
        """What each other live member of the replica set finds when it reads its copy back."""
        ctx = self._context
        others = [n for n in record.replicas if n != ctx.node_id and ctx.is_live(n)]
        request = encode_fence(FenceRequest(record.range_id, record.base_offset, record.epoch))

        def ask(node: str) -> Deferred[CopyCheck | None]:
            asking = ctx.requester.request(node, PeerOp.VERIFY_COPY, request)
            asking.addTimeout(VERIFY_SECONDS, ctx.clock)
            # An answer that does not decode says nothing either.
            return asking.addCallback(decode_check).addErrback(lambda failure: None)

        answers = await gatherResults([ask(node) for node in others])
        return dict(zip(others, answers, strict=True))

    async def _replace(
        self, record: SegmentMeta, sources: Sequence[str]
    ) -> tuple[RepairOutcome, str]:
        ctx = self._context
        segments = ctx.control.segments(record.range_id)
        is_last = bool(segments) and segments[-1].base_offset == record.base_offset
        moved = rules.stepped_back(record, ctx.node_id, is_last)
        if moved is not None:
            try:
                await ctx.control.put_segment(moved, expected=record)
            except ControlPlaneError as error:
                # Reads do not come to this copy meanwhile either way: a damaged copy is not
                # trusted, so the range's reads of the segment go to the other copies.
                log.warn(
                    "Repair of {segment}: could not move this node to the end of its replica"
                    " set ({error}); repairing it in place",
                    segment=_name(record.range_id, record.base_offset),
                    error=str(error),
                )
            else:
                record = moved
        if not await self._healer.refetch(record, sources):
            return RepairOutcome.DEFERRED, (
                f"no qualifying replica ({', '.join(sources)}) sent its copy whole, or healing"
                " is fetching it already; tried again later"
            )
        copy = ctx.storage.logs.get(record.range_id)
        if copy is None:
            return RepairOutcome.DEFERRED, "the range's log was closed meanwhile"
        try:
            verification = await copy.verify_segment(record.base_offset)
        except (SegmentNotFoundError, StorageError) as error:
            return RepairOutcome.DEFERRED, f"the fetched copy could not be read back ({error})"
        if verification.damage is not None:
            # Damaged on the way to the disk, or by it: the next try fetches it again.
            return RepairOutcome.DEFERRED, (
                f"the fetched copy fails verification at byte {verification.damage.position}"
            )
        return RepairOutcome.REPAIRED, (
            f"fetched whole from {sources[0]} ({verification.byte_size} bytes,"
            f" {verification.record_count} records) and verified"
        )

    def _unrepairable(self, record: SegmentMeta, position: int, why: str) -> RepairOutcome:
        name = _name(record.range_id, record.base_offset)
        self.unrepairable[(record.range_id, record.base_offset)] = f"byte {position}: {why}"
        self._metrics.scrub_checked(RepairOutcome.UNREPAIRABLE.value)
        log.error(
            "Scrub: sealed segment {segment} is damaged at byte {position}: {why}."
            " Unrepairable for now; nothing was deleted, its frames stay on disk",
            segment=name,
            position=position,
            why=why,
        )
        return RepairOutcome.UNREPAIRABLE


def _name(range_id: str, base_offset: int) -> str:
    return f"{range_id}@{base_offset}"
