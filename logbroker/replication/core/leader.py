"""The primary of one active segment, as a sans-IO state machine: events in, actions out.

In the style of etcd's ``raft`` package (``Step`` and ``Ready``): ``LeaderCore`` makes every
decision a segment's primary makes, and ``logbroker.replication.primary.SegmentLeader`` only
drives it: it feeds the core what happened (with the time it happened) and carries out the
actions the core hands back. No Deferreds, no clock, no I/O here; ``deadline()`` says when the
driver must next call ``tick``.

Events:

- ``wrote(...)``: the local log stored a batch (offsets assigned, bytes handed back). Nothing
  goes out yet: the driver calls ``flush`` once the reactor turn's appends are in, so that they
  travel as one replicate message per replica.
- ``wait(end, now)``: an append ending at ``end`` wants its acknowledgement (a ticket).
- ``locally_durable(end, now)``, ``local_failure(...)``: the local copy's fsync.
- ``answered(node, generation, status, now)``: a replica's answer to data it was sent;
  ``send_failed(...)`` when the link failed; ``notice_answered(...)`` for a commit notice.
- ``read_back(...)``: bytes the backlog no longer held, read from the local log for a replica.
- ``tick(now)``: timers (ack deadlines, retries after a back-off, commit notices).
- ``member_back(node, now)``: a parked replica is alive again.
- ``check_quorum(now, heard_at, is_live)``: whether a quorum of replicas has been heard from
  within a lease TTL (Raft's CheckQuorum).
- ``stop(reason, message)``: the node stops leading (sealed, lease lost, stopping).

Actions (``logbroker.replication.core.actions``): ``Send`` (a replicate message or a commit
notice), ``ReadBack`` (read the local log), ``Commit`` (the commit index moved), ``Acknowledge``
/ ``Refuse`` (answer waiting appends), ``Settle`` (what became of appends refused while their
records could still commit), ``Park`` (a dead replica waits for ``member_back``) and
``StepDown`` (this leader stopped; with ``resign``, another replica should lead).

The rules:

- **Acknowledge on a quorum.** The commit index is the highest offset a quorum
  (``floor(RF/2)+1`` copies, this one counted once durable) holds durably (``CommitTracker``).
  Appends are acknowledged in offset order as it passes them.
- **No quorum, no wait.** ``refusal`` refuses an append at once while fewer replicas are alive
  than a quorum needs. An append not committed within ``ack_timeout_seconds`` is refused
  ``no_quorum`` *in doubt*: its records stay in the log and may still be committed. The core
  remembers it and ``Settle``\\ s it later (committed when the commit index passes it, not known
  here when this leader stops), so a retry with the same producer stamp is answered with the
  first try's fate instead of being stored again.
- **Fenced.** A replica that answers ``fenced`` means another node took the segment over: the
  leader stops, and waiting appends are refused ``not_primary``.
- **CheckQuorum.** A leader that has not heard from a quorum of its replicas for a lease TTL,
  while enough of them are alive to form one, steps down and resigns (another replica, which
  may reach a quorum, takes the segment over): a node cut off from its peers but not from etcd
  costs a failover instead of holding its ranges.
- **Streams.** Each replica is sent the bytes it lacks, pipelined up to a window
  (``ReplicaStream``); one whose link failed is sent again from its last durable end after a
  back-off; one whose copy ends elsewhere (``mismatch``) from where it ends; one whose view of
  the claim lags (``unknown``) again after a short back-off. One whose link failed while the
  membership says it is dead is **parked** (``Park``): sent nothing, on no timer, until the
  driver says it is back (``member_back``). A node leading thousands of segments would
  otherwise retry a dead replica thousands of times a second. What the backlog no longer holds
  is read back from the local log.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

import attrs

from logbroker.errors import Reason
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
from logbroker.replication.core.quorum import (
    Backlog,
    Chunk,
    CommitTracker,
    CopyEnd,
    ReplicaStream,
    join,
)
from logbroker.replication.replica_codec import CopyOutcome, CopyStatus, ReplicateRequest
from logbroker.storage._format import scan_batches


@attrs.define
class _Waiter:
    ticket: int
    end: int
    expires: float


class LeaderCore:
    """Leads segment ``segment`` of ``range_id`` at ``epoch`` (see the module docstring).

    ``copies`` says where each copy was known to end durably when the leadership began (this
    node's own copy included, and complete: it ends at the longest end of a quorum); a copy not
    listed is taken to hold nothing yet. ``data_epoch`` is the epoch of the primary whose
    records the segment holds (``epoch`` unless given: a claim that found records goes on with
    an older primary's, only to seal them). ``now`` is when it began: every replica counts as
    heard from then.
    """

    def __init__(
        self,
        *,
        node_id: str,
        range_id: str,
        segment: int,
        epoch: int,
        replicas: Sequence[str],
        copies: Mapping[str, CopyEnd],
        settings: ReplicationSettings,
        now: float,
        data_epoch: int | None = None,
    ) -> None:
        if replicas[0] != node_id:
            raise ValueError(f"{node_id} leads {range_id}@{segment}, but {replicas[0]} is first")
        self.node_id = node_id
        self.range_id = range_id
        self.segment = segment
        self.epoch = epoch
        self.data_epoch = epoch if data_epoch is None else data_epoch
        self.replicas = tuple(replicas)
        self._settings = settings
        own = copies[node_id]
        ends = {node: copies.get(node, CopyEnd(segment, 0)) for node in self.replicas}
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
        #: When each replica waiting out a back-off is sent to again.
        self._retry_at: dict[str, float] = {}
        #: Dead replicas sent nothing until ``member_back`` (also in ``_paused``).
        self._parked: set[str] = set()
        self._waiting: deque[_Waiter] = deque()
        #: Appends refused in doubt, by end: settled when the commit passes them, or at stop.
        self._doubt: deque[_Waiter] = deque()
        self._next_ticket = 0
        #: The commit index each replica was last sent, and when pending notices go out.
        self._told_commit = dict.fromkeys(self._streams, 0)
        self._notice_at: float | None = None
        #: When each replica last answered anything.
        self._heard_at = dict.fromkeys(self._streams, now)
        #: The latest time an event carried: deadlines already past are not asked for again.
        self._now = now
        #: Why this leader stopped, if it did.
        self._stopped: StepDown | None = None

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
    def stopped(self) -> StepDown | None:
        return self._stopped

    def drained(self) -> bool:
        """Everything written is committed."""
        return self._tracker.commit >= self._written

    def deadline(self) -> float | None:
        """When ``tick`` must run next (``None``: nothing is timed)."""
        if self._stopped is not None:
            return None
        times = list(self._retry_at.values())
        if self._waiting:
            times.append(self._waiting[0].expires)
        if self._notice_at is not None:
            times.append(self._notice_at)
        return min(times, default=None)

    # -- events ----------------------------------------------------------------------------

    def start(self, now: float) -> list[Action]:
        """The leadership begins (its commit index is where the copies stand): the replicas
        that lack some of what this copy holds (after a takeover) are sent it."""
        self._now = now
        actions: list[Action] = []
        for node in self._streams:
            self._pump(node, actions)
        return actions

    def refusal(self, is_live: Callable[[str], bool]) -> tuple[Reason, str] | None:
        """Why an append cannot be taken now, if it cannot."""
        if self._stopped is not None:
            return self._stopped.reason, self._stopped.message
        live = 1 + sum(1 for node in self._streams if is_live(node))
        if live < self._settings.quorum:
            return (
                Reason.NO_QUORUM,
                f"{self.range_id}: {live} of {len(self.replicas)} replicas are alive, fewer "
                f"than the quorum of {self._settings.quorum}",
            )
        return None

    def wrote(self, offset: int, next_offset: int, data: bytes) -> None:
        """The local log stored ``data``, records ``[offset, next_offset)``, at the end of the
        segment's file; it goes out at the next ``flush``."""
        if offset != self._written:
            raise ValueError(f"a write at offset {offset}, the segment is at {self._written}")
        chunk = Chunk(offset, next_offset, self._position, data)
        self._position = chunk.end_position
        self._written = next_offset
        self._backlog.add(chunk)

    def wait(self, end: int, now: float) -> tuple[int, list[Action]]:
        """A ticket for an append ending at ``end`` (at most what was written): acknowledged
        once the commit index reaches it, refused past the ack deadline or when this leader
        stops."""
        self._now = now
        ticket = self._next_ticket
        self._next_ticket += 1
        if self._stopped is not None:
            stopped = self._stopped
            return ticket, [Refuse((ticket,), stopped.reason, stopped.message)]
        if self._tracker.commit >= end:
            return ticket, [Acknowledge((ticket,))]
        self._waiting.append(_Waiter(ticket, end, now + self._settings.ack_timeout_seconds))
        return ticket, []

    def flush(self, now: float) -> list[Action]:
        """Send what was written since the last flush."""
        self._now = now
        actions: list[Action] = []
        for node in self._streams:
            self._pump(node, actions)
        return actions

    def locally_durable(self, end: int, now: float) -> list[Action]:
        self._now = now
        actions: list[Action] = []
        if self._stopped is not None:
            return actions
        before = self._tracker.durable(self.node_id)
        if self._tracker.advance(self.node_id, end):
            self._committed(actions)
        elif before < min(end, self._tracker.commit):
            # The replicas committed these records before this copy held them: its readers
            # see them only now.
            actions.append(Commit(self._tracker.commit))
        return actions

    def local_failure(self, message: str) -> list[Action]:
        """The local copy's write failed: the log is out of service, nothing more is
        acknowledged from this copy."""
        return self.stop(
            Reason.UNREACHABLE, f"{self.range_id}: this primary's copy failed: {message}"
        )

    def answered(
        self, node: str, generation: int, status: CopyStatus, now: float, live: bool = True
    ) -> list[Action]:
        """``node`` answered data sent to it with ``generation``."""
        self._now = now
        actions: list[Action] = []
        if self._stopped is not None:
            return actions
        self._heard_at[node] = now
        stream = self._streams[node]
        if status.outcome is CopyOutcome.FENCED:
            return self._fenced(node, status)
        if status.outcome is CopyOutcome.UNKNOWN:
            # The replica has not heard of this claim yet: its control plane view lags.
            if generation == stream.generation:
                stream.restart_from_durable(self.segment, 0)
                self._retry_later(node, now, live, actions)
            return actions
        self._backoff[node] = self._settings.retry_seconds
        if status.outcome is CopyOutcome.OK:
            stream.stored(generation, status.end_offset, status.end_position)
            if self._tracker.advance(node, min(status.end_offset, self._written)):
                self._committed(actions)
            elif stream.idle and self._told_commit[node] < self._tracker.commit:
                # A replica slower than the quorum: it was sent an older commit.
                self._notice_soon(now)
        else:
            # mismatch (or short): send from where the copy ends.
            if generation == stream.generation:
                stream.rewind(status.end_offset, status.end_position)
            if (
                status.epoch == self.epoch
                and status.data_epoch == self.data_epoch
                and self._tracker.advance(node, min(status.end_offset, self._written))
            ):
                # The copy holds more than this leader knew, durably: what it was sent before
                # its answers were lost (a stall, a broken link). At this epoch, of this data
                # epoch, every byte of it is what this leader sent
                # (``logbroker.replication.core.replica``): it counts, or nothing would commit
                # those records until another append comes, and a retry waiting for their
                # fate would wait with them.
                self._committed(actions)
        self._pump(node, actions)
        return actions

    def send_failed(self, node: str, generation: int, now: float, live: bool) -> list[Action]:
        """Data sent to ``node`` with ``generation`` may not have arrived (the link failed):
        send again from its last durable end after a back-off (a dead node's, longest)."""
        self._now = now
        stream = self._streams[node]
        if self._stopped is not None or generation != stream.generation:
            return []
        stream.restart_from_durable(self.segment, 0)
        actions: list[Action] = []
        self._retry_later(node, now, live, actions)
        return actions

    def member_back(self, node: str, now: float) -> list[Action]:
        """``node``, parked while dead, is alive again: send it what it lacks."""
        self._now = now
        actions: list[Action] = []
        if self._stopped is not None or node not in self._parked:
            return actions
        self._parked.discard(node)
        self._paused.discard(node)
        self._backoff[node] = self._settings.retry_seconds
        self._pump(node, actions)
        return actions

    def notice_answered(self, node: str, status: CopyStatus, now: float) -> list[Action]:
        self._now = now
        if self._stopped is not None:
            return []
        self._heard_at[node] = now
        if status.outcome is CopyOutcome.FENCED:
            return self._fenced(node, status)
        return []

    def read_back(self, node: str, generation: int, data: bytes, now: float) -> list[Action]:
        """The local log's bytes for ``node`` from where its stream was when ``ReadBack`` was
        asked for (``b""`` if the read failed: tried again after a back-off)."""
        self._now = now
        self._paused.discard(node)
        actions: list[Action] = []
        stream = self._streams[node]
        if self._stopped is not None:
            return actions
        if stream.generation != generation:
            self._pump(node, actions)
            return actions
        if not data:
            self._retry_later(node, now, True, actions)
            return actions
        offset, position = stream.next_offset, stream.next_position
        scan = scan_batches(data, 0, offset)
        if not scan.batches or scan.damage is not None:
            return self.stop(
                Reason.UNREACHABLE,
                f"{self.range_id}: this primary's copy cannot be read back from offset "
                f"{offset} for {node}",
            )
        chunk = Chunk(offset, scan.batches[-1].next_offset, position, data[: scan.end])
        self._send(stream, chunk, actions)
        self._pump(node, actions)
        return actions

    def tick(self, now: float) -> list[Action]:
        """Run what is due: refuse appends past their deadline (in doubt), retry replicas
        whose back-off is over, send pending commit notices."""
        self._now = now
        actions: list[Action] = []
        if self._stopped is not None:
            return actions
        expired = []
        while self._waiting and self._waiting[0].expires <= now:
            waiter = self._waiting.popleft()
            expired.append(waiter.ticket)
            self._doubt.append(waiter)
        if expired:
            actions.append(
                Refuse(
                    tuple(expired),
                    Reason.NO_QUORUM,
                    f"{self.range_id}: no quorum of {self._settings.quorum} copies held the "
                    f"records within {self._settings.ack_timeout_seconds:g} s; they may still "
                    "be committed, retry with the same producer stamp",
                    in_doubt=True,
                )
            )
        for node, at in sorted(self._retry_at.items()):
            if at <= now:
                del self._retry_at[node]
                self._paused.discard(node)
                self._pump(node, actions)
        if self._notice_at is not None and self._notice_at <= now:
            self._notice_at = None
            self._send_notices(actions)
        return actions

    def check_quorum(
        self,
        now: float,
        heard_at: Callable[[str], float | None],
        is_live: Callable[[str], bool],
    ) -> list[Action]:
        """Raft's CheckQuorum: step down and resign if a quorum of the replicas (this node
        counted) has not been heard from within a lease TTL while enough of them are alive to
        form one elsewhere. ``heard_at`` is when the node's link last heard from each replica
        (``None``: no link); answers to this segment count too."""
        self._now = now
        if self._stopped is not None:
            return []
        ttl = self._settings.ack_timeout_seconds

        def heard(node: str) -> bool:
            times = [self._heard_at[node], heard_at(node)]
            latest = max(t for t in times if t is not None)
            return now - latest < ttl

        reached = 1 + sum(1 for node in self._streams if heard(node))
        quorum = self._settings.quorum
        if reached >= quorum:
            return []
        live = 1 + sum(1 for node in self._streams if is_live(node))
        if live < quorum:
            # No quorum is alive anywhere: resigning would help no one (appends are refused
            # ``no_quorum`` at once meanwhile).
            return []
        silent = sorted(node for node in self._streams if not heard(node))
        return self.stop(
            Reason.NOT_PRIMARY,
            f"{self.range_id}@{self.segment}: this primary has heard from {reached} of "
            f"{len(self.replicas)} replicas (not from {', '.join(silent)}) for {ttl:g} s, "
            f"fewer than the quorum of {quorum}, while they are alive: it steps down so that "
            "a replica that reaches a quorum takes over",
            resign=True,
        )

    def stop(self, reason: Reason, message: str, *, resign: bool = False) -> list[Action]:
        """Stop leading: waiting appends are refused with ``reason``, appends in doubt settle
        as not known here."""
        if self._stopped is not None:
            return []
        step_down = self._stopped = StepDown(reason, message, resign)
        actions: list[Action] = [step_down]
        waiting, self._waiting = self._waiting, deque()
        if waiting:
            actions.append(Refuse(tuple(w.ticket for w in waiting), reason, message))
        doubt, self._doubt = self._doubt, deque()
        if doubt:
            actions.append(Settle(tuple(w.ticket for w in doubt), committed=False))
        self._retry_at.clear()
        self._notice_at = None
        return actions

    # -- inside ----------------------------------------------------------------------------

    def _committed(self, actions: list[Action]) -> None:
        commit = self._tracker.commit
        actions.append(Commit(commit))
        acked = []
        while self._waiting and self._waiting[0].end <= commit:
            acked.append(self._waiting.popleft().ticket)
        if acked:
            actions.append(Acknowledge(tuple(acked)))
        settled = []
        while self._doubt and self._doubt[0].end <= commit:
            settled.append(self._doubt.popleft().ticket)
        if settled:
            actions.append(Settle(tuple(settled), committed=True))
        self._backlog.release(min(self._tracker.durable(node) for node in self.replicas))
        self._notice_soon(self._now)

    def _fenced(self, node: str, status: CopyStatus) -> list[Action]:
        return self.stop(
            Reason.NOT_PRIMARY,
            f"{self.range_id}@{self.segment}: {node} is fenced at epoch {status.epoch},"
            f" past this primary's {self.epoch}; another node took the segment over",
        )

    def _pump(self, node: str, actions: list[Action]) -> None:
        stream = self._streams[node]
        while (
            self._stopped is None
            and node not in self._paused
            and stream.room() > 0
            and stream.next_offset < self._written
        ):
            wanted = min(stream.room(), self._settings.max_message_bytes)
            chunks = self._backlog.take(stream.next_offset, wanted)
            if chunks is None:
                self._paused.add(node)
                actions.append(
                    ReadBack(
                        node,
                        stream.generation,
                        stream.next_offset,
                        stream.next_position,
                        self._settings.max_message_bytes,
                    )
                )
                return
            if not chunks:
                return
            self._send(stream, join(chunks), actions)

    def _send(self, stream: ReplicaStream, chunk: Chunk, actions: list[Action]) -> None:
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
            data_epoch=self.data_epoch,
        )
        actions.append(Send(stream.node, generation, request))

    def _notice_soon(self, now: float) -> None:
        if self._notice_at is None and self._stopped is None:
            self._notice_at = now + self._settings.commit_notice_seconds

    def _send_notices(self, actions: list[Action]) -> None:
        """Tell each replica that has nothing in flight and nothing more to be sent how far
        the range is committed: the records acknowledged last would otherwise be known to be
        committed only on this node until the next produce, and a copy serves only those when
        this node is lost (``read_committed``)."""
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
                data_epoch=self.data_epoch,
            )
            actions.append(Send(node, stream.generation, notice, notice=True))

    def _retry_later(self, node: str, now: float, live: bool, actions: list[Action]) -> None:
        if node in self._retry_at or node in self._parked or self._stopped is not None:
            return
        self._paused.add(node)
        if not live:
            self._parked.add(node)
            actions.append(Park(node))
            return
        delay = self._backoff[node]
        self._backoff[node] = min(delay * 2, self._settings.retry_max_seconds)
        self._retry_at[node] = now + delay
