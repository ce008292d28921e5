"""Reads of committed records from a range's copies while its primary cannot serve them
(``CommittedCopies``, ``ReplicaServer.read_committed``, ``ClusterRanges``' fallback), and the
commit notices that tell replicas how far a range is committed.

Three in-process nodes replicate one range (``tests.unit.replication.harness``); ``a`` leads it,
then is lost along with the quorum, and ``b`` serves reads from the copies."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
from twisted.internet.defer import Deferred, fail

from logbroker import wire
from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import Bounds, RangeHandle, RangeRead
from logbroker.cluster.forwarding import ForwardedRange
from logbroker.cluster.ranges import ClusterRanges
from logbroker.config import SpreadPolicy
from logbroker.controlplane import SegmentState
from logbroker.errors import Reason
from logbroker.peer.frames import PeerOp
from logbroker.placement import PlacementRule
from logbroker.records import Record
from logbroker.replication.copies import POLL_SECONDS, CommittedCopies
from logbroker.replication.leading import LeadRanges
from logbroker.replication.replica_codec import (
    CommittedRecords,
    FetchRequest,
    decode_committed,
    encode_fetch,
)
from logbroker.replication.takeover import SegmentClaims
from tests.unit.replication.harness import CONFIG, RANGE, Cluster, cluster
from tests.unit.storage.helpers import failure_of, result_of, run_until_idle


def values(read: RangeRead) -> list[bytes]:
    payload = b"".join(wire.records_payload_parts(read.count, read.data, ""))
    return [record.value for record in wire.decode_records(payload).records]


def produce(world: Cluster, lead: LeadRanges, *batches: Sequence[bytes]) -> None:
    for batch in batches:
        appended = lead.handle(RANGE).append([Record(value) for value in batch])
        world.settle()
        assert result_of(appended) is None


def ranges_of(world: Cluster, node: str, holds_lease: bool = True) -> ClusterRanges:
    """``node``'s range directory, as a broker assembles it (``cluster.assembly``)."""
    context = world.context(node)
    lead = LeadRanges(
        context.storage, SegmentClaims(context), CommittedCopies(context), CONFIG.roll_bytes
    )
    return ClusterRanges(
        node,
        world.control,
        lead,
        lambda primary, range_id: ForwardedRange(range_id, primary, world.peers),
        context.live_nodes,
        PlacementRule(3, None, 1, SpreadPolicy.SOFT),
        lambda: holds_lease,
        copies=CommittedCopies(context),
    )


def read_committed(world: Cluster, node: str, offset: int, max_bytes: int) -> CommittedRecords:
    request = encode_fetch(FetchRequest(RANGE, 0, 0, offset, 0, max_bytes))
    answered = world.peers.request(node, PeerOp.READ_COMMITTED, request)
    world.settle()
    return decode_committed(result_of(answered))


def test_with_the_primary_and_the_quorum_lost_every_acknowledged_record_is_read_from_a_copy() -> (
    None
):
    world = cluster()
    lead = world.lead("a")
    produce(world, lead, [b"1", b"2"], [b"3"], [b"4", b"5"])
    # Let the commit notice of the last produce reach the replicas, then lose a and c.
    world.clock.advance(0.1)
    world.settle()
    world.peers.dead |= {"a", "c"}

    handle = ranges_of(world, "b").handle(RANGE)
    bounds = handle.bounds()
    read = handle.read(0, 100, 1 << 20)
    world.settle()

    assert result_of(bounds) == Bounds(0, 5, end_known=False)
    got = result_of(read)
    assert values(got) == [b"1", b"2", b"3", b"4", b"5"]
    assert got.next_offset == 5
    # Appends have no primary to go to: they fail, and store nothing.
    appended = handle.append([Record(b"6")])
    world.settle()
    assert failure_of(appended).value.reason is Reason.UNREACHABLE
    assert world.stored("b") == [b"1", b"2", b"3", b"4", b"5"]


def test_a_primary_without_its_lease_refuses_appends_and_reads_on_from_the_copies() -> None:
    world = cluster()
    produce(world, world.lead("a"), [b"1", b"2"])
    world.clock.advance(0.1)
    world.settle()

    handle = ranges_of(world, "a", holds_lease=False).handle(RANGE)
    refused = handle.refusal(1)
    read = handle.read(0, 100, 1 << 20)
    world.settle()

    assert refused is not None
    assert refused.reason is Reason.UNREACHABLE
    assert "no membership lease" in str(refused)
    assert values(result_of(read)) == [b"1", b"2"]


def test_a_node_catching_up_with_etcd_refuses_a_read_that_finds_nothing() -> None:
    # Its view of the control plane may end before segments it does not know yet: "no
    # records" there would tell a consumer that the range ends where the view does.
    world = cluster()
    produce(world, world.lead("a"), [b"1", b"2"])
    world.clock.advance(0.1)
    world.settle()
    following = [False]
    context = attrs.evolve(world.context("b"), control_follows=lambda: following[0])
    copies = CommittedCopies(context)

    found = copies.read(RANGE, 0, 100, 1 << 20)
    past = copies.read(RANGE, 2, 100, 1 << 20)
    world.settle()
    assert values(result_of(found)) == [b"1", b"2"], "what it finds it serves"
    error = failure_of(past).value
    assert isinstance(error, BrokerError)
    assert error.reason is Reason.UNREACHABLE
    assert "catching up with etcd" in str(error)

    following[0] = True
    again = copies.read(RANGE, 2, 100, 1 << 20)
    world.settle()
    assert result_of(again).count == 0


def test_a_replica_shows_only_what_it_was_told_is_committed() -> None:
    world = cluster()
    lead = world.lead("a")
    produce(world, lead, [b"1", b"2"])
    # The produce is acknowledged; no commit notice has gone out yet, so b knows only that
    # nothing is committed, though it holds both records durably.
    assert read_committed(world, "b", 0, 1 << 20) == CommittedRecords(0, b"")
    assert world.storages["b"].logs[RANGE].durable_offset == 2

    world.clock.advance(0.1)
    world.settle()

    answer = read_committed(world, "b", 0, 1 << 20)
    assert answer.end_offset == 2
    assert len(answer.data) > 0
    assert read_committed(world, "b", 0, 0) == CommittedRecords(2, b"")
    assert read_committed(world, "b", 2, 1 << 20) == CommittedRecords(2, b"")


def test_the_next_produce_tells_the_replicas_the_last_ones_commit() -> None:
    world = cluster()
    lead = world.lead("a")
    produce(world, lead, [b"1"], [b"2"])
    # No notice (the clock stands still): the second produce's message carried the first's
    # commit.
    assert read_committed(world, "c", 0, 1 << 20).end_offset == 1


def test_a_copy_left_at_an_older_epoch_serves_nothing_until_it_is_healed() -> None:
    world = cluster()
    produce(world, world.lead("a"), [b"1", b"2"])
    world.clock.advance(0.1)
    world.settle()
    assert read_committed(world, "c", 0, 1 << 20).end_offset == 2
    # c is down while b takes the range over (a is fenced): b seals segment 0 at epoch 2 on
    # a and b, and opens the next segment.
    world.peers.dead.add("c")
    world.lead("b")
    first = world.control.segments(RANGE)[0]
    assert (first.state, first.record_count) == (SegmentState.SEALED, 2)
    world.peers.dead.discard("c")

    # b's copy is sealed here; c's was never fenced at the sealed epoch, so it may hold bytes
    # nobody acknowledged: it serves none until healing has fetched or sealed it.
    sealed = read_committed(world, "b", 0, 1 << 20)
    assert sealed.end_offset == 2
    assert len(sealed.data) > 0
    assert read_committed(world, "c", 0, 1 << 20) == CommittedRecords(0, b"")


def test_a_segment_the_copy_does_not_hold_serves_nothing() -> None:
    world = cluster()
    produce(world, world.lead("a"), [b"1"])
    request = encode_fetch(FetchRequest(RANGE, 99, 0, 99, 0, 100))
    answered = world.peers.request("b", PeerOp.READ_COMMITTED, request)
    world.settle()
    assert decode_committed(result_of(answered)) == CommittedRecords(99, b"")


class Unreachable:
    """A primary that cannot be reached, counting what is asked of it."""

    range_id = RANGE

    def __init__(self, reason: Reason = Reason.UNREACHABLE) -> None:
        self.error = BrokerError(reason, "primary lost")
        self.waits = 0

    def refusal(self, count: int) -> BrokerError | None:
        return None

    def append(self, records: object, stamp: object = None) -> Deferred[None]:
        return fail(self.error)

    def bounds(self) -> Deferred[Bounds]:
        return fail(self.error)

    def read(self, offset: int, max_records: int, max_bytes: int) -> Deferred[RangeRead]:
        return fail(self.error)

    def wait(self, offset: int, wait_ms: int) -> Deferred[None]:
        self.waits += 1
        return fail(self.error)


def _over(world: Cluster, primary: RangeHandle) -> RangeHandle:
    ranges = ranges_of(world, "b")
    ranges.route = lambda range_id: primary  # type: ignore[method-assign]
    return ranges.handle(RANGE)


def test_once_a_read_went_to_the_copies_the_long_poll_waits_on_them() -> None:
    world = cluster()
    produce(world, world.lead("a"), [b"1"])
    primary = Unreachable()
    handle = _over(world, primary)
    read = handle.read(1, 10, 1000)
    world.settle()
    assert result_of(read).count == 0

    waiting = handle.wait(1, 30_000)
    assert primary.waits == 0, "a lost primary's wait would end at once"
    world.clock.advance(POLL_SECONDS - 0.01)
    assert not waiting.called
    world.clock.advance(0.01)
    assert result_of(waiting) is None


@pytest.mark.parametrize("reason", [Reason.INVALID_OPERATION, Reason.OFFSET_OUT_OF_RANGE])
def test_a_primary_that_answers_another_error_is_not_passed_over(reason: Reason) -> None:
    world = cluster()
    produce(world, world.lead("a"), [b"1"])
    handle = _over(world, Unreachable(reason))
    read = handle.read(0, 10, 1000)
    world.settle()
    assert failure_of(read).value.reason is reason


def test_with_no_live_copy_a_read_is_unreachable() -> None:
    world = cluster()
    produce(world, world.lead("a"), [b"1"])
    world.peers.dead |= {"a", "c"}
    ranges = ranges_of(world, "b")

    def disk_lost(payload: bytes) -> Deferred[bytes]:
        return fail(BrokerError(Reason.STORAGE_ERROR, "b's copy cannot be read"))

    world.peers.ops["b"][PeerOp.READ_COMMITTED] = disk_lost
    read = ranges.handle(RANGE).read(0, 10, 1000)
    world.settle()
    error = failure_of(read).value
    assert error.reason is Reason.UNREACHABLE
    assert "no live copy" in str(error)


def test_a_read_forwarded_to_a_primary_that_no_longer_leads_is_served_from_the_copies() -> None:
    # Its leadership moved after the forwarding node looked (a take-back, decision 0026).
    world = cluster()
    produce(world, world.lead("a"), [b"1", b"2"], [b"3"])
    world.clock.advance(0.1)
    world.settle()

    handle = _over(world, Unreachable(Reason.NOT_PRIMARY))
    read = handle.read(0, 100, 1 << 20)
    bounds = handle.bounds()
    appended = handle.append([Record(b"4")])
    world.settle()

    assert values(result_of(read)) == [b"1", b"2", b"3"]
    assert result_of(bounds).end == 3
    error = failure_of(appended).value
    assert error.reason is Reason.NOT_PRIMARY, "an append goes to the primary or fails"


def test_a_cursor_a_copy_served_is_within_the_primary_s_bounds_before_its_own_copy_is_durable() -> (
    None
):
    # A produce is committed once a quorum holds it durably, which need not include the
    # primary: b and c may fsync before a does. The copies then serve the records as committed;
    # a consumer reading there and moving to the primary must not be told its cursor is past
    # the range's end.
    world = cluster()
    lead = world.lead("a")
    produce(world, lead, [b"1", b"2"])
    handle = lead.handle(RANGE)
    appended = handle.append([Record(b"3")])
    replicas = [world.executors["b"], world.executors["c"]]
    run_until_idle(world.clock, replicas)  # a's own write is still queued
    assert result_of(appended) is None, "acknowledged by the quorum of b and c"
    world.clock.advance(0.1)  # the commit notice
    run_until_idle(world.clock, replicas)
    reading = CommittedCopies(world.context("b")).read(RANGE, 0, 100, 1 << 20)
    run_until_idle(world.clock, replicas)
    served = result_of(reading)
    assert values(served) == [b"1", b"2", b"3"]
    assert world.storages["a"].logs[RANGE].durable_offset == 2

    bounds = result_of(handle.bounds())
    assert bounds.end == served.next_offset == 3
    assert bounds.end_known
    # A long poll there waits for a's copy, and wakes once a holds it durably.
    polled = handle.wait(2, 30_000)
    assert not polled.called
    world.settle()
    assert polled.called
    reading = handle.read(2, 100, 1 << 20)
    world.settle()
    assert values(result_of(reading)) == [b"3"]


def test_a_node_whose_leadership_stopped_does_not_know_where_the_range_ends() -> None:
    # A node cut off loses its lease and stops leading; the others take the range over and
    # commit on. Back, its view of etcd may still name it the primary for a moment: the commit
    # index it knew is not the range's end, and a consumer's cursor read elsewhere is not past
    # it (the certification's follower was told invalid_cursor there).
    world = cluster()
    lead = world.lead("a")
    produce(world, lead, [b"1", b"2"], [b"3"])
    handle = lead.handle(RANGE)
    leading = handle.bounds()
    world.settle()
    assert result_of(leading) == Bounds(0, 3, end_known=True)

    leader = handle.leader
    assert leader is not None
    leader.step_down(BrokerError(Reason.UNREACHABLE, "this node holds no membership lease"))
    stopped = handle.bounds()
    world.settle()

    assert result_of(stopped) == Bounds(0, 3, end_known=False)


def test_a_node_whose_leader_stopped_during_a_roll_does_not_know_where_the_range_ends() -> None:
    # A roll waits for etcd to record the seal. Cut off from etcd meanwhile, the node loses its
    # lease and its leader stops; the others take the range over and commit on. Back with a
    # lease, the roll still waiting, the commit index it knew is not the range's end (the soak
    # at 8b9df27 was told invalid_cursor there twice, each time by the node back from etcd).
    world = cluster()
    lead = world.lead("a")
    produce(world, lead, [b"1", b"2"], [b"3"])
    handle = lead.handle(RANGE)
    world.store.hold()
    assert handle.roll()
    world.settle()
    assert handle.leads(world.control.last_segment(RANGE)), "the roll is under way"
    rolling = handle.bounds()
    assert result_of(rolling) == Bounds(0, 3, end_known=True), "it still leads the range"

    leader = handle.leader
    assert leader is not None
    leader.step_down(BrokerError(Reason.UNREACHABLE, "this node holds no membership lease"))
    stopped = handle.bounds()

    assert handle.leads(world.control.last_segment(RANGE)), "the roll is still under way"
    assert result_of(stopped) == Bounds(0, 3, end_known=False)
