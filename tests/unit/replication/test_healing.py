"""Healing a node back from an outage: every sealed segment it should hold is fetched, in
parallel, and put in place once, byte for byte its replicas' copies."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import attrs
from twisted.internet.defer import Deferred

from logbroker.controlplane import ControlPlane, SegmentMeta, SegmentState
from logbroker.records import Record
from logbroker.replication.healing import FULL_LOOK_SECONDS, Healer
from logbroker.replication.leading import LeadRanges
from logbroker.replication.replica_sets import FULL_LOOK_SECONDS as REPLICA_SETS_FULL_LOOK_SECONDS
from logbroker.replication.replica_sets import ReplicaSets
from logbroker.replication.takeover import ClaimContext
from tests.unit.replication.harness import RANGE, Cluster, cluster
from tests.unit.storage.helpers import result_of

#: Small segments: the range rolls every few appends.
ROLL_BYTES = 400


def append_each(world: Cluster, lead: LeadRanges, count: int) -> None:
    for index in range(count):
        result = lead.handle(RANGE).append([Record(b"value-%03d" % index, key=b"k")])
        world.settle()
        world.clock.advance(0.1)
        world.settle()
        result_of(result)


def test_a_node_back_from_an_outage_puts_each_missing_segment_in_place_once(
    logged: list[dict[str, Any]],
) -> None:
    world = cluster()
    lead = world.lead("a", ROLL_BYTES)
    append_each(world, lead, 2)
    world.peers.dead.add("c")  # c holds the first segment's start, active, as its last copy
    append_each(world, lead, 60)
    world.peers.dead.discard("c")
    replica_sets = ReplicaSets(world.context("a"), lead, 60.0, lambda: True)
    for _ in range(2):  # the first rolls the active segment back onto c; the second seals it
        replica_sets.tick([RANGE])
        world.settle()
    sealed = [m for m in world.control.segments(RANGE) if m.state is SegmentState.SEALED]
    assert len(sealed) >= 8, "enough segments to fetch many at once"
    assert all("c" in m.replicas for m in sealed), [
        (m.base_offset, m.replicas) for m in sealed if "c" not in m.replicas
    ]
    logged.clear()

    healer = Healer(world.context("c"))
    healer.tick([RANGE])
    world.settle()

    assert healer.missing == set()
    fetched = [e for e in logged if "whole" in e.get("log_format", "")]
    assert sorted(e["segment"] for e in fetched) == [m.base_offset for m in sealed]
    assert not [e for e in logged if "cannot be healed" in e.get("log_format", "")]
    a_fs, c_fs = world.storages["a"].fs, world.storages["c"].fs
    for meta in sealed:
        path = f"/data/ranges/{RANGE}/{meta.base_offset:020d}"
        for suffix in (".log", ".index", ".sealed", ".epoch"):
            assert c_fs.read_file(path + suffix) == a_fs.read_file(path + suffix), path + suffix


def test_a_roll_under_way_is_not_started_again_nor_logged_again_by_the_next_passes(
    logged: list[dict[str, Any]],
) -> None:
    world = cluster()
    lead = world.lead("a", ROLL_BYTES)
    world.peers.dead.add("c")
    append_each(world, lead, 7)  # the next segment is placed on a and b while c is away
    world.peers.silent.add("b")  # then a record b does not answer for: it is not committed
    # Its producer hears "in doubt" after the ack timeout; the leader keeps offering it to b.
    lead.handle(RANGE).append([Record(b"uncommitted", key=b"k")]).addErrback(lambda _: None)
    world.settle()
    active = world.control.segments(RANGE)[-1]
    assert (active.replicas, active.state) == (("a", "b"), SegmentState.ACTIVE)
    world.peers.dead.discard("c")
    replica_sets = ReplicaSets(world.context("a"), lead, 60.0, lambda: True)
    logged.clear()

    for _ in range(3):  # passes while the roll waits for that record to be committed
        replica_sets.tick([RANGE])
        world.settle()
    rolling = [e for e in logged if e.get("log_format", "").startswith("Rolling")]
    assert [e["range_id"] for e in rolling] == [RANGE]
    world.peers.silent.discard("b")
    for _ in range(20):  # the roll gave up after the ack timeout; the passes go on
        world.clock.advance(0.5)
        lead.sweep([RANGE])
        replica_sets.tick([RANGE])
        world.settle()

    active = world.control.segments(RANGE)[-1]
    assert (set(active.replicas), active.state) == ({"a", "b", "c"}, SegmentState.ACTIVE)


class _CountedReads:
    """A control plane that notes the ranges whose segments are read through it."""

    def __init__(self, control: ControlPlane) -> None:
        self._control = control
        self.read: list[str] = []

    def segments(self, range_id: str) -> list[SegmentMeta]:
        self.read.append(range_id)
        return self._control.segments(range_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._control, name)


class _Pass(Protocol):
    def tick(self, range_ids: Sequence[str]) -> Deferred[None]: ...


_P = TypeVar("_P", bound=_Pass)


def _counted_ticks(
    world: Cluster, node: str, make: Callable[[ClaimContext], _P]
) -> tuple[_P, Callable[[], list[str]]]:
    """The pass ``make`` makes on ``node``'s context, and a tick of it that says the ranges
    whose segments it read."""
    reads = _CountedReads(world.control)
    made = make(attrs.evolve(world.context(node), control=cast(ControlPlane, reads)))

    def tick() -> list[str]:
        reads.read.clear()
        result_of(made.tick([RANGE]))
        world.settle()
        return reads.read

    return made, tick


def test_between_full_looks_a_tick_looks_only_at_ranges_whose_records_changed() -> None:
    world = cluster()
    lead = world.lead("a", ROLL_BYTES)
    healer, tick = _counted_ticks(world, "c", Healer)

    assert tick() == [RANGE], "the first tick looks at every range"
    world.clock.advance(1)
    assert tick() == [], "nothing changed"

    append_each(world, lead, 12)  # rolls: segments sealed, their next ones opened
    assert tick() == [RANGE]
    assert healer.missing == set(), "c's copies were sealed with the others"
    assert tick() == []

    world.clock.advance(FULL_LOOK_SECONDS)
    assert tick() == [RANGE], "every range now and then"


def test_between_full_looks_the_replica_sets_tick_reads_only_ranges_whose_records_changed() -> None:
    world = cluster()
    lead = world.lead("a", ROLL_BYTES)
    _, tick = _counted_ticks(
        world, "a", lambda context: ReplicaSets(context, lead, 60.0, lambda: True)
    )

    assert tick() == [RANGE], "the first tick looks at every range"
    world.clock.advance(1)
    assert tick() == [], "nothing changed"

    append_each(world, lead, 12)  # rolls: segments sealed, their next ones opened
    assert tick() == [RANGE]
    assert tick() == []

    world.peers.dead.add("c")  # the live members changed
    assert tick() == [RANGE]
    assert tick() == []
    world.clock.advance(REPLICA_SETS_FULL_LOOK_SECONDS)
    assert tick() == [RANGE], "every range now and then"


def test_a_node_without_the_chores_reads_no_range_and_still_rolls_its_weak_sets() -> None:
    world = cluster("abcd")
    lead = world.lead("a", ROLL_BYTES)
    chores = [False]
    _, tick = _counted_ticks(
        world, "a", lambda context: ReplicaSets(context, lead, 60.0, lambda: chores[0])
    )

    assert tick() == [], "another node decides for the sealed segments"
    world.clock.advance(1)
    append_each(world, lead, 12)
    assert tick() == []

    # c is away for longer than replace_after: a's active segment names it, and is rolled onto
    # the live nodes (d takes c's place) by a's own look at the replica sets it leads.
    world.peers.dead.add("c")
    assert tick() == []
    world.clock.advance(61)
    assert tick() == []
    world.settle()
    active = world.control.segments(RANGE)[-1]
    assert set(active.replicas) == {"a", "b", "d"}

    # Given the chores, it looks at every range at once.
    chores[0] = True
    assert tick() == [RANGE]
