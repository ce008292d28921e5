"""Requests and responses of the client protocol, v1 (docs/protocol.md).

``request  = api_key:u16 correlation_id:u32 payload``
``response = correlation_id:u32 error_code:u16 payload`` (0 ok, 1 error: payload is str(reason))

Each request type knows its API key and encodes and decodes its own payload. The server side
uses ``decode_request`` and the ``encode_*_response`` functions; the client side uses
``encode_request`` and ``decode_response`` plus the ``decode_*`` payload readers. Everything here
is pure: bytes in, values out.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, ClassVar, Self, TypeVar

import attrs

from logbroker.errors import Reason
from logbroker.records import ProducerStamp, Record, Records, WireRecords
from logbroker.wire import primitives as p
from logbroker.wire.errors import WireError
from logbroker.wire.frames import encode_frame
from logbroker.wire.primitives import Reader, Truncated

_REQUEST_HEAD = struct.Struct(">HI")
_RESPONSE_HEAD = struct.Struct(">IH")
ERROR_CODE_OK = 0
ERROR_CODE_ERROR = 1
#: How many of a producer's latest sequences each range remembers (``produce_idempotent``), and
#: so how far a producer may run ahead of its oldest unfinished produce: it sends sequence ``s``
#: only once every produce up to ``s - PRODUCER_WINDOW`` has finished (docs/protocol.md).
PRODUCER_WINDOW = 32


class ApiKey(IntEnum):
    AUTH = 0
    CREATE_TOPIC = 1
    PRODUCE = 2
    FETCH = 3
    COMMIT = 4
    SUBSCRIBE = 5
    STREAM_ACK = 6
    LEAVE_GROUP = 7
    CREATE_USER = 8
    DELETE_USER = 9
    CHANGE_PASSWORD = 10
    LIST_USERS = 11
    GRANT_ACL = 14
    REVOKE_ACL = 15
    LIST_ACLS = 16
    # Extensions (docs/protocol.md, "Extensions"): keys from 64 up, never renumbered.
    LIST_TOPICS = 64
    DESCRIBE_CLUSTER = 66
    PRODUCE_IDEMPOTENT = 67
    VERIFY_CLUSTER = 68
    TOPIC_LEADERS = 69


@attrs.frozen
class FieldKind:
    """How one kind of request field is written and read."""

    encode: Callable[[Any], bytes]
    decode: Callable[[Reader], Any]


def _encode_records(records: Records) -> bytes:
    return p.u32(len(records)) + p.wire_records(records).data


TEXT = FieldKind(p.text, Reader.text)
U8 = FieldKind(p.u8, Reader.u8)
U32 = FieldKind(p.u32, Reader.u32)
RECORDS = FieldKind(_encode_records, lambda reader: _wire_records(reader))
STAMP = FieldKind(
    lambda stamp: p.u64(stamp.producer_id) + p.u64(stamp.sequence),
    lambda reader: ProducerStamp(reader.u64(), reader.u64()),
)
PERMISSIONS = FieldKind(lambda names: _encode_permissions(names), lambda r: _permissions(r))


class Request:
    """Base of every request type: its API key and the kinds of its fields, in payload order
    (the attrs fields of the subclass, one ``FieldKind`` each), which encode and decode it."""

    API_KEY: ClassVar[ApiKey]
    WIRE: ClassVar[tuple[FieldKind, ...]] = ()

    def encode_payload(self) -> bytes:
        values = attrs.astuple(self, recurse=False)  # type: ignore[arg-type]
        return b"".join(kind.encode(value) for kind, value in zip(self.WIRE, values, strict=True))

    @classmethod
    def decode_payload(cls, reader: Reader) -> Self:
        return cls(*(kind.decode(reader) for kind in cls.WIRE))


@attrs.frozen
class Auth(Request):
    API_KEY = ApiKey.AUTH
    WIRE = (TEXT, TEXT)
    user: str | None
    password: str | None


@attrs.frozen
class CreateTopic(Request):
    API_KEY = ApiKey.CREATE_TOPIC
    WIRE = (TEXT, U8)
    topic: str | None
    keyspace_bits: int


@attrs.frozen
class Produce(Request):
    API_KEY = ApiKey.PRODUCE
    WIRE = (TEXT, RECORDS)
    topic: str | None
    #: Kept as the bytes they came in (records given as objects are encoded).
    records: WireRecords = attrs.field(converter=p.wire_records)

    @classmethod
    def decode_payload(cls, reader: Reader) -> Self:
        # The request a producer sends for every batch: its two fields read directly, not
        # through the general walk of ``WIRE`` (which reads them the same way).
        return cls(reader.text(), _wire_records(reader))


@attrs.frozen
class Fetch(Request):
    API_KEY = ApiKey.FETCH
    WIRE = (TEXT, TEXT, TEXT, TEXT, U32, U32)
    topic: str | None
    cursor: str | None
    group: str | None
    member: str | None
    max: int
    wait_ms: int


@attrs.frozen
class Commit(Request):
    API_KEY = ApiKey.COMMIT
    WIRE = (TEXT, TEXT, TEXT)
    topic: str | None
    group: str | None
    cursor: str | None


@attrs.frozen
class Subscribe(Request):
    API_KEY = ApiKey.SUBSCRIBE
    WIRE = (TEXT, TEXT, TEXT, U32, U32)
    topic: str | None
    group: str | None
    member: str | None
    window: int
    max: int


@attrs.frozen
class StreamAck(Request):
    API_KEY = ApiKey.STREAM_ACK
    WIRE = (TEXT, TEXT, TEXT, TEXT, U32)
    topic: str | None
    group: str | None
    member: str | None
    cursor: str | None
    count: int


@attrs.frozen
class LeaveGroup(Request):
    API_KEY = ApiKey.LEAVE_GROUP
    WIRE = (TEXT, TEXT, TEXT)
    topic: str | None
    group: str | None
    member: str | None


@attrs.frozen
class CreateUser(Request):
    API_KEY = ApiKey.CREATE_USER
    WIRE = (TEXT, TEXT, PERMISSIONS)
    user: str | None
    password: str | None
    permissions: tuple[str | None, ...]


@attrs.frozen
class DeleteUser(Request):
    API_KEY = ApiKey.DELETE_USER
    WIRE = (TEXT,)
    user: str | None


@attrs.frozen
class ChangePassword(Request):
    API_KEY = ApiKey.CHANGE_PASSWORD
    WIRE = (TEXT, TEXT)
    user: str | None
    new_password: str | None


@attrs.frozen
class ListUsers(Request):
    API_KEY = ApiKey.LIST_USERS


@attrs.frozen
class GrantAcl(Request):
    API_KEY = ApiKey.GRANT_ACL
    WIRE = (TEXT, TEXT, TEXT)
    user: str | None
    operation: str | None
    pattern: str | None


@attrs.frozen
class RevokeAcl(GrantAcl):
    API_KEY = ApiKey.REVOKE_ACL


@attrs.frozen
class ListAcls(Request):
    API_KEY = ApiKey.LIST_ACLS
    WIRE = (TEXT,)
    user: str | None


@attrs.frozen
class ListTopics(Request):
    """Extension: every topic with its keyspace bits and its number of ranges."""

    API_KEY = ApiKey.LIST_TOPICS


@attrs.frozen
class DescribeCluster(Request):
    """Extension: the cluster as the answering node sees it (admin only)."""

    API_KEY = ApiKey.DESCRIBE_CLUSTER


@attrs.frozen
class ProduceIdempotent(Request):
    """Extension: ``produce`` with the producer's stamp, so that a retry with the same stamp
    is not stored again. Answered as ``produce`` (``encode_count``)."""

    API_KEY = ApiKey.PRODUCE_IDEMPOTENT
    WIRE = (TEXT, STAMP, RECORDS)
    topic: str | None
    stamp: ProducerStamp
    records: WireRecords = attrs.field(converter=p.wire_records)


@attrs.frozen
class VerifyCluster(Request):
    """Extension: are every sealed segment's copies complete and identical on every node
    (admin only)? Answered as ``logbroker.wire.verify`` lays out."""

    API_KEY = ApiKey.VERIFY_CLUSTER


@attrs.frozen
class TopicLeaders(Request):
    """Extension: which node leads each range of a topic, and where to reach it, so that a
    client sends each range's records straight to its leader. Answered as
    ``encode_leaders`` lays out."""

    API_KEY = ApiKey.TOPIC_LEADERS
    WIRE = (TEXT,)
    topic: str | None


REQUEST_TYPES: dict[int, type[Request]] = {
    kind.API_KEY: kind
    for kind in (
        Auth,
        CreateTopic,
        Produce,
        Fetch,
        Commit,
        Subscribe,
        StreamAck,
        LeaveGroup,
        CreateUser,
        DeleteUser,
        ChangePassword,
        ListUsers,
        GrantAcl,
        RevokeAcl,
        ListAcls,
        ListTopics,
        DescribeCluster,
        ProduceIdempotent,
        VerifyCluster,
        TopicLeaders,
    )
}


def _record_count(reader: Reader) -> int:
    count = reader.u32()
    # A record takes at least 17 bytes (null key, value length, timestamp, header count).
    if count * 17 > reader.remaining:
        raise Truncated(f"{count} records cannot fit in {reader.remaining} bytes")
    return count


def _records(reader: Reader) -> tuple[Record, ...]:
    return reader.records(_record_count(reader))


def _wire_records(reader: Reader) -> WireRecords:
    return reader.wire_records(_record_count(reader))


def _permissions(reader: Reader) -> tuple[str | None, ...]:
    count = reader.u32()
    if count > reader.remaining:
        raise Truncated(f"{count} permissions cannot fit in {reader.remaining} bytes")
    return tuple(reader.text() for _ in range(count))


def _encode_permissions(permissions: Sequence[str | None]) -> bytes:
    return p.u32(len(permissions)) + b"".join(p.text(name) for name in permissions)


# -- requests ------------------------------------------------------------------------------


def encode_request(correlation_id: int, request: Request) -> bytes:
    """A whole request frame, length prefix included."""
    return encode_frame(
        _REQUEST_HEAD.pack(request.API_KEY, correlation_id) + request.encode_payload()
    )


@attrs.frozen
class ReceivedRequest:
    correlation_id: int
    request: Request


def decode_request(body: bytes) -> ReceivedRequest:
    """Decode one request frame body.

    Raises ``WireError``: ``malformed_request`` (correlation id 0 if the header itself is cut
    short) when the payload does not parse exactly to its end, ``unknown_api_key`` for a key
    this version does not have.
    """
    if len(body) < _REQUEST_HEAD.size:
        raise WireError(
            Reason.MALFORMED_REQUEST, f"a request header takes 6 bytes, the frame has {len(body)}"
        )
    api_key, correlation_id = _REQUEST_HEAD.unpack_from(body, 0)
    kind = REQUEST_TYPES.get(api_key)
    if kind is None:
        raise WireError(Reason.UNKNOWN_API_KEY, f"no operation has key {api_key}", correlation_id)
    reader = Reader(body, _REQUEST_HEAD.size)
    try:
        request = kind.decode_payload(reader)
        reader.end()
    except (Truncated, ValueError) as error:
        raise WireError(
            Reason.MALFORMED_REQUEST, f"{kind.__name__}: {error}", correlation_id
        ) from None
    return ReceivedRequest(correlation_id, request)


# -- responses -----------------------------------------------------------------------------


def encode_ok(correlation_id: int, payload: bytes = b"") -> bytes:
    """A whole ok response frame."""
    return encode_frame(_RESPONSE_HEAD.pack(correlation_id, ERROR_CODE_OK) + payload)


def ok_frame_parts(correlation_id: int, payload: Sequence[bytes]) -> list[bytes]:
    """An ok response frame whose payload is the concatenation of ``payload``, as pieces to
    write one after another (large payloads are not copied into one string first)."""
    size = sum(len(part) for part in payload)
    head = struct.pack(">I", _RESPONSE_HEAD.size + size) + _RESPONSE_HEAD.pack(
        correlation_id, ERROR_CODE_OK
    )
    return [head, *payload]


def encode_error(correlation_id: int, reason: Reason | str) -> bytes:
    """A whole error response frame carrying ``reason``."""
    return encode_frame(_RESPONSE_HEAD.pack(correlation_id, ERROR_CODE_ERROR) + p.text(str(reason)))


def encode_token(token: str) -> bytes:
    """The ok payload of ``auth``."""
    return p.text(token)


def encode_count(count: int) -> bytes:
    """The ok payload of ``produce`` and ``produce_idempotent``."""
    return p.u32(count)


def encode_records(records: Sequence[Record], next_cursor: str) -> bytes:
    """The ok payload of ``fetch`` and of every ``subscribe`` push."""
    parts = [p.u32(len(records))]
    parts.extend(p.record(record) for record in records)
    parts.append(p.text(next_cursor))
    return b"".join(parts)


def encode_records_data(count: int, data: bytes, next_cursor: str) -> bytes:
    """The ok payload of ``fetch`` from ``count`` records already in the protocol's encoding
    (the broker's read path transcodes stored records straight into it)."""
    return b"".join(records_payload_parts(count, [data], next_cursor))


def records_payload_parts(count: int, data: Sequence[bytes], next_cursor: str) -> list[bytes]:
    """``encode_records_data`` as pieces, for ``ok_frame_parts``."""
    return [p.u32(count), *data, p.text(next_cursor)]


def encode_users(users: Sequence[tuple[str, Sequence[str]]]) -> bytes:
    """The ok payload of ``list_users``: each user's name and permissions."""
    parts = [p.u32(len(users))]
    for name, permissions in users:
        parts.append(p.text(name))
        parts.append(_encode_permissions(list(permissions)))
    return b"".join(parts)


def encode_acls(grants: Sequence[tuple[str, str]]) -> bytes:
    """The ok payload of ``list_acls``: each grant's operation and pattern."""
    parts = [p.u32(len(grants))]
    for operation, pattern in grants:
        parts.append(p.text(operation))
        parts.append(p.text(pattern))
    return b"".join(parts)


@attrs.frozen
class TopicInfo:
    """One topic as ``list_topics`` describes it."""

    name: str | None
    keyspace_bits: int
    range_count: int


def encode_topics(topics: Sequence[TopicInfo]) -> bytes:
    """The ok payload of ``list_topics``: ``count:u32, (str name, keyspace_bits:u8,
    range_count:u32)*``."""
    parts = [p.u32(len(topics))]
    for topic in topics:
        parts.append(p.text(topic.name))
        parts.append(p.u8(topic.keyspace_bits))
        parts.append(p.u32(topic.range_count))
    return b"".join(parts)


@attrs.frozen
class Response:
    """A response as the client reads it: ``reason`` set for an error, else the ok payload."""

    correlation_id: int
    payload: bytes
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None


class ProtocolViolation(ValueError):
    """A response from the server that does not follow the protocol."""


def decode_response(body: bytes) -> Response:
    if len(body) < _RESPONSE_HEAD.size:
        raise ProtocolViolation(f"a response header takes 6 bytes, the frame has {len(body)}")
    correlation_id, error_code = _RESPONSE_HEAD.unpack_from(body, 0)
    payload = body[_RESPONSE_HEAD.size :]
    if error_code == ERROR_CODE_OK:
        return Response(correlation_id, payload)
    if error_code != ERROR_CODE_ERROR:
        raise ProtocolViolation(f"unknown error code {error_code}")
    reason = _read_exactly(payload, Reader.text)
    return Response(correlation_id, b"", reason if reason is not None else "")


_T = TypeVar("_T")


def _read_exactly(payload: bytes, read: Callable[[Reader], _T]) -> _T:
    reader = Reader(payload)
    try:
        value = read(reader)
        reader.end()
    except (Truncated, ValueError) as error:
        raise ProtocolViolation(str(error)) from None
    return value


def decode_token(payload: bytes) -> str | None:
    return _read_exactly(payload, Reader.text)


def decode_count(payload: bytes) -> int:
    return _read_exactly(payload, Reader.u32)


@attrs.frozen
class RecordsPayload:
    records: tuple[Record, ...]
    next_cursor: str | None


def decode_records(payload: bytes) -> RecordsPayload:
    return _read_exactly(payload, lambda reader: RecordsPayload(_records(reader), reader.text()))


def decode_users(payload: bytes) -> list[tuple[str | None, tuple[str | None, ...]]]:
    def read(reader: Reader) -> list[tuple[str | None, tuple[str | None, ...]]]:
        count = reader.u32()
        if count * 5 > reader.remaining:
            raise Truncated(f"{count} users cannot fit in {reader.remaining} bytes")
        return [(reader.text(), _permissions(reader)) for _ in range(count)]

    return _read_exactly(payload, read)


def decode_acls(payload: bytes) -> list[tuple[str | None, str | None]]:
    def read(reader: Reader) -> list[tuple[str | None, str | None]]:
        count = reader.u32()
        if count * 2 > reader.remaining:
            raise Truncated(f"{count} grants cannot fit in {reader.remaining} bytes")
        return [(reader.text(), reader.text()) for _ in range(count)]

    return _read_exactly(payload, read)


def decode_topics(payload: bytes) -> list[TopicInfo]:
    def read(reader: Reader) -> list[TopicInfo]:
        count = reader.u32()
        # A topic takes at least six bytes (null name, bits, range count).
        if count * 6 > reader.remaining:
            raise Truncated(f"{count} topics cannot fit in {reader.remaining} bytes")
        return [TopicInfo(reader.text(), reader.u8(), reader.u32()) for _ in range(count)]

    return _read_exactly(payload, read)


#: The version of the ``describe_cluster`` payload this codec writes. A later version keeps every
#: field of the earlier ones where it is and only appends: at the end of the payload and at the
#: end of a node's entry (which is why each entry carries its length), so a reader of version 1
#: reads a later payload's version 1 fields and skips the rest.
CLUSTER_PAYLOAD_VERSION = 3
#: A lease age of this many milliseconds or more is written as this (about 49 days).
_MAX_LEASE_AGE_MS = p.MAX_U32


@attrs.frozen
class ClusterNodeInfo:
    """One node as ``describe_cluster`` describes it."""

    node_id: str
    host: str
    client_port: int
    dashboard_port: int
    peer_port: int
    alive: bool
    #: Active segments whose primary this node is.
    segments_led: int
    attributes: tuple[tuple[str, str], ...] = ()
    version: str = ""


@attrs.frozen
class ClusterInfo:
    """The answer of ``describe_cluster``: the cluster as the answering node sees it."""

    cluster_id: str
    #: The node that answered.
    node_id: str
    #: ``local`` (one node) or ``etcd``.
    control_plane: str
    #: The node holding the cluster-chores lease; None when none does.
    chores_holder: str | None
    #: Segments whose replica set misses its placement spread.
    domain_violations: int
    #: Milliseconds since etcd last renewed the answering node's lease; None on one node.
    lease_age_ms: int | None
    nodes: tuple[ClusterNodeInfo, ...]
    #: Segments with fewer whole copies on live nodes than the replication factor; None from
    #: a node that has not counted them yet (it just started) or does not say (version 1).
    under_replicated: int | None = None
    #: Ranges that no node can lead now: their active segment has fewer live replicas than a
    #: quorum. None as for ``under_replicated`` (and from a node of version 1 or 2).
    unavailable_ranges: int | None = None


def _encode_cluster_node(node: ClusterNodeInfo) -> bytes:
    parts = [
        p.text(node.node_id),
        p.text(node.host),
        p.u16(node.client_port),
        p.u16(node.dashboard_port),
        p.u16(node.peer_port),
        p.u8(1 if node.alive else 0),
        p.u32(node.segments_led),
        p.u32(len(node.attributes)),
    ]
    for name, value in node.attributes:
        parts.append(p.text(name))
        parts.append(p.text(value))
    parts.append(p.text(node.version))
    body = b"".join(parts)
    return p.u32(len(body)) + body


def _optional_u32(value: int | None) -> bytes:
    """A marker byte (0x00: none), then the value if there is one."""
    return p.u8(0) if value is None else p.u8(1) + p.u32(value)


def encode_cluster(cluster: ClusterInfo) -> bytes:
    """The ok payload of ``describe_cluster`` (docs/protocol.md, "describe_cluster")."""
    lease = _optional_u32(
        None
        if cluster.lease_age_ms is None
        else min(max(cluster.lease_age_ms, 0), _MAX_LEASE_AGE_MS)
    )
    return b"".join(
        [
            p.u8(CLUSTER_PAYLOAD_VERSION),
            p.text(cluster.cluster_id),
            p.text(cluster.node_id),
            p.text(cluster.control_plane),
            p.text(cluster.chores_holder),
            p.u32(cluster.domain_violations),
            lease,
            p.u32(len(cluster.nodes)),
            *(_encode_cluster_node(node) for node in cluster.nodes),
            _optional_u32(cluster.under_replicated),
            _optional_u32(cluster.unavailable_ranges),
        ]
    )


def _required_text(reader: Reader, field: str) -> str:
    value = reader.text()
    if value is None:
        raise Truncated(f"{field} is null")
    return value


def _flag(reader: Reader, field: str) -> bool:
    value = reader.u8()
    if value > 1:
        raise Truncated(f"{field} is {value:#04x}, neither 0x00 nor 0x01")
    return value == 1


def _cluster_node(reader: Reader) -> ClusterNodeInfo:
    body = Reader(reader.raw(reader.u32()))
    node_id = _required_text(body, "a node id")
    host = _required_text(body, "a host")
    client_port, dashboard_port, peer_port = body.u16(), body.u16(), body.u16()
    alive = _flag(body, "alive")
    segments_led = body.u32()
    count = body.u32()
    if count * 2 > body.remaining:
        raise Truncated(f"{count} attributes cannot fit in {body.remaining} bytes")
    attributes = tuple(
        (_required_text(body, "an attribute name"), _required_text(body, "an attribute value"))
        for _ in range(count)
    )
    version = _required_text(body, "a version")
    # Fields of a later version follow: skipped (``body`` is this entry alone).
    return ClusterNodeInfo(
        node_id,
        host,
        client_port,
        dashboard_port,
        peer_port,
        alive,
        segments_led,
        attributes,
        version,
    )


def decode_cluster(payload: bytes) -> ClusterInfo:
    """Read a ``describe_cluster`` payload of version 1 or later (a later one's added fields
    are skipped; version 1 says nothing of under-replication, versions 1 and 2 nothing of
    unavailable ranges); ``ProtocolViolation`` for
    version 0 or a payload cut short."""
    reader = Reader(payload)
    try:
        version = reader.u8()
        if version < 1:
            raise Truncated(f"describe_cluster payload version {version}; versions start at 1")
        cluster_id = _required_text(reader, "the cluster id")
        node_id = _required_text(reader, "the answering node id")
        control_plane = _required_text(reader, "the control plane")
        chores_holder = reader.text()
        domain_violations = reader.u32()
        lease_age_ms = reader.u32() if _flag(reader, "the lease marker") else None
        count = reader.u32()
        # A node entry takes at least its 4-byte length.
        if count * 4 > reader.remaining:
            raise Truncated(f"{count} nodes cannot fit in {reader.remaining} bytes")
        nodes = tuple(_cluster_node(reader) for _ in range(count))
        under_replicated = (
            reader.u32() if version >= 2 and _flag(reader, "the under-replicated marker") else None
        )
        unavailable_ranges = (
            reader.u32() if version >= 3 and _flag(reader, "the unavailable marker") else None
        )
        if version <= CLUSTER_PAYLOAD_VERSION:
            reader.end()
        # A later version's fields follow: skipped.
    except (Truncated, ValueError) as error:
        raise ProtocolViolation(str(error)) from None
    return ClusterInfo(
        cluster_id,
        node_id,
        control_plane,
        chores_holder,
        domain_violations,
        lease_age_ms,
        nodes,
        under_replicated,
        unavailable_ranges,
    )


def decode_empty(payload: bytes) -> None:
    if payload:
        raise ProtocolViolation(f"expected an empty payload, got {len(payload)} bytes")


#: The version of the ``topic_leaders`` payload this codec writes and reads.
LEADERS_PAYLOAD_VERSION = 1


@attrs.frozen
class RangeLeader:
    """One active range of a topic as ``topic_leaders`` describes it."""

    range_id: str
    #: Its slots, ``[start, end)`` of the topic's ``2 ** keyspace_bits``.
    start: int
    end: int
    #: The node leading it now; None when none does (its primary is being replaced), or from a
    #: broker of one node (the node answering leads every range).
    leader: str | None


@attrs.frozen
class LeaderAddress:
    """Where a client reaches a node that leads ranges: its client port."""

    node_id: str
    host: str
    client_port: int


@attrs.frozen
class LeadersInfo:
    """The answer of ``topic_leaders``: the topic's active ranges in slot order, and the
    addresses of the nodes leading them."""

    keyspace_bits: int
    ranges: tuple[RangeLeader, ...]
    nodes: tuple[LeaderAddress, ...]


def encode_leaders(info: LeadersInfo) -> bytes:
    parts = [
        p.u8(LEADERS_PAYLOAD_VERSION),
        p.u8(info.keyspace_bits),
        p.u32(len(info.ranges)),
    ]
    for entry in info.ranges:
        parts += [
            p.text(entry.range_id),
            p.u64(entry.start),
            p.u64(entry.end),
            p.text(entry.leader),
        ]
    parts.append(p.u32(len(info.nodes)))
    for node in info.nodes:
        parts += [p.text(node.node_id), p.text(node.host), p.u16(node.client_port)]
    return b"".join(parts)


def decode_leaders(payload: bytes) -> LeadersInfo:
    def read(reader: Reader) -> LeadersInfo:
        version = reader.u8()
        if version != LEADERS_PAYLOAD_VERSION:
            raise Truncated(f"topic_leaders payload version {version} is not one this reads")
        bits = reader.u8()
        count = reader.u32()
        # A range takes at least 22 bytes (its id's marker, two u64, the leader's marker).
        if count * 22 > reader.remaining:
            raise Truncated(f"{count} ranges cannot fit in {reader.remaining} bytes")
        ranges = tuple(
            RangeLeader(
                _required_text(reader, "range id"), reader.u64(), reader.u64(), reader.text()
            )
            for _ in range(count)
        )
        count = reader.u32()
        # A node takes at least 6 bytes (two markers and the port) and says both names.
        if count * 6 > reader.remaining:
            raise Truncated(f"{count} nodes cannot fit in {reader.remaining} bytes")
        nodes = tuple(
            LeaderAddress(
                _required_text(reader, "node id"), _required_text(reader, "host"), reader.u16()
            )
            for _ in range(count)
        )
        return LeadersInfo(bits, ranges, nodes)

    return _read_exactly(payload, read)
