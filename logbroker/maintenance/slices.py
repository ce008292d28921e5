"""Long passes over a node's tens of thousands of ranges, in slices that give the reactor back.

Healing and the replication health count look at every range now and then (and whenever the
membership changes). At 40,000 ranges one such pass held a node's reactor for the better part
of a second, and three such passes with the takeover sweep kept it from answering sign-ins,
peers' requests and etcd's keepalive answers in time: nodes lost their membership leases.
``Slices.next`` ends the slice once it has run ``SLICE_SECONDS`` of the reactor's clock, and
lets the reactor turn before the pass goes on. Under a test's ``Clock``, whose time moves only
when told, a pass runs in one slice.
"""

from __future__ import annotations

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater

#: How long a pass runs before it lets the reactor turn.
SLICE_SECONDS = 0.01


class Slices:
    def __init__(self, clock: IReactorTime, seconds: float = SLICE_SECONDS) -> None:
        self._clock = clock
        self._seconds = seconds
        self._until = clock.seconds() + seconds
        #: How many times the pass let the reactor turn.
        self.breaks = 0

    async def next(self) -> None:
        """Go on at once while the slice lasts; else after one turn of the reactor."""
        if self._clock.seconds() < self._until:
            return
        await deferLater(self._clock, 0, lambda: None)
        self.breaks += 1
        self._until = self._clock.seconds() + self._seconds
