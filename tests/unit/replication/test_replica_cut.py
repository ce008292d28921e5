"""A replica's copy at an older epoch than the primary sending to it: every byte the older
epoch wrote is cut, however far into the segment the request starts (``Step.CUT``)."""

from __future__ import annotations

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.peer.frames import PeerOp
from logbroker.records import Record
from logbroker.replication.replica_codec import (
    CopyOutcome,
    CopyStatus,
    ReplicateRequest,
    decode_status,
    encode_replicate,
)
from logbroker.storage._format import encode_batch
from tests.unit.replication.harness import RANGE, cluster
from tests.unit.storage.helpers import result_of


def batch(first: int, value: bytes) -> bytes:
    return encode_batch(first, [Record(value, key=b"k")])


def test_a_request_past_the_start_cuts_the_whole_older_copy_and_is_sent_from_the_start() -> None:
    world = cluster()
    # c holds what a wrote at epoch 0, alone (a was cut off, and nothing was acknowledged).
    opening = world.storages["c"].open_range(RANGE)
    world.settle()
    copy = result_of(opening)
    starting = copy.start_segment(0, 0)
    world.settle()
    result_of(starting)
    old = batch(0, b"old-0") + batch(1, b"old-1")
    appending = copy.append_raw(0, old, epoch=0)
    world.settle()
    result_of(appending)
    # b claimed the segment at epoch 1 without c, and started it again, empty, on a and b.
    result_of(
        world.control.put_segment(
            SegmentMeta(RANGE, 0, SegmentState.ACTIVE, None, None, ("b", "a", "c"), 1)
        )
    )
    world.settle()
    # b's first message to c (offset 0, position 0) was lost; its second arrives: its offset
    # and position match where c's old bytes end, which must not make them b's.
    first = batch(0, b"new-0")
    second = batch(1, b"new-1")
    request = ReplicateRequest(RANGE, 0, 1, 1, len(first), 0, second)

    answering = world.peers.sent_by("b").request("c", PeerOp.REPLICATE, encode_replicate(request))
    world.settle()
    status = decode_status(result_of(answering))

    assert status == CopyStatus(CopyOutcome.MISMATCH, 1, 0, 0)
    assert copy.end_offset == 0
    # Sent from the start, the copy takes b's bytes only.
    resent = ReplicateRequest(RANGE, 0, 1, 0, 0, 0, first)
    answering = world.peers.sent_by("b").request("c", PeerOp.REPLICATE, encode_replicate(resent))
    world.settle()
    assert decode_status(result_of(answering)).outcome is CopyOutcome.OK
    assert copy.durable_offset == 1
    copy.commit(1)  # to read the copy's records here (its readers see committed ones only)
    assert [stored.record.value for stored in copy.read(0)] == [b"new-0"]
