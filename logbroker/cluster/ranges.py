"""The ``RangeDirectory`` of a cluster node: each range is served where its active segment lives.

The control plane records every segment's replica set; the first member is the primary. This
node serves the ranges whose active segment it leads (``local``: ``LocalRanges`` at replication
factor 1, ``LeadRanges`` above it, see ``logbroker.cluster.assembly``) and reaches every other
range through a forwarder to its primary (``forward``). A new range's first
segment is placed by the placement planner over the live nodes when the range is opened, and
recorded in the control plane; the node whose turn it is to create it and the nodes racing it
agree, since placement is a pure function of the membership every node sees, and the control
plane takes only one record of a segment.

With replication factor 1 a range's active segment stays on its primary for good: a dead
primary's ranges answer ``unreachable`` until it returns. Above it, the first live replica takes
a dead primary's segments over (``logbroker.replication.takeover``). A node that
holds no membership lease (etcd has not answered it for a lease TTL) acts as no range's primary
(``unreachable``: retry later) until it registers again: it cannot know whether another node
took over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

from twisted.internet.defer import Deferred, fail, gatherResults, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import Bounds, RangeDirectory, RangeHandle, RangeRead
from logbroker.controlplane import (
    ControlPlane,
    ControlPlaneError,
    SegmentMeta,
    SegmentState,
)
from logbroker.errors import Reason
from logbroker.placement import PlacementNode, PlacementRule, place, segment_key
from logbroker.records import ProducerStamp, Records

log = Logger()

_T = TypeVar("_T")


class LedRanges(RangeDirectory, Protocol):
    """The ranges this node leads (``LocalRanges``, ``LeadRanges``): ``open`` readies many at
    once (at start-up, for a new topic) as far as it can; ``prepare`` readies one before its
    first use, failing with why it cannot be served yet."""

    def prepare(self, range_id: str) -> Deferred[None]: ...


#: ``(primary node id, range id)`` -> a handle reaching the range on that node.
Forwarder = Callable[[str, str], RangeHandle]


class CommittedReads(Protocol):
    """Reads of a range's committed records without its primary (``CommittedCopies``)."""

    def read(
        self, range_id: str, offset: int, max_records: int, max_bytes: int
    ) -> Deferred[RangeRead]: ...

    def bounds(self, range_id: str) -> Deferred[Bounds]: ...

    def wait(self, offset: int, wait_ms: int) -> Deferred[None]: ...


#: Why a range's primary may not serve it while its copies still can.
_PRIMARY_LOST = frozenset({Reason.UNREACHABLE, Reason.NO_QUORUM})
#: Why a read asked of the range's primary goes to its copies instead: besides a lost primary,
#: one that no longer leads the range (its leadership moved after this node looked, as when a
#: range goes back to its preferred leader): the copies hold every committed record all the
#: same, and the reader is not failed for a move it cannot see.
_READ_FROM_COPIES = _PRIMARY_LOST | {Reason.NOT_PRIMARY}


class ClusterRanges:
    def __init__(
        self,
        node_id: str,
        control: ControlPlane,
        local: LedRanges,
        forward: Forwarder,
        live_nodes: Callable[[], Iterable[PlacementNode]],
        rule: PlacementRule,
        holds_lease: Callable[[], bool] = lambda: True,
        copies: CommittedReads | None = None,
    ) -> None:
        self.node_id = node_id
        #: Where reads go when a range's primary cannot serve them (with replication).
        self._copies = copies
        self._control = control
        self._local = local
        self._forward = forward
        self._live_nodes = live_nodes
        self._rule = rule
        self._holds_lease = holds_lease
        #: Ranges that must be placed or opened before their first use, and their handle
        #: meanwhile: one per range, so that what waits for it goes on in order.
        self._later: dict[str, _Later] = {}

    def primary(self, range_id: str) -> str | None:
        """The node leading the range, if its first segment is placed: the primary of its last
        segment. With replication factor 1 a range's next segment stays on the node that
        sealed the last one, so between a seal and the record of the next active segment (two
        changes) the range still has its primary."""
        last = self._control.last_segment(range_id)
        return last.replicas[0] if last is not None else None

    def handle(self, range_id: str) -> RangeHandle:
        """The range's handle; with replication, its reads go to the live copies of its
        segments whenever its primary cannot serve them (``unreachable``, ``no_quorum``)."""
        if self._copies is None:
            return self.route(range_id)
        try:
            return _PrimaryOrCopies(range_id, self.route(range_id), self._copies)
        except BrokerError as error:
            if error.reason not in _PRIMARY_LOST:
                raise
            return _PrimaryOrCopies(range_id, error, self._copies)

    def route(self, range_id: str) -> RangeHandle:
        """The handle of the range's primary, wherever it is."""
        primary = self.primary(range_id)
        if primary is None:
            # Its topic is created but its first segment not placed (the creating node stopped
            # in between, or the record failed): place it now, then serve it.
            return self._when_ready(range_id, self._place)
        if primary != self.node_id:
            return self._forward(primary, range_id)
        if not self._holds_lease():
            # Another node may have taken over meanwhile: this one cannot know, so it stops
            # acting as the primary until it holds a lease again.
            raise BrokerError(
                Reason.UNREACHABLE,
                f"this node ({self.node_id}) holds no membership lease, so it does not act as"
                f" the primary of {range_id} until etcd answers again",
            )
        try:
            handle = self._local.handle(range_id)
        except BrokerError:
            # Placed here by another node (it created the topic): open it on first use.
            return self._when_ready(range_id, self._local.prepare)
        self._later.pop(range_id, None)
        return handle

    def _when_ready(self, range_id: str, prepare: Callable[[str], Deferred[None]]) -> _Later:
        """The range's one waiting handle, until ``prepare`` has made it ready."""
        later = self._later.get(range_id)
        if later is None:

            def ready() -> Deferred[RangeHandle]:
                return prepare(range_id).addCallback(self._again, range_id)

            later = self._later[range_id] = _Later(range_id, ready)
        return later

    def _again(self, _: object, range_id: str) -> RangeHandle | Deferred[RangeHandle]:
        """The range's handle once one step is done; the next step's if there is one (a range
        placed here must still be opened)."""
        self._later.pop(range_id, None)
        handle = self.route(range_id)
        return handle.ready() if isinstance(handle, _Later) else handle

    def led_here(self) -> LedHere:
        """The ranges this node leads, for the peers' requests: a range led elsewhere is
        refused (``not_primary``) rather than forwarded on, so two nodes that disagree about a
        primary for a moment can never bounce a request between them."""
        return LedHere(self)

    def open(self, range_ids: Sequence[str]) -> Deferred[None]:
        """Place every range that has no active segment yet, then open the ones led here."""
        placed = [self._place(range_id) for range_id in range_ids]

        def open_ours(_: object) -> Deferred[None]:
            ours = [r for r in range_ids if self.primary(r) == self.node_id]
            return self._local.open(ours)

        return gatherResults(placed, consumeErrors=True).addCallback(open_ours)

    def _place(self, range_id: str) -> Deferred[None]:
        if self._control.segments(range_id):
            return succeed(None)
        placement = place(segment_key(range_id, 0), self._live_nodes(), self._rule)
        meta = SegmentMeta(range_id, 0, SegmentState.ACTIVE, None, None, placement.replicas, 0)

        def lost_race(failure: Failure) -> None:
            # Another node recorded the segment first: its record stands.
            recorded = bool(self._control.segments(range_id))
            if not (isinstance(failure.value, ControlPlaneError) and recorded):
                failure.raiseException()

        return self._control.put_segment(meta).addErrback(lost_race)


class LedHere:
    """The ``RangeDirectory`` of the ranges ``ranges`` leads on this node."""

    def __init__(self, ranges: ClusterRanges) -> None:
        self._ranges = ranges

    def handle(self, range_id: str) -> RangeHandle:
        primary = self._ranges.primary(range_id)
        if primary != self._ranges.node_id:
            raise BrokerError(
                Reason.NOT_PRIMARY,
                f"range {range_id} is led by {primary or 'no node yet'}, not by this node",
            )
        return self._ranges.route(range_id)

    def open(self, range_ids: Sequence[str]) -> Deferred[None]:
        return self._ranges.open(range_ids)


class _Later:
    """A range that needs something done before its first use (opened here, or placed): what
    asks for it meanwhile waits, in order, then goes to the handle ``ready`` gives."""

    def __init__(self, range_id: str, ready: Callable[[], Deferred[RangeHandle]]) -> None:
        self._range_id = range_id
        self.ready = ready

    @property
    def range_id(self) -> str:
        return self._range_id

    def refusal(self, count: int) -> BrokerError | None:
        return None

    def append(self, records: Records, stamp: ProducerStamp | None = None) -> Deferred[None]:
        return self.ready().addCallback(lambda handle: handle.append(records, stamp))

    def bounds(self) -> Deferred[Bounds]:
        return self.ready().addCallback(lambda handle: handle.bounds())

    def read(self, offset: int, max_records: int, max_bytes: int) -> Deferred[RangeRead]:
        return self.ready().addCallback(lambda handle: handle.read(offset, max_records, max_bytes))

    def wait(self, offset: int, wait_ms: int) -> Deferred[None]:
        return self.ready().addCallback(lambda handle: handle.wait(offset, wait_ms))


class _PrimaryOrCopies:
    """A range as its primary serves it (or why it cannot), with reads that fall back on the
    committed records of its copies while the primary cannot serve them. Appends go to the
    primary only: without one they are refused with its error."""

    def __init__(
        self, range_id: str, primary: RangeHandle | BrokerError, copies: CommittedReads
    ) -> None:
        self._range_id = range_id
        self._primary = primary
        self._copies = copies
        #: Whether a read went to the copies: then so do the long poll's waits, since a lost
        #: primary's wait ends at once, and the fetch would read again and again meanwhile.
        self._lost = isinstance(primary, BrokerError)

    @property
    def range_id(self) -> str:
        return self._range_id

    def refusal(self, count: int) -> BrokerError | None:
        if isinstance(self._primary, BrokerError):
            return self._primary
        return self._primary.refusal(count)

    def append(self, records: Records, stamp: ProducerStamp | None = None) -> Deferred[None]:
        if isinstance(self._primary, BrokerError):
            return fail(self._primary)
        return self._primary.append(records, stamp)

    def bounds(self) -> Deferred[Bounds]:
        if isinstance(self._primary, BrokerError):
            return self._copies.bounds(self._range_id)
        return self._primary.bounds().addErrback(
            self._unless_lost, lambda: self._copies.bounds(self._range_id)
        )

    def read(self, offset: int, max_records: int, max_bytes: int) -> Deferred[RangeRead]:
        def from_copies() -> Deferred[RangeRead]:
            return self._copies.read(self._range_id, offset, max_records, max_bytes)

        if isinstance(self._primary, BrokerError):
            return from_copies()
        return self._primary.read(offset, max_records, max_bytes).addErrback(
            self._unless_lost, from_copies
        )

    def wait(self, offset: int, wait_ms: int) -> Deferred[None]:
        if self._lost or isinstance(self._primary, BrokerError):
            return self._copies.wait(offset, wait_ms)
        return self._primary.wait(offset, wait_ms)

    def _unless_lost(self, failure: Failure, instead: Callable[[], Deferred[_T]]) -> Deferred[_T]:
        """Go to the copies if the primary could not serve the request; fail otherwise."""
        error = failure.value
        if not isinstance(error, BrokerError) or error.reason not in _READ_FROM_COPIES:
            failure.raiseException()
        self._lost = True
        log.debug(
            "Reading {range_id} from its copies: {error}", range_id=self._range_id, error=str(error)
        )
        return instead()
