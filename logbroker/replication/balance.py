"""Leadership handed back to each range's preferred leader, a few ranges at a time (decision
0026).

A failover leaves every range of a dead primary with the node that claimed it, and the segments
that node opens next keep it first, so nothing ever moved them back. In a soak of a three-node
cluster with 4,000 ranges, one node led 3,995 of them after twenty minutes of faults: it took
every client's produce, and its own failure moved every range onto one survivor at once, whose
claim storm grew the time to a clean produce from 2 s to over 8 s and cost nodes their leases.

``LeadershipBalance.tick`` (run with the takeover sweep) claims the ranges this node is the
preferred leader of while another live node leads them (``core.claims.should_take_back``),
once the cluster is quiet: the live membership unchanged for ``settle_seconds``, this node
holding its lease and following the control plane, and none of the sweep's own claims queued
or under way, so that the balance never competes with a failover. At most ``max_under_way``
such claims run at once, and a tick looks at ``looks_per_tick`` ranges at most, going round
all of them in turn: a node back from a restart gets its ranges back over some seconds, not
in one storm. A claim that fails backs off as any claim does (``LeadRanges``) and is looked at
again in a later round.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.replication.core import claims as rules
from logbroker.replication.leading import LeadRanges
from logbroker.replication.takeover import ClaimContext

log = Logger()

#: How long the live membership must stay unchanged before ranges are taken back: a node that
#: just came back first heals its copies, and a flapping one is not handed ranges to lose again.
SETTLE_SECONDS = 10.0
#: The most take-backs under way at once.
MAX_UNDER_WAY = 16
#: The most ranges one tick looks at.
LOOKS_PER_TICK = 1024


class LeadershipBalance:
    def __init__(
        self,
        lead: LeadRanges,
        context: ClaimContext,
        *,
        settle_seconds: float = SETTLE_SECONDS,
        max_under_way: int = MAX_UNDER_WAY,
        looks_per_tick: int = LOOKS_PER_TICK,
    ) -> None:
        self._lead = lead
        self._context = context
        self._settle_seconds = settle_seconds
        self._max_under_way = max_under_way
        self._looks_per_tick = looks_per_tick
        #: The live members last seen, and since when things have been quiet.
        self._live: frozenset[str] | None = None
        self._quiet_since = 0.0
        #: Where the next tick's look begins, among the range ids it is given.
        self._next = 0
        #: The ranges being taken back now.
        self._under_way: set[str] = set()
        #: Ranges taken back since the balance last said so, and whether the round of looks
        #: under way found any to take.
        self._taken_back = 0
        self._found_in_round = False

    @property
    def under_way(self) -> frozenset[str]:
        return frozenset(self._under_way)

    def tick(self, range_ids: Sequence[str]) -> None:
        """Take back some of ``range_ids`` (every range of the cluster, in a stable order)
        that this node should lead, if the cluster is quiet."""
        ctx = self._context
        now = ctx.clock.seconds()
        live = frozenset(node.node_id for node in ctx.live_nodes() if node.alive)
        if live != self._live or not ctx.holds_lease() or not ctx.control_follows():
            self._live, self._quiet_since = live, now
            return
        if now - self._quiet_since < self._settle_seconds or not range_ids:
            return
        if self._lead.sweep_pending() or self._lead.claims_under_way() > len(self._under_way):
            return  # the sweep claims what has no live leader first
        looks = min(self._looks_per_tick, len(range_ids))
        start = self._next % len(range_ids)
        looked = 0
        while looked < looks and len(self._under_way) < self._max_under_way:
            range_id = range_ids[(start + looked) % len(range_ids)]
            looked += 1
            if self._should_take_back(range_id):
                self._take_back(range_id)
        self._next = start + looked
        if self._next >= len(range_ids):
            self._round_ended()

    def _should_take_back(self, range_id: str) -> bool:
        ctx = self._context
        if range_id in self._under_way or self._lead.claiming(range_id):
            return False
        meta = ctx.control.last_segment(range_id)
        return meta is not None and rules.should_take_back(meta, ctx.node_id, ctx.is_live)

    def _take_back(self, range_id: str) -> None:
        self._under_way.add(range_id)
        self._found_in_round = True
        taking = self._lead.prepare(range_id)
        taking.addCallbacks(
            self._taken, self._not_taken, callbackArgs=(range_id,), errbackArgs=(range_id,)
        )

    def _taken(self, _: None, range_id: str) -> None:
        self._under_way.discard(range_id)
        self._taken_back += 1

    def _not_taken(self, failure: Failure, range_id: str) -> None:
        self._under_way.discard(range_id)
        log.debug(
            "Taking back {range_id} failed: {error}",
            range_id=range_id,
            error=failure.getErrorMessage(),
        )

    def _round_ended(self) -> None:
        """A round of looks went over every range: if it found none to take back after some
        were, the balance is done for now, and says so once."""
        found, self._found_in_round = self._found_in_round, False
        self._next = 0
        if not found and not self._under_way and self._taken_back:
            log.info(
                "Took back the leadership of {count} ranges this node is the preferred leader of",
                count=self._taken_back,
            )
            self._taken_back = 0
