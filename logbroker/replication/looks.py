"""Which ranges a periodic pass over a node's thousands of ranges needs to look at.

The takeover sweep and healing run every second or so. Most of the time nothing changed for
almost every range, and reading every range's records at every pass took a good share of an
idle node's time. ``RangesToLookAt`` gives a pass only the ranges that may need it: those whose
segment records changed since the last pass (the control plane's ``watch_segments``), those the
pass is told of, and those the pass itself names (what it left unfinished); and every range now
and then (anything else that changes, such as a back-off running out, is seen within that
time) and whenever the live members of the cluster change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from twisted.internet.interfaces import IReactorTime

from logbroker.controlplane import ControlPlane
from logbroker.placement import PlacementNode


class RangesToLookAt:
    def __init__(
        self,
        control: ControlPlane,
        clock: IReactorTime,
        live_nodes: Callable[[], Iterable[PlacementNode]],
        every_seconds: float,
    ) -> None:
        self._clock = clock
        self._live_nodes = live_nodes
        self._every_seconds = every_seconds
        #: The ranges to look at besides those the pass names; ``None``: every range.
        self._changed: set[str] | None = None
        #: The live members at the last pass, and when the next looks at every range.
        self._live: frozenset[str] = frozenset()
        self._everything_at = 0.0
        control.watch_segments(self.add_all)

    def add(self, range_id: str) -> None:
        """The next pass looks at ``range_id``."""
        if self._changed is not None:
            self._changed.add(range_id)

    def add_all(self, range_ids: Iterable[str]) -> None:
        if self._changed is not None:
            self._changed.update(range_ids)

    def everything(self) -> None:
        """The next pass looks at every range (what it depends on may have changed unseen)."""
        self._changed = None

    def take(
        self, range_ids: Sequence[str], unfinished: Callable[[], Iterable[str]]
    ) -> Sequence[str]:
        """The ranges among ``range_ids`` to look at now, in their order: every one, or those
        that changed since the last call and those ``unfinished`` names."""
        now = self._clock.seconds()
        live = frozenset(node.node_id for node in self._live_nodes() if node.alive)
        if self._changed is None or live != self._live or now >= self._everything_at:
            self._live = live
            self._everything_at = now + self._every_seconds
            self._changed = set()
            return range_ids
        changed, self._changed = self._changed, set()
        changed.update(unfinished())
        if not changed:
            return ()
        return [range_id for range_id in range_ids if range_id in changed]
