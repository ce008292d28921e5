"""Stamped produces across a failover: the primary's stamped batches reach the replicas as they
are, and a node that takes the range over rebuilds its dedupe table from its copy before it
takes appends, so a retry of a produce the old primary stored is not stored again."""

from __future__ import annotations

from logbroker.records import ProducerStamp, Record
from tests.unit.replication.harness import RANGE, cluster
from tests.unit.storage.helpers import result_of

STAMP = ProducerStamp(0x5EED, 3)


def test_a_retry_after_a_failover_is_answered_without_being_stored_again() -> None:
    world = cluster()
    first = world.lead("a")
    sent = first.handle(RANGE).append([Record(b"x"), Record(b"y")], STAMP)
    world.settle()
    assert result_of(sent) is None
    # The replicas hold the primary's stamped batch as it wrote it.
    found = world.storages["b"].logs[RANGE].recent_stamps()
    world.settle()
    assert result_of(found) == [(STAMP, 0, 2)]

    second = world.lead("b")  # a failover: b claims the range at a newer epoch
    retry = second.handle(RANGE).append([Record(b"x"), Record(b"y")], STAMP)
    world.settle()

    assert result_of(retry) is None
    assert world.stored("b") == [b"x", b"y"]
    new = second.handle(RANGE).append([Record(b"z")], ProducerStamp(0x5EED, 4))
    world.settle()
    assert result_of(new) is None
    assert world.stored("b") == [b"x", b"y", b"z"]
    second.stop()


def test_a_new_primary_reads_the_stamps_of_segments_it_holds_no_copy_of() -> None:
    world = cluster("abcde")
    first = world.lead("a")
    stored = first.handle(RANGE).append([Record(b"x")], STAMP)
    world.settle()
    assert result_of(stored) is None
    # b and c are down when a rolls: the next segment goes to a and two nodes that hold
    # nothing of the first one.
    world.peers.dead |= {"b", "c"}
    first.handle(RANGE).roll()
    world.settle()
    [_, second] = world.control.segments(RANGE)
    assert second.replicas == ("a", "d", "e")
    # Then a is lost (and b and c are back): d takes the range over. The first try's answer
    # was lost with a, so the producer sends it again, through d.
    world.peers.dead = {"a"}
    taken = world.lead("d")
    retry = taken.handle(RANGE).append([Record(b"x")], STAMP)
    world.settle()

    assert result_of(retry) is None
    d_log = world.storages["d"].logs[RANGE]
    assert d_log.next_offset == 1, "the retry was answered without being stored again"
