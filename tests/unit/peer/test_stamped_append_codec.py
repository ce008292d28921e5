"""The peer protocol's stamped append (op 9, ``logbroker.peer.frames``): a range's share of
a ``produce_idempotent`` with its stamp, an op of its own beside the unchanged op 1."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbroker.peer.frames import MalformedPeerMessage, PeerOp
from logbroker.peer.range_ops import (
    AppendRequest,
    decode_stamped_append_request,
    encode_append_request,
)
from logbroker.records import ProducerStamp

u32s = st.integers(0, 0xFFFFFFFF)
u64s = st.integers(0, 0xFFFFFFFFFFFFFFFF)
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
blobs = st.binary(max_size=200)


def test_a_stamped_append_has_the_documented_bytes_and_op() -> None:
    request = AppendRequest("r-1", 2, b"RECORDS", ProducerStamp(0x0102030405060708, 9))

    assert request.op is PeerOp.STAMPED_APPEND == 9
    assert encode_append_request(request) == (
        b"\x00\x03r-1"  # range id
        b"\x01\x02\x03\x04\x05\x06\x07\x08"  # producer id
        b"\x00\x00\x00\x00\x00\x00\x00\x09"  # sequence
        b"\x00\x00\x00\x02"  # record count
        b"RECORDS"
    )


def test_an_unstamped_append_keeps_op_1_and_its_layout() -> None:
    request = AppendRequest("r-1", 2, b"RECORDS")

    assert request.op is PeerOp.APPEND == 1
    assert encode_append_request(request) == b"\x00\x03r-1\x00\x00\x00\x02RECORDS"


@given(texts, u64s, u64s, u32s, blobs)
def test_stamped_append_requests_round_trip(
    range_id: str, producer_id: int, sequence: int, count: int, records: bytes
) -> None:
    request = AppendRequest(range_id, count, records, ProducerStamp(producer_id, sequence))

    assert decode_stamped_append_request(encode_append_request(request)) == request


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"\x00\x03r-1" + bytes(15), id="stamp-cut-short"),
        pytest.param(b"\x00\x03r-1" + bytes(16) + b"\x00\x00\x00", id="count-cut-short"),
        pytest.param(b"\x00\x03r-", id="range-id-cut-short"),
    ],
)
def test_a_malformed_stamped_append_is_refused(payload: bytes) -> None:
    with pytest.raises(MalformedPeerMessage, match="stamped append request"):
        decode_stamped_append_request(payload)
