"""The peer protocol's range operations: a sans-IO codec of what one node asks of the node
leading a range (forwarded produces, reads and bounds) and of a consumer group's coordinator.
``text`` is as in ``logbroker.peer.frames``; all integers are big-endian.

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
see ``logbroker.wire``), carried as those bytes (``WireRecords``): ``read_records`` checks
them without decoding them.

Every decoder is strict: a payload that does not parse exactly to its end raises
``MalformedPeerMessage``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import IntEnum

import attrs

from logbroker.peer.frames import (
    PeerOp,
    bytes_field,
    encode_text,
    read_exactly,
    read_text,
    text_field,
    u32_field,
    u64_field,
)
from logbroker.records import ProducerStamp, WireRecords
from logbroker.wire import primitives as p
from logbroker.wire.primitives import Reader, Truncated

_U16 = struct.Struct(">H")


class GroupVerb(IntEnum):
    SHARE = 1
    TOUCH = 2
    LEAVE = 3


@attrs.frozen
class AppendRequest:
    """Append ``record_count`` records (``records``, in the record encoding) to a range; with
    ``stamp``, only if the range has not stored that stamp yet (op ``stamped_append``)."""

    range_id: str = attrs.field(validator=text_field)
    record_count: int = attrs.field(validator=u32_field)
    records: bytes = attrs.field(validator=bytes_field)
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
    count: int = attrs.field(validator=u32_field)


@attrs.frozen
class ReadRequest:
    range_id: str = attrs.field(validator=text_field)
    from_offset: int = attrs.field(validator=u64_field)
    max_records: int = attrs.field(validator=u32_field)
    max_bytes: int = attrs.field(validator=u32_field)
    #: How long the serving node may wait for a record at ``from_offset`` (a long poll).
    wait_ms: int = attrs.field(validator=u32_field)


@attrs.frozen
class ReadResult:
    record_count: int = attrs.field(validator=u32_field)
    records: bytes = attrs.field(validator=bytes_field)
    #: The offset to read from next.
    next_offset: int = attrs.field(validator=u64_field)
    #: The range's end on the serving node when it answered.
    end_offset: int = attrs.field(validator=u64_field)


@attrs.frozen
class BoundsRequest:
    range_id: str = attrs.field(validator=text_field)


@attrs.frozen
class BoundsResult:
    """The offsets the range can be read from on the serving node: ``[start_offset,
    end_offset)``."""

    start_offset: int = attrs.field(validator=u64_field)
    end_offset: int = attrs.field(validator=u64_field)


@attrs.frozen
class GroupRequest:
    """A consumer group member's news for the group's coordinator node."""

    verb: GroupVerb = attrs.field(validator=attrs.validators.instance_of(GroupVerb))
    topic: str = attrs.field(validator=text_field)
    group: str = attrs.field(validator=text_field)
    member: str = attrs.field(validator=text_field)
    #: The topic's ranges, to share out (``share`` only).
    range_ids: tuple[str, ...] = attrs.field(default=())

    @range_ids.validator
    def _check_ranges(self, attribute: attrs.Attribute[tuple[str, ...]], value: object) -> None:
        if not isinstance(value, tuple) or len(value) > 0xFFFF:
            raise ValueError("a group request lists at most 65535 range ids, as a tuple")
        for range_id in value:
            text_field(self, attribute, range_id)  # type: ignore[arg-type]


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
    return read_exactly(
        payload,
        lambda r: AppendRequest(read_text(r), r.u32(), r.raw(r.remaining)),
        "append request",
    )


def decode_stamped_append_request(payload: bytes) -> AppendRequest:
    """A ``stamped_append`` payload (op 9)."""

    def read(r: Reader) -> AppendRequest:
        range_id = read_text(r)
        stamp = ProducerStamp(r.u64(), r.u64())
        return AppendRequest(range_id, r.u32(), r.raw(r.remaining), stamp)

    return read_exactly(payload, read, "stamped append request")


def encode_append_result(result: AppendResult) -> bytes:
    return p.u32(result.count)


def decode_append_result(payload: bytes) -> AppendResult:
    return read_exactly(payload, lambda r: AppendResult(r.u32()), "append result")


def encode_read_request(request: ReadRequest) -> bytes:
    tail = _READ_TAIL.pack(
        request.from_offset, request.max_records, request.max_bytes, request.wait_ms
    )
    return encode_text(request.range_id) + tail


def decode_read_request(payload: bytes) -> ReadRequest:
    return read_exactly(
        payload,
        lambda r: ReadRequest(read_text(r), r.u64(), r.u32(), r.u32(), r.u32()),
        "read request",
    )


def encode_read_result(result: ReadResult) -> bytes:
    head = _READ_RESULT_HEAD.pack(result.record_count, result.next_offset, result.end_offset)
    return head + result.records


def decode_read_result(payload: bytes) -> ReadResult:
    def read(r: Reader) -> ReadResult:
        count, next_offset, end_offset = r.u32(), r.u64(), r.u64()
        return ReadResult(count, r.raw(r.remaining), next_offset, end_offset)

    return read_exactly(payload, read, "read result")


def encode_bounds_request(request: BoundsRequest) -> bytes:
    return encode_text(request.range_id)


def decode_bounds_request(payload: bytes) -> BoundsRequest:
    return read_exactly(payload, lambda r: BoundsRequest(read_text(r)), "bounds request")


def encode_bounds_result(result: BoundsResult) -> bytes:
    return _BOUNDS_RESULT.pack(result.start_offset, result.end_offset)


def decode_bounds_result(payload: bytes) -> BoundsResult:
    return read_exactly(payload, lambda r: BoundsResult(r.u64(), r.u64()), "bounds result")


def _encode_texts(values: Sequence[str]) -> bytes:
    return _U16.pack(len(values)) + b"".join(encode_text(value) for value in values)


def read_texts(reader: Reader) -> tuple[str, ...]:
    return tuple(read_text(reader) for _ in range(reader.u16()))


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
            read_text(reader),
            read_text(reader),
            read_text(reader),
            read_texts(reader),
        )

    return read_exactly(payload, read, "group request")


def encode_group_share(range_ids: Sequence[str]) -> bytes:
    return _encode_texts(range_ids)


def decode_group_share(payload: bytes) -> list[str]:
    return list(read_exactly(payload, read_texts, "group share"))


def read_records(record_count: int, records: bytes) -> WireRecords:
    """The records of an append, checked and kept as their wire bytes: exactly
    ``record_count`` of them."""

    def read(r: Reader) -> WireRecords:
        # A record takes at least 17 bytes (null key, value length, timestamp, header count).
        if record_count * 17 > r.remaining:
            raise Truncated(f"{record_count} records cannot fit in {r.remaining} bytes")
        return r.wire_records(record_count)

    return read_exactly(records, read, "records")
