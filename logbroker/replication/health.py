"""How many segments have fewer whole copies than the replication factor:
``svc_under_replicated_segments``, ``logbroker cluster status`` and the dashboard's Cluster card;
and how many ranges cannot be led for want of live replicas (``svc_unavailable_ranges``).

A segment is under-replicated when its replica set is shorter than the factor, names a node that
is dead, or names a live node that does not hold it whole yet (a sealed segment it has to fetch).
Every node knows the first two from the control plane and the member list; the third each node
knows of itself (``Healer.missing``) and tells the others through the ``copy_health`` peer op.
``ReplicationHealth.refresh`` (run periodically) asks every live node and recounts; the count is
read synchronously between refreshes (None before the first). 0 is the healthy state: every
segment written is on the factor's number of nodes, whole.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from twisted.internet.defer import Deferred, DeferredList, succeed
from twisted.logger import Logger

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.maintenance.slices import Slices
from logbroker.peer.frames import PeerOp
from logbroker.replication.core.claims import live_quorum
from logbroker.replication.healing import Healer, SegmentKey
from logbroker.replication.replica_codec import decode_missing, encode_missing
from logbroker.replication.takeover import ClaimContext

log = Logger()


def under_replicated(
    segments: Iterable[SegmentMeta],
    factor: int,
    is_live: Callable[[str], bool],
    missing: Mapping[str, set[SegmentKey]],
) -> int:
    """How many of ``segments`` have fewer than ``factor`` whole copies on live nodes;
    ``missing`` says, for each node that answered, the sealed segments it lacks (a live node
    that did not answer is taken to lack nothing it was not known to lack)."""
    count = 0
    for meta in segments:
        if meta.state is SegmentState.SEALED and not meta.record_count:
            continue  # it holds nothing: no copy to lose
        key = (meta.range_id, meta.base_offset)
        if (
            len(meta.replicas) < factor
            or not all(is_live(node) for node in meta.replicas)
            or any(key in missing.get(node, ()) for node in meta.replicas)
        ):
            count += 1
    return count


def unavailable_ranges(
    active: Iterable[SegmentMeta], quorum: int, is_live: Callable[[str], bool]
) -> int:
    """How many ranges cannot be led now, of those whose last segments are ``active``: the
    replica set of their active segment has fewer live members than the quorum, so no node
    claims it (``svc_unavailable_ranges``) until enough of them are back."""
    return sum(
        1
        for meta in active
        if meta.state is SegmentState.ACTIVE and not live_quorum(meta, is_live, quorum)
    )


#: How often a node asks the others what they lack (its count is as old as this, at most).
REFRESH_SECONDS = 2.0
#: The ranges counted between two looks at the clock (``Slices``): the count is a pass over
#: every range of the cluster.
_RANGES_AT_ONCE = 256


class ReplicationHealth:
    def __init__(
        self, context: ClaimContext, healer: Healer, every_seconds: float = REFRESH_SECONDS
    ) -> None:
        self._context = context
        self._healer = healer
        self._every = every_seconds
        self._last: float | None = None
        #: The last count (None before the first), and what each node said it lacks.
        self.count: int | None = None
        #: Ranges that cannot be led now (``unavailable_ranges``), as last counted.
        self.unavailable: int | None = None
        self.missing: dict[str, set[SegmentKey]] = {}
        #: What each range added to the two counts, as last counted: a count after a change
        #: looks again only at the ranges it touched (at 40,000 ranges a whole count takes
        #: seconds of CPU, every refresh while a failover changes records).
        self._by_range: dict[str, tuple[int, int]] = {}
        #: The live members the counts were made with (None: nothing counted yet); when they
        #: change, every range is counted again.
        self._counted_live: frozenset[str] | None = None
        #: Ranges whose records changed since they were last counted.
        self._changed: set[str] = set()
        context.control.watch_segments(self._segments_changed)

    def _segments_changed(self, range_ids: Collection[str]) -> None:
        self._changed.update(range_ids)

    def serve(self, sender: str, payload: bytes) -> Deferred[bytes]:
        """The ``copy_health`` op: the sealed copies this node lacks, answered once its
        healer has looked (a node just started would otherwise say it lacks nothing)."""
        return self._healer.looked().addCallback(
            lambda _: encode_missing(sorted(self._healer.missing))
        )

    def refresh(self, range_ids: Sequence[str]) -> Deferred[None]:
        """Ask every live node what it lacks, and count again (at most every
        ``every_seconds``: asked more often, it does nothing)."""
        now = self._context.clock.seconds()
        if self._last is not None and now - self._last < self._every:
            return succeed(None)
        self._last = now
        return Deferred.fromCoroutine(self._refresh(range_ids))

    async def _refresh(self, range_ids: Sequence[str]) -> None:
        ctx = self._context
        peers = [
            node.node_id for node in ctx.live_nodes() if node.alive and node.node_id != ctx.node_id
        ]
        asked = [
            ctx.requester.request(node, PeerOp.COPY_HEALTH, b"")
            .addCallback(decode_missing)
            .addTimeout(ctx.settings.ack_timeout_seconds, ctx.clock)
            for node in peers
        ]
        answers = await DeferredList(asked, consumeErrors=True)
        missing = {ctx.node_id: set(self._healer.missing)}
        for node, (ok, answer) in zip(peers, answers, strict=True):
            if ok:
                missing[node] = set(answer)
            else:
                # A node that cannot say is kept at what it said last.
                missing[node] = self.missing.get(node, set())
        live = frozenset(node.node_id for node in ctx.live_nodes() if node.alive)
        if live != self._counted_live:
            recount: Collection[str] = range_ids
            self._changed.clear()
        else:
            recount = self._changed | _ranges_lacking_otherwise(self.missing, missing)
            self._changed = set()
            if not recount:
                return  # the count would come out the same
        self.missing, self._counted_live = missing, live
        await self._count(sorted(recount), missing, live)

    async def _count(
        self,
        range_ids: Sequence[str],
        missing: Mapping[str, set[SegmentKey]],
        live: frozenset[str],
    ) -> None:
        """Count ``range_ids`` again into the totals, with ``live`` the live members.

        With those the count began with, not whoever is alive as each range is read: the
        next count reads again only what changed since, taking the members as unchanged if
        they are the same as at this count's start. A node whose lease lapsed and came back
        while a count ran (a few seconds at 4,000 ranges on a busy node) otherwise left every
        range read meanwhile counted short of it until its records changed: one node of a
        soak counted 515 under-replicated segments for minutes while the others counted 0."""
        ctx = self._context
        by_range = self._by_range
        count, unavailable = self.count or 0, self.unavailable or 0
        is_live = live.__contains__
        slices = Slices(ctx.clock)
        for start in range(0, len(range_ids), _RANGES_AT_ONCE):
            await slices.next()
            for range_id in range_ids[start : start + _RANGES_AT_ONCE]:
                metas = ctx.control.segments(range_id)
                counted = (
                    under_replicated(metas, ctx.settings.replication_factor, is_live, missing),
                    unavailable_ranges(metas[-1:], ctx.settings.quorum, is_live),
                )
                was = by_range.get(range_id, (0, 0))
                by_range[range_id] = counted
                count += counted[0] - was[0]
                unavailable += counted[1] - was[1]
        self.count, self.unavailable = count, unavailable


def _ranges_lacking_otherwise(
    before: Mapping[str, set[SegmentKey]], after: Mapping[str, set[SegmentKey]]
) -> set[str]:
    """The ranges of the segments some node lacks now and did not before, or the reverse."""
    changed: set[str] = set()
    for node in before.keys() | after.keys():
        lacked, lacks = before.get(node, set()), after.get(node, set())
        if lacked != lacks:
            changed.update(range_id for range_id, _ in lacked ^ lacks)
    return changed
