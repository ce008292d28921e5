"""A replicated range's roll: the appends made while it runs wait for it, then go on together,
and the copies are sealed behind the appends of the next segment."""

from __future__ import annotations

from twisted.internet.defer import Deferred

from logbroker.peer.frames import PeerOp
from logbroker.records import Record
from logbroker.replication.leading import LeadRanges
from logbroker.replication.replica_codec import decode_replicate
from logbroker.storage import CopyState
from tests.unit.replication.harness import RANGE, Cluster, cluster
from tests.unit.storage.helpers import result_of


def data_messages_to(world: Cluster, node: str) -> list[tuple[int, int]]:
    """From now on, each replicate message with records that ``node`` is sent, as its segment
    and the bytes it carries."""
    seen: list[tuple[int, int]] = []
    replicate = world.peers.ops[node][PeerOp.REPLICATE]

    def counted(sender: str, payload: bytes) -> Deferred[bytes]:
        request = decode_replicate(payload)
        if request.data:
            seen.append((request.segment, len(request.data)))
        return replicate(sender, payload)

    world.peers.ops[node][PeerOp.REPLICATE] = counted
    return seen


def led_with_one_record() -> tuple[Cluster, LeadRanges]:
    """The range led by ``a``, its first segment holding one committed record."""
    world = cluster()
    lead = world.lead("a")
    first = lead.handle(RANGE).append([Record(b"first")])
    world.settle()
    assert result_of(first) is None
    return world, lead


def test_the_appends_that_waited_for_a_roll_go_to_the_replicas_together() -> None:
    world, lead = led_with_one_record()
    handle = lead.handle(RANGE)
    assert handle.roll()
    waiting = [handle.append([Record(b"%d" % n)]) for n in range(5)]
    sent_to_b = data_messages_to(world, "b")

    world.settle()

    assert [result_of(appended) for appended in waiting] == [None] * 5
    assert [segment for segment, _ in sent_to_b] == [1], (
        "one message for all five: each waited for the one before it to commit"
    )
    assert world.storages["b"].logs[RANGE].durable_offset == 6
    lead.stop()


def test_every_copy_of_a_rolled_segment_is_sealed_once_the_roll_settles() -> None:
    world, lead = led_with_one_record()

    assert lead.handle(RANGE).roll()
    world.settle()

    for node in "abc":
        copy = world.storages[node].logs[RANGE].segment(0)
        assert copy is not None
        assert (copy.state, copy.record_count) == (CopyState.SEALED, 1), node
    lead.stop()
