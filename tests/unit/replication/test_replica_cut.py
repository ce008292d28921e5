"""A replica's copy holding another primary's records than the one sending to it (at an older
epoch, or fenced late at the sender's): every byte of them is cut, however far into the
segment the request starts (``Step.CUT``), and such a copy is never sealed as the sender's."""

from __future__ import annotations

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.peer.frames import PeerOp
from logbroker.records import Record
from logbroker.replication.replica_codec import (
    CopyOutcome,
    CopyStatus,
    FenceRequest,
    ReplicateRequest,
    SealRequest,
    decode_status,
    encode_fence,
    encode_replicate,
    encode_seal,
)
from logbroker.storage import CopyState, RangeLog
from logbroker.storage._format import encode_batch
from tests.unit.replication.harness import RANGE, Cluster, cluster
from tests.unit.storage.helpers import result_of


def batch(first: int, value: bytes) -> bytes:
    return encode_batch(first, [Record(value, key=b"k")])


def older_records_left_on_c() -> tuple[Cluster, RangeLog, bytes]:
    """c holds two records a wrote at epoch 0, alone (a was cut off, and nothing was
    acknowledged); b claimed the segment at epoch 1 without c and led it on, empty, on a and b.
    The cluster, c's copy and a's records."""
    world = cluster()
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
    result_of(
        world.control.put_segment(
            SegmentMeta(RANGE, 0, SegmentState.ACTIVE, None, None, ("b", "a", "c"), 1)
        )
    )
    world.settle()
    return world, copy, old


def test_a_request_past_the_start_cuts_the_whole_older_copy_and_is_sent_from_the_start() -> None:
    world, copy, _ = older_records_left_on_c()
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


def test_a_copy_fenced_late_is_cut_and_never_sealed_with_the_older_primary_s_records() -> None:
    world, copy, old = older_records_left_on_c()
    # b's fence reaches c only now (c was stalled): c is at epoch 1, but its records are a's.
    fencing = world.peers.sent_by("b").request(
        "c", PeerOp.FENCE, encode_fence(FenceRequest(RANGE, 0, 1))
    )
    world.settle()
    fenced = decode_status(result_of(fencing))
    assert (fenced.epoch, fenced.data_epoch, fenced.end_offset) == (1, 0, 2)

    # b's own records at offsets 0 and 1 are the same size as a's: b's third lands exactly
    # where c's bytes end. Taken there, c would hold a's two records and b's third, and count
    # for b's first two.
    third = ReplicateRequest(RANGE, 0, 1, 2, len(old), 0, batch(2, b"new-2"))
    answering = world.peers.sent_by("b").request("c", PeerOp.REPLICATE, encode_replicate(third))
    world.settle()
    status = decode_status(result_of(answering))

    assert status == CopyStatus(CopyOutcome.MISMATCH, 1, 0, 0, data_epoch=1)
    assert copy.end_offset == 0
    assert copy.segment_data_epoch(0) == 1

    # Nor is a copy holding a's records sealed as b's: it is fetched whole.
    starting = copy.start_segment(0, 1, 0)
    world.settle()
    result_of(starting)
    appending = copy.append_raw(0, old, epoch=1)
    world.settle()
    result_of(appending)
    sealing = world.peers.sent_by("b").request(
        "c", PeerOp.SEAL, encode_seal(SealRequest(RANGE, 0, 1, 2, len(old), data_epoch=1))
    )
    world.settle()
    assert decode_status(result_of(sealing)).outcome is CopyOutcome.SHORT
    assert copy.segment(0) is not None
    assert copy.segment(0).state is not CopyState.SEALED
