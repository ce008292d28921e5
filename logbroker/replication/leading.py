"""The ranges whose active segment this node leads, as the broker reaches them.

``LeadRanges`` is the replicated counterpart of ``LocalRanges``: ``ClusterRanges`` asks it for
the handle of a range whose active segment names this node as primary, and opens (claims) the
range through it when this node does not lead it yet. A ``ReplicatedRange`` answers appends once
a quorum holds them, reads only what is committed (from this node's copy where it is trusted and
whole, else from the other copies), and wakes long polls as the commit index moves. When the
active segment reaches the roll size it is sealed and the next one opened
(``SegmentClaims.roll``); appends made meanwhile wait for the new leader.

The sweep (every half second) claims the ranges this node should lead and does not: those it is
first for (it restarted, or another replica stepped aside to it) and those whose primary died
where it is the first live replica. It looks only at the ranges whose records changed since,
that this node stopped leading or whose back-off ended, and at every range when the membership
changed and every ``FULL_SWEEP_SECONDS``. A range whose claim failed is tried again after a back-off
that doubles up to ``MAX_CLAIM_BACKOFF``, so a range that cannot be led now costs nothing but an
occasional try; one whose replica set has too few live members for a quorum is not claimed
at all (a claim bumps the epoch) until enough of them are alive again. The sweep also asks
every leader whether it still hears a quorum (CheckQuorum): one that does not steps down and
resigns, so that a replica that reaches a quorum takes over.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred, fail, gatherResults, succeed
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.broker.errors import BrokerError
from logbroker.broker.producers import ProducerTable
from logbroker.broker.ranges import Bounds, LocalRange, RangeRead
from logbroker.broker.stamped import StampedAppends
from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.errors import Reason
from logbroker.records import ProducerStamp, Records
from logbroker.replication.copies import CommittedCopies, SegmentRead, segment_read
from logbroker.replication.core import replica as rules
from logbroker.replication.core.actions import StepDown
from logbroker.replication.core.claims import live_quorum
from logbroker.replication.looks import RangesToLookAt
from logbroker.replication.primary import SegmentLeader
from logbroker.replication.replica import view_of
from logbroker.replication.stamps import recent_range_stamps
from logbroker.replication.takeover import SegmentClaims, WaitingForMembers
from logbroker.storage import OpenLogs, RangeLog

log = Logger()

#: The most claims the sweep has under way at once. A node taking over many thousands of
#: ranges otherwise fences them all at once: the fences of the last ones time out behind the
#: fsyncs of the first (and the claim, its epoch bumped, fails), and everything else on the
#: node, clients included, waits behind them. A claim holds its place until the range is led
#: (sealed and the next segment opened, when it holds records): at 256, a node taking over
#: 660 ranges did so in three waves, each waiting for the last one's seals.
MAX_SWEEP_CLAIMS = 1024
#: The most claims the sweep starts in one reactor turn; the rest go on at the next. Claims
#: that fail at once (the node lost its lease, the record changed) never fill
#: ``MAX_SWEEP_CLAIMS``: at 40,000 ranges one pass over them all held a node's reactor for
#: 2.8 s, its peer links unanswered, and its peers stopped leading with it.
CLAIMS_PER_TURN = 256
#: The most queued ranges the sweep asks whether to claim in one reactor turn (most of them,
#: in a pass over every range, are not to be claimed).
LOOKS_PER_TURN = 2048
#: How often the sweep looks at every range. In between it looks only at the ranges that may
#: have become this node's to claim: their records changed, this node stopped leading them, or
#: their back-off ended; and at every range when the membership changed. At thousands of ranges,
#: looking at each twice a second took a tenth of an idle node's time.
FULL_SWEEP_SECONDS = 5.0
#: The first wait before a failed claim of a range is tried again, and the longest.
FIRST_CLAIM_BACKOFF = 0.5
MAX_CLAIM_BACKOFF = 8.0


class ReplicatedRange:
    """A range this node leads: ``leader`` leads its active segment."""

    def __init__(
        self,
        range_id: str,
        range_log: RangeLog,
        claims: SegmentClaims,
        copies: CommittedCopies,
        roll_bytes: int,
        on_not_leading: Callable[[str], None] = lambda range_id: None,
        on_led: Callable[[SegmentLeader], None] = lambda leader: None,
    ) -> None:
        self._range_id = range_id
        self._on_led = on_led
        self._log = range_log
        self._claims = claims
        self._copies = copies
        self._roll_bytes = roll_bytes
        #: Told (with the range id) when this node may have stopped leading the range: a leader
        #: stopped, or a roll failed.
        self._on_not_leading = on_not_leading
        self._reads = LocalRange(range_id, range_log)
        self._stamped = StampedAppends(ProducerTable())
        self.leader: SegmentLeader | None = None
        #: The roll under way, if any: appends wait for the leader of the next segment.
        self._rolling: Deferred[Any] | None = None

    @property
    def range_id(self) -> str:
        return self._range_id

    @property
    def range_log(self) -> RangeLog:
        return self._log

    def leads(self, meta: SegmentMeta | None) -> bool:
        """Whether this node still leads the range, as the control plane has it now (or is
        rolling it: appends wait for the roll, and go to the next segment's leader or fail
        with the roll)."""
        if self._rolling is not None:
            return True
        leader = self.leader
        return (
            self._leading()
            and leader is not None
            and meta is not None
            and meta.base_offset == leader.segment
            and meta.epoch == leader.epoch
        )

    def _leading(self) -> bool:
        """Whether a leader of this node's leads the range now: a stopped one (the lease lost,
        the range claimed by another node) knows nothing more. A roll under way does not
        count: its leader may have stopped while etcd was out of reach, and the seal it waits
        to record may lose to the other nodes' takeover."""
        leader = self.leader
        return leader is not None and not leader.stopped

    def use_producers(self, producers: ProducerTable) -> None:
        """Dedupe stamped appends with ``producers`` from now on (rebuilt from the log after a
        claim). Appends taken before settle on the table they started with."""
        self._stamped = StampedAppends(producers)

    def led_by(self, leader: SegmentLeader) -> None:
        self.leader = leader
        self._on_led(leader)
        self.committed(leader.commit)

    def committed(self, _: int) -> None:
        """The commit index moved: wake the long polls it passed."""
        self._reads.wake()

    def refusal(self, count: int) -> BrokerError | None:
        if self._rolling is not None:
            return None
        if self.leader is None:
            return BrokerError(Reason.UNREACHABLE, f"{self._range_id} is not led here yet")
        return self.leader.refusal(count)

    def append(self, records: Records, stamp: ProducerStamp | None = None) -> Deferred[None]:
        return self._stamped.append(records, stamp, self._store)

    def _store(self, records: Records, stamp: ProducerStamp | None) -> Deferred[object]:
        if self._rolling is not None:
            waiting: Deferred[object] = Deferred()

            def rolled(_: object) -> None:
                # Returns nothing: a Deferred returned here would hold every append waiting
                # after this one until this one commits (they went on one at a time, one
                # replication round trip each, for up to a second after every roll).
                self._store(records, stamp).chainDeferred(waiting)

            self._rolling.addBoth(rolled)
            return waiting
        leader = self.leader
        if leader is None:
            unled = BrokerError(Reason.UNREACHABLE, f"{self._range_id} is not led here yet")
            return fail(unled)
        appended = leader.append(records, stamp)
        if self._log.active_bytes >= self._roll_bytes and not leader.stopped:
            self._roll(leader)
        return appended  # type: ignore[return-value]

    def roll(self) -> bool:
        """Seal the active segment and open the next (on the live nodes), unless a roll is
        under way or the segment holds nothing yet; whether a roll started."""
        leader = self.leader
        if leader is None or leader.stopped or self._rolling is not None:
            return False
        if leader.written == leader.segment:
            return False
        self._roll(leader)
        return True

    def _roll(self, leader: SegmentLeader) -> None:
        rolled = self._claims.roll(leader, self.committed, self._stepped_down)
        # Fires once the roll is over, either way: appends waiting for it go on then (set
        # before the callback, which clears it, in case the roll is over at once).
        self._rolling = rolled
        rolled.addBoth(self._rolled, leader)

    def _rolled(self, outcome: SegmentLeader | Failure, leader: SegmentLeader) -> None:
        self._rolling = None
        if isinstance(outcome, SegmentLeader):
            self.led_by(outcome)
            return
        log.warn(
            "Rolling {range_id} failed: {error}",
            range_id=self._range_id,
            error=outcome.getErrorMessage(),
        )
        leader.step_down(BrokerError(Reason.NOT_PRIMARY, f"rolling {self._range_id} failed"))
        self._on_not_leading(self._range_id)

    def _stepped_down(self, leader: SegmentLeader, step: StepDown) -> None:
        """A leader of this range stopped; one that gave up for want of a quorum resigns."""
        self._on_not_leading(self._range_id)
        if not step.resign:
            return
        self._claims.resign(leader, step.message).addErrback(
            lambda failure: log.warn(
                "Resigning {range_id} failed: {error}",
                range_id=self._range_id,
                error=failure.getErrorMessage(),
            )
        )

    def bounds(self) -> Deferred[Bounds]:
        """To the commit index, which may be past this copy's durable end: a quorum of the
        replicas can hold records durably before the primary does, and their copies then serve
        them as committed. A consumer with a cursor read there is not past the range's end; its
        reads here find the records once this copy holds them (a long poll wakes then).

        Only while this node leads the range does it know where the range ends. Once its
        leader stopped (it lost its lease, or another node claimed the range), even with a
        roll still waiting for etcd, the commit index is the last one it knew: the range may
        have gone on elsewhere, and a node back from a partition whose view of etcd still
        names it the primary must not tell a consumer that a cursor read on another node is
        past the end."""
        log = self._log
        return succeed(Bounds(log.start_offset, log.committed_offset, end_known=self._leading()))

    def read(self, offset: int, max_records: int, max_bytes: int) -> Deferred[RangeRead]:
        """Committed records from ``offset``, within one segment: from this node's copy where
        it is trusted and whole, else from the other copies (a node holds only the segments
        whose replica sets name it, and a copy may be short until healing fetches it)."""
        plan = segment_read(self._claims.segments(self._range_id), offset, max_records)
        found = plan.segment
        if found is None:
            return plan.nothing()
        # The active segment is the one this node leads: its copy is the complete one.
        end = found.base_offset + (found.record_count or 0)
        node_id = self._claims.context.node_id
        if found.state is SegmentState.ACTIVE:
            return self._reads.read(plan.offset, plan.max_records, max_bytes)
        if rules.holds_whole(view_of(self._log, found.base_offset), found, node_id, end):
            reading = self._reads.read(plan.offset, plan.max_records, max_bytes)
            return reading.addCallback(self._unless_damaged, found, plan, max_bytes)
        return self._copies.read(self._range_id, plan.offset, plan.max_records, max_bytes)

    def _unless_damaged(
        self, read: RangeRead, found: SegmentMeta, plan: SegmentRead, max_bytes: int
    ) -> RangeRead | Deferred[RangeRead]:
        """A read of this node's sealed copy that found nothing (it met damage, and the copy is
        now known damaged and being repaired; or the copy's files are gone) goes on from the
        other copies: a sealed segment's records end where it was sealed, never at the damage."""
        if read.count:
            return read  # the next read, from where this one ends, goes to the other copies
        # Nothing, below a sealed segment's end: this copy cannot serve it (damaged, or its
        # files gone from under the node); the others can.
        return self._copies.read(self._range_id, plan.offset, plan.max_records, max_bytes)

    def wait(self, offset: int, wait_ms: int) -> Deferred[None]:
        return self._reads.wait(offset, wait_ms)


@attrs.define
class _Backoff:
    #: When the range may be claimed again, and how long the next wait is.
    until: float
    delay: float
    #: The claim was not made for want of live replicas: tried again as soon as enough are
    #: alive, whatever the wait.
    waiting_for_members: bool = False


class LeadRanges:
    """The ``RangeDirectory`` of the ranges this node leads (``ClusterRanges`` asks it only for
    ranges whose active segment names this node first)."""

    def __init__(
        self, storage: OpenLogs, claims: SegmentClaims, copies: CommittedCopies, roll_bytes: int
    ) -> None:
        self._storage = storage
        self._claims = claims
        self._copies = copies
        self._roll_bytes = roll_bytes
        self._handles: dict[str, ReplicatedRange] = {}
        #: Claims under way, one per range, and who waits for each.
        self._claiming: dict[str, list[Deferred[None]]] = {}
        #: Ranges whose last claim failed: not claimed again before ``until``.
        self._backoff: dict[str, _Backoff] = {}
        #: Ranges the sweeps found to look at, not looked at yet (whether to claim each is
        #: asked when its turn comes), and the same as a set.
        self._to_claim: collections.deque[str] = collections.deque()
        self._queued: set[str] = set()
        #: The ranges whose claims the sweep started, taken over from each dead primary: one
        #: log line for them all once every queued claim has started (a node takes over
        #: thousands at once, a turn's worth at a time; each claim logs its own line once
        #: fenced).
        self._taken_over: collections.Counter[str] = collections.Counter()
        #: The leaders made here, by replica set (weakly: a leader goes once its range's
        #: handle has another, or none), for ``_check_quorums``.
        self._leaders_by_set: dict[tuple[str, ...], weakref.WeakSet[SegmentLeader]] = {}
        #: Claims that failed since the last were reported: ``(range id, error)``.
        self._failed_claims: list[tuple[str, str]] = []
        #: The next reactor turn's go at the claims still queued (see ``_claim_more``).
        self._next_turn: IDelayedCall | None = None
        ctx = claims.context
        #: What the sweep looks at: besides the ranges whose records changed, those this
        #: node stopped leading, and those whose back-off ended.
        self._looks = RangesToLookAt(ctx.control, ctx.clock, ctx.live_nodes, FULL_SWEEP_SECONDS)

    def handle(self, range_id: str) -> ReplicatedRange:
        handle = self._handles.get(range_id)
        if handle is None or not handle.leads(self._claims.active(range_id)):
            raise BrokerError(Reason.UNREACHABLE, f"range {range_id} is not led here yet")
        return handle

    def leading(
        self, where: Callable[[SegmentLeader], bool] = lambda leader: True
    ) -> list[ReplicatedRange]:
        """The ranges this node leads, as the control plane has it now; only those whose
        leader passes ``where`` (asked first: cheaper than the control plane's record)."""
        return [
            h
            for h in self._handles.values()
            if h.leader is not None and where(h.leader) and h.leads(self._claims.active(h.range_id))
        ]

    def claiming(self, range_id: str) -> bool:
        """Whether a claim of ``range_id`` is under way."""
        return range_id in self._claiming

    def claims_under_way(self) -> int:
        """How many claims are under way, the sweep's and those asked for."""
        return len(self._claiming)

    def sweep_pending(self) -> bool:
        """Whether the sweep has ranges queued to look at (claims it may still start)."""
        return bool(self._to_claim)

    def prepare(self, range_id: str) -> Deferred[None]:
        """Claim one range before its first use; fails with why it cannot be led now."""
        return self._claim(range_id)

    def open(self, range_ids: Sequence[str]) -> Deferred[None]:
        """Claim the ranges (at start-up, or for a new topic), as far as it goes now: a range
        that cannot be claimed yet (no quorum answers while the cluster starts) is claimed at
        its first use or by the sweep, so it does not fail the whole."""
        claims = [
            self._claim(range_id).addErrback(self._claim_failed, range_id) for range_id in range_ids
        ]
        return gatherResults(claims).addCallback(lambda _: None)

    def _claim(self, range_id: str) -> Deferred[None]:
        waiter: Deferred[None] = Deferred()
        waiting = self._claiming.get(range_id)
        if waiting is not None:
            waiting.append(waiter)
            return waiter
        ctx = self._claims.context
        if not ctx.control_follows():
            return fail(
                BrokerError(
                    Reason.UNREACHABLE,
                    f"range {range_id} is not claimed while this node's view of the control"
                    " plane catches up with etcd",
                )
            )
        backoff = self._backoff.get(range_id)
        if backoff is not None and not self._may_claim(range_id):
            if backoff.waiting_for_members:
                return fail(
                    BrokerError(
                        Reason.NO_QUORUM,
                        f"range {range_id} is not led: too few members of its replica set are"
                        " alive; it is claimed once enough of them are back",
                    )
                )
            return fail(
                BrokerError(
                    Reason.UNREACHABLE,
                    f"range {range_id} could not be claimed a moment ago; it is tried again in "
                    f"{backoff.until - ctx.clock.seconds():.1f} s",
                )
            )
        self._claiming[range_id] = [waiter]
        opened = self._storage.logs.get(range_id)
        ready = succeed(opened) if opened is not None else self._storage.open_range(range_id)

        def claim(range_log: RangeLog) -> Deferred[SegmentLeader]:
            handle = self._handles.get(range_id)
            if handle is None or handle.range_log is not range_log:
                handle = self._handles[range_id] = ReplicatedRange(
                    range_id,
                    range_log,
                    self._claims,
                    self._copies,
                    self._roll_bytes,
                    on_not_leading=self._looks.add,
                    on_led=self._led,
                )
            if handle.leader is not None:
                handle.leader.step_down(
                    BrokerError(Reason.NOT_PRIMARY, f"{range_id} is being claimed anew")
                )
            claiming = self._claims.claim(range_id, handle.committed, handle._stepped_down)
            return claiming.addCallback(self._claimed, handle)

        ready.addCallback(claim).addBoth(self._settled, range_id)
        return waiter

    def _claimed(self, leader: SegmentLeader, handle: ReplicatedRange) -> Deferred[SegmentLeader]:
        # The claim left this copy of the active segment complete up to the longest end of a
        # quorum: with the segments before it (read from other copies where this node holds
        # none), its stamps are those of every recent produce the range may have stored. The
        # new leader takes appends only once its table knows them.
        def rebuilt(found: list[tuple[ProducerStamp, int, int]]) -> SegmentLeader:
            handle.use_producers(ProducerTable.rebuild(found))
            handle.led_by(leader)
            return leader

        def unread(failure: Failure) -> Failure:
            leader.step_down(
                BrokerError(
                    Reason.UNREACHABLE,
                    f"{handle.range_id}: the producer stamps in its log could not be read "
                    f"back ({failure.getErrorMessage()})",
                )
            )
            return failure

        stamps = recent_range_stamps(self._claims.context, handle.range_log, handle.range_id)
        return stamps.addCallbacks(rebuilt, unread)

    def _settled(self, outcome: object, range_id: str) -> None:
        now = self._claims.context.clock.seconds()
        if isinstance(outcome, Failure):
            previous = self._backoff.get(range_id)
            delay = FIRST_CLAIM_BACKOFF if previous is None else previous.delay * 2
            delay = min(delay, MAX_CLAIM_BACKOFF)
            self._backoff[range_id] = _Backoff(
                now + delay,
                delay,
                waiting_for_members=isinstance(outcome.value, WaitingForMembers),
            )
        else:
            self._backoff.pop(range_id, None)
        for waiter in self._claiming.pop(range_id):
            if isinstance(outcome, Failure):
                waiter.errback(outcome)
            else:
                waiter.callback(None)
        # A claim ended: the sweep's next may start, at the next reactor turn. Not at once: a
        # lost peer link fails every claim waiting on it in one turn, and each starting up to
        # CLAIMS_PER_TURN more (which failed too) kept a restarted node's reactor busy for
        # seconds at 40,000 ranges.
        self._claim_next_turn()

    def sweep(self, range_ids: Sequence[str]) -> None:
        """Claim the ranges among ``range_ids`` this node should lead and does not, and check
        that every leader still hears a quorum (run periodically: no request needs to come
        first)."""
        ctx = self._claims.context
        if not ctx.holds_lease():
            self.stop()
            self._looks.everything()
            return
        ctx.parked.resume_live(ctx.is_live)
        self._check_quorums()
        if not ctx.control_follows():
            self._looks.everything()
            return
        # Whether to claim each is asked as the queue is worked through, a slice per reactor
        # turn (``_claim_more``): a pass over every range (every five seconds, and whenever
        # the membership changes) asked it of 40,000 ranges in one turn.
        fresh = [
            r for r in self._looks.take(range_ids, self._backoffs_ended) if r not in self._queued
        ]
        self._queued.update(fresh)
        self._to_claim.extend(fresh)
        self._claim_more()

    def _backoffs_ended(self) -> Iterable[str]:
        now = self._claims.context.clock.seconds()
        return [
            range_id
            for range_id, backoff in self._backoff.items()
            if not backoff.waiting_for_members and now >= backoff.until
        ]

    def _led(self, leader: SegmentLeader) -> None:
        self._leaders_by_set.setdefault(leader.replicas, weakref.WeakSet()).add(leader)

    def _check_quorums(self) -> None:
        """Ask every leader whether it still hears a quorum; only those whose replica set the
        peer links do not vouch for on their own: a link that heard from a replica lately
        answers for every leader of it (most of a node's thousands of leaders share a handful
        of replica sets, so the sets are looked at, not each leader)."""
        ctx = self._claims.context
        quorum = ctx.settings.quorum
        for replicas, leaders in list(self._leaders_by_set.items()):
            if not leaders:
                del self._leaders_by_set[replicas]
                continue
            reached = 1 + sum(1 for node in replicas[1:] if ctx.heard_recently(node))
            if reached >= quorum:
                continue
            # In a stable order (a weak set's is its members' addresses'): the simulation
            # replays a seed's run exactly.
            for leader in sorted(leaders, key=lambda leader: (leader.range_id, leader.segment)):
                if not leader.stopped:
                    leader.check_quorum(ctx.heard_at)

    def _should_claim(self, range_id: str) -> bool:
        """Whether this node should claim the range now, unasked: it is first in the active
        segment's replica set, or the primary is dead and this node is the first live member;
        and it does not lead it, nor claims it, nor waits to try again."""
        meta = self._claims.active(range_id)
        if meta is None or range_id in self._claiming:
            return False
        handle = self._handles.get(range_id)
        if handle is not None and handle.leads(meta):
            return False
        first = meta.replicas[0] == self._claims.context.node_id
        return (first or self._claims.should_take_over(meta)) and self._may_claim(range_id)

    def _claim_more(self) -> None:
        """Start the sweep's claims while fewer than ``MAX_SWEEP_CLAIMS`` are under way: the
        next starts (at the next reactor turn) as one ends. Claims a client asks for
        (``prepare``) go at once, ahead of these."""
        self._report_failed_claims()
        taken_over = self._taken_over
        started = looked_at = 0
        while self._to_claim and len(self._claiming) < MAX_SWEEP_CLAIMS:
            if started == CLAIMS_PER_TURN or looked_at == LOOKS_PER_TURN:
                self._claim_next_turn()
                break
            looked_at += 1
            range_id = self._to_claim.popleft()
            self._queued.discard(range_id)
            if not self._should_claim(range_id):
                continue
            started += 1
            meta = self._claims.active(range_id)
            assert meta is not None
            if meta.replicas[0] != self._claims.context.node_id:
                taken_over[meta.replicas[0]] += 1
            self._claim(range_id).addErrback(self._claim_failed, range_id)
        if self._to_claim:
            return  # said once all are started
        for primary, count in sorted(taken_over.items()):
            log.info(
                "Taking over {count} ranges whose primary, {primary}, is dead",
                count=count,
                primary=primary,
            )
        taken_over.clear()

    def _claim_next_turn(self) -> None:
        if self._next_turn is None or not self._next_turn.active():
            clock = self._claims.context.clock
            self._next_turn = clock.callLater(0, self._claim_more)

    def _may_claim(self, range_id: str) -> bool:
        backoff = self._backoff.get(range_id)
        if backoff is None:
            return True
        ctx = self._claims.context
        if backoff.waiting_for_members:
            # Tried again only once something changed: enough members are back.
            meta = self._claims.active(range_id)
            return meta is not None and live_quorum(meta, ctx.is_live, ctx.settings.quorum)
        return ctx.clock.seconds() >= backoff.until

    def _claim_failed(self, failure: Failure, range_id: str) -> None:
        error = failure.getErrorMessage()
        log.debug("Claiming {range_id} failed: {error}", range_id=range_id, error=error)
        if not self._failed_claims:
            self._claim_next_turn()  # reported there
        self._failed_claims.append((range_id, error))

    def _report_failed_claims(self) -> None:
        """One line for the claims that failed since the last: a node that lost its lease or a
        peer fails thousands at once, and a line each took a sixth of its time."""
        failed, self._failed_claims = self._failed_claims, []
        if len(failed) == 1:
            log.warn(
                "Claiming {range_id} failed: {error}", range_id=failed[0][0], error=failed[0][1]
            )
        elif failed:
            log.warn(
                "Claiming {count} ranges failed, {range_id} first: {error}",
                count=len(failed),
                range_id=failed[0][0],
                error=failed[0][1],
            )

    def stop(self) -> None:
        """Stop leading every range (the node stops, or lost its lease)."""
        # Claimed again from a pass over every range once the lease is back (and the claims
        # started before are not said to be taking anything over).
        self._to_claim.clear()
        self._queued.clear()
        self._taken_over.clear()
        why = BrokerError(Reason.UNREACHABLE, "this node stopped leading its ranges")
        leaders = [
            handle.leader
            for handle in self._handles.values()
            if handle.leader is not None and not handle.leader.stopped
        ]
        if leaders:
            # One line for them all, not one per leader: tens of thousands at scale.
            log.info("No longer leading {count} ranges: {why}", count=len(leaders), why=str(why))
        for leader in leaders:
            leader.step_down(why, logged=True)
