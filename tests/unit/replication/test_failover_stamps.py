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
