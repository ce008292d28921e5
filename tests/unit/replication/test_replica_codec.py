"""The replication ops' payloads: exact bytes, strict decoding, and the data checksum."""

from __future__ import annotations

import pytest
from crc32c import crc32c

from logbroker.peer.frames import MalformedPeerMessage, encode_text
from logbroker.replication.replica_codec import (
    CommittedRecords,
    CopyOutcome,
    CopyStatus,
    FenceRequest,
    FetchRequest,
    ReplicateRequest,
    SealRequest,
    decode_committed,
    decode_fence,
    decode_fetch,
    decode_replicate,
    decode_seal,
    decode_status,
    encode_committed,
    encode_fence,
    encode_fetch,
    encode_replicate,
    encode_seal,
    encode_status,
)


def test_replicate_bytes_are_pinned() -> None:
    request = ReplicateRequest("r1", 100, 3, 150, 4096, 140, b"batch", data_epoch=2)
    encoded = encode_replicate(request)
    assert encoded == (
        encode_text("r1")
        + (100).to_bytes(8, "big")
        + (3).to_bytes(8, "big")
        + (2).to_bytes(8, "big")
        + (150).to_bytes(8, "big")
        + (4096).to_bytes(8, "big")
        + (140).to_bytes(8, "big")
        + crc32c(b"batch").to_bytes(4, "big")
        + b"batch"
    )
    assert decode_replicate(encoded) == request


def test_replicated_data_damaged_on_the_way_is_refused() -> None:
    encoded = bytearray(encode_replicate(ReplicateRequest("r1", 0, 1, 0, 0, 0, b"batch")))
    encoded[-1] ^= 0x01
    with pytest.raises(MalformedPeerMessage, match="fails its checksum"):
        decode_replicate(bytes(encoded))


@pytest.mark.parametrize(
    ("request_", "encode", "decode"),
    [
        (FenceRequest("r1", 10, 2), encode_fence, decode_fence),
        (SealRequest("r1", 10, 2, 40, 9000, data_epoch=1), encode_seal, decode_seal),
        (FetchRequest("r1", 10, 3, 20, 512, 1 << 20, data_epoch=2), encode_fetch, decode_fetch),
    ],
)
def test_requests_round_trip_and_refuse_trailing_bytes(request_, encode, decode) -> None:  # type: ignore[no-untyped-def]
    encoded = encode(request_)
    assert decode(encoded) == request_
    with pytest.raises(MalformedPeerMessage):
        decode(encoded + b"\x00")
    with pytest.raises(MalformedPeerMessage):
        decode(encoded[:-1])


def test_status_bytes_are_pinned() -> None:
    status = CopyStatus(CopyOutcome.MISMATCH, 4, 200, 8192, data_epoch=3)
    encoded = encode_status(status)
    assert encoded == b"\x02" + b"".join(n.to_bytes(8, "big") for n in (4, 3, 200, 8192))
    assert decode_status(encoded) == status
    # Unless said, a copy's records are its epoch's.
    assert CopyStatus(CopyOutcome.OK, 4, 0, 0).data_epoch == 4


def test_an_unknown_outcome_is_malformed() -> None:
    with pytest.raises(MalformedPeerMessage, match="unknown copy outcome 9"):
        decode_status(b"\x09" + bytes(32))


def test_fields_must_fit_their_width() -> None:
    with pytest.raises(ValueError, match="epoch"):
        FenceRequest("r1", 0, 1 << 64)


def test_a_read_committed_answer_is_its_end_then_its_batches() -> None:
    answer = CommittedRecords(77, b"batches")
    encoded = encode_committed(answer)
    assert encoded == (77).to_bytes(8, "big") + b"batches"
    assert decode_committed(encoded) == answer
    assert decode_committed((5).to_bytes(8, "big")) == CommittedRecords(5, b"")
    with pytest.raises(MalformedPeerMessage):
        decode_committed(b"\x00" * 7)


def test_a_commit_notice_is_a_replicate_request_without_data() -> None:
    notice = ReplicateRequest("r1", 0, 2, 40, 4096, 40, b"")
    assert decode_replicate(encode_replicate(notice)) == notice
