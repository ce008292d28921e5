"""The client protocol codec (``logbroker.wire``): exact bytes, round trips, refusals.

The byte-level examples pin the layout of DESIGN section 4 (existing clients depend on it); the
property tests check that every request and response round-trips through any chunking of the
stream, one byte at a time included, and that bad input is refused with the right reason and the
request's correlation id.
"""

from __future__ import annotations

import itertools
import struct

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbroker import wire
from logbroker.records import ProducerStamp, Record
from logbroker.wire import (
    REQUEST_TYPES,
    ApiKey,
    Auth,
    ChangePassword,
    ClusterInfo,
    ClusterNodeInfo,
    Commit,
    CreateTopic,
    CreateUser,
    DeleteUser,
    DescribeCluster,
    Fetch,
    FrameDecoder,
    FrameTooLargeError,
    GrantAcl,
    LeaveGroup,
    ListAcls,
    ListTopics,
    ListUsers,
    Produce,
    ProduceIdempotent,
    ProtocolViolation,
    Reason,
    ReceivedRequest,
    RecordsPayload,
    Request,
    Response,
    RevokeAcl,
    StreamAck,
    Subscribe,
    TopicInfo,
    VerifyCluster,
    WireError,
    decode_acls,
    decode_cluster,
    decode_count,
    decode_empty,
    decode_records,
    decode_request,
    decode_response,
    decode_token,
    decode_topics,
    decode_users,
    encode_acls,
    encode_cluster,
    encode_count,
    encode_error,
    encode_frame,
    encode_ok,
    encode_records,
    encode_request,
    encode_token,
    encode_topics,
    encode_users,
)

U32 = st.integers(0, 2**32 - 1)
texts = st.one_of(st.none(), st.text(max_size=20))
nbytes = st.one_of(st.none(), st.binary(max_size=20))
records = st.builds(
    Record,
    value=st.binary(max_size=40),
    key=nbytes,
    timestamp_ms=st.integers(0, 2**64 - 1),
    headers=st.lists(st.tuples(nbytes, nbytes), max_size=3).map(tuple),
)
record_tuples = st.lists(records, max_size=5).map(tuple)
U64 = st.integers(0, 2**64 - 1)
stamps = st.builds(ProducerStamp, U64, U64)

requests: st.SearchStrategy[Request] = st.one_of(
    st.builds(Auth, texts, texts),
    st.builds(CreateTopic, texts, st.integers(0, 255)),
    st.builds(Produce, texts, record_tuples),
    st.builds(ProduceIdempotent, texts, stamps, record_tuples),
    st.builds(Fetch, texts, texts, texts, texts, U32, U32),
    st.builds(Commit, texts, texts, texts),
    st.builds(Subscribe, texts, texts, texts, U32, U32),
    st.builds(StreamAck, texts, texts, texts, texts, U32),
    st.builds(LeaveGroup, texts, texts, texts),
    st.builds(CreateUser, texts, texts, st.lists(texts, max_size=4).map(tuple)),
    st.builds(DeleteUser, texts),
    st.builds(ChangePassword, texts, texts),
    st.just(ListUsers()),
    st.builds(GrantAcl, texts, texts, texts),
    st.builds(RevokeAcl, texts, texts, texts),
    st.builds(ListAcls, texts),
    st.just(ListTopics()),
    st.just(DescribeCluster()),
    st.just(VerifyCluster()),
    st.builds(wire.TopicLeaders, texts),
)
names = st.text(max_size=12)
cluster_nodes = st.builds(
    ClusterNodeInfo,
    node_id=names,
    host=names,
    client_port=st.integers(0, 65535),
    dashboard_port=st.integers(0, 65535),
    peer_port=st.integers(0, 65535),
    alive=st.booleans(),
    segments_led=U32,
    attributes=st.lists(st.tuples(names, names), max_size=3).map(tuple),
    version=names,
)
clusters = st.builds(
    ClusterInfo,
    cluster_id=names,
    node_id=names,
    control_plane=st.sampled_from(["local", "etcd"]),
    chores_holder=st.one_of(st.none(), names),
    domain_violations=U32,
    lease_age_ms=st.one_of(st.none(), U32),
    nodes=st.lists(cluster_nodes, max_size=4).map(tuple),
    under_replicated=U32,
    unavailable_ranges=st.one_of(st.none(), U32),
)


range_leaders = st.builds(
    wire.RangeLeader,
    range_id=names,
    start=U64,
    end=U64,
    leader=st.one_of(st.none(), names),
)
leaders = st.builds(
    wire.LeadersInfo,
    keyspace_bits=st.integers(0, 255),
    ranges=st.lists(range_leaders, max_size=4).map(tuple),
    nodes=st.lists(
        st.builds(wire.LeaderAddress, names, names, st.integers(0, 65535)), max_size=3
    ).map(tuple),
)


def body_of(frame: bytes) -> bytes:
    (length,) = struct.unpack_from(">I", frame, 0)
    assert length == len(frame) - 4
    return frame[4:]


@st.composite
def chunkings(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` cut at arbitrary points (sometimes every byte)."""
    if draw(st.booleans()) and len(data) < 400:
        return [data[i : i + 1] for i in range(len(data))]
    cuts = sorted(draw(st.sets(st.integers(0, len(data)), max_size=8)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# -- exact bytes ---------------------------------------------------------------------------


def test_an_auth_request_has_the_documented_bytes() -> None:
    frame = encode_request(7, Auth("admin", "admin123"))

    assert frame == (
        b"\x00\x00\x00\x1d"  # length 29: 2 + 4 + (1 + 4 + 5) + (1 + 4 + 8)
        b"\x00\x00"  # api key 0: auth
        b"\x00\x00\x00\x07"  # correlation id
        b"\x01\x00\x00\x00\x05admin"
        b"\x01\x00\x00\x00\x08admin123"
    )


def test_a_produce_request_has_the_documented_record_layout() -> None:
    record = Record(b"v1", key=None, timestamp_ms=258, headers=((b"h", None),))

    frame = encode_request(1, Produce("t", (record,)))

    assert body_of(frame) == (
        b"\x00\x02\x00\x00\x00\x01"
        b"\x01\x00\x00\x00\x01t"
        b"\x00\x00\x00\x01"  # record count
        b"\x00"  # null key
        b"\x00\x00\x00\x02v1"  # value
        b"\x00\x00\x00\x00\x00\x00\x01\x02"  # timestamp_ms
        b"\x00\x00\x00\x01"  # header count
        b"\x01\x00\x00\x00\x01h\x00"  # header name, null value
    )


def test_ok_and_error_responses_have_the_documented_bytes() -> None:
    assert (
        encode_ok(9, encode_count(3)) == b"\x00\x00\x00\x0a\x00\x00\x00\x09\x00\x00\x00\x00\x00\x03"
    )
    assert encode_error(9, Reason.NO_SUCH_TOPIC) == (
        b"\x00\x00\x00\x18\x00\x00\x00\x09\x00\x01\x01\x00\x00\x00\x0dno_such_topic"
    )


def test_api_keys_are_those_of_the_protocol_table() -> None:
    assert {key.name.lower(): int(key) for key in ApiKey if key < 64} == {
        "auth": 0,
        "create_topic": 1,
        "produce": 2,
        "fetch": 3,
        "commit": 4,
        "subscribe": 5,
        "stream_ack": 6,
        "leave_group": 7,
        "create_user": 8,
        "delete_user": 9,
        "change_password": 10,
        "list_users": 11,
        "grant_acl": 14,
        "revoke_acl": 15,
        "list_acls": 16,
    }
    assert set(REQUEST_TYPES) == {int(key) for key in ApiKey}


def test_extensions_take_keys_from_64_up() -> None:
    assert {key.name.lower(): int(key) for key in ApiKey if key >= 64} == {
        "list_topics": 64,
        "describe_cluster": 66,
        "produce_idempotent": 67,
        "verify_cluster": 68,
        "topic_leaders": 69,
    }


def test_a_list_topics_exchange_has_the_documented_bytes() -> None:
    assert encode_request(3, ListTopics()) == b"\x00\x00\x00\x06\x00\x40\x00\x00\x00\x03"
    assert encode_topics([TopicInfo("t", 8, 4)]) == (
        b"\x00\x00\x00\x01"  # count
        b"\x01\x00\x00\x00\x01t"  # name
        b"\x08"  # keyspace_bits
        b"\x00\x00\x00\x04"  # range_count
    )


def test_a_produce_idempotent_exchange_has_the_documented_bytes() -> None:
    stamp = ProducerStamp(0x0102030405060708, 9)
    record = Record(b"v1", key=None, timestamp_ms=258)

    frame = encode_request(1, ProduceIdempotent("t", stamp, (record,)))

    assert frame == (
        b"\x00\x00\x00\x33"  # length 51: 2 + 4 + 6 + 16 + 4 + 19
        b"\x00\x43"  # api key 67: produce_idempotent
        b"\x00\x00\x00\x01"  # correlation id
        b"\x01\x00\x00\x00\x01t"  # topic
        b"\x01\x02\x03\x04\x05\x06\x07\x08"  # producer_id
        b"\x00\x00\x00\x00\x00\x00\x00\x09"  # sequence
        b"\x00\x00\x00\x01"  # record count, then the records as produce has them
        b"\x00"
        b"\x00\x00\x00\x02v1"
        b"\x00\x00\x00\x00\x00\x00\x01\x02"
        b"\x00\x00\x00\x00"
    )
    # Answered as produce: the count.
    assert (
        encode_ok(1, encode_count(1)) == b"\x00\x00\x00\x0a\x00\x00\x00\x01\x00\x00\x00\x00\x00\x01"
    )


def test_produce_idempotent_is_produce_with_the_stamp_after_the_topic() -> None:
    records = (Record(b"a", key=b"k"), Record(b"b", headers=((b"h", None),)))
    plain = body_of(encode_request(5, Produce("t", records)))

    stamped = body_of(encode_request(5, ProduceIdempotent("t", ProducerStamp(1, 2), records)))

    topic_end = 6 + 6  # header, then str "t"
    assert stamped[:2] == b"\x00\x43"
    assert stamped[2:topic_end] == plain[2:topic_end]
    assert stamped[topic_end : topic_end + 16] == struct.pack(">QQ", 1, 2)
    assert stamped[topic_end + 16 :] == plain[topic_end:]


ONE_NODE = ClusterInfo(
    cluster_id="c",
    node_id="n1",
    control_plane="local",
    chores_holder="n1",
    domain_violations=2,
    lease_age_ms=None,
    nodes=(ClusterNodeInfo("n1", "h", 4040, 4041, 4042, True, 3, (("zone", "a"),), "0.1"),),
    under_replicated=5,
    unavailable_ranges=7,
)
ONE_NODE_BYTES = (
    b"\x03"  # payload version 3
    b"\x01\x00\x00\x00\x01c"  # cluster id
    b"\x01\x00\x00\x00\x02n1"  # answering node
    b"\x01\x00\x00\x00\x05local"  # control plane
    b"\x01\x00\x00\x00\x02n1"  # chores holder
    b"\x00\x00\x00\x02"  # domain violations
    b"\x00"  # no lease age
    b"\x00\x00\x00\x01"  # node count
    b"\x00\x00\x00\x33"  # the node's entry: 51 bytes
    b"\x01\x00\x00\x00\x02n1"  # node id
    b"\x01\x00\x00\x00\x01h"  # host
    b"\x0f\xc8\x0f\xc9\x0f\xca"  # client, dashboard and peer ports
    b"\x01"  # alive
    b"\x00\x00\x00\x03"  # segments led
    b"\x00\x00\x00\x01"  # attribute count
    b"\x01\x00\x00\x00\x04zone\x01\x00\x00\x00\x01a"  # zone=a
    b"\x01\x00\x00\x00\x030.1"  # version
    b"\x01\x00\x00\x00\x05"  # under-replicated segments: counted, 5 (version 2)
    b"\x01\x00\x00\x00\x07"  # unavailable ranges: counted, 7 (version 3)
)
#: The same as a node of version 2 sent it: nothing after the under-replicated count.
ONE_NODE_BYTES_V2 = b"\x02" + ONE_NODE_BYTES[1:-5]
#: The same as a node of version 1 sent it: nothing after the nodes.
ONE_NODE_BYTES_V1 = b"\x01" + ONE_NODE_BYTES[1:-10]


def test_a_describe_cluster_exchange_has_the_documented_bytes() -> None:
    assert encode_request(3, DescribeCluster()) == b"\x00\x00\x00\x06\x00\x42\x00\x00\x00\x03"
    assert encode_cluster(ONE_NODE) == ONE_NODE_BYTES
    with_lease = encode_cluster(attrs.evolve(ONE_NODE, lease_age_ms=1500, chores_holder=None))
    assert with_lease[:29] == ONE_NODE_BYTES[:24] + b"\x00" + b"\x00\x00\x00\x02"
    assert with_lease[29:34] == b"\x01\x00\x00\x05\xdc"  # a lease age of 1500 ms
    not_counted = encode_cluster(
        attrs.evolve(ONE_NODE, under_replicated=None, unavailable_ranges=None)
    )
    assert not_counted == ONE_NODE_BYTES[:-10] + b"\x00\x00"
    assert decode_cluster(not_counted) == attrs.evolve(
        ONE_NODE, under_replicated=None, unavailable_ranges=None
    )


def test_a_later_cluster_payload_version_is_read_for_the_fields_this_one_knows() -> None:
    # Version 4 appends a field to the node's entry and one to the payload.
    entry_start = 40
    entry = ONE_NODE_BYTES_V1[entry_start + 4 :] + b"\x07more"
    later = (
        b"\x04"
        + ONE_NODE_BYTES[1:entry_start]
        + struct.pack(">I", len(entry))
        + entry
        + b"\x01\x00\x00\x00\x05"
        + b"\x01\x00\x00\x00\x07"
        + b"\x00\x00\x00\x09"
    )

    assert decode_cluster(later) == ONE_NODE
    with pytest.raises(ProtocolViolation, match="bytes left"):
        decode_cluster(ONE_NODE_BYTES + b"\x00")  # version 3 has nothing after its counts
    with pytest.raises(ProtocolViolation, match="under-replicated marker"):
        decode_cluster(ONE_NODE_BYTES[:-10] + b"\x02")
    with pytest.raises(ProtocolViolation, match="unavailable marker"):
        decode_cluster(ONE_NODE_BYTES[:-5] + b"\x02")


def test_a_version_2_cluster_payload_says_nothing_of_unavailable_ranges() -> None:
    assert decode_cluster(ONE_NODE_BYTES_V2) == attrs.evolve(ONE_NODE, unavailable_ranges=None)
    with pytest.raises(ProtocolViolation, match="bytes left"):
        decode_cluster(ONE_NODE_BYTES_V2 + b"\x00")  # version 2 has nothing after its count


def test_a_version_1_cluster_payload_says_nothing_of_under_replication() -> None:
    assert decode_cluster(ONE_NODE_BYTES_V1) == attrs.evolve(
        ONE_NODE, under_replicated=None, unavailable_ranges=None
    )
    with pytest.raises(ProtocolViolation, match="bytes left"):
        decode_cluster(ONE_NODE_BYTES_V1 + b"\x00")  # version 1 has nothing after its nodes


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\x00" + ONE_NODE_BYTES[1:], "version 0"),
        (b"\x01\x00" + ONE_NODE_BYTES[7:], "cluster id is null"),
        (ONE_NODE_BYTES[:35] + b"\x02", "lease marker"),
        (ONE_NODE_BYTES_V1[:-1], "needs"),
        (ONE_NODE_BYTES[:40] + b"\xff\xff\xff\xff" + ONE_NODE_BYTES[44:], "needs"),
        (ONE_NODE_BYTES[:36] + b"\x7f\xff\xff\xff", "nodes cannot fit"),
    ],
    ids=["version 0", "null id", "bad lease marker", "cut short", "bad length", "node count"],
)
def test_a_cluster_payload_that_breaks_the_layout_is_refused(payload: bytes, why: str) -> None:
    with pytest.raises(ProtocolViolation, match=why):
        decode_cluster(payload)


@given(clusters)
def test_cluster_payloads_round_trip(cluster: ClusterInfo) -> None:
    assert decode_cluster(encode_cluster(cluster)) == cluster


@given(leaders)
def test_leaders_payloads_round_trip(info: wire.LeadersInfo) -> None:
    assert wire.decode_leaders(wire.encode_leaders(info)) == info


LEADERS = wire.encode_leaders(
    wire.LeadersInfo(
        8, (wire.RangeLeader("t.0", 0, 256, "n1"),), (wire.LeaderAddress("n1", "h", 4040),)
    )
)


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\x02" + LEADERS[1:], "version 2"),
        (LEADERS[:2] + b"\x00\x00\x00\x09" + LEADERS[6:], "9 ranges cannot fit"),
        (LEADERS[:6] + b"\x00" + LEADERS[7 + 4 + 3 :], "range id is null"),
        (LEADERS[:-1], "needs 2 bytes"),
        (LEADERS + b"!", "1 bytes left"),
    ],
    ids=["version", "range count", "null range id", "cut short", "trailing"],
)
def test_a_leaders_payload_that_breaks_the_layout_is_refused(payload: bytes, why: str) -> None:
    with pytest.raises(ProtocolViolation, match=why):
        wire.decode_leaders(payload)


# -- round trips ---------------------------------------------------------------------------


@given(st.lists(st.tuples(U32, requests), min_size=1, max_size=4), st.data())
def test_requests_round_trip_through_any_chunking(
    sent: list[tuple[int, Request]], data: st.DataObject
) -> None:
    stream = b"".join(encode_request(correlation_id, request) for correlation_id, request in sent)
    decoder = FrameDecoder()

    bodies = [body for chunk in data.draw(chunkings(stream)) for body in decoder.feed(chunk)]

    assert [decode_request(body) for body in bodies] == [
        ReceivedRequest(correlation_id, request) for correlation_id, request in sent
    ]
    assert decoder.buffered == 0


@given(U32, st.lists(records, max_size=5), st.text(max_size=30))
def test_record_batches_round_trip_in_responses(
    correlation_id: int, batch: list[Record], cursor: str
) -> None:
    response = decode_response(body_of(encode_ok(correlation_id, encode_records(batch, cursor))))

    assert response.ok
    assert response.correlation_id == correlation_id
    assert decode_records(response.payload) == RecordsPayload(tuple(batch), cursor)


@given(U32, st.sampled_from(list(Reason)))
def test_error_reasons_round_trip(correlation_id: int, reason: Reason) -> None:
    assert decode_response(body_of(encode_error(correlation_id, reason))) == Response(
        correlation_id, b"", str(reason)
    )


@given(
    st.text(max_size=20),
    U32,
    st.lists(st.tuples(st.text(max_size=10), st.lists(st.text(max_size=8), max_size=3))),
    st.lists(st.tuples(st.text(max_size=8), st.text(max_size=12))),
    st.lists(st.builds(TopicInfo, texts, st.integers(0, 255), U32)),
)
def test_the_other_ok_payloads_round_trip(
    token: str,
    count: int,
    users: list[tuple[str, list[str]]],
    grants: list[tuple[str, str]],
    topics: list[TopicInfo],
) -> None:
    assert decode_token(encode_token(token)) == token
    assert decode_count(encode_count(count)) == count
    assert decode_users(encode_users(users)) == [(name, tuple(perms)) for name, perms in users]
    assert decode_acls(encode_acls(grants)) == grants
    assert decode_topics(encode_topics(topics)) == topics
    decode_empty(b"")


# -- refusals ------------------------------------------------------------------------------


def test_a_frame_over_the_maximum_is_refused_at_its_length_prefix() -> None:
    decoder = FrameDecoder(max_frame_size=100)
    good = encode_request(1, ListUsers())

    with pytest.raises(FrameTooLargeError) as raised:
        decoder.feed(good + struct.pack(">I", 101))  # no byte of the body has arrived

    assert raised.value.reason is Reason.FRAME_TOO_LARGE
    assert raised.value.correlation_id == 0
    assert raised.value.complete_frames == [body_of(good)]
    assert decoder.buffered == 0
    with pytest.raises(FrameTooLargeError):
        decoder.feed(good)


def test_a_frame_of_exactly_the_maximum_is_accepted() -> None:
    decoder = FrameDecoder(max_frame_size=10)

    assert decoder.feed(encode_frame(bytes(10))) == [bytes(10)]


@pytest.mark.parametrize("body", [b"", b"\x00", b"\x00\x00\x00\x00\x00"])
def test_a_request_header_cut_short_is_malformed_with_correlation_id_0(body: bytes) -> None:
    with pytest.raises(WireError) as raised:
        decode_request(body)

    assert (raised.value.reason, raised.value.correlation_id) == (Reason.MALFORMED_REQUEST, 0)


@pytest.mark.parametrize("api_key", [12, 13, 17, 63, 65, 70, 0xFFFF])
def test_an_unknown_api_key_is_refused_with_the_correlation_id(api_key: int) -> None:
    with pytest.raises(WireError) as raised:
        decode_request(struct.pack(">HI", api_key, 42))

    assert (raised.value.reason, raised.value.correlation_id) == (Reason.UNKNOWN_API_KEY, 42)


@given(U32, requests, st.data())
def test_a_payload_cut_short_or_overlong_is_malformed_with_the_correlation_id(
    correlation_id: int, request: Request, data: st.DataObject
) -> None:
    body = body_of(encode_request(correlation_id, request))
    if len(body) > 6:
        cut = data.draw(st.integers(6, len(body) - 1))
        with pytest.raises(WireError) as short:
            decode_request(body[:cut])
        assert (short.value.reason, short.value.correlation_id) == (
            Reason.MALFORMED_REQUEST,
            correlation_id,
        )
    with pytest.raises(WireError) as long:
        decode_request(body + data.draw(st.binary(min_size=1, max_size=4)))
    assert (long.value.reason, long.value.correlation_id) == (
        Reason.MALFORMED_REQUEST,
        correlation_id,
    )


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\x02\x00\x00\x00\x00\x00", "string marker"),
        (b"\x01\x00\x00\x00\x09topic", "needs 9 bytes at byte 11, has 5"),
        (b"\x01\x00\x00\x00\x01t\xff\xff\xff\xff", "records cannot fit"),
    ],
    ids=["bad string marker", "string longer than the payload", "record count beyond the payload"],
)
def test_invalid_fields_are_malformed(payload: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why) as raised:
        decode_request(struct.pack(">HI", ApiKey.PRODUCE, 5) + payload)

    assert (raised.value.reason, raised.value.correlation_id) == (Reason.MALFORMED_REQUEST, 5)


def test_a_header_count_beyond_the_payload_is_refused_before_reading_headers() -> None:
    record = b"\x00" + b"\x00\x00\x00\x00" + bytes(8) + b"\xff\xff\xff\xff"
    payload = b"\x01\x00\x00\x00\x01t" + b"\x00\x00\x00\x01" + record

    with pytest.raises(WireError, match="headers cannot fit"):
        decode_request(struct.pack(">HI", ApiKey.PRODUCE, 5) + payload)


@pytest.mark.parametrize(
    "body",
    [b"\x00\x00\x00", b"\x00\x00\x00\x01\x00\x02", b"\x00\x00\x00\x01\x00\x01\x01\x00"],
    ids=["short header", "unknown error code", "truncated reason"],
)
def test_a_response_that_breaks_the_protocol_is_refused_by_the_client(body: bytes) -> None:
    with pytest.raises(ProtocolViolation):
        decode_response(body)


@given(U32, st.lists(st.binary(max_size=30), max_size=5))
def test_an_ok_frame_in_parts_is_the_same_bytes_as_in_one_piece(
    correlation_id: int, payload: list[bytes]
) -> None:
    assert b"".join(wire.ok_frame_parts(correlation_id, payload)) == encode_ok(
        correlation_id, b"".join(payload)
    )


@given(st.lists(records, max_size=5), st.text(max_size=10))
def test_a_records_payload_from_encoded_records_matches_encode_records(
    batch: list[Record], cursor: str
) -> None:
    from logbroker.wire import primitives

    data = [primitives.record(record) for record in batch]

    assert wire.encode_records_data(len(batch), b"".join(data), cursor) == encode_records(
        batch, cursor
    )


def test_a_topic_count_beyond_the_payload_is_refused_by_the_client() -> None:
    with pytest.raises(ProtocolViolation, match="topics cannot fit"):
        decode_topics(b"\xff\xff\xff\xff\x00")


def test_a_name_that_is_not_utf8_is_read_and_written_back_byte_for_byte() -> None:
    body = body_of(encode_request(3, Fetch("t", None, None, None, 0, 0)))
    raw = body.replace(b"\x01\x00\x00\x00\x01t", b"\x01\x00\x00\x00\x02\xff\xfe", 1)

    received = decode_request(raw)

    assert isinstance(received.request, Fetch)
    assert received.request.topic == "\udcff\udcfe"
    assert body_of(encode_request(3, received.request)) == raw
