"""The peer codecs (``logbroker.peer.frames``, ``logbroker.peer.range_ops``): exact bytes, round
trips, refusals.

The byte-level examples pin the layout the module docstring documents; the property tests check
that every message and op payload round-trips, through any chunking of the stream, one byte at a
time included, and that truncated, trailing and oversized input is refused.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from logbroker.peer import range_ops
from logbroker.peer.frames import (
    MAC_SIZE,
    NONCE_SIZE,
    PROTOCOL_VERSION,
    Hello,
    MalformedPeerMessage,
    PeerFrameDecoder,
    PeerFrameTooLarge,
    PeerMessage,
    PeerOp,
    PeerReason,
    Ping,
    Pong,
    Proof,
    Refuse,
    Request,
    Response,
    Welcome,
    decode_body,
    encode,
    encode_body,
)
from logbroker.peer.range_ops import (
    AppendRequest,
    AppendResult,
    BoundsRequest,
    BoundsResult,
    ReadRequest,
    ReadResult,
    decode_append_request,
    decode_append_result,
    decode_bounds_request,
    decode_bounds_result,
    decode_read_request,
    decode_read_result,
    encode_append_request,
    encode_append_result,
    encode_bounds_request,
    encode_bounds_result,
    encode_read_request,
    encode_read_result,
    read_records,
)
from logbroker.records import Record
from logbroker.wire import decode_wire_records, encode_wire_records

u8s = st.integers(0, 0xFF)
u16s = st.integers(0, 0xFFFF)
u32s = st.integers(0, 0xFFFFFFFF)
u64s = st.integers(0, 0xFFFFFFFFFFFFFFFF)
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
blobs = st.binary(max_size=200)

messages: st.SearchStrategy[PeerMessage] = st.one_of(
    st.builds(Hello, u16s, texts, texts, st.binary(min_size=NONCE_SIZE, max_size=NONCE_SIZE)),
    st.builds(Proof, st.binary(min_size=MAC_SIZE, max_size=MAC_SIZE)),
    st.just(Welcome()),
    st.builds(Refuse, texts, texts),
    st.builds(Request, u32s, u8s, blobs),
    st.builds(Response, u32s, blobs),
    st.builds(lambda cid, reason: Response(cid, error=reason), u32s, texts),
    st.builds(Ping, u64s),
    st.builds(Pong, u64s),
)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts})
    pieces, start = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[start:point])
        start = point
    return pieces


# -- exact bytes -----------------------------------------------------------------------------


def test_hello_bytes() -> None:
    nonce = bytes(range(32))
    body = b"\x01\x00\x03" + b"\x00\x02c1" + b"\x00\x02n1" + nonce
    assert encode(Hello(PROTOCOL_VERSION, "c1", "n1", nonce)) == struct.pack(">I", 43) + body


def test_request_and_response_bytes() -> None:
    assert encode_body(Request(7, PeerOp.READ, b"xy")) == b"\x05\x00\x00\x00\x07\x02xy"
    assert encode_body(Response(7, b"ok")) == b"\x06\x00\x00\x00\x07\x00ok"
    assert encode_body(Response(7, error="overloaded")) == (
        b"\x06\x00\x00\x00\x07\x01\x00\x0aoverloaded"
    )


def test_small_message_bytes() -> None:
    assert encode_body(Welcome()) == b"\x03"
    assert encode_body(Refuse("timeout", "")) == b"\x04\x00\x07timeout\x00\x00"
    assert encode_body(Ping(1)) == b"\x07" + (1).to_bytes(8, "big")
    assert encode_body(Pong(2)) == b"\x08" + (2).to_bytes(8, "big")
    assert encode_body(Proof(b"m" * 32)) == b"\x02" + b"m" * 32


def test_op_payload_bytes() -> None:
    append = AppendRequest("r-1", 2, b"RECORDS")
    assert encode_append_request(append) == b"\x00\x03r-1\x00\x00\x00\x02RECORDS"
    assert encode_append_result(AppendResult(2)) == b"\x00\x00\x00\x02"
    read = ReadRequest("r-1", 5, 10, 4096, 250)
    assert encode_read_request(read) == (b"\x00\x03r-1" + struct.pack(">QIII", 5, 10, 4096, 250))
    result = ReadResult(1, b"R", 6, 9)
    assert encode_read_result(result) == struct.pack(">IQQ", 1, 6, 9) + b"R"
    assert encode_bounds_request(BoundsRequest("r-1")) == b"\x00\x03r-1"
    assert encode_bounds_result(BoundsResult(5, 9)) == struct.pack(">QQ", 5, 9)
    assert encode_body(Request(7, PeerOp.BOUNDS, b"")) == b"\x05\x00\x00\x00\x07\x03"


# -- round trips -----------------------------------------------------------------------------


@given(messages)
def test_every_message_round_trips(message: PeerMessage) -> None:
    assert decode_body(encode_body(message)) == message


@given(st.lists(messages, max_size=8), st.lists(st.integers(0, 10_000), max_size=12))
def test_any_chunking_gives_the_same_messages(sent: list[PeerMessage], cuts: list[int]) -> None:
    stream = b"".join(encode(message) for message in sent)
    for pieces in (
        [stream],
        chunked(stream, cuts),
        [stream[i : i + 1] for i in range(len(stream))],
    ):
        decoder = PeerFrameDecoder()
        received = [message for piece in pieces for message in decoder.feed(piece)]
        assert received == sent
        assert decoder.buffered == 0


@given(texts, u32s, blobs)
def test_append_request_round_trips(range_id: str, count: int, records: bytes) -> None:
    request = AppendRequest(range_id, count, records)
    assert decode_append_request(encode_append_request(request)) == request


@given(u32s)
def test_append_result_round_trips(count: int) -> None:
    assert decode_append_result(encode_append_result(AppendResult(count))) == AppendResult(count)


@given(texts, u64s, u32s, u32s, u32s)
def test_read_request_round_trips(
    range_id: str, offset: int, max_records: int, max_bytes: int, wait_ms: int
) -> None:
    request = ReadRequest(range_id, offset, max_records, max_bytes, wait_ms)
    assert decode_read_request(encode_read_request(request)) == request


@given(u32s, blobs, u64s, u64s)
def test_read_result_round_trips(count: int, records: bytes, next_: int, end: int) -> None:
    result = ReadResult(count, records, next_, end)
    assert decode_read_result(encode_read_result(result)) == result


@given(texts)
def test_bounds_request_round_trips(range_id: str) -> None:
    request = BoundsRequest(range_id)
    assert decode_bounds_request(encode_bounds_request(request)) == request


@given(u64s, u64s)
def test_bounds_result_round_trips(start: int, end: int) -> None:
    result = BoundsResult(start, end)
    assert decode_bounds_result(encode_bounds_result(result)) == result


records = st.builds(
    Record,
    st.binary(max_size=20),
    st.none() | st.binary(max_size=8),
    u64s,
    st.lists(st.tuples(st.none() | st.binary(max_size=4), st.none() | st.binary(max_size=4)))
    .map(tuple)
    .filter(lambda headers: len(headers) < 4),
)


@given(st.lists(records, max_size=6))
def test_an_appends_records_are_read_as_the_bytes_they_came_in(values: list[Record]) -> None:
    sent = encode_wire_records(values)
    read = read_records(sent.count, sent.data)
    assert read == sent
    assert decode_wire_records(read) == tuple(values)


def test_records_with_a_wrong_count_are_refused() -> None:
    sent = encode_wire_records([Record(b"a"), Record(b"b")])
    with pytest.raises(MalformedPeerMessage):
        read_records(sent.count + 1, sent.data)
    with pytest.raises(MalformedPeerMessage):
        read_records(sent.count - 1, sent.data)
    with pytest.raises(MalformedPeerMessage, match="cannot fit"):
        read_records(0xFFFFFFFF, sent.data)


# -- refusals --------------------------------------------------------------------------------


def test_an_oversized_length_prefix_is_refused_before_buffering() -> None:
    decoder = PeerFrameDecoder(max_frame_size=100)
    with pytest.raises(PeerFrameTooLarge) as caught:
        decoder.feed(struct.pack(">I", 101) + b"x" * 50)
    assert caught.value.reason is PeerReason.FRAME_TOO_LARGE
    assert caught.value.length == 101
    assert decoder.buffered == 0
    # The stream can no longer be trusted: all further input is refused.
    with pytest.raises(PeerFrameTooLarge):
        decoder.feed(encode(Welcome()))


def test_the_length_prefix_alone_is_enough_to_refuse() -> None:
    decoder = PeerFrameDecoder(max_frame_size=100)
    assert decoder.feed(b"\x00\x00") == []
    with pytest.raises(PeerFrameTooLarge):
        decoder.feed(b"\xff\xff")


def test_a_frame_of_the_maximum_size_is_taken() -> None:
    message = Request(1, PeerOp.APPEND, b"x" * 94)
    assert len(encode_body(message)) == 100
    assert PeerFrameDecoder(max_frame_size=100).feed(encode(message)) == [message]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\x09", id="unknown-kind"),
        pytest.param(b"\x00", id="kind-zero"),
        pytest.param(b"\x03!", id="welcome-with-trailing-byte"),
        pytest.param(b"\x02" + b"m" * 31, id="short-mac"),
        pytest.param(b"\x02" + b"m" * 33, id="long-mac"),
        pytest.param(b"\x01\x00\x01\x00\x02c1\x00\x02n1" + b"n" * 31, id="short-nonce"),
        pytest.param(b"\x01\x00\x01\x00\x05c1", id="text-past-the-end"),
        pytest.param(b"\x04\x00\x02\xff\xfe\x00\x00", id="text-not-utf8"),
        pytest.param(b"\x06\x00\x00\x00\x01\x02", id="unknown-response-status"),
        pytest.param(b"\x06\x00\x00\x00\x01\x01\x00\x02x", id="truncated-error-reason"),
        pytest.param(b"\x06\x00\x00\x00\x01\x01\x00\x01xy", id="trailing-error-bytes"),
        pytest.param(b"\x05\x00\x00\x01", id="truncated-request"),
        pytest.param(b"\x07" + b"\x00" * 7, id="short-ping"),
        pytest.param(b"\x08" + b"\x00" * 9, id="long-pong"),
    ],
)
def test_malformed_bodies_are_refused(body: bytes) -> None:
    with pytest.raises(MalformedPeerMessage) as caught:
        decode_body(body)
    assert caught.value.reason is PeerReason.MALFORMED_MESSAGE


@given(messages, st.data())
def test_truncated_or_extended_bodies_are_refused(
    message: PeerMessage, data: st.DataObject
) -> None:
    """Only a request or an ok response ends in an open payload ("the rest of the body"): cut
    or extended, it is still one (with another payload); anything else is refused."""
    open_ended = isinstance(message, Request) or (isinstance(message, Response) and message.ok)
    body = encode_body(message)
    cut = data.draw(st.integers(0, len(body) - 1))
    if open_ended and cut >= 6:
        assert type(decode_body(body[:cut])) is type(message)
    else:
        with pytest.raises(MalformedPeerMessage):
            decode_body(body[:cut])
    if open_ended:
        assert type(decode_body(body + b"\x00")) is type(message)
    else:
        with pytest.raises(MalformedPeerMessage):
            decode_body(body + b"\x00")


def test_a_malformed_frame_fails_the_decoder() -> None:
    decoder = PeerFrameDecoder()
    with pytest.raises(MalformedPeerMessage):
        decoder.feed(encode(Welcome()) + struct.pack(">I", 1) + b"\x09")
    with pytest.raises(MalformedPeerMessage):
        decoder.feed(encode(Welcome()))


@pytest.mark.parametrize(
    ("decode", "payload"),
    [
        pytest.param(decode_append_request, b"\x00\x03r-1\x00\x00\x00", id="append-truncated"),
        pytest.param(decode_append_result, b"\x00\x00\x00\x01\x00", id="append-result-trailing"),
        pytest.param(decode_append_result, b"\x00\x00\x01", id="append-result-short"),
        pytest.param(
            decode_read_request,
            b"\x00\x01r" + struct.pack(">QIII", 1, 2, 3, 4) + b"\x00",
            id="read-trailing",
        ),
        pytest.param(
            decode_read_request, b"\x00\x01r" + struct.pack(">QII", 1, 2, 3), id="read-truncated"
        ),
        pytest.param(decode_read_result, struct.pack(">IQ", 1, 2), id="read-result-short"),
        pytest.param(decode_bounds_request, b"\x00\x03r-", id="bounds-truncated"),
        pytest.param(decode_bounds_request, b"\x00\x01rx", id="bounds-trailing"),
        pytest.param(decode_bounds_request, b"\x00\x01\xff", id="bounds-not-utf8"),
        pytest.param(decode_bounds_result, struct.pack(">QI", 1, 2), id="bounds-result-short"),
        pytest.param(
            decode_bounds_result, struct.pack(">QQ", 1, 2) + b"\x00", id="bounds-result-trailing"
        ),
    ],
)
def test_malformed_op_payloads_are_refused(decode: object, payload: bytes) -> None:
    assert callable(decode)
    with pytest.raises(MalformedPeerMessage):
        decode(payload)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: Hello(0x10000, "c", "n", b"n" * 32), id="version-over-u16"),
        pytest.param(lambda: Hello(1, "c", "n", b"n" * 31), id="short-nonce"),
        pytest.param(lambda: Hello(1, "x" * 65536, "n", b"n" * 32), id="long-text"),
        pytest.param(lambda: Hello(1, "\udc80", "n", b"n" * 32), id="lone-surrogate"),
        pytest.param(lambda: Request(-1, 1, b""), id="negative-id"),
        pytest.param(lambda: Request(1, 256, b""), id="op-over-u8"),
        pytest.param(lambda: Response(1, b"x", "overloaded"), id="error-with-payload"),
        pytest.param(lambda: Ping(2**64), id="ping-over-u64"),
        pytest.param(lambda: ReadRequest("r", 0, 2**32, 0, 0), id="max-records-over-u32"),
        pytest.param(lambda: BoundsResult(-1, 0), id="negative-start"),
        pytest.param(lambda: BoundsResult(0, 2**64), id="end-over-u64"),
        pytest.param(lambda: BoundsRequest("x" * 65536), id="long-range-id"),
    ],
)
def test_messages_that_cannot_be_encoded_cannot_be_built(build: object) -> None:
    assert callable(build)
    with pytest.raises(ValueError):  # noqa: PT011 - each validator says what, in its own words
        build()


@given(
    st.sampled_from(list(range_ops.GroupVerb)),
    st.text(max_size=40),
    st.text(max_size=40),
    st.text(max_size=40),
    st.lists(st.text(max_size=20), max_size=8).map(tuple),
)
def test_group_requests_round_trip(
    verb: range_ops.GroupVerb, topic: str, group: str, member: str, range_ids: tuple[str, ...]
) -> None:
    assume(all(c < "\ud800" or c > "\udfff" for c in topic + group + member + "".join(range_ids)))
    request = range_ops.GroupRequest(verb, topic, group, member, range_ids)

    assert range_ops.decode_group_request(range_ops.encode_group_request(request)) == request


def test_a_group_request_s_bytes() -> None:
    request = range_ops.GroupRequest(range_ops.GroupVerb.SHARE, "t", "g", "m", ("t.0", "t.1"))

    assert range_ops.encode_group_request(request) == (
        b"\x01" + b"\x00\x01t" + b"\x00\x01g" + b"\x00\x01m" + b"\x00\x02" + b"\x00\x03t.0"
        b"\x00\x03t.1"
    )
    assert range_ops.decode_group_share(range_ops.encode_group_share(["t.1"])) == ["t.1"]


@pytest.mark.parametrize(
    "payload",
    [
        b"\x09\x00\x01t\x00\x01g\x00\x01m\x00\x00",
        b"\x01\x00\x01t",
        b"\x02\x00\x01t\x00\x01g\x00\x01m\x00\x00!",
    ],
)
def test_a_malformed_group_request_is_refused(payload: bytes) -> None:
    with pytest.raises(MalformedPeerMessage):
        range_ops.decode_group_request(payload)
