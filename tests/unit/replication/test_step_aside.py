"""A node whose copy is damaged does not lead: it steps aside, an intact replica takes the
range over, epochs stop climbing, and the damaged copy is replaced once the segment is sealed."""

from __future__ import annotations

from typing import Any

from twisted.logger import formatEvent

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


def test_a_damaged_next_in_line_copy_steps_aside_and_is_replaced(
    logged_errors: list[dict[str, Any]],
) -> None:
    world = cluster()
    first = world.lead("a")
    for index in range(20):
        first.handle(RANGE).append([Record(b"value-%02d" % index)])
        world.settle()
    world.clock.advance(0.1)  # the commit notice of the last append
    world.settle()
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
