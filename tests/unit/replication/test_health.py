"""The under-replicated count: every node counts the cluster's segments with fewer whole
copies on live nodes than the factor, asking the others what they lack; a node knows nothing
before its first count, and says what it lacks only once its healer has looked."""

from __future__ import annotations

import attrs
from twisted.internet.defer import succeed

from logbroker.controlplane import Range, RangeState, SegmentMeta, SegmentState, Topic
from logbroker.peer.frames import PeerOp
from logbroker.replication.healing import Healer
from logbroker.replication.health import REFRESH_SECONDS, ReplicationHealth
from logbroker.replication.replica import ReplicaServer
from logbroker.replication.replica_codec import decode_missing, encode_missing
from tests.unit.replication.harness import CONFIG, RANGE, Cluster, cluster
from tests.unit.replication.test_healing import ROLL_BYTES, append_each
from tests.unit.storage.helpers import MemoryLogs, result_of


def _health(world: Cluster, node: str) -> tuple[ReplicationHealth, Healer]:
    healer = Healer(world.context(node))
    health = ReplicationHealth(world.context(node), healer)
    world.peers.ops[node][PeerOp.COPY_HEALTH] = health.serve
    return health, healer


def _counted_once(world: Cluster, ranges: list[str]) -> tuple[ReplicationHealth, list[str]]:
    """``a``'s count, once every node's healer has looked at ``ranges`` and ``a`` has counted
    them (nothing under-replicated); and the ranges whose segments are read from then on."""
    a, a_healer = _health(world, "a")
    for node in "bc":
        _health(world, node)[1].tick(ranges)
    a_healer.tick(ranges)
    world.settle()
    result_of(a.refresh(ranges))
    assert a.count == 0
    read: list[str] = []
    segments = world.control.segments

    def counted(range_id: str) -> list[SegmentMeta]:
        read.append(range_id)
        return segments(range_id)

    world.control.segments = counted  # type: ignore[method-assign]
    return a, read


def _with_another_range() -> tuple[Cluster, str, SegmentMeta]:
    """A cluster whose range has sealed segments, and another range (its id) with an empty
    active segment (its record) on every node."""
    world = cluster()
    append_each(world, world.lead("a", ROLL_BYTES), 30)
    other = "s.0"
    topic = Topic("s", 8, 0, (other,))
    result_of(world.control.create_topic(topic, [Range(other, "s", 0, 256, RangeState.ACTIVE)]))
    placed = SegmentMeta(other, 0, SegmentState.ACTIVE, None, None, ("a", "b", "c"), 0)
    result_of(world.control.put_segment(placed))
    return world, other, placed


def test_the_count_follows_a_node_away_and_back_and_is_unknown_before_the_first() -> None:
    world = cluster()
    append_each(world, world.lead("a", ROLL_BYTES), 30)
    sealed = [m for m in world.control.segments(RANGE) if m.record_count]
    assert len(sealed) >= 3
    a, a_healer = _health(world, "a")
    _, b_healer = _health(world, "b")
    for healer in (a_healer, b_healer):
        healer.tick([RANGE])
    world.settle()

    assert a.count is None, "not counted yet"
    assert a.unavailable is None, "not counted yet"
    world.peers.dead.add("c")
    result_of(a.refresh([RANGE]))
    # Every segment names c, which is down: the sealed ones and the active one.
    assert a.count == len(sealed) + 1
    assert a.unavailable == 0, "a and b are a quorum of the active segment's set"

    # c is back with none of its copies (a new disk), and has not looked yet: asked what it
    # lacks, it answers once its healer has looked, not "nothing" before.
    world.peers.dead.discard("c")
    world.storages["c"] = MemoryLogs(
        clock=world.clock, executor=world.executors["c"], config=CONFIG
    )
    world.peers.ops["c"] = ReplicaServer("c", world.storages["c"], world.control).ops
    c, c_healer = _health(world, "c")
    world.clock.advance(2.0)
    asked = world.peers.request("c", PeerOp.COPY_HEALTH, b"")
    assert not asked.called
    c_healer.tick([RANGE])
    world.settle()  # c opens the range, looks, and fetches its copies
    assert sorted(decode_missing(result_of(asked))) == [(RANGE, m.base_offset) for m in sealed]

    result_of(a.refresh([RANGE]))
    result_of(c.refresh([RANGE]))
    assert (a.count, c.count) == (0, 0)


def test_a_range_is_unavailable_while_its_active_segment_lacks_a_live_quorum() -> None:
    world = cluster()
    append_each(world, world.lead("a", ROLL_BYTES), 3)
    a, a_healer = _health(world, "a")
    _, b_healer = _health(world, "b")
    for healer in (a_healer, b_healer):
        healer.tick([RANGE])
    world.settle()
    world.peers.dead.update({"b", "c"})
    result_of(a.refresh([RANGE]))
    assert a.unavailable == 1

    world.peers.dead.discard("b")
    world.clock.advance(REFRESH_SECONDS + 0.5)
    refreshed = a.refresh([RANGE])
    world.settle()
    result_of(refreshed)
    assert a.unavailable == 0


def test_a_count_with_nothing_changed_reads_no_range_again() -> None:
    world = cluster()
    append_each(world, world.lead("a", ROLL_BYTES), 30)
    a, read = _counted_once(world, [RANGE])
    segments = world.control.segments
    world.clock.advance(REFRESH_SECONDS)
    result_of(a.refresh([RANGE]))
    assert read == [], "what every node lacks, the members and the records are as they were"

    # c goes down: counted again, every segment short of it.
    world.peers.dead.add("c")
    world.clock.advance(REFRESH_SECONDS)
    result_of(a.refresh([RANGE]))
    assert read == [RANGE]
    assert a.count == len(
        [m for m in segments(RANGE) if m.record_count or m.state is SegmentState.ACTIVE]
    )


def test_a_count_after_a_change_reads_only_the_ranges_it_touched() -> None:
    world, other, placed = _with_another_range()
    a, read = _counted_once(world, [RANGE, other])
    assert a.unavailable == 0
    segments = world.control.segments
    # The other range's active segment placed short: only that range is read again, and the
    # totals keep what the first range added.
    short = attrs.evolve(placed, replicas=("a", "b"))
    result_of(world.control.put_segment(short, expected=placed))
    world.clock.advance(REFRESH_SECONDS)
    result_of(a.refresh([RANGE, other]))
    assert read == [other]
    assert (a.count, a.unavailable) == (1, 0)

    # b says it lacks a sealed segment of the first range: that range alone is read again.
    lacked = next(m for m in segments(RANGE) if m.record_count)
    world.peers.ops["b"][PeerOp.COPY_HEALTH] = lambda sender, payload: succeed(
        encode_missing([(RANGE, lacked.base_offset)])
    )
    read.clear()
    world.clock.advance(REFRESH_SECONDS)
    result_of(a.refresh([RANGE, other]))
    assert read == [RANGE]
    assert (a.count, a.unavailable) == (2, 0)

    # Both b and c down: every range is counted again, each short of them.
    world.peers.dead.update({"b", "c"})
    read.clear()
    world.clock.advance(REFRESH_SECONDS)
    result_of(a.refresh([RANGE, other]))
    assert sorted(read) == [RANGE, other]
    assert a.unavailable == 2
    assert a.count == 1 + len(
        [m for m in segments(RANGE) if m.record_count or m.state is SegmentState.ACTIVE]
    )


def test_a_node_whose_lease_lapses_while_a_count_runs_leaves_nothing_counted_behind() -> None:
    """A count takes the live members it began with: ``c`` dead only while the count read
    one range (its lease lapsed and it registered again before the next count) leaves that
    range counted as it was, not short of ``c`` until its records change."""
    world, other, placed = _with_another_range()
    a, read = _counted_once(world, [RANGE, other])
    # Its record changes (claimed anew on the same set): the next count reads it again.
    result_of(world.control.put_segment(attrs.evolve(placed, epoch=1), expected=placed))
    segments = world.control.segments

    def lapsing(range_id: str) -> list[SegmentMeta]:
        if range_id == other:
            world.peers.dead.add("c")
        return segments(range_id)

    world.control.segments = lapsing  # type: ignore[method-assign]
    world.clock.advance(REFRESH_SECONDS)
    result_of(a.refresh([RANGE, other]))
    assert read == [other]
    world.peers.dead.discard("c")  # registered again
    world.control.segments = segments  # type: ignore[method-assign]
    world.clock.advance(REFRESH_SECONDS)
    result_of(a.refresh([RANGE, other]))

    assert (a.count, a.unavailable) == (0, 0)
