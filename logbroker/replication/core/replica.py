"""What a replica does with its copy of a segment, decided: the pure rules behind
``logbroker.replication.replica.ReplicaServer`` (which carries them out on the range's log) and
behind every read of a copy. No I/O, no clock, no Deferreds.

The rules that make a quorum's acknowledgement mean something:

- **Only the claimer writes.** A segment's bytes are taken only from the node that claimed the
  segment's current epoch: the first member of its replica set at that epoch in the control
  plane (``authority``). An older epoch, or a node no longer first, is ``fenced``; a newer
  epoch than this node's view shows is ``unknown`` for now (its view lags behind the claim).
- **Epochs only go up.** A copy fenced at an epoch refuses every older one (``older_epoch``),
  so once a node taking over has fenced a quorum, the old primary can get nothing more
  durable on a quorum.
- **Contiguity.** Bytes are taken only where the copy ends (offset and byte position); else
  the answer says where it ends, and the primary sends from there. A resend of bytes the copy
  holds (after a lost answer) is answered so too, and stores nothing twice.
- **One primary's records per copy.** A segment's records are all written by one primary, from
  its first byte: the one that led it when it held none (a claim seals a segment that holds
  records, or leads it on empty at the new epoch). Each copy knows whose they are: its **data
  epoch**, which a fence does not change (a copy fenced late, after the claim went on without
  it, still holds the older primary's records at the new epoch). A request carries the data
  epoch of its records (a claimer completing copies sends the older primary's, at its own
  epoch): a copy holding another primary's records cuts them all first (``replicate_step``),
  however far into the segment the request starts, and a copy holding none takes the
  request's data epoch before its records. The records cut never reached a quorum: every
  acknowledged record is on a quorum of copies of one data epoch, which the claim's fence
  meets, and the claim goes on with the latest data epoch it finds
  (``logbroker.replication.core.claims``). Rot is never cut (the storage engine refuses).

And the rule for reading: **stale copies are never served.** A copy counts (for reads, fetches,
reads of committed records, producer stamps) only if its node is in the segment's replica set
and the copy is at the segment's epoch (``trusted``); of such a copy only records known to be
committed are served (``committed_end``), and a copy hears how far they are committed only from
a primary whose records it holds.
"""

from __future__ import annotations

from enum import Enum, auto

import attrs

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.replication.replica_codec import CopyOutcome, ReplicateRequest
from logbroker.storage import CopyState


@attrs.frozen
class CopyView:
    """What a node knows of its copy of one segment: its state (``None``: no copy), the epoch it
    is at and the data epoch of its records (``None``: unknown, its marker unreadable), whether
    it is damaged, where its records end, and, for the copy taking appends, where its bytes end
    once what it was sent is written (``tail_offset``, ``tail_position``) and where they are
    durable (``durable_offset``)."""

    state: CopyState | None
    epoch: int | None
    data_epoch: int | None = None
    damaged: bool = False
    next_offset: int = 0
    tail_offset: int = 0
    tail_position: int = 0
    durable_offset: int = 0


class Authority(Enum):
    ACCEPT = auto()
    FENCED = auto()
    UNKNOWN = auto()


def older_epoch(epoch: int, current: int) -> bool:
    """Whether a request at ``epoch`` comes from before ``current``: it is refused."""
    return epoch < current


def authority(record: SegmentMeta | None, epoch: int, sender: str) -> Authority:
    """Whether ``sender`` may write the segment at ``epoch``, as this node's view of the
    control plane has the segment's ``record``."""
    if record is None or older_epoch(record.epoch, epoch):
        return Authority.UNKNOWN
    if older_epoch(epoch, record.epoch) or record.replicas[0] != sender:
        return Authority.FENCED
    return Authority.ACCEPT


class Step(Enum):
    """The next thing to do with a replicate request's bytes."""

    #: Answer with the copy's status: ``outcome`` says which.
    ANSWER = auto()
    #: Record the commit index the primary sent (a commit notice), then answer ``ok``.
    NOTE_COMMIT = auto()
    #: Start a copy of the segment at the request's epoch (closing the active one), then
    #: decide again.
    START = auto()
    #: Record the request's epoch, cut every byte of the copy (another primary's records, or
    #: none), and take the request's data epoch; then decide again. Another primary's records
    #: share no byte with the request's, even where the request starts later in the segment
    #: (the messages before it lost on the way): the copy answers that it is empty, and the
    #: primary sends from the start.
    CUT = auto()
    #: Append the bytes at ``epoch``.
    APPEND = auto()
    #: The copy cannot take bytes now: its epoch is unknown (its marker unreadable) until it
    #: is fenced again.
    UNAVAILABLE = auto()


@attrs.frozen
class Decision:
    step: Step
    outcome: CopyOutcome = CopyOutcome.OK
    #: The epoch an ``APPEND`` is stored at.
    epoch: int = 0


def replicate_step(
    view: CopyView, request: ReplicateRequest, sender: str, record: SegmentMeta | None
) -> Decision:
    """What to do with ``request`` (from ``sender``) given this node's ``view`` of its copy and
    its control plane's ``record`` of the segment."""
    allowed = authority(record, request.epoch, sender)
    if allowed is Authority.FENCED:
        return Decision(Step.ANSWER, CopyOutcome.FENCED)
    if allowed is Authority.UNKNOWN:
        return Decision(Step.ANSWER, CopyOutcome.UNKNOWN)
    if not request.data:
        if view.state is CopyState.ACTIVE and view.epoch is not None:
            if older_epoch(request.epoch, view.epoch):
                return Decision(Step.ANSWER, CopyOutcome.FENCED)
            if request.epoch == view.epoch and view.data_epoch == request.data_epoch:
                # Only a primary whose records the copy holds says how far they are committed.
                return Decision(Step.NOTE_COMMIT)
        return Decision(Step.ANSWER, CopyOutcome.OK)
    if view.state is CopyState.SEALED:
        # The segment is over here: whoever still sends to it is stale.
        return Decision(Step.ANSWER, CopyOutcome.FENCED)
    if view.state is not CopyState.ACTIVE:
        return Decision(Step.START)
    if view.epoch is None or view.data_epoch is None:
        return Decision(Step.UNAVAILABLE)
    if older_epoch(request.epoch, view.epoch):
        return Decision(Step.ANSWER, CopyOutcome.FENCED)
    if view.data_epoch != request.data_epoch:
        # Another primary's records (or none, under another's name): cut, and named anew.
        return Decision(Step.CUT)
    if request.offset == view.tail_offset and request.position == view.tail_position:
        # Stored at the epoch these rules let through (the request's, as they stand): the
        # storage engine refuses an epoch older than the copy's once more.
        return Decision(Step.APPEND, epoch=max(request.epoch, view.epoch))
    if request.offset < view.tail_offset and request.epoch > view.epoch:
        # The same primary's records, but the copy missed this claim's fence: it was not
        # counted, and may hold more of them than the claim kept. Sent again from the start.
        return Decision(Step.CUT)
    return Decision(Step.ANSWER, CopyOutcome.MISMATCH)


def trusted(view: CopyView, record: SegmentMeta, node_id: str) -> bool:
    """Whether this node's copy of ``record``'s segment may be served or believed at all: the
    node is in the segment's replica set, and the copy is undamaged and at the segment's epoch
    (its bytes are then a prefix of what one primary wrote). Of a sealed segment, the copy
    must be sealed too, or written at the sealed epoch (``seals_in_place``): a copy still
    open, fenced at the epoch a claim sealed it at, may hold another primary's records than
    the sealed ones."""
    return (
        view.state is not None
        and not view.damaged
        and node_id in record.replicas
        and view.epoch == record.epoch
        and (
            record.state is not SegmentState.SEALED
            or view.state is CopyState.SEALED
            or seals_in_place(view, record)
        )
    )


def seals_in_place(view: CopyView, record: SegmentMeta) -> bool:
    """Whether a copy still open may be sealed to ``record``'s seal without a seal request from
    the primary that sealed it: only if it is at the sealed epoch and holds the sealed records'
    primary's records (``SegmentMeta.records_epoch``: a claim records whose it sealed), not a
    copy fenced after the claim went on without it."""
    return view.epoch == record.epoch and view.data_epoch == record.records_epoch


def known_commit(told: int, durable: int) -> int:
    """How far a replica may take its copy as committed (what its readers may see): the
    commit index its primary told it, as far as the copy holds it durably. Never its durable
    end alone: a record there may be on no other copy, and be cut by the next claim."""
    return min(told, durable)


def committed_end(view: CopyView, record: SegmentMeta, node_id: str, commit: int) -> int:
    """Where the records of this copy that are known to be committed end (the segment's base:
    none). ``commit`` is the commit index the copy last heard from its primary.

    Only a trusted copy counts. Of a sealed segment, its records up to the sealed end are
    committed; of the active segment, those below the commit index its primary last sent (only
    a copy still appending to it has heard it)."""
    base = record.base_offset
    if not trusted(view, record, node_id):
        return base
    appending = view.state is CopyState.ACTIVE
    held = min(view.durable_offset, commit) if appending else view.next_offset
    if record.state is SegmentState.SEALED:
        assert record.record_count is not None
        return min(held if appending else view.next_offset, base + record.record_count)
    return held if appending else base


def holds_whole(view: CopyView, record: SegmentMeta, node_id: str, end: int) -> bool:
    """Whether this node's copy of ``record``'s segment can serve its records up to ``end``."""
    return trusted(view, record, node_id) and view.next_offset >= end


def stale(view: CopyView, record: SegmentMeta | None, node_id: str) -> bool:
    """Whether this node's copy is of a segment it should not hold: sealed in the control plane
    on a replica set without this node (it was dropped from it, or the copy was left behind by
    a takeover). Such a copy is deleted once the replica set holds the segment whole."""
    return view.state is not None and record is not None and left_behind(record, node_id)


def left_behind(record: SegmentMeta, node_id: str) -> bool:
    """Whether a copy of ``record``'s segment on ``node_id`` would be stale (``stale``)."""
    return record.state is SegmentState.SEALED and node_id not in record.replicas
