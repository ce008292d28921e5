"""A node whose copy is damaged does not lead: it steps aside, an intact replica takes the
range over, epochs stop climbing, and the damaged copy is replaced once the segment is sealed.
A claim whose quorum includes a damaged copy seals only what is known committed."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.logger import formatEvent

from logbroker.broker.errors import InDoubtError
from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.records import Record
from logbroker.replication.copies import CommittedCopies
from logbroker.replication.healing import Healer
from logbroker.replication.leading import LeadRanges
from logbroker.replication.replica import ReplicaServer
from logbroker.replication.takeover import SegmentClaims
from tests.unit.replication.harness import CONFIG, RANGE, Cluster, cluster
from tests.unit.storage.helpers import MemoryLogs, result_of


def _segment(world: Cluster, base: int = 0) -> SegmentMeta:
    return next(m for m in world.control.segments(RANGE) if m.base_offset == base)


def _restart_with_a_damaged_copy(world: Cluster, node: str) -> None:
    """``node``'s copy of the first segment rots in the middle; it restarts, and recovery
    finds the rot (its copy is closed there and then)."""
    storage = world.storages[node]
    path = f"/data/ranges/{RANGE}/{0:020d}.log"
    storage.fs.corrupt(path, storage.fs.size(path) // 2)
    restarted = MemoryLogs(
        storage.fs, clock=world.clock, executor=world.executors[node], config=CONFIG
    )
    world.storages[node] = restarted
    world.peers.ops[node] = ReplicaServer(node, restarted, world.control).ops


def _claim(world: Cluster, node: str) -> LeadRanges:
    context = world.context(node)
    lead = LeadRanges(context.storage, SegmentClaims(context), CommittedCopies(context), 1 << 20)
    lead.open([RANGE])
    for _ in range(80):
        world.settle()
        world.clock.advance(0.1)
    world.settle()
    return lead


def _lead_twenty_committed(world: Cluster) -> LeadRanges:
    """a leads the range, with twenty records committed on every copy."""
    first = world.lead("a")
    for index in range(20):
        first.handle(RANGE).append([Record(b"value-%02d" % index)])
        world.settle()
    world.clock.advance(0.1)  # the commit notice of the last append
    world.settle()
    return first


def test_a_damaged_next_in_line_copy_steps_aside_and_is_replaced(
    logged_errors: list[dict[str, Any]],
) -> None:
    world = cluster()
    _lead_twenty_committed(world)
    assert world.stored("c") == [b"value-%02d" % i for i in range(20)]
    _restart_with_a_damaged_copy(world, "b")
    world.peers.dead.add("a")
    before = _segment(world)

    # b is next in line, and its copy is damaged: it steps aside rather than claim again and
    # again (the epoch does not climb).
    b = _claim(world, "b")
    assert [formatEvent(e).split(" at byte")[0] for e in logged_errors] == [
        f"Integrity failure in /data/ranges/{RANGE}/{0:020d}.log"
    ]
    logged_errors.clear()
    stepped = _segment(world)
    assert stepped.replicas == ("a", "c", "b")
    assert stepped.epoch == before.epoch
    assert not b.leading()

    # c, now the first live replica, takes the range over from its intact copy: every
    # acknowledged record is kept, and the segment is sealed at its end (after the ack deadline:
    # b's copy cannot take the records it lacks, and a is down).
    c = _claim(world, "c")
    assert [h.range_id for h in c.leading()] == [RANGE]
    sealed = _segment(world)
    assert sealed.state is SegmentState.SEALED
    assert sealed.epoch == before.epoch + 1
    assert sealed.record_count == 20
    appended = c.handle(RANGE).append([Record(b"after")])
    world.settle()
    result_of(appended)

    # b's damaged copy is replaced by a whole one, byte for byte c's.
    result_of(Healer(world.context("b")).tick([RANGE]))
    world.settle()
    path = f"/data/ranges/{RANGE}/{0:020d}"
    b_fs, c_fs = world.storages["b"].fs, world.storages["c"].fs
    for suffix in (".log", ".index", ".sealed", ".epoch"):
        assert b_fs.read_file(path + suffix) == c_fs.read_file(path + suffix), suffix


def _failure_of(deferred: Deferred[object]) -> BaseException:
    failures: list[BaseException] = []
    deferred.addErrback(lambda failure: failures.append(failure.value))
    assert failures, "the Deferred has not failed"
    return failures[0]


def test_a_claim_does_not_seal_records_no_quorum_holds_until_one_does(
    logged_errors: list[dict[str, Any]],
) -> None:
    world = cluster()
    first = _lead_twenty_committed(world)
    # One more record reaches a's copy alone: it is refused in doubt, never acknowledged.
    world.peers.silent.update("bc")
    unacked = first.handle(RANGE).append([Record(b"unacked")])
    for _ in range(60):
        world.clock.advance(0.1)
        world.settle()
    assert isinstance(_failure_of(unacked), InDoubtError)
    assert world.storages["a"].logs[RANGE].committed_offset == 20
    first.stop()
    world.settle()
    # b comes back with its copy rotten in the middle: it answers a fence, but can take
    # nothing past the rot. c stays down.
    world.peers.silent.clear()
    world.peers.dead.add("c")
    _restart_with_a_damaged_copy(world, "b")
    before = _segment(world)

    # a claims anew: a fence quorum (a, b) answers, and a's copy is the longest. No quorum
    # takes the unacknowledged record, and a's copy does not know it committed: the segment
    # is not sealed there (a read would see a record that is on a's copy alone).
    a = _claim(world, "a")
    assert not a.leading()
    held = _segment(world)
    assert held.state is SegmentState.ACTIVE
    assert held.epoch == before.epoch + 1
    # A client's produce asks for a claim: it fails the same way, saying why.
    failed = a.prepare(RANGE)
    for _ in range(60):
        world.clock.advance(0.1)
        world.settle()
    assert "no quorum took its records from 20 to 21" in str(_failure_of(failed))
    assert _segment(world).state is SegmentState.ACTIVE

    # c comes back: the next claim commits the record on a and c, and seals there.
    world.peers.dead.discard("c")
    for _ in range(100):
        world.clock.advance(0.1)
        world.settle()
    a.sweep([RANGE])
    for _ in range(80):
        world.clock.advance(0.1)
        world.settle()
    assert [h.range_id for h in a.leading()] == [RANGE]
    sealed = _segment(world)
    assert sealed.state is SegmentState.SEALED
    assert sealed.record_count == 21
    assert world.stored("c")[-1] == b"unacked"
    assert [formatEvent(e).split(" at byte")[0] for e in logged_errors] == [
        f"Integrity failure in /data/ranges/{RANGE}/{0:020d}.log"
    ]
    logged_errors.clear()
