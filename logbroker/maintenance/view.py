"""What an operator sees of this node's integrity scrub and retention, and the one thing they
can start: a full scrub pass now (the dashboard's ``POST /scrub``)."""

from __future__ import annotations

import attrs

from logbroker.maintenance.retention import Retention
from logbroker.maintenance.scrub import MaintenanceRefused, Scrubber


@attrs.frozen
class ScrubStatus:
    enabled: bool
    interval_ms: int
    segments_per_tick: int
    #: Cycles the rotation completed, and full passes started on demand and done.
    cycles: int = 0
    full_passes: int = 0
    #: When the last cycle or full pass ended (seconds since the epoch; ``None``: none yet).
    last_cycle_at: float | None = None
    #: The segments of the full pass running now, if one is.
    full_pass: int | None = None
    #: Segments found damaged and not repaired: ``(range@base, where and why)``.
    unrepairable: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class RetentionStatus:
    enabled: bool
    max_age_ms: int | None
    max_bytes: int | None
    interval_ms: int
    #: When the last pass ended, and whether this node decided at it (a cluster's chores
    #: lease holder does).
    last_pass_at: float | None = None
    deciding: bool = False


class MaintenanceView:
    def __init__(
        self,
        *,
        scrub: ScrubStatus,
        retention: RetentionStatus,
        scrubber: Scrubber | None = None,
        retainer: Retention | None = None,
    ) -> None:
        self._scrub = scrub
        self._retention = retention
        self._scrubber = scrubber
        self._retainer = retainer

    def scrub(self) -> ScrubStatus:
        scrubber = self._scrubber
        if scrubber is None:
            return self._scrub
        return attrs.evolve(
            self._scrub,
            cycles=scrubber.rotation.cycles,
            full_passes=scrubber.full_passes,
            last_cycle_at=scrubber.last_cycle_at,
            full_pass=scrubber.full_pass,
            unrepairable=tuple(
                sorted((f"{r}@{b}", why) for (r, b), why in scrubber.repair.unrepairable.items())
            ),
        )

    def retention(self) -> RetentionStatus:
        retainer = self._retainer
        if retainer is None:
            return self._retention
        return attrs.evolve(
            self._retention, last_pass_at=retainer.last_pass_at, deciding=retainer.deciding
        )

    def scrub_now(self) -> int:
        """Start a full scrub pass; the segments it checks."""
        if self._scrubber is None:
            raise MaintenanceRefused(
                "the integrity scrub is off on this node (SVC_SCRUB_ENABLED=false)"
            )
        return self._scrubber.check_all_now()
