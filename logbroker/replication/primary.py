"""The primary of one active segment: appends locally, streams the bytes to the replicas, and
acknowledges once a quorum holds them durably.

``SegmentLeader`` is the thin Twisted adapter around the sans-IO bookkeeping in ``quorum``. It
leads one segment at one epoch for as long as this process runs and nothing fences it: a node
that restarts, or takes a segment over, claims it anew (``logbroker.replication.takeover``).

- **Append.** ``RangeLog.write`` assigns the offsets and hands back the stored bytes at once;
  they go into the backlog and out to every replica while the local fsync runs. The produce is
  acknowledged when the commit index passes its last record: a quorum of copies (this one
  included) is durable past it. Acknowledgements go out in offset order.
- **No quorum, no wait.** With fewer replicas believed alive than a quorum needs, an append is
  refused at once (``no_quorum``); one that is not committed within ``ack_timeout`` is answered
  ``no_quorum`` too. Its records may still be committed later (the node that takes the segment
  over keeps the longest end of a quorum): a retry with the same producer stamp is not stored
  twice.
- **Fenced.** A replica that answers ``fenced`` means another node took the segment over: this
  leader stops, and what it had not acknowledged is answered ``not_primary``.
- **Links.** A replica whose link fails is sent to again from its last durable end, after a
  back-off; one whose copy ends elsewhere (``mismatch``) is sent to from where it ends; bytes the
  backlog no longer holds are read back from the local log.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

import attrs
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.broker.errors import BrokerError
from logbroker.errors import Reason
from logbroker.peer.frames import PeerOp
from logbroker.peer.requester import PeerRequester
from logbroker.records import ProducerStamp, Record
from logbroker.replication.quorum import (
    Backlog,
    Chunk,
    CommitTracker,
    CopyEnd,
    ReplicaStream,
    join,
    quorum_size,
)
from logbroker.replication.replica_codec import (
    CopyOutcome,
    CopyStatus,
    ReplicateRequest,
    decode_status,
    encode_replicate,
)
from logbroker.storage import Appended, OverloadedError, RangeLog, StorageError
from logbroker.storage._format import scan_batches

log = Logger()


@attrs.frozen
class ReplicationSettings:
    """How a primary streams to its replicas; built from ``SVC_*`` settings."""

    replication_factor: int = attrs.field(validator=attrs.validators.ge(1))
    #: Bytes in flight to one replica before the primary waits for its answers.
    window_bytes: int = 8 * 1024 * 1024
    #: The most bytes one replicate message carries.
    max_message_bytes: int = 1024 * 1024
    #: Recent bytes kept in memory for replicas that lag; older ones are read from disk.
    backlog_bytes: int = 64 * 1024 * 1024
    #: How long a produce waits for a quorum before it is answered ``no_quorum``.
    ack_timeout_seconds: float = 5.0
    #: How long after the commit index moves a replica that was sent nothing since is told
    #: where it is (a commit notice).
    commit_notice_seconds: float = 0.02
    #: Back-off after a replica's link failed, doubling up to ``retry_max_seconds``.
    retry_seconds: float = 0.05
    retry_max_seconds: float = 1.0

    @property
    def quorum(self) -> int:
        return quorum_size(self.replication_factor)


class _Waiter:
    __slots__ = ("deferred", "end", "expires")

    def __init__(self, end: int, expires: float) -> None:
        self.end = end
        self.expires = expires
        self.deferred: Deferred[None] = Deferred()


class SegmentLeader:
    """Leads segment ``segment`` of ``range_id`` at ``epoch``.

    ``copies`` says where each copy was known to end durably when the leadership began (this
    node's own copy included, and complete: it ends at the longest end of a quorum); a copy not
    listed is taken to hold nothing yet.
    """

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
    ) -> None:
        if replicas[0] != node_id:
            raise ValueError(f"{node_id} leads {range_id}@{segment}, but {replicas[0]} is first")
        self.range_id = range_id
        self.segment = segment
        self.epoch = epoch
        self.replicas = tuple(replicas)
        self._node_id = node_id
        self._log = range_log
        self._requester = requester
        self._clock = clock
        self._settings = settings
        self._is_live = is_live
        self._on_commit = on_commit
        own = copies[node_id]
        ends = {node: copies.get(node, CopyEnd(segment, 0)) for node in self.replicas}
        #: Where a replica that never answered is sent from: the start of the segment.
        self._segment_start = CopyEnd(segment, 0)
        #: Where the next write lands in the segment's file, and the offset it takes.
        self._position = own.position
        self._written = own.offset
        self._tracker = CommitTracker(
            {node: end.offset for node, end in ends.items()}, settings.quorum
        )
        self._backlog = Backlog(settings.backlog_bytes)
        self._streams = {
            node: ReplicaStream(node, ends[node].offset, ends[node].position, settings.window_bytes)
            for node in self.replicas[1:]
        }
        #: Replicas being read back from disk for, or waiting out a back-off.
        self._paused: set[str] = set()
        self._backoff = dict.fromkeys(self._streams, settings.retry_seconds)
        self._retries: dict[str, IDelayedCall] = {}
        self._waiting: deque[_Waiter] = deque()
        self._timer: IDelayedCall | None = None
        #: The pump that sends this reactor turn's appends to the replicas, once scheduled.
        self._pump_call: IDelayedCall | None = None
        #: The commit index each replica was last sent, and the pending commit notices.
        self._told_commit = dict.fromkeys(self._streams, 0)
        self._notice_call: IDelayedCall | None = None
        #: Why this leader stopped (fenced, or stepped down), if it did.
        self._stopped: BrokerError | None = None
        range_log.commit(self._tracker.commit)
        # Replicas that lack some of what this copy holds (after a takeover) get it now.
        for node in self._streams:
            self._pump(node)

    # -- positions -------------------------------------------------------------------------

    @property
    def commit(self) -> int:
        return self._tracker.commit

    @property
    def written(self) -> int:
        """The offset after the last record written (committed or not)."""
        return self._written

    @property
    def position(self) -> int:
        """The byte length of the segment's file once every write lands."""
        return self._position

    @property
    def stopped(self) -> bool:
        return self._stopped is not None

    # -- appends ---------------------------------------------------------------------------

    def refusal(self, count: int) -> BrokerError | None:
        if self._stopped is not None:
            return self._stopped
        live = 1 + sum(1 for node in self._streams if self._is_live(node))
        if live < self._settings.quorum:
            return BrokerError(
                Reason.NO_QUORUM,
                f"{self.range_id}: {live} of {len(self.replicas)} replicas are alive, fewer "
                f"than the quorum of {self._settings.quorum}",
            )
        refused = self._log.refusal(count)
        if refused is not None:
            return _storage_error(refused)
        return None

    def append(
        self, records: Sequence[Record], stamp: ProducerStamp | None = None
    ) -> Deferred[None]:
        refused = self.refusal(len(records))
        if refused is not None:
            return fail(refused)
        try:
            written = self._log.write(records, stamp)
        except StorageError as error:
            return fail(_storage_error(error))
        end = written.base_offset + written.record_count
        chunk = Chunk(written.base_offset, end, self._position, written.data)
        self._position = chunk.end_position
        self._written = end
        self._backlog.add(chunk)
        written.durable.addCallbacks(self._locally_durable, self._local_failure)
        self._pump_soon()
        return self.wait_committed(end)

    def wait_committed(self, end: int) -> Deferred[None]:
        """Fires once the commit index reaches ``end`` (at most what was written); fails with
        ``no_quorum`` past the ack timeout, or with why this leader stopped."""
        if self._stopped is not None:
            return fail(self._stopped)
        if self._tracker.commit >= end:
            return succeed(None)
        waiter = _Waiter(end, self._clock.seconds() + self._settings.ack_timeout_seconds)
        self._waiting.append(waiter)
        if len(self._waiting) == 1:
            self._arm_timer()
        return waiter.deferred

    def _locally_durable(self, appended: Appended) -> None:
        if self._tracker.advance(self._node_id, appended.next_offset):
            self._committed()

    def _local_failure(self, failure: Failure) -> None:
        # The log is out of service: nothing more is acknowledged from this copy.
        self._stop(
            BrokerError(
                Reason.UNREACHABLE,
                f"{self.range_id}: this primary's copy failed: {failure.getErrorMessage()}",
            )
        )

    def _committed(self) -> None:
        commit = self._tracker.commit
        self._log.commit(commit)
        released = False
        while self._waiting and self._waiting[0].end <= commit:
            self._waiting.popleft().deferred.callback(None)
            released = True
        self._backlog.release(min(self._tracker.durable(node) for node in self.replicas))
        if released:
            self._arm_timer()
        self._notices_soon()
        self._on_commit(commit)

    # -- the ack deadline ------------------------------------------------------------------

    def _arm_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._waiting and self._stopped is None:
            delay = max(self._waiting[0].expires - self._clock.seconds(), 0.0)
            self._timer = self._clock.callLater(delay, self._expire)

    def _expire(self) -> None:
        self._timer = None
        now = self._clock.seconds()
        while self._waiting and self._waiting[0].expires <= now:
            waiter = self._waiting.popleft()
            waiter.deferred.errback(
                BrokerError(
                    Reason.NO_QUORUM,
                    f"{self.range_id}: no quorum of {self._settings.quorum} copies held the "
                    f"records within {self._settings.ack_timeout_seconds:g} s; they may still "
                    "be committed, retry with the same producer stamp",
                )
            )
        self._arm_timer()

    # -- streaming to replicas -------------------------------------------------------------

    def _pump_soon(self) -> None:
        """Send what was appended once this reactor turn's appends are all in.

        The appends of one turn (the range's parts of every request read in it) go out as one
        replicate message per replica instead of one per append: each message costs an
        encoding, a socket write, a replica's check and append, and an answer.
        """
        if self._pump_call is None and self._stopped is None:
            self._pump_call = self._clock.callLater(0, self._pump_all)

    def _pump_all(self) -> None:
        self._pump_call = None
        for node in self._streams:
            self._pump(node)

    def _pump(self, node: str) -> None:
        stream = self._streams[node]
        # A send that fails at once (no link) pauses the replica: check again after each.
        while (
            self._stopped is None
            and node not in self._paused
            and stream.room() > 0
            and stream.next_offset < self._written
        ):
            wanted = min(stream.room(), self._settings.max_message_bytes)
            chunks = self._backlog.take(stream.next_offset, wanted)
            if chunks is None:
                self._read_back(node)
                return
            if not chunks:
                return
            self._send(stream, join(chunks))

    def _notices_soon(self) -> None:
        if self._notice_call is None and self._stopped is None:
            self._notice_call = self._clock.callLater(
                self._settings.commit_notice_seconds, self._send_notices
            )

    def _send_notices(self) -> None:
        """Tell each replica that has nothing in flight and nothing more to be sent how far
        the range is committed: the records acknowledged last would otherwise be known to be
        committed only on this node until the next produce, and a copy serves only those when
        this node is lost (``ReplicaServer.read_committed``)."""
        self._notice_call = None
        commit = self._tracker.commit
        for node, stream in self._streams.items():
            if (
                self._told_commit[node] >= commit
                or node in self._paused
                or not stream.idle
                or stream.next_offset < self._written
            ):
                continue
            self._told_commit[node] = commit
            notice = ReplicateRequest(
                self.range_id,
                self.segment,
                self.epoch,
                stream.next_offset,
                stream.next_position,
                commit,
                b"",
            )
            sent = self._requester.request(node, PeerOp.REPLICATE, encode_replicate(notice))
            sent.addCallback(decode_status).addCallbacks(
                self._notice_answered, self._notice_failed, callbackArgs=(node,)
            )

    def _notice_answered(self, status: CopyStatus, node: str) -> None:
        if status.outcome is CopyOutcome.FENCED and self._stopped is None:
            self._fenced(node, status)

    def _notice_failed(self, failure: Failure) -> None:
        # The next data message or notice tells the replica again; a broken link is the data
        # stream's to handle.
        log.debug(
            "A commit notice of {range_id} failed: {error}",
            range_id=self.range_id,
            error=failure.getErrorMessage(),
        )

    def _send(self, stream: ReplicaStream, chunk: Chunk) -> None:
        generation = stream.sent(chunk)
        self._told_commit[stream.node] = self._tracker.commit
        request = ReplicateRequest(
            self.range_id,
            self.segment,
            self.epoch,
            chunk.offset,
            chunk.position,
            self._tracker.commit,
            chunk.data,
        )
        sent = self._requester.request(stream.node, PeerOp.REPLICATE, encode_replicate(request))
        sent.addCallback(decode_status).addCallbacks(
            self._answered,
            self._link_failed,
            callbackArgs=(stream, generation),
            errbackArgs=(stream, generation),
        )

    def _read_back(self, node: str) -> None:
        """The backlog lost what ``node`` needs next: read it from the local log."""
        stream = self._streams[node]
        self._paused.add(node)
        offset, position = stream.next_offset, stream.next_position
        generation = stream.generation
        reading = self._log.read_raw_async(offset, self._settings.max_message_bytes)

        def read(data: bytes) -> None:
            self._paused.discard(node)
            if self._stopped is not None or stream.generation != generation:
                self._pump(node)
                return
            scan = scan_batches(data, 0, offset)
            if not scan.batches or scan.damage is not None:
                self._stop(
                    BrokerError(
                        Reason.UNREACHABLE,
                        f"{self.range_id}: this primary's copy cannot be read back from "
                        f"offset {offset} for {node}",
                    )
                )
                return
            chunk = Chunk(offset, scan.batches[-1].next_offset, position, data[: scan.end])
            self._send(stream, chunk)
            self._pump(node)

        def failed(failure: Failure) -> None:
            self._paused.discard(node)
            log.failure(
                "Reading {range_id} back from offset {offset} for {node} failed",
                failure,
                range_id=self.range_id,
                offset=offset,
                node=node,
            )
            self._retry_later(node)

        reading.addCallbacks(read, failed)

    def _answered(self, status: CopyStatus, stream: ReplicaStream, generation: int) -> None:
        node = stream.node
        if self._stopped is not None:
            return
        if status.outcome is CopyOutcome.FENCED:
            self._fenced(node, status)
            return
        self._backoff[node] = self._settings.retry_seconds
        if status.outcome is CopyOutcome.OK:
            stream.stored(generation, status.end_offset, status.end_position)
            if self._tracker.advance(node, min(status.end_offset, self._written)):
                self._committed()
            elif stream.idle and self._told_commit[node] < self._tracker.commit:
                # A replica slower than the quorum: it was sent an older commit.
                self._notices_soon()
        elif generation == stream.generation:
            # mismatch (or short): send from where the copy ends.
            stream.rewind(status.end_offset, status.end_position)
        self._pump(node)

    def _fenced(self, node: str, status: CopyStatus) -> None:
        self._stop(
            BrokerError(
                Reason.NOT_PRIMARY,
                f"{self.range_id}@{self.segment}: {node} is fenced at epoch {status.epoch},"
                f" past this primary's {self.epoch}; another node took the segment over",
            )
        )

    def _link_failed(self, failure: Failure, stream: ReplicaStream, generation: int) -> None:
        if self._stopped is not None or isinstance(failure.value, CancelledError):
            return
        if generation != stream.generation:
            return
        if self._backoff[stream.node] == self._settings.retry_seconds:
            # Once per streak of failures: a dead replica is retried every second for as long
            # as it is down.
            log.debug(
                "Replicating {range_id} to {node} failed: {error}; retrying",
                range_id=self.range_id,
                node=stream.node,
                error=failure.getErrorMessage(),
            )
        stream.restart_from_durable(self._segment_start.offset, self._segment_start.position)
        self._retry_later(stream.node)

    def _retry_later(self, node: str) -> None:
        if node in self._retries or self._stopped is not None:
            return
        self._paused.add(node)
        # A replica the membership says is dead is not worth a quick retry.
        delay = self._backoff[node] if self._is_live(node) else self._settings.retry_max_seconds
        self._backoff[node] = min(delay * 2, self._settings.retry_max_seconds)

        def retry() -> None:
            del self._retries[node]
            self._paused.discard(node)
            self._pump(node)

        self._retries[node] = self._clock.callLater(delay, retry)

    # -- stopping --------------------------------------------------------------------------

    def drained(self) -> bool:
        """Everything written is committed."""
        return self._tracker.commit >= self._written

    def step_down(self, why: BrokerError) -> None:
        """Stop leading (a roll sealed the segment, the node lost its lease, it stops)."""
        self._stop(why)

    def _stop(self, why: BrokerError) -> None:
        if self._stopped is not None:
            return
        self._stopped = why
        log.info(
            "No longer leading {range_id}@{segment} at epoch {epoch}: {why}",
            range_id=self.range_id,
            segment=self.segment,
            epoch=self.epoch,
            why=str(why),
        )
        for call in self._retries.values():
            call.cancel()
        self._retries.clear()
        for pending in (self._pump_call, self._notice_call):
            if pending is not None:
                pending.cancel()
        self._pump_call = self._notice_call = None
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        waiting, self._waiting = self._waiting, deque()
        for waiter in waiting:
            waiter.deferred.errback(why)


def _storage_error(error: StorageError) -> BrokerError:
    if isinstance(error, OverloadedError):
        return BrokerError(Reason.OVERLOADED, str(error))
    return BrokerError(Reason.UNREACHABLE, f"storage refused the append: {error}")
