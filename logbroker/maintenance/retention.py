"""Retention: reclaiming a range's oldest sealed segments by age and by a byte budget (the
spec's "Retention").

``expired`` (no I/O) decides, for one range, which segments go:

- Only sealed segments are eligible, never the range's last segment (the active one, or the
  one whose successor is not recorded yet): the active segment is never deleted.
- Oldest first, and only a run from the range's start: the range stays one unbroken run of
  offsets from its first remaining record, which is where a consumer whose cursor points into
  removed data goes on from.
- ``max_age_ms``: a segment whose newest record is older than that goes. A segment whose
  newest record's time is not known (a copy sealed by an earlier build) is not removed by age.
- ``max_bytes``: the budget of the range's sealed segments' bytes (the active segment's bytes
  are not counted: it is never removed); the oldest go while the rest are over it. ``0`` is a
  real budget of zero bytes: every sealed segment goes.
- With both set, a segment goes if either says so; with neither, nothing goes (and no
  retention task runs at all).

``Retention`` carries it out every ``SVC_RETENTION_INTERVAL_MS``. One node decides: a single
node, or in a cluster the node holding the chores lease. The control plane's record goes first:
a segment no longer recorded is served by no node (reads start at the range's first recorded
segment). Then every node deletes its copies of the segments removed, as its own view of the
control plane shows them gone (``delete_removed_copies``): right after the record on one node,
at its next pass on every node of a cluster (every node must be given the same limits).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import attrs
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from logbroker.broker.segments import delete_removed_copies
from logbroker.controlplane import ControlPlane, ControlPlaneError, SegmentMeta, SegmentState
from logbroker.maintenance.periodic import PeriodicTask, TaskMetrics
from logbroker.maintenance.slices import Slices
from logbroker.storage import CopyState, RangeLog

log = Logger()


@attrs.frozen
class RetentionRule:
    """``SVC_RETENTION_MAX_AGE_MS`` and ``SVC_RETENTION_MAX_BYTES`` (``None``: unset)."""

    max_age_ms: int | None = None
    max_bytes: int | None = None

    @property
    def enabled(self) -> bool:
        return self.max_age_ms is not None or self.max_bytes is not None


@attrs.frozen
class SegmentFacts:
    """What retention needs to know of one of a range's segments."""

    base_offset: int
    sealed: bool
    byte_size: int
    #: The time of its newest record, in ms since the epoch (``None``: not known).
    newest_ms: int | None = None


def expired(segments: Sequence[SegmentFacts], rule: RetentionRule, now_ms: int) -> list[int]:
    """The base offsets of the segments of one range (``segments``, in offset order) that go
    now, oldest first."""
    if not segments:
        return []
    remaining = sum(s.byte_size for s in segments if s.sealed)
    removed = []
    for segment in segments[:-1]:
        if not segment.sealed:
            break
        by_age = (
            rule.max_age_ms is not None
            and segment.newest_ms is not None
            and now_ms - segment.newest_ms > rule.max_age_ms
        )
        # A budget of 0 expires every eligible segment, empty ones too (the spec's words).
        by_bytes = rule.max_bytes is not None and (remaining > rule.max_bytes or not rule.max_bytes)
        if not (by_age or by_bytes):
            break
        removed.append(segment.base_offset)
        remaining -= segment.byte_size
    return removed


class RetentionMetrics(TaskMetrics, Protocol):
    def retention_removed(self, segments: int, byte_size: int) -> None:
        """Segments removed by retention, and their bytes."""


#: ``(range id) -> {base offset: newest record's time in ms}`` of the sealed segments, as far
#: as known: this node's copies on one node, every live node's in a cluster.
NewestTimes = Callable[[Sequence[str]], Deferred[Mapping[tuple[str, int], int]]]


class Retention:
    """One retention pass over every range (``tick``): decides, records and deletes."""

    rule: RetentionRule

    def __init__(
        self,
        control: ControlPlane,
        logs: Mapping[str, RangeLog],
        rule: RetentionRule,
        clock: IReactorTime,
        metrics: RetentionMetrics,
        *,
        newest_times: NewestTimes,
        decides: Callable[[], bool] = lambda: True,
    ) -> None:
        self._control = control
        self._logs = logs
        self.rule = self._rule = rule
        self._clock = clock
        self._metrics = metrics
        self._newest_times = newest_times
        self._decides = decides
        #: When the last pass ended, by the clock, and whether this node decided at it.
        self.last_pass_at: float | None = None
        self.deciding = False

    def tick(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._tick())

    async def _tick(self) -> None:
        self.deciding = self._decides()
        if self.deciding:
            await self._decide()
        # Every node deletes its own copies of what was removed (a cluster's decider removes
        # records only): after the record, never before it.
        slices = Slices(self._clock)
        for range_id, copy in list(self._logs.items()):
            await slices.next()
            await delete_removed_copies(self._control, copy, range_id)
        self.last_pass_at = self._clock.seconds()

    async def _decide(self) -> None:
        range_ids = list(self._control.range_ids())
        times: Mapping[tuple[str, int], int] = {}
        if self._rule.max_age_ms is not None:
            times = await self._newest_times(range_ids)
        now_ms = int(self._clock.seconds() * 1000)
        slices = Slices(self._clock)
        for range_id in range_ids:
            await slices.next()
            metas = self._control.segments(range_id)
            facts = [_facts(meta, times) for meta in metas]
            for base in expired(facts, self._rule, now_ms):
                meta = next(m for m in metas if m.base_offset == base)
                if not await self._remove(meta):
                    break  # the rest wait for the next pass, oldest first

    async def _remove(self, meta: SegmentMeta) -> bool:
        try:
            await self._control.delete_segment(meta.range_id, meta.base_offset)
        except ControlPlaneError as error:
            log.warn(
                "Retention: could not remove {range_id}@{segment} from the control plane:"
                " {error}; tried again at the next pass",
                range_id=meta.range_id,
                segment=meta.base_offset,
                error=str(error),
            )
            return False
        self._metrics.retention_removed(1, meta.byte_size or 0)
        log.info(
            "Retention: removed {range_id}@{segment} ({records} records, {size} bytes)",
            range_id=meta.range_id,
            segment=meta.base_offset,
            records=meta.record_count,
            size=meta.byte_size,
        )
        return True


def _facts(meta: SegmentMeta, times: Mapping[tuple[str, int], int]) -> SegmentFacts:
    sealed = meta.state is SegmentState.SEALED
    return SegmentFacts(
        meta.base_offset,
        sealed,
        meta.byte_size or 0,
        times.get((meta.range_id, meta.base_offset)),
    )


def local_newest_times(logs: Mapping[str, RangeLog]) -> NewestTimes:
    """The newest-record times of this node's own sealed copies."""

    def newest(range_ids: Sequence[str]) -> Deferred[Mapping[tuple[str, int], int]]:
        found = {}
        for range_id in range_ids:
            copy = logs.get(range_id)
            for info in () if copy is None else copy.segments():
                if info.state is CopyState.SEALED and info.max_timestamp_ms is not None:
                    found[(range_id, info.base_offset)] = info.max_timestamp_ms
        return succeed(found)

    return newest


class RetentionTask(PeriodicTask):
    """Retention's periodic task: a pass every ``SVC_RETENTION_INTERVAL_MS``."""

    def __init__(
        self, retention: Retention, interval: float, clock: IReactorTime, metrics: TaskMetrics
    ) -> None:
        super().__init__("retention", interval, retention.tick, clock, metrics=metrics, now=False)
