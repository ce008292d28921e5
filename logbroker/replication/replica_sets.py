"""Keeping every segment's replica set at the replication factor, without the operator.

Run periodically on every node (``ReplicaSets.tick``):

- **Active segments it leads.** A range this node leads whose active segment is on fewer
  replicas than the factor (it was placed while nodes were down) or names a node dead for
  longer than ``replace_after``, is rolled as soon as enough nodes are alive for a fuller set:
  the next segment is placed on the live nodes.
- **Sealed segments** (the chores lease holder only, so that one node decides). A sealed
  segment on fewer replicas than the factor gets live nodes added (a node back from an outage
  first: ``placement.replace`` keeps the members in order and adds the best live nodes), and
  one naming a node dead for longer than ``replace_after`` gets that node replaced. The new
  members fetch their copies at their next healing tick, so the replication factor is restored
  for data already written, not just for new segments.

Every change is a compare-and-swap on the record this node read, so it never overwrites what a
claim or a seal did meanwhile. A tick reads only the segment records of the ranges that may
need it (``RangesToLookAt``): those whose records changed, those whose change failed, and every
range every ``FULL_LOOK_SECONDS`` and whenever the live members change (a member dead for
longer than ``replace_after`` is seen within that time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import attrs
from twisted.internet.defer import Deferred, DeferredSemaphore, gatherResults
from twisted.logger import Logger

from logbroker.controlplane import ControlPlaneError, SegmentMeta, SegmentState
from logbroker.placement import PlacementError, replace, segment_key
from logbroker.replication.core import claims
from logbroker.replication.leading import LeadRanges
from logbroker.replication.looks import RangesToLookAt
from logbroker.replication.primary import SegmentLeader
from logbroker.replication.takeover import ClaimContext

log = Logger()

#: Replica-set changes sent to the control plane at once.
CHANGES_IN_FLIGHT = 16
#: How often a tick reads every range's segment records, whatever changed.
FULL_LOOK_SECONDS = 10.0


def restore_replication_factor(meta: SegmentMeta, context: ClaimContext) -> SegmentMeta | None:
    """The sealed segment ``meta`` with its replica set completed with live nodes, if it is
    short of the factor and live nodes can be added."""
    if meta.state is not SegmentState.SEALED or not meta.record_count:
        return None
    if len(meta.replicas) >= context.rule.replication_factor:
        return None
    try:
        return claims.completed_set(meta, list(context.live_nodes()), context.rule)
    except PlacementError:
        return None


class ReplicaSets:
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
        self._looks = RangesToLookAt(
            context.control, context.clock, context.live_nodes, FULL_LOOK_SECONDS
        )
        #: Ranges whose replica-set change failed: the next tick looks at them again.
        self._failed: set[str] = set()

    def tick(self, range_ids: Sequence[str]) -> Deferred[None]:
        return Deferred.fromCoroutine(self._tick(range_ids))

    async def _tick(self, range_ids: Sequence[str]) -> None:
        ctx = self._context
        if not self._holds_chores() or not ctx.holds_lease():
            # Another node decides for the sealed segments, and this one reads no range's
            # records (it read every range's at every tick, a fifth of a node's time at 40,000
            # ranges); should it hold the chores next, it looks at all.
            self._looks.everything()
            self._note_deaths(())
            self._roll_weak_sets()
            return
        looked = self._looks.take(range_ids, self._take_failed)
        segments = {range_id: ctx.control.segments(range_id) for range_id in looked}
        # Thousands of segments share a handful of replica sets: each node is noted once.
        replica_sets = {m.replicas for metas in segments.values() for m in metas}
        self._note_deaths({node for replicas in replica_sets for node in replicas})
        self._roll_weak_sets()
        changes = [
            (meta, updated)
            for metas in segments.values()
            for meta in metas
            if (updated := self._repaired(meta)) is not None
        ]
        # A node back from an outage joins the set of every segment sealed while it was away,
        # thousands at realistic sizes: the changes go to the control plane several at a time,
        # and the node fetches what it is named for as they land.
        changing = DeferredSemaphore(CHANGES_IN_FLIGHT)
        await gatherResults(
            [changing.run(self._change, meta, updated) for meta, updated in changes],
            consumeErrors=True,
        )

    def _take_failed(self) -> Iterable[str]:
        failed, self._failed = self._failed, set()
        return failed

    async def _change(self, meta: SegmentMeta, updated: SegmentMeta) -> None:
        try:
            await self._context.control.put_segment(updated, expected=meta)
        except ControlPlaneError as error:
            self._failed.add(meta.range_id)
            log.info(
                "Could not change the replica set of {range_id}@{segment} now: {error}",
                range_id=meta.range_id,
                segment=meta.base_offset,
                error=str(error),
            )
            return
        log.info(
            "The replica set of {range_id}@{segment} is now {replicas} (was {was})",
            range_id=meta.range_id,
            segment=meta.base_offset,
            replicas=",".join(updated.replicas),
            was=",".join(meta.replicas),
        )

    def _repaired(self, meta: SegmentMeta) -> SegmentMeta | None:
        """``meta`` with its replica set brought back to the factor, if it needs it now."""
        if meta.state is not SegmentState.SEALED or not meta.record_count:
            return None
        restored = restore_replication_factor(meta, self._context)
        if restored is not None:
            return restored
        if not any(self._long_dead(node) for node in meta.replicas):
            return None
        try:
            placement = replace(
                segment_key(meta.range_id, meta.base_offset),
                meta.replicas,
                self._context.live_nodes(),
                self._context.rule,
            )
        except PlacementError:
            return None
        if set(placement.replicas) == set(meta.replicas):
            return None
        return attrs.evolve(meta, replicas=placement.replicas)

    # -- who is dead, and for how long -------------------------------------------------------

    def _note_deaths(self, nodes: Iterable[str]) -> None:
        now = self._context.clock.seconds()
        # Those noted dead before too: one back is forgotten even if no range was looked at.
        for node in set(nodes) | set(self._dead_since):
            if self._context.is_live(node):
                self._dead_since.pop(node, None)
            else:
                self._dead_since.setdefault(node, now)

    def _long_dead(self, node: str) -> bool:
        since = self._dead_since.get(node)
        return since is not None and self._context.clock.seconds() - since >= self._replace_after

    # -- active segments this node leads -------------------------------------------------------

    def _roll_weak_sets(self) -> None:
        ctx = self._context
        live = sum(1 for node in ctx.live_nodes() if node.alive)
        factor = ctx.settings.replication_factor
        # Thousands of leaders share a handful of replica sets: each is judged once.
        weak_sets: dict[tuple[str, ...], bool] = {}

        def weak(leader: SegmentLeader) -> bool:
            found = weak_sets.get(leader.replicas)
            if found is None:
                self._note_deaths(leader.replicas)
                members = [n for n in leader.replicas if not self._long_dead(n)]
                found = weak_sets[leader.replicas] = len(members) < factor and len(members) < live
            return found

        for handle in self._lead.leading(weak):
            leader = handle.leader
            assert leader is not None
            if leader.written == leader.segment:
                # Nothing to seal: claimed anew, it is led on a set completed from the live
                # nodes. Each pass finds it weak until that claim is over: one claim is enough.
                if self._lead.claiming(handle.range_id):
                    continue
                log.info(
                    "Claiming {range_id} anew: its empty active segment is on {replicas},"
                    " fewer than {factor} live replicas",
                    range_id=handle.range_id,
                    replicas=",".join(leader.replicas),
                    factor=factor,
                )
                self._lead.prepare(handle.range_id).addErrback(lambda _: None)
                continue
            # A roll already under way (passes find the set weak until it is over) is not
            # started again, nor logged again.
            if handle.roll():
                log.info(
                    "Rolling {range_id}: its active segment is on {replicas}, fewer than"
                    " {factor} live replicas; the next one is placed on the live nodes",
                    range_id=handle.range_id,
                    replicas=",".join(leader.replicas),
                    factor=factor,
                )
