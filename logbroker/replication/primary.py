"""The primary of one active segment, driven: ``SegmentLeader`` carries out what its sans-IO
``LeaderCore`` (``logbroker.replication.core.leader``, where every rule is written down)
decides, and tells it what happened.

It appends through the range's log (``RangeLog.write`` assigns the offsets and hands back the
stored bytes at once), sends the core's replicate messages over the peer link, reads the local
log back when a replica needs bytes the backlog dropped, answers appends as the core says, and
keeps one timer at the core's next deadline. Sends are flushed once per reactor turn, so that
the turn's appends go out as one message per replica.

A replica the core parks (dead in the membership) is registered with ``ParkedReplicas``, shared
by every leader of the node: ``resume_live`` (run by the sweep) sends each parked replica's
leaders ``member_back`` once the membership has it alive again, a thousand leaders at each
sweep.

A node that has lost its membership lease leads nothing: before carrying out anything, the
leader checks the lease, and if it is gone the core stops first (nothing it meant to send goes
out). A leader that stopped tells ``on_step_down`` (which resigns the segment when the core
asks to).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

from twisted.internet.defer import CancelledError, Deferred, fail
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.broker.errors import BrokerError, InDoubtError
from logbroker.errors import Reason
from logbroker.peer.frames import PeerOp
from logbroker.peer.requester import PeerRequester
from logbroker.records import ProducerStamp, Records
from logbroker.replication.core.actions import (
    Acknowledge,
    Action,
    Commit,
    Park,
    ReadBack,
    Refuse,
    ReplicationSettings,
    Send,
    Settle,
    StepDown,
)
from logbroker.replication.core.leader import LeaderCore
from logbroker.replication.core.quorum import CopyEnd
from logbroker.replication.replica_codec import CopyStatus, decode_status, encode_replicate
from logbroker.storage import Appended, FencedError, OverloadedError, RangeLog, StorageError
from logbroker.transcode import storable

log = Logger()


def _ignore_step_down(leader: SegmentLeader, step: StepDown) -> None:
    pass


#: The most leaders ``ParkedReplicas.resume_live`` tells at one call (the sweep's, twice a
#: second) that a node is back. All at once, 17,000 leaders on each survivor of a
#: 10,000-topic cluster sent the restarted node what it lacked in one go, and the survivors
#: could not answer their own lease keepalives for the next five seconds.
RESUMED_AT_ONCE = 1000


class ParkedReplicas:
    """The leaders that parked a dead replica, by node: told when it is back."""

    def __init__(self) -> None:
        self._leaders: dict[str, dict[SegmentLeader, None]] = {}
        #: Nodes back alive whose leaders are being told, a share at each call.
        self._resuming: set[str] = set()

    def park(self, leader: SegmentLeader, node: str) -> None:
        waiting = self._leaders.get(node)
        if waiting is None:
            waiting = self._leaders[node] = {}
            log.info(
                "The leaders here wait for {node}, dead in the membership: it is sent what it"
                " lacks once it is alive again",
                node=node,
            )
        waiting[leader] = None

    def forget(self, leader: SegmentLeader) -> None:
        """``leader`` stopped: it waits for no one."""
        for node in leader.replicas:
            waiting = self._leaders.get(node)
            if waiting is not None:
                waiting.pop(leader, None)
                if not waiting:
                    del self._leaders[node]

    def nodes(self) -> list[str]:
        """The nodes some leader waits for."""
        return list(self._leaders)

    def resume_live(self, is_live: Callable[[str], bool], at_most: int = RESUMED_AT_ONCE) -> None:
        """Tell the leaders of every parked node that is alive now that it is back: at most
        ``at_most`` of each node's leaders, the others at the next calls."""
        # One that died again (or whose leaders all stopped) is said to be back anew.
        self._resuming = {
            node for node in self._resuming if node in self._leaders and is_live(node)
        }
        for node in [node for node in self._leaders if is_live(node)]:
            waiting = self._leaders[node]
            if node not in self._resuming:
                self._resuming.add(node)
                log.info(
                    "{node} is alive again: {count} leaders here send it what it lacks",
                    node=node,
                    count=len(waiting),
                )
            for leader in list(itertools.islice(waiting, at_most)):
                del waiting[leader]
                leader.member_back(node)
            if not waiting:
                del self._leaders[node]
                self._resuming.discard(node)


class SegmentLeader:
    """Leads segment ``segment`` of ``range_id`` at ``epoch`` (see ``LeaderCore``)."""

    def __init__(
        self,
        *,
        node_id: str,
        range_id: str,
        segment: int,
        epoch: int,
        replicas: Sequence[str],
        range_log: RangeLog,
        copies: Mapping[str, CopyEnd],
        requester: PeerRequester,
        clock: IReactorTime,
        settings: ReplicationSettings,
        is_live: Callable[[str], bool],
        on_commit: Callable[[int], None],
        parked: ParkedReplicas,
        holds_lease: Callable[[], bool] = lambda: True,
        on_step_down: Callable[[SegmentLeader, StepDown], None] = _ignore_step_down,
        data_epoch: int | None = None,
    ) -> None:
        self._core = LeaderCore(
            node_id=node_id,
            range_id=range_id,
            segment=segment,
            epoch=epoch,
            data_epoch=data_epoch,
            replicas=replicas,
            copies=copies,
            settings=settings,
            now=clock.seconds(),
        )
        self.range_id = range_id
        self.segment = segment
        self.epoch = epoch
        #: The epoch of the primary whose records the segment holds (``LeaderCore``).
        self.data_epoch = self._core.data_epoch
        self.replicas = self._core.replicas
        self._log = range_log
        self._requester = requester
        self._clock = clock
        self._is_live = is_live
        self._on_commit = on_commit
        self._holds_lease = holds_lease
        self._on_step_down = on_step_down
        #: Shared by the node's leaders: only the sweep's ``resume_live`` ends a parking.
        self._parked = parked
        #: The Deferreds of waiting appends, and of the fates of appends refused in doubt.
        self._tickets: dict[int, Deferred[None]] = {}
        self._fates: dict[int, Deferred[bool]] = {}
        self._timer: IDelayedCall | None = None
        self._timer_at: float | None = None
        self._flush_call: IDelayedCall | None = None
        #: Replicas whose last message failed: a streak of failures is logged once (a leader
        #: retries a dead replica every second, and a node leads thousands of ranges).
        self._failing: set[str] = set()
        #: Whether the stop is logged by the caller (``step_down(..., logged=True)``).
        self._quiet_stop = False
        range_log.commit(self._core.commit)
        self._run(self._core.start(clock.seconds()))

    # -- positions -------------------------------------------------------------------------

    @property
    def commit(self) -> int:
        return self._core.commit

    @property
    def written(self) -> int:
        """The offset after the last record written (committed or not)."""
        return self._core.written

    @property
    def position(self) -> int:
        """The byte length of the segment's file once every write lands."""
        return self._core.position

    @property
    def stopped(self) -> bool:
        return self._core.stopped is not None

    def drained(self) -> bool:
        """Everything written is committed."""
        return self._core.drained()

    # -- appends ---------------------------------------------------------------------------

    def refusal(self, count: int) -> BrokerError | None:
        refused = self._leader_refusal()
        if refused is not None:
            return refused
        storage_refused = self._log.refusal(count)
        if storage_refused is not None:
            return _storage_error(storage_refused)
        return None

    def _leader_refusal(self) -> BrokerError | None:
        """Why this leader takes no append now (its lease, its quorum), if it takes none."""
        self._check_lease()
        refused = self._core.refusal(self._is_live)
        return None if refused is None else BrokerError(*refused)

    def append(self, records: Records, stamp: ProducerStamp | None = None) -> Deferred[None]:
        # The log's own refusal comes from ``write`` below, as the StorageError it raises.
        refused = self._leader_refusal()
        if refused is not None:
            return fail(refused)
        try:
            written = self._log.write(storable(records), stamp, self.epoch)
        except FencedError as error:
            # Another node claimed the segment (its fence reached this copy first).
            self._run(self._core.stop(Reason.NOT_PRIMARY, f"{self.range_id}: {error}"))
            return fail(BrokerError(Reason.NOT_PRIMARY, f"{self.range_id}: {error}"))
        except StorageError as error:
            return fail(_storage_error(error))
        end = written.base_offset + written.record_count
        self._core.wrote(written.base_offset, end, written.data)
        written.durable.addCallbacks(self._locally_durable, self._local_failure)
        if self._flush_call is None:
            self._flush_call = self._clock.callLater(0, self._flush)
        return self.wait_committed(end)

    def wait_committed(self, end: int) -> Deferred[None]:
        """Fires once the commit index reaches ``end`` (at most what was written); fails with
        ``no_quorum`` past the ack deadline (``InDoubtError``: the records may still commit),
        or with why this leader stopped."""
        waiting: Deferred[None] = Deferred()
        ticket, actions = self._core.wait(end, self._clock.seconds())
        self._tickets[ticket] = waiting
        self._run(actions)
        return waiting

    def check_quorum(self, heard_at: Callable[[str], float | None]) -> None:
        """Step down (and resign) if no quorum of replicas was heard from for a lease TTL."""
        self._run(self._core.check_quorum(self._clock.seconds(), heard_at, self._is_live))

    def member_back(self, node: str) -> None:
        """``node``, parked while dead, is alive again."""
        self._run(self._core.member_back(node, self._clock.seconds()))

    def step_down(self, why: BrokerError, *, logged: bool = False) -> None:
        """Stop leading (a roll sealed the segment, the node lost its lease, it stops).
        ``logged``: the caller's own log line says so (a seal), this one adds none: a node
        that takes over thousands of segments seals hundreds of them at once."""
        self._quiet_stop = logged
        self._run(self._core.stop(why.reason, str(why)))

    # -- what happened ---------------------------------------------------------------------

    def _flush(self) -> None:
        self._flush_call = None
        self._run(self._core.flush(self._clock.seconds()))

    def _locally_durable(self, appended: Appended) -> None:
        self._run(self._core.locally_durable(appended.next_offset, self._clock.seconds()))

    def _local_failure(self, failure: Failure) -> None:
        self._run(self._core.local_failure(failure.getErrorMessage()))

    def _answered(self, status: CopyStatus, node: str, generation: int) -> None:
        self._failing.discard(node)
        now = self._clock.seconds()
        self._run(self._core.answered(node, generation, status, now, self._is_live(node)))

    def _send_failed(self, failure: Failure, node: str, generation: int) -> None:
        if isinstance(failure.value, CancelledError):
            return
        if node not in self._failing and self._is_live(node):
            # A dead node's leaders park it, and ``ParkedReplicas`` says so once for them all.
            self._failing.add(node)
            log.debug(
                "Replicating {range_id} to {node} failed: {error} (retried until it answers)",
                range_id=self.range_id,
                node=node,
                error=failure.getErrorMessage(),
            )
        now = self._clock.seconds()
        self._run(self._core.send_failed(node, generation, now, self._is_live(node)))

    def _notice_answered(self, status: CopyStatus, node: str) -> None:
        self._run(self._core.notice_answered(node, status, self._clock.seconds()))

    def _read(self, data: bytes, node: str, generation: int) -> None:
        self._run(self._core.read_back(node, generation, data, self._clock.seconds()))

    def _read_failed(self, failure: Failure, node: str, generation: int) -> None:
        log.failure(
            "Reading {range_id} back for {node} failed", failure, range_id=self.range_id, node=node
        )
        self._run(self._core.read_back(node, generation, b"", self._clock.seconds()))

    def _tick(self) -> None:
        self._timer = None
        self._run(self._core.tick(self._clock.seconds()))

    # -- carrying out the core's actions ---------------------------------------------------

    def _check_lease(self) -> None:
        if self._core.stopped is None and not self._holds_lease():
            self._run(
                self._core.stop(
                    Reason.UNREACHABLE,
                    f"{self.range_id}@{self.segment}: this node holds no membership lease,"
                    " so it leads nothing until it registers again",
                )
            )

    def _run(self, actions: list[Action]) -> None:
        if self._core.stopped is None and not self._holds_lease():
            # Nothing this leader meant to send goes out without a lease; what is committed
            # is committed (a quorum holds it), and is still acknowledged.
            actions = [a for a in actions if not isinstance(a, (Send, ReadBack))]
            actions += self._core.stop(
                Reason.UNREACHABLE,
                f"{self.range_id}@{self.segment}: this node holds no membership lease,"
                " so it leads nothing until it registers again",
            )
        for action in actions:
            self._carry_out(action)
        self._arm_timer()

    def _carry_out(self, action: Action) -> None:
        if isinstance(action, Send):
            self._send(action)
        elif isinstance(action, ReadBack):
            reading = self._log.read_raw_async(action.offset, action.max_bytes)
            reading.addCallbacks(
                self._read,
                self._read_failed,
                callbackArgs=(action.node, action.generation),
                errbackArgs=(action.node, action.generation),
            )
        elif isinstance(action, Commit):
            self._log.commit(action.index)
            self._on_commit(action.index)
        elif isinstance(action, Acknowledge):
            for ticket in action.tickets:
                self._tickets.pop(ticket).callback(None)
        elif isinstance(action, Refuse):
            for ticket in action.tickets:
                error: BrokerError
                if action.in_doubt:
                    fate = self._fates[ticket] = Deferred()
                    error = InDoubtError(action.reason, action.message, fate)
                else:
                    error = BrokerError(action.reason, action.message)
                self._tickets.pop(ticket).errback(error)
        elif isinstance(action, Settle):
            for ticket in action.tickets:
                self._fates.pop(ticket).callback(action.committed)
        elif isinstance(action, Park):
            self._parked.park(self, action.node)
        else:
            self._stopped(action)

    def _send(self, send: Send) -> None:
        sent = self._requester.request(send.node, PeerOp.REPLICATE, encode_replicate(send.request))
        sent.addCallback(decode_status)
        if send.notice:
            # A notice that fails is told again by the next data message or notice; a broken
            # link is the data stream's to handle (and to log).
            sent.addCallbacks(self._notice_answered, _ignored, callbackArgs=(send.node,))
        else:
            sent.addCallbacks(
                self._answered,
                self._send_failed,
                callbackArgs=(send.node, send.generation),
                errbackArgs=(send.node, send.generation),
            )

    def _stopped(self, step: StepDown) -> None:
        if not self._quiet_stop:
            log.info(
                "No longer leading {range_id}@{segment} at epoch {epoch}: {why}",
                range_id=self.range_id,
                segment=self.segment,
                epoch=self.epoch,
                why=step.message,
            )
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        self._parked.forget(self)
        # The leader goes with it: this can run before the constructor returns (a replica's
        # answer that comes at once, while the leadership starts).
        self._on_step_down(self, step)

    def _arm_timer(self) -> None:
        deadline = self._core.deadline()
        if self._timer is not None:
            if deadline == self._timer_at:
                return
            if self._timer.active():
                self._timer.cancel()
            self._timer = None
        self._timer_at = deadline
        if deadline is not None:
            delay = max(deadline - self._clock.seconds(), 0.0)
            self._timer = self._clock.callLater(delay, self._tick)


def _storage_error(error: StorageError) -> BrokerError:
    if isinstance(error, OverloadedError):
        return BrokerError(Reason.OVERLOADED, str(error))
    return BrokerError(Reason.UNREACHABLE, f"storage refused the append: {error}")


def _ignored(_: Failure) -> None:
    return None
