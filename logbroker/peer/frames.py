"""The peer protocol (port 4042), v2: a sans-IO codec of its frames. No Twisted, no sockets,
no logging.

Brokers of one cluster talk over one long-lived connection per direction and peer: a handshake
(``logbroker.peer.handshake``), then pipelined requests and responses matched by
correlation id, and pings on an idle link. ``logbroker.peer.link`` is the thin Twisted
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
follows the handshake may change with ``PROTOCOL_VERSION`` (2 since fetches carry the epoch
the copy must be at, and replicas may answer ``unknown``; 3 since replicate and seal requests
and copy states carry a data epoch; nodes of different versions refuse each other: upgrade a
cluster's nodes together). A request with an op this version
does not know still decodes (its op is kept as a number), so that it can be answered
``unknown_op`` rather than end the connection.

The ops' payloads are laid out in ``logbroker.peer.range_ops`` (append, read, bounds, group,
stamped append), ``logbroker.replication.replica_codec`` (replicate, fence, seal, fetch,
read committed) and ``logbroker.cluster.digests`` (digests).

Every decoder is strict: a body or payload that does not parse exactly to its end raises
``MalformedPeerMessage``. A peer that sends one has broken the protocol: the connection ends.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from enum import IntEnum, StrEnum
from typing import TypeVar

import attrs

from logbroker import wire
from logbroker.wire import primitives as p
from logbroker.wire.primitives import Reader, Truncated

PROTOCOL_VERSION = 3
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
    #: Over mutual TLS, the peer's certificate does not name the node id it claims.
    WRONG_CERTIFICATE = "wrong_certificate"
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
    # The digests of a node's segment copies, for ``logbroker cluster verify``
    # (``logbroker.cluster.digests``).
    DIGESTS = 11
    # The sealed copies a node should hold and does not yet, for the under-replicated count.
    COPY_HEALTH = 12
    # A replica's own check of its sealed copy, for a repair (``logbroker.replication.repair``).
    VERIFY_COPY = 13
    # When sealed copies' newest records were written, for retention's age rule
    # (``logbroker.cluster.retention``).
    SEGMENT_TIMES = 14


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


u8_field = _unsigned(0xFF)
u16_field = _unsigned(_MAX_U16)
u32_field = _unsigned(_MAX_U32)
u64_field = _unsigned(_MAX_U64)


def text_field(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be str, not {type(value).__name__}")
    size = len(value.encode("utf-8"))  # also refuses lone surrogates
    if size > MAX_TEXT_BYTES:
        raise ValueError(f"{attribute.name} of {size} bytes exceeds {MAX_TEXT_BYTES} bytes")


def exact_bytes_field(size: int) -> Callable[[object, attrs.Attribute[bytes], bytes], None]:
    def check(_: object, attribute: attrs.Attribute[bytes], value: bytes) -> None:
        if not isinstance(value, bytes) or len(value) != size:
            raise ValueError(f"{attribute.name} must be {size} bytes")

    return check


def bytes_field(_: object, attribute: attrs.Attribute[bytes], value: bytes) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"{attribute.name} must be bytes, not {type(value).__name__}")


# -- messages --------------------------------------------------------------------------------


@attrs.frozen
class Hello:
    protocol_version: int = attrs.field(validator=u16_field)
    cluster_id: str = attrs.field(validator=text_field)
    node_id: str = attrs.field(validator=text_field)
    nonce: bytes = attrs.field(validator=exact_bytes_field(NONCE_SIZE))


@attrs.frozen
class Proof:
    mac: bytes = attrs.field(validator=exact_bytes_field(MAC_SIZE))


@attrs.frozen
class Welcome:
    pass


@attrs.frozen
class Refuse:
    reason: str = attrs.field(validator=text_field)
    detail: str = attrs.field(default="", validator=text_field)


@attrs.frozen
class Request:
    correlation_id: int = attrs.field(validator=u32_field)
    #: A ``PeerOp``, or the number of an op this version does not know.
    op: int = attrs.field(validator=u8_field)
    payload: bytes = attrs.field(default=b"", validator=bytes_field)


@attrs.frozen
class Response:
    """``error`` None: ok, with ``payload``; else the reason the request failed (no payload)."""

    correlation_id: int = attrs.field(validator=u32_field)
    payload: bytes = attrs.field(default=b"", validator=bytes_field)
    error: str | None = attrs.field(default=None, validator=attrs.validators.optional(text_field))

    def __attrs_post_init__(self) -> None:
        if self.error is not None and self.payload:
            raise ValueError("an error response carries a reason, not a payload")

    @property
    def ok(self) -> bool:
        return self.error is None


@attrs.frozen
class Ping:
    token: int = attrs.field(validator=u64_field)


@attrs.frozen
class Pong:
    token: int = attrs.field(validator=u64_field)


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


def read_text(reader: Reader) -> str:
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
        return Response(correlation_id, error=read_text(reader))
    raise Truncated(f"response status {status} is neither 0 (ok) nor 1 (error)")


_DECODERS: dict[int, Callable[[Reader], PeerMessage]] = {
    _Kind.HELLO: lambda r: Hello(r.u16(), read_text(r), read_text(r), r.raw(NONCE_SIZE)),
    _Kind.PROOF: lambda r: Proof(r.raw(MAC_SIZE)),
    _Kind.WELCOME: lambda r: Welcome(),
    _Kind.REFUSE: lambda r: Refuse(read_text(r), read_text(r)),
    _Kind.REQUEST: lambda r: Request(r.u32(), r.u8(), r.raw(r.remaining)),
    _Kind.RESPONSE: _decode_response,
    _Kind.PING: lambda r: Ping(r.u64()),
    _Kind.PONG: lambda r: Pong(r.u64()),
}

_T = TypeVar("_T")


def read_exactly(data: bytes, read: Callable[[Reader], _T], what: str) -> _T:
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
    return read_exactly(body[1:], decoder, _Kind(body[0]).name.lower())


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
