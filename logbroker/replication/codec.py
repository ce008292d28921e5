"""The peer protocol (port 4042), v1: a sans-IO codec. No Twisted, no sockets, no logging.

Brokers of one cluster talk over one long-lived connection per direction and peer: a handshake
(``logbroker.replication.handshake``), then pipelined requests and responses matched by
correlation id, and pings on an idle link. ``logbroker.replication.protocol`` is the thin Twisted
adapter. All integers are big-endian (network order).

Byte layout::

    frame    = len:u32 body[len]          len > the maximum frame size -> PeerFrameTooLarge,
                                          raised before any of the body is buffered
    body     = kind:u8 fields             the fields must end exactly at the end of the body
    text     = len:u16 utf8[len]          UTF-8, at most 65 535 bytes

    kind 0x01 Hello    = protocol_version:u16 text(cluster_id) text(node_id) nonce[32]
    kind 0x02 Proof    = mac[32]                          HMAC-SHA256, see handshake.py
    kind 0x03 Welcome  = (no fields)
    kind 0x04 Refuse   = text(reason) text(detail)
    kind 0x05 Request  = correlation_id:u32 op:u8 payload[rest of the body]
    kind 0x06 Response = correlation_id:u32 status:u8 ...
                           status 0 (ok):    payload[rest of the body]
                           status 1 (error): text(reason)
    kind 0x07 Ping     = token:u64
    kind 0x08 Pong     = token:u64                        the token of the Ping it answers

Hello and Refuse keep this layout in every version of the protocol, so that two nodes of
different versions can always tell each other why they part (``incompatible_version``); what
follows the handshake may change with ``PROTOCOL_VERSION``. A request with an op this version
does not know still decodes (its op is kept as a number), so that it can be answered
``unknown_op`` rather than end the connection.

Request payloads and their ok payloads, by op (an error response carries only a reason)::

    op 1 append  request = text(range_id) record_count:u32 records[rest]
                 ok      = count:u32                      records appended
    op 2 read    request = text(range_id) from_offset:u64 max_records:u32 max_bytes:u32 wait_ms:u32
                 ok      = record_count:u32 next_offset:u64 end_offset:u64 records[rest]
    op 3 bounds  request = text(range_id)
                 ok      = start_offset:u64 end_offset:u64    the range's readable [start, end)
    op 4 group   request = verb:u8 text(topic) text(group) text(member) count:u16 text(range_id)*
                 ok      = count:u16 text(range_id)*          the member's share (share only)
                 verb: 1 share (the member is active; which ranges does it read), 2 touch (it
                 is active), 3 leave; touch and leave carry no ranges and answer none
    op 9 stamped append
                 request = text(range_id) producer_id:u64 sequence:u64 record_count:u32
                           records[rest]
                 ok      = count:u32                      records acknowledged
                 an append of a range's share of a ``produce_idempotent``, with its stamp: the
                 primary does not store a stamp it has stored already (it answers the count)

The stamped append is an op of its own, not a field added to op 1, so that op 1 keeps its layout
and no version changes: a node that does not know op 9 answers ``unknown_op``, and the node
forwarding to it sends the share as op 1 instead (stored without the dedupe, as that node would
store any produce).

Ops 5-8 (replicate, fence, seal, fetch: what a segment's primary tells its replicas) are laid
out in ``logbroker.replication.replica_codec``.

``records`` is ``record_count`` records in the client protocol's record encoding
(``record = str(key) value_len:u32 value timestamp_ms:u64 header_count:u32 (str(k) str(v))*``,
see ``logbroker.wire``), carried opaque: ``pack_records`` and ``unpack_records`` convert.

Every decoder is strict: a body or payload that does not parse exactly to its end raises
``MalformedPeerMessage``. A peer that sends one has broken the protocol: the connection ends.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from enum import IntEnum, StrEnum
from typing import TypeVar

import attrs

from logbroker import wire
from logbroker.records import ProducerStamp, Record
from logbroker.wire import primitives as p
from logbroker.wire.primitives import Reader, Truncated

PROTOCOL_VERSION = 1
NONCE_SIZE = 32
MAC_SIZE = 32
#: The peer port's default maximum frame: room for an append or a read of a full client frame
#: (``SVC_MAX_FRAME_SIZE``, 16 MiB by default) with its headers.
DEFAULT_MAX_PEER_FRAME_SIZE = 32 * 1024 * 1024
MAX_TEXT_BYTES = 0xFFFF
_MAX_U16 = 0xFFFF
_MAX_U32 = 0xFFFFFFFF
_MAX_U64 = 0xFFFFFFFFFFFFFFFF
_U16 = struct.Struct(">H")
_CORRELATION_OP = struct.Struct(">IB")
_RESPONSE_STATUS_OK = 0
_RESPONSE_STATUS_ERROR = 1


class PeerReason(StrEnum):
    """Why a peer refused a handshake, failed a request or ended a connection."""

    WRONG_CLUSTER = "wrong_cluster"
    INCOMPATIBLE_VERSION = "incompatible_version"
    BAD_CREDENTIALS = "bad_credentials"
    #: The peer said it was this very node (a loop back to ourselves, or a misconfigured id).
    SAME_NODE_ID = "same_node_id"
    #: The dialed address answered with another node id than the one it was dialed as.
    UNEXPECTED_NODE = "unexpected_node"
    MALFORMED_MESSAGE = "malformed_message"
    FRAME_TOO_LARGE = "frame_too_large"
    UNEXPECTED_MESSAGE = "unexpected_message"
    UNKNOWN_OP = "unknown_op"
    # The same strings as the client protocol's reasons of these names.
    TIMEOUT = "timeout"
    OVERLOADED = "overloaded"
    UNREACHABLE = "unreachable"
    INTERNAL_ERROR = "internal_error"


class PeerOp(IntEnum):
    APPEND = 1
    READ = 2
    BOUNDS = 3
    GROUP = 4
    # Replication (``logbroker.replication.replica_codec``).
    REPLICATE = 5
    FENCE = 6
    SEAL = 7
    FETCH = 8
    # ``append`` with the producer's stamp of a ``produce_idempotent``.
    STAMPED_APPEND = 9
    # The committed records of a copy, for reads while a range's primary cannot serve them.
    READ_COMMITTED = 10


class GroupVerb(IntEnum):
    SHARE = 1
    TOUCH = 2
    LEAVE = 3


class PeerCodecError(ValueError):
    """Bytes the peer protocol refuses; ``reason`` is a ``PeerReason``."""

    def __init__(self, reason: PeerReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class PeerFrameTooLarge(PeerCodecError):
    def __init__(self, length: int, maximum: int) -> None:
        super().__init__(
            PeerReason.FRAME_TOO_LARGE, f"frame of {length} bytes exceeds the maximum of {maximum}"
        )
        self.length = length
        self.maximum = maximum


class MalformedPeerMessage(PeerCodecError):
    def __init__(self, detail: str) -> None:
        super().__init__(PeerReason.MALFORMED_MESSAGE, detail)


# -- validators: a message that exists can be encoded ----------------------------------------


def _unsigned(maximum: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(_: object, attribute: attrs.Attribute[int], value: int) -> None:
        if type(value) is bool or not isinstance(value, int) or not 0 <= value <= maximum:
            raise ValueError(f"{attribute.name} must be an integer in 0..{maximum}, not {value!r}")

    return check


_u8 = _unsigned(0xFF)
_u16 = _unsigned(_MAX_U16)
_u32 = _unsigned(_MAX_U32)
_u64 = _unsigned(_MAX_U64)


def _text(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be str, not {type(value).__name__}")
    size = len(value.encode("utf-8"))  # also refuses lone surrogates
    if size > MAX_TEXT_BYTES:
        raise ValueError(f"{attribute.name} of {size} bytes exceeds {MAX_TEXT_BYTES} bytes")


def _exact_bytes(size: int) -> Callable[[object, attrs.Attribute[bytes], bytes], None]:
    def check(_: object, attribute: attrs.Attribute[bytes], value: bytes) -> None:
        if not isinstance(value, bytes) or len(value) != size:
            raise ValueError(f"{attribute.name} must be {size} bytes")

    return check


def _bytes(_: object, attribute: attrs.Attribute[bytes], value: bytes) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"{attribute.name} must be bytes, not {type(value).__name__}")


# -- messages --------------------------------------------------------------------------------


@attrs.frozen
class Hello:
    protocol_version: int = attrs.field(validator=_u16)
    cluster_id: str = attrs.field(validator=_text)
    node_id: str = attrs.field(validator=_text)
    nonce: bytes = attrs.field(validator=_exact_bytes(NONCE_SIZE))


@attrs.frozen
class Proof:
    mac: bytes = attrs.field(validator=_exact_bytes(MAC_SIZE))


@attrs.frozen
class Welcome:
    pass


@attrs.frozen
class Refuse:
    reason: str = attrs.field(validator=_text)
    detail: str = attrs.field(default="", validator=_text)


@attrs.frozen
class Request:
    correlation_id: int = attrs.field(validator=_u32)
    #: A ``PeerOp``, or the number of an op this version does not know.
    op: int = attrs.field(validator=_u8)
    payload: bytes = attrs.field(default=b"", validator=_bytes)


@attrs.frozen
class Response:
    """``error`` None: ok, with ``payload``; else the reason the request failed (no payload)."""

    correlation_id: int = attrs.field(validator=_u32)
    payload: bytes = attrs.field(default=b"", validator=_bytes)
    error: str | None = attrs.field(default=None, validator=attrs.validators.optional(_text))

    def __attrs_post_init__(self) -> None:
        if self.error is not None and self.payload:
            raise ValueError("an error response carries a reason, not a payload")

    @property
    def ok(self) -> bool:
        return self.error is None


@attrs.frozen
class Ping:
    token: int = attrs.field(validator=_u64)


@attrs.frozen
class Pong:
    token: int = attrs.field(validator=_u64)


PeerMessage = Hello | Proof | Welcome | Refuse | Request | Response | Ping | Pong


class _Kind(IntEnum):
    HELLO = 0x01
    PROOF = 0x02
    WELCOME = 0x03
    REFUSE = 0x04
    REQUEST = 0x05
    RESPONSE = 0x06
    PING = 0x07
    PONG = 0x08


# -- encoding --------------------------------------------------------------------------------


def encode_text(value: str) -> bytes:
    """``text = len:u16 utf8[len]`` (the handshake's proof input uses it too)."""
    data = value.encode("utf-8")
    return _U16.pack(len(data)) + data


def _read_text(reader: Reader) -> str:
    data = reader.raw(reader.u16())
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Truncated(f"text is not UTF-8: {error}") from None


def encode_body(message: PeerMessage) -> bytes:
    """The frame body of ``message``: ``kind:u8 fields``."""
    match message:
        case Request(correlation_id, op, payload):
            return bytes((_Kind.REQUEST,)) + _CORRELATION_OP.pack(correlation_id, op) + payload
        case Response(correlation_id, payload, None):
            head = _CORRELATION_OP.pack(correlation_id, _RESPONSE_STATUS_OK)
            return bytes((_Kind.RESPONSE,)) + head + payload
        case Response(correlation_id, _, str(reason)):
            head = _CORRELATION_OP.pack(correlation_id, _RESPONSE_STATUS_ERROR)
            return bytes((_Kind.RESPONSE,)) + head + encode_text(reason)
        case Hello(version, cluster_id, node_id, nonce):
            return b"".join(
                (
                    bytes((_Kind.HELLO,)),
                    p.u16(version),
                    encode_text(cluster_id),
                    encode_text(node_id),
                    nonce,
                )
            )
        case Proof(mac):
            return bytes((_Kind.PROOF,)) + mac
        case Welcome():
            return bytes((_Kind.WELCOME,))
        case Refuse(reason, detail):
            return bytes((_Kind.REFUSE,)) + encode_text(reason) + encode_text(detail)
        case Ping(token):
            return bytes((_Kind.PING,)) + p.u64(token)
        case Pong(token):
            return bytes((_Kind.PONG,)) + p.u64(token)
    raise TypeError(f"not a peer message: {message!r}")


def encode(message: PeerMessage) -> bytes:
    """``message`` as one frame, ``len:u32 body``."""
    return wire.encode_frame(encode_body(message))


# -- decoding --------------------------------------------------------------------------------


def _decode_response(reader: Reader) -> Response:
    correlation_id = reader.u32()
    status = reader.u8()
    if status == _RESPONSE_STATUS_OK:
        return Response(correlation_id, reader.raw(reader.remaining))
    if status == _RESPONSE_STATUS_ERROR:
        return Response(correlation_id, error=_read_text(reader))
    raise Truncated(f"response status {status} is neither 0 (ok) nor 1 (error)")


_DECODERS: dict[int, Callable[[Reader], PeerMessage]] = {
    _Kind.HELLO: lambda r: Hello(r.u16(), _read_text(r), _read_text(r), r.raw(NONCE_SIZE)),
    _Kind.PROOF: lambda r: Proof(r.raw(MAC_SIZE)),
    _Kind.WELCOME: lambda r: Welcome(),
    _Kind.REFUSE: lambda r: Refuse(_read_text(r), _read_text(r)),
    _Kind.REQUEST: lambda r: Request(r.u32(), r.u8(), r.raw(r.remaining)),
    _Kind.RESPONSE: _decode_response,
    _Kind.PING: lambda r: Ping(r.u64()),
    _Kind.PONG: lambda r: Pong(r.u64()),
}

_T = TypeVar("_T")


def _read_exactly(data: bytes, read: Callable[[Reader], _T], what: str) -> _T:
    reader = Reader(data)
    try:
        value = read(reader)
        reader.end()
    except Truncated as error:
        raise MalformedPeerMessage(f"{what}: {error}") from None
    return value


def decode_body(body: bytes) -> PeerMessage:
    """The message of one frame body; ``MalformedPeerMessage`` unless it parses exactly."""
    if not body:
        raise MalformedPeerMessage("empty frame")
    decoder = _DECODERS.get(body[0])
    if decoder is None:
        raise MalformedPeerMessage(f"unknown message kind {body[0]:#04x}")
    return _read_exactly(body[1:], decoder, _Kind(body[0]).name.lower())


class PeerFrameDecoder:
    """Splits the peer byte stream into messages, whatever its chunking.

    Each length prefix is checked against the maximum before any of its body is buffered
    (``logbroker.wire.FrameDecoder`` does the framing), so a peer can make this hold at most one
    maximum-size frame. After any error the decoder refuses all further input: the stream can no
    longer be trusted.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_PEER_FRAME_SIZE) -> None:
        self._frames = wire.FrameDecoder(max_frame_size)
        self._failed: PeerCodecError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return self._frames.buffered

    def feed(self, data: bytes) -> list[PeerMessage]:
        """Add ``data``; return every message it completes, in order. Raises
        ``PeerFrameTooLarge`` or ``MalformedPeerMessage`` at the first bad frame (the messages
        ahead of it in this call are dropped with the connection)."""
        if self._failed is not None:
            raise self._failed
        try:
            return [decode_body(body) for body in self._frames.feed(data)]
        except wire.FrameTooLargeError as error:
            self._failed = PeerFrameTooLarge(error.length, error.maximum)
        except PeerCodecError as error:
            self._failed = error
        raise self._failed


# -- op payloads -----------------------------------------------------------------------------


@attrs.frozen
class AppendRequest:
    """Append ``record_count`` records (``records``, in the record encoding) to a range; with
    ``stamp``, only if the range has not stored that stamp yet (op ``stamped_append``)."""

    range_id: str = attrs.field(validator=_text)
    record_count: int = attrs.field(validator=_u32)
    records: bytes = attrs.field(validator=_bytes)
    stamp: ProducerStamp | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(ProducerStamp)),
    )

    @property
    def op(self) -> PeerOp:
        """The op that carries it."""
        return PeerOp.APPEND if self.stamp is None else PeerOp.STAMPED_APPEND


@attrs.frozen
class AppendResult:
    count: int = attrs.field(validator=_u32)


@attrs.frozen
class ReadRequest:
    range_id: str = attrs.field(validator=_text)
    from_offset: int = attrs.field(validator=_u64)
    max_records: int = attrs.field(validator=_u32)
    max_bytes: int = attrs.field(validator=_u32)
    #: How long the serving node may wait for a record at ``from_offset`` (a long poll).
    wait_ms: int = attrs.field(validator=_u32)


@attrs.frozen
class ReadResult:
    record_count: int = attrs.field(validator=_u32)
    records: bytes = attrs.field(validator=_bytes)
    #: The offset to read from next.
    next_offset: int = attrs.field(validator=_u64)
    #: The range's end on the serving node when it answered.
    end_offset: int = attrs.field(validator=_u64)


@attrs.frozen
class BoundsRequest:
    range_id: str = attrs.field(validator=_text)


@attrs.frozen
class BoundsResult:
    """The offsets the range can be read from on the serving node: ``[start_offset,
    end_offset)``."""

    start_offset: int = attrs.field(validator=_u64)
    end_offset: int = attrs.field(validator=_u64)


@attrs.frozen
class GroupRequest:
    """A consumer group member's news for the group's coordinator node."""

    verb: GroupVerb = attrs.field(validator=attrs.validators.instance_of(GroupVerb))
    topic: str = attrs.field(validator=_text)
    group: str = attrs.field(validator=_text)
    member: str = attrs.field(validator=_text)
    #: The topic's ranges, to share out (``share`` only).
    range_ids: tuple[str, ...] = attrs.field(default=())

    @range_ids.validator
    def _check_ranges(self, attribute: attrs.Attribute[tuple[str, ...]], value: object) -> None:
        if not isinstance(value, tuple) or len(value) > 0xFFFF:
            raise ValueError("a group request lists at most 65535 range ids, as a tuple")
        for range_id in value:
            _text(self, attribute, range_id)  # type: ignore[arg-type]


_APPEND_HEAD = struct.Struct(">I")
_STAMP = struct.Struct(">QQ")
_READ_TAIL = struct.Struct(">QIII")
_READ_RESULT_HEAD = struct.Struct(">IQQ")
_BOUNDS_RESULT = struct.Struct(">QQ")


def encode_append_request(request: AppendRequest) -> bytes:
    """The payload of ``request.op``: an ``append``, or a ``stamped_append`` with a stamp."""
    head = encode_text(request.range_id)
    if request.stamp is not None:
        head += _STAMP.pack(request.stamp.producer_id, request.stamp.sequence)
    return head + _APPEND_HEAD.pack(request.record_count) + request.records


def decode_append_request(payload: bytes) -> AppendRequest:
    """An ``append`` payload (op 1)."""
    return _read_exactly(
        payload,
        lambda r: AppendRequest(_read_text(r), r.u32(), r.raw(r.remaining)),
        "append request",
    )


def decode_stamped_append_request(payload: bytes) -> AppendRequest:
    """A ``stamped_append`` payload (op 9)."""

    def read(r: Reader) -> AppendRequest:
        range_id = _read_text(r)
        stamp = ProducerStamp(r.u64(), r.u64())
        return AppendRequest(range_id, r.u32(), r.raw(r.remaining), stamp)

    return _read_exactly(payload, read, "stamped append request")


def encode_append_result(result: AppendResult) -> bytes:
    return p.u32(result.count)


def decode_append_result(payload: bytes) -> AppendResult:
    return _read_exactly(payload, lambda r: AppendResult(r.u32()), "append result")


def encode_read_request(request: ReadRequest) -> bytes:
    tail = _READ_TAIL.pack(
        request.from_offset, request.max_records, request.max_bytes, request.wait_ms
    )
    return encode_text(request.range_id) + tail


def decode_read_request(payload: bytes) -> ReadRequest:
    return _read_exactly(
        payload,
        lambda r: ReadRequest(_read_text(r), r.u64(), r.u32(), r.u32(), r.u32()),
        "read request",
    )


def encode_read_result(result: ReadResult) -> bytes:
    head = _READ_RESULT_HEAD.pack(result.record_count, result.next_offset, result.end_offset)
    return head + result.records


def decode_read_result(payload: bytes) -> ReadResult:
    def read(r: Reader) -> ReadResult:
        count, next_offset, end_offset = r.u32(), r.u64(), r.u64()
        return ReadResult(count, r.raw(r.remaining), next_offset, end_offset)

    return _read_exactly(payload, read, "read result")


def encode_bounds_request(request: BoundsRequest) -> bytes:
    return encode_text(request.range_id)


def decode_bounds_request(payload: bytes) -> BoundsRequest:
    return _read_exactly(payload, lambda r: BoundsRequest(_read_text(r)), "bounds request")


def encode_bounds_result(result: BoundsResult) -> bytes:
    return _BOUNDS_RESULT.pack(result.start_offset, result.end_offset)


def decode_bounds_result(payload: bytes) -> BoundsResult:
    return _read_exactly(payload, lambda r: BoundsResult(r.u64(), r.u64()), "bounds result")


def _encode_texts(values: Sequence[str]) -> bytes:
    return _U16.pack(len(values)) + b"".join(encode_text(value) for value in values)


def _read_texts(reader: Reader) -> tuple[str, ...]:
    return tuple(_read_text(reader) for _ in range(reader.u16()))


def encode_group_request(request: GroupRequest) -> bytes:
    return (
        bytes([request.verb])
        + encode_text(request.topic)
        + encode_text(request.group)
        + encode_text(request.member)
        + _encode_texts(request.range_ids)
    )


def decode_group_request(payload: bytes) -> GroupRequest:
    def read(reader: Reader) -> GroupRequest:
        verb = reader.u8()
        if verb not in GroupVerb.__members__.values():
            raise Truncated(f"unknown group verb {verb}")
        return GroupRequest(
            GroupVerb(verb),
            _read_text(reader),
            _read_text(reader),
            _read_text(reader),
            _read_texts(reader),
        )

    return _read_exactly(payload, read, "group request")


def encode_group_share(range_ids: Sequence[str]) -> bytes:
    return _encode_texts(range_ids)


def decode_group_share(payload: bytes) -> list[str]:
    return list(_read_exactly(payload, _read_texts, "group share"))


def pack_records(records: Iterable[Record]) -> tuple[int, bytes]:
    """``(record_count, records)`` for an append or a read result."""
    encoded = [p.record(record) for record in records]
    return len(encoded), b"".join(encoded)


def unpack_records(record_count: int, records: bytes) -> tuple[Record, ...]:
    """The records of an append or a read result: exactly ``record_count`` of them."""

    def read(r: Reader) -> tuple[Record, ...]:
        # A record takes at least 17 bytes (null key, value length, timestamp, header count).
        if record_count * 17 > r.remaining:
            raise Truncated(f"{record_count} records cannot fit in {r.remaining} bytes")
        return r.records(record_count)

    return _read_exactly(records, read, "records")
