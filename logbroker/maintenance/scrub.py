"""The integrity scrub (the spec's "Integrity scrub", rules 1-6): every
``SVC_SCRUB_INTERVAL_MS`` a node verifies ``SVC_SCRUB_SEGMENTS_PER_TICK`` of its own sealed
segments, in rotation, so that every sealed copy is read back now and then, not only when a
client happens to fetch it.

A check reads every record's checksum and the sealed size and count the segment's own seal
marker recorded (``RangeLog.verify_segment``, on a reader thread, beside the range's writes), then
compares the count and size with what the control plane recorded at sealing. Outcomes are
counted in ``svc_storage_scrub_segments_total{result}``; the damage itself is counted by the
range log, once per segment, in ``svc_storage_integrity_failures_total{reason}``.

Damage found (in the bytes, or a count or size unlike the control plane's record) is handed to
the node's ``DamageRepair``, which counts the outcome. In a cluster that is
``logbroker.replication.repair.SegmentRepairs``: the copy is repaired from an intact replica
(rules 2-5). On a single node (and at replication factor 1) there is no other copy to repair
from: ``NoOtherCopy`` counts every finding ``unrepairable`` and logs it loudly, naming the
segment and the byte position, at each check (the count never clears by itself; the spec's
alert pages on it).

``ScrubRotation`` (no I/O) picks what to check next; ``Scrubber`` carries it out.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from logbroker.controlplane import ControlPlane, SegmentMeta, SegmentState
from logbroker.errors import LogbrokerError, Reason
from logbroker.maintenance.periodic import PeriodicTask, TaskMetrics
from logbroker.maintenance.slices import Slices
from logbroker.replication.replica import record_of, view_of
from logbroker.storage import (
    CopyState,
    DamageReason,
    IntegrityEvent,
    RangeLog,
    SegmentNotFoundError,
    StorageError,
)

log = Logger()

#: A sealed segment: its range and base offset.
SegmentKey = tuple[str, int]


@attrs.define
class ScrubRotation:
    """Which sealed segments a scrub checks next: the ones after the last checked, in key
    order, wrapping around at the end. A segment added behind the rotation's place waits for
    the next cycle; one removed is skipped. ``cycles`` counts the passes that reached the end."""

    _last: SegmentKey | None = None
    cycles: int = 0

    def next(self, available: Sequence[SegmentKey], count: int) -> list[SegmentKey]:
        """Up to ``count`` of ``available`` (sorted, distinct) to check now, none twice."""
        total = len(available)
        if not total:
            return []
        index = 0 if self._last is None else bisect.bisect_right(available, self._last)
        if index >= total:
            index = 0
        chosen = []
        for _ in range(min(count, total)):
            chosen.append(available[index])
            if index == total - 1:
                self.cycles += 1
                index = 0
            else:
                index += 1
        self._last = chosen[-1]
        return chosen


class ScrubMetrics(TaskMetrics, Protocol):
    def scrub_running(self, running: bool) -> None:
        """The scrub started (or stopped) on this node: ``svc_scrub_enabled``."""

    def scrub_checked(self, result: str) -> None:
        """A check's result: ``verified``, ``repaired`` or ``unrepairable``."""

    def integrity_event(self, event: IntegrityEvent) -> None:
        """A copy whose count or size differs from the control plane's record (the range log
        reports damage in its bytes itself)."""


class MaintenanceRefused(LogbrokerError):
    """An operator's request of the scrub or retention that cannot be done now; says why."""

    default_reason = Reason.INVALID_OPERATION


class ScrubBusy(MaintenanceRefused):
    """A full pass was asked for while one runs."""


class DamageRepair(Protocol):
    @property
    def unrepairable(self) -> Mapping[SegmentKey, str]:
        """The segments found damaged and not repaired, with where and why."""

    def repair(self, range_id: str, base_offset: int, position: int, why: str) -> Deferred[Any]:
        """Repair this node's copy of ``range_id@base_offset``, found damaged at byte
        ``position`` (``why`` says how), and count the outcome."""

    def forget_missing(self, held: Collection[SegmentKey]) -> None:
        """Forget what was found of segments no longer ``held`` here."""


class NoOtherCopy:
    """The ``DamageRepair`` of a node whose ranges have one copy: every finding is
    ``unrepairable``, counted and logged loudly, and nothing is deleted."""

    def __init__(self, metrics: ScrubMetrics) -> None:
        self._metrics = metrics
        self.unrepairable: dict[SegmentKey, str] = {}

    def forget_missing(self, held: Collection[SegmentKey]) -> None:
        for key in [key for key in self.unrepairable if key not in held]:
            del self.unrepairable[key]

    def repair(self, range_id: str, base_offset: int, position: int, why: str) -> Deferred[None]:
        self.unrepairable[(range_id, base_offset)] = f"byte {position}: {why}"
        self._metrics.scrub_checked("unrepairable")
        log.error(
            "Scrub: sealed segment {segment} is damaged at byte {position}: {why}. No other"
            " copy to repair it from: unrepairable; its frames stay on disk for salvage",
            segment=f"{range_id}@{base_offset}",
            position=position,
            why=why,
        )
        return succeed(None)


class Scrubber:
    """Checks a node's sealed segments in rotation (``tick``, run by a ``ScrubTask``)."""

    def __init__(
        self,
        logs: Mapping[str, RangeLog],
        control: ControlPlane,
        segments_per_tick: int,
        metrics: ScrubMetrics,
        repair: DamageRepair,
        clock: IReactorTime,
        *,
        node_id: str | None = None,
    ) -> None:
        #: This node's id, to tell its copies from those left behind; ``None``: one node,
        #: whose copies are all its own.
        self._node_id = node_id
        self._logs = logs
        self._clock = clock
        self.repair = repair
        self._control = control
        self._segments_per_tick = segments_per_tick
        self._metrics = metrics
        self.rotation = ScrubRotation()
        #: When a cycle last ended (the rotation's, or a full pass's), by the clock.
        self.last_cycle_at: float | None = None
        #: Full passes started on demand and done; the segments of the one running, if any.
        self.full_passes = 0
        self.full_pass: int | None = None
        #: Copies found unlike the control plane's record: counted as a failure once each, as
        #: the range logs count damage in their bytes.
        self._size_reported: set[SegmentKey] = set()

    def tick(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._tick())

    def sealed_segments(self) -> list[SegmentKey]:
        """Every sealed segment this node holds, sorted."""
        return sorted(
            (range_id, info.base_offset)
            for range_id, range_log in self._logs.items()
            for info in range_log.segments()
            if info.state is CopyState.SEALED
        )

    async def _tick(self) -> None:
        await self._check_files()
        cycles = self.rotation.cycles
        held = self.sealed_segments()
        self.repair.forget_missing(set(held))
        for range_id, base in self.rotation.next(held, self._segments_per_tick):
            await self._check(range_id, base)
        if self.rotation.cycles != cycles:
            self.last_cycle_at = self._clock.seconds()

    def _repair(self, range_id: str, base: int, position: int, why: str) -> None:
        """Hand damage to the repair, and go on: a repair runs beside the scrub (a cluster's
        fetches a whole copy, or waits on a replica that is slow to answer), and the scrub's
        pace does not depend on it."""
        self.repair.repair(range_id, base, position, why).addErrback(
            lambda failure: log.failure(
                "Scrub: repairing {range_id}@{segment} failed",
                failure,
                range_id=range_id,
                segment=base,
            )
        )

    def _believed(self, range_log: RangeLog, base: int, recorded: SegmentMeta) -> bool:
        """Whether this node's copy is one the record speaks for: its node in the replica set,
        at the sealed epoch (a copy left behind by a takeover or a replica-set change is
        healing's to replace or delete, not damage)."""
        if self._node_id is not None and self._node_id not in recorded.replicas:
            return False
        epoch = view_of(range_log, base).epoch
        return epoch is None or epoch == recorded.epoch

    def check_all_now(self) -> int:
        """Start a full pass over every sealed segment now, beside the rotation (an operator's
        ``POST /scrub``); the number of segments it checks. ``ScrubBusy`` while one runs."""
        if self.full_pass is not None:
            raise ScrubBusy(
                f"a full pass started on demand is checking {self.full_pass} sealed segments"
                " already"
            )
        segments = self.sealed_segments()
        self.full_pass = len(segments)
        log.info("Scrub: a full pass over {count} sealed segments starts", count=len(segments))
        Deferred.fromCoroutine(self._check_all(segments)).addErrback(
            lambda failure: log.failure("Scrub: the full pass failed", failure)
        )
        return len(segments)

    async def _check_all(self, segments: Sequence[SegmentKey]) -> None:
        try:
            await self._check_files()
            for range_id, base in segments:
                await self._check(range_id, base)
        finally:
            self.full_pass = None
        self.last_cycle_at = self._clock.seconds()
        self.full_passes += 1
        log.info("Scrub: the full pass over {count} sealed segments is done", count=len(segments))

    async def _check_files(self) -> None:
        """Physical healing's pass (rule 9): every sealed copy's files on disk against its seal,
        so that a copy deleted or cut short under the running node is found at once, not at the
        rotation's turn, at a restart or when a client reads it."""
        slices = Slices(self._clock)
        for range_id, range_log in list(self._logs.items()):
            await slices.next()
            try:
                found = await range_log.check_files()
            except OSError as error:
                log.warn(
                    "Scrub: could not look at the files of {range_id}: {error}",
                    range_id=range_id,
                    error=str(error),
                )
                continue
            for base, damage in found:
                if damage.reason is DamageReason.METADATA:
                    why = "its seal marker is gone from disk"
                elif damage.position == 0:
                    why = "its .log is gone from disk, or empty"
                else:
                    why = f"its .log on disk ends at byte {damage.position}, short of its seal"
                self._repair(range_id, base, damage.position, why)

    async def _check(self, range_id: str, base: int) -> None:
        range_log = self._logs.get(range_id)
        if range_log is None:
            return
        try:
            verification = await range_log.verify_segment(base)
        except SegmentNotFoundError:
            return  # deleted since it was listed, or while it was checked
        except StorageError as error:
            log.warn(
                "Scrub: could not check {range_id}@{segment}: {error}",
                range_id=range_id,
                segment=base,
                error=str(error),
            )
            return
        except OSError as error:
            # Its files cannot be read back (gone, or the disk fails): damaged, as far as any
            # reader can tell.
            self._repair(range_id, base, 0, f"it cannot be read ({error})")
            return
        if verification.damage is not None:
            self._repair(
                range_id,
                base,
                verification.damage.position,
                f"its bytes fail verification ({verification.damage.reason.value})",
            )
            return
        recorded = record_of(self._control, range_id, base)
        if (
            recorded is not None
            and recorded.state is SegmentState.SEALED
            and self._believed(range_log, base, recorded)
            and (recorded.record_count, recorded.byte_size)
            != (verification.record_count, verification.byte_size)
        ):
            position = min(verification.byte_size, recorded.byte_size or 0)
            if (range_id, base) not in self._size_reported:
                self._size_reported.add((range_id, base))
                self._metrics.integrity_event(
                    IntegrityEvent(
                        DamageReason.SIZE,
                        range_log.directory,
                        base,
                        position,
                        True,
                    )
                )
            self._repair(
                range_id,
                base,
                position,
                f"it holds {verification.record_count} records in {verification.byte_size}"
                f" bytes, and the control plane recorded {recorded.record_count} records in"
                f" {recorded.byte_size} bytes at sealing",
            )
            return
        self._metrics.scrub_checked("verified")


class ScrubTask(PeriodicTask):
    """The scrub's periodic task: a check of the next segments every ``interval`` seconds,
    the first one interval after the start; ``svc_scrub_enabled`` is 1 while it runs."""

    def __init__(
        self, scrubber: Scrubber, interval: float, clock: IReactorTime, metrics: ScrubMetrics
    ) -> None:
        super().__init__("scrub", interval, scrubber.tick, clock, metrics=metrics, now=False)
        self._scrub_metrics = metrics

    def startService(self) -> None:
        super().startService()
        self._scrub_metrics.scrub_running(True)

    def stopService(self) -> Deferred[None]:
        self._scrub_metrics.scrub_running(False)
        return super().stopService()
