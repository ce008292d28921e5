"""How a node comes to lead a segment, decided: the pure rules behind
``logbroker.replication.takeover`` (which only carries them out: control-plane writes, fences,
fetches). No I/O, no clock, no Deferreds.

A node leads a segment only within a **claim**: a compare-and-swap in the control plane that
bumps the segment's epoch and puts the claiming node first (``claimed``), expecting exactly the
record the node read, so that of two nodes claiming from one record one wins. It claims:

- when it is first in the segment's replica set and does not lead it in this process (it
  restarted, the segment was just placed, or another replica resigned to it);
- when the segment's primary is dead and it is the first live replica (``should_take_over``).

Then it fences every replica at the new epoch; from the answers (``fence_outcome``) it needs a
quorum, its own copy among them. A segment's records are all one primary's, and each copy says
whose (its data epoch, which a fence leaves as it was: ``logbroker.replication.core.replica``).
Every acknowledged record is on a quorum of copies of one data epoch, and no later primary
wrote records of its own there (its claim's fence met one of those copies, which held
records), so the latest data epoch among a quorum's answers is theirs, and the longest of those
copies holds every acknowledged record (``seal_point``); copies of an older data epoch count as
empty (their records never reached a quorum, and are cut before they take any). The claiming
node completes its own copy to that end from the copy that has it, then:

- if the segment holds records, it is **sealed** at that end (``sealed``) once a quorum holds
  them all, and the next segment opens at that offset (``next_segment``): on the live members
  of the old replica set, completed by placement, this node first; recorded only if no node
  recorded it first. If no quorum takes them within the ack timeout, it is sealed all the
  same only when its copy knows every one of them committed (``seals_in_doubt``); otherwise
  the claim fails and is tried again later;
- if it holds none, it is led on at the new epoch (``kept_answered``). A copy that did not
  answer stays in the replica set unless placement has a live node to put in its place: the
  leader sends it the segment from its start once it is back, and the replica rules cut the
  bytes an older primary left there, never acknowledged, before it takes any
  (``logbroker.replication.core.replica``), so no copy mixes two primaries' bytes. Taking a
  dead member out where nothing can replace it would cost a control-plane change per segment
  at the failover and another to put it back after its return (decision 0014).

A node also claims, a few at a time, the active segments of the ranges it is the **preferred
leader** of (``should_take_back``, ``logbroker.placement.preferred_leader``) while another live
node leads them: a failover leaves a dead primary's ranges with one survivor, and without this
they stay there, so that after a few failures one node led nearly every range and each later
failure moved thousands of ranges at once (decision 0026). Such a claim is the same claim,
with the same fence: only when to make it differs.

A node that should not lead a segment steps aside (``stepped_aside``: it moves to the end of
the replica set, at the same epoch, so the next member claims): its copy is damaged, it cannot
reach a quorum of replicas that are alive (a node cut off from its peers but not from etcd), or
its claim's fence found no quorum for the same reason (``steps_aside_after``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.placement import (
    PlacementNode,
    PlacementRule,
    preferred_leader,
    replace,
    segment_key,
)
from logbroker.replication.core.quorum import CopyEnd
from logbroker.replication.replica_codec import CopyOutcome, CopyStatus


def should_take_over(meta: SegmentMeta, node_id: str, is_live: Callable[[str], bool]) -> bool:
    """Whether ``node_id`` should claim ``meta`` because its primary is dead and this node is
    the first live member of its replica set."""
    if node_id not in meta.replicas or meta.replicas[0] == node_id:
        return False
    if is_live(meta.replicas[0]):
        return False
    return next((n for n in meta.replicas if is_live(n)), None) == node_id


def should_take_back(meta: SegmentMeta, node_id: str, is_live: Callable[[str], bool]) -> bool:
    """Whether ``node_id`` should claim ``meta`` from its live primary to lead the range again:
    the segment is active, this node is its preferred leader and not its primary, and every
    member of its replica set is alive (a claim while one is dead would leave the range on
    fewer copies than it has, and that node's return would move it again)."""
    return (
        meta.state is SegmentState.ACTIVE
        and meta.replicas[0] != node_id
        and node_id in meta.replicas
        and preferred_leader(meta.range_id, meta.replicas) == node_id
        and all(is_live(node) for node in meta.replicas)
    )


def live_quorum(meta: SegmentMeta, is_live: Callable[[str], bool], quorum: int) -> bool:
    """Whether enough members of ``meta``'s replica set are alive for a claim's fence to
    reach a quorum. A claim without one is not recorded: it would bump the epoch for nothing,
    again at every try, until a member came back."""
    return sum(1 for node in meta.replicas if is_live(node)) >= quorum


def claimed(meta: SegmentMeta, node_id: str) -> SegmentMeta | None:
    """``meta`` claimed by ``node_id``: the next epoch, this node first. ``None`` if this node
    is not in the replica set (it holds no copy to lead from)."""
    if node_id not in meta.replicas:
        return None
    others = tuple(node for node in meta.replicas if node != node_id)
    return attrs.evolve(meta, epoch=meta.epoch + 1, replicas=(node_id, *others))


def stepped_aside(meta: SegmentMeta, node_id: str) -> SegmentMeta:
    """``meta`` with ``node_id`` moved to the end of the replica set, at the same epoch: the
    next member leads it (by claiming it)."""
    others = tuple(node for node in meta.replicas if node != node_id)
    return attrs.evolve(meta, replicas=(*others, node_id))


@attrs.frozen
class Ends:
    """A quorum answered the fence: where each answering copy ends, of the records the claim
    goes on with (a copy holding another primary's counts as empty), and whose those are
    (their data epoch; the claim's own epoch when no copy holds any)."""

    ends: Mapping[str, CopyEnd]
    data_epoch: int


@attrs.frozen
class FencedOut:
    """A copy is fenced at a later epoch than the claim's: another node claimed since."""

    node: str
    epoch: int


@attrs.frozen
class NoQuorum:
    """Fewer copies than a quorum (or not this node's own) took the fence; ``silent`` did not
    answer it."""

    answered: int
    silent: tuple[str, ...]


FenceOutcome = Ends | FencedOut | NoQuorum


def fence_outcome(
    meta: SegmentMeta,
    answers: Mapping[str, CopyStatus | None],
    node_id: str,
    quorum: int,
) -> FenceOutcome:
    """What the answers to a fence at ``meta.epoch`` (``None``: no answer) allow."""
    taken: dict[str, CopyStatus] = {}
    for node in meta.replicas:
        status = answers.get(node)
        if status is None:
            continue
        if status.outcome is CopyOutcome.FENCED:
            return FencedOut(node, status.epoch)
        if status.outcome is CopyOutcome.OK:
            taken[node] = status
    if node_id not in taken or len(taken) < quorum:
        silent = tuple(node for node in meta.replicas if node not in taken)
        return NoQuorum(len(taken), silent)
    base = meta.base_offset
    data_epoch = max(
        (status.data_epoch for status in taken.values() if status.end_offset > base),
        default=meta.epoch,
    )
    ends = {
        node: CopyEnd(status.end_offset, status.end_position)
        if status.data_epoch == data_epoch
        else CopyEnd(base, 0)
        for node, status in taken.items()
    }
    return Ends(ends, data_epoch)


def seal_point(ends: Mapping[str, CopyEnd], claimer: str) -> tuple[str, CopyEnd]:
    """Where the claimer of a segment seals it (after completing its own copy to there): at
    the copy that ends longest among a quorum's answers, which holds every acknowledged record
    (and maybe some that never were: kept, harmlessly). Ties go to the claimer's own copy."""
    return max(
        ends.items(), key=lambda item: (item[1].offset, item[1].position, item[0] == claimer)
    )


def seals_in_doubt(seal_offset: int, known_commit: int) -> bool:
    """Whether a claimer may seal at ``seal_offset`` though no quorum took the records its copy
    holds there (within the ack timeout): only if every one of them is known committed (its
    copy heard a commit index that far). A record past that may be on the claimer's copy
    alone; sealed, it would be readable, and lost with that copy."""
    return known_commit >= seal_offset


def steps_aside_after(
    no_quorum: NoQuorum,
    meta: SegmentMeta,
    quorum: int,
    is_live: Callable[[str], bool],
    heard_recently: Callable[[str], bool],
) -> bool:
    """Whether a claim whose fence found no quorum should step aside: enough replicas are
    alive to form a quorum, but this node has not heard from the silent live ones for a lease
    TTL. It is likely the one cut off; another replica may reach a quorum."""
    live = sum(1 for node in meta.replicas if is_live(node))
    if live < quorum:
        return False
    silent_live = [node for node in no_quorum.silent if is_live(node)]
    return bool(silent_live) and not any(heard_recently(node) for node in silent_live)


def sealed(meta: SegmentMeta, end_offset: int, byte_size: int, data_epoch: int) -> SegmentMeta:
    """``meta`` sealed with its records (``data_epoch``'s primary's) up to ``end_offset`` in
    ``byte_size`` bytes."""
    return attrs.evolve(
        meta,
        state=SegmentState.SEALED,
        record_count=end_offset - meta.base_offset,
        byte_size=byte_size,
        data_epoch=None if data_epoch == meta.epoch else data_epoch,
    )


def kept_answered(
    meta: SegmentMeta,
    answered: Iterable[str],
    live_nodes: Iterable[PlacementNode],
    rule: PlacementRule,
) -> SegmentMeta:
    """An empty segment's replica set with the copies that did not answer the fence replaced
    by placement over the live nodes, up to the replication factor (so a set placed short
    while nodes were down is made whole on its next claim too); ``meta`` itself if placement
    has no node to add: the silent copies are kept, to be sent the segment once they answer.
    Raises ``PlacementError`` when the live nodes cannot make a set."""
    answered = set(answered)
    silent = set(meta.replicas) - answered
    candidates = [node for node in live_nodes if node.node_id not in silent]
    kept = tuple(node for node in meta.replicas if node in answered)
    placement = replace(segment_key(meta.range_id, meta.base_offset), kept, candidates, rule)
    if set(placement.replicas) <= set(meta.replicas):
        return meta
    return attrs.evolve(meta, replicas=placement.replicas)


def next_segment(
    sealed_meta: SegmentMeta,
    node_id: str,
    live_nodes: Iterable[PlacementNode],
    rule: PlacementRule,
) -> SegmentMeta | None:
    """The segment that follows ``sealed_meta``, led by ``node_id``: on the live members of
    the old replica set, completed by placement, this node first, at epoch 0. ``None`` if
    this node is not alive in the view given. Raises ``PlacementError`` when the live nodes
    cannot make a set."""
    assert sealed_meta.record_count is not None
    base = sealed_meta.base_offset + sealed_meta.record_count
    keep = (node_id, *(node for node in sealed_meta.replicas if node != node_id))
    placement = replace(segment_key(sealed_meta.range_id, base), keep, live_nodes, rule)
    if placement.replicas[0] != node_id:
        return None
    return SegmentMeta(
        sealed_meta.range_id, base, SegmentState.ACTIVE, None, None, placement.replicas, 0
    )


def completed_set(
    meta: SegmentMeta, live_nodes: Sequence[PlacementNode], rule: PlacementRule
) -> SegmentMeta | None:
    """A sealed segment's replica set completed to the replication factor with live nodes it
    lacks (it was placed while nodes were down, or lost a member), its members kept in order;
    ``None`` if it needs no new member or no live node can be added. Raises
    ``PlacementError`` when no member is alive."""
    if len(meta.replicas) >= rule.replication_factor:
        return None
    # Members that are down keep their place (they come back, or are replaced once down for
    # long): ``replace`` keeps the members it is told are alive.
    live = {node.node_id: node for node in live_nodes}
    members = [live.get(member, PlacementNode(member)) for member in meta.replicas]
    candidates = [*members, *(node for node in live.values() if node.node_id not in meta.replicas)]
    key = segment_key(meta.range_id, meta.base_offset)
    placement = replace(key, meta.replicas, candidates, rule)
    if len(placement.replicas) <= len(meta.replicas):
        return None
    return attrs.evolve(meta, replicas=placement.replicas)
