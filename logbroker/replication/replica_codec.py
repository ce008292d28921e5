"""The peer protocol's replication ops: a sans-IO codec, like ``codec``, for what a segment's
primary tells its replicas.

Request payloads and their ok payloads, by op (integers big-endian; ``text`` as in ``codec``)::

    op 5 replicate  request = text(range_id) segment:u64 epoch:u64 data_epoch:u64 offset:u64
                              position:u64 commit:u64 crc:u32 data[rest]
                    ok      = copy_state
    op 6 fence      request = text(range_id) segment:u64 epoch:u64
                    ok      = copy_state
    op 7 seal       request = text(range_id) segment:u64 epoch:u64 data_epoch:u64
                              record_count:u64 byte_size:u64
                    ok      = copy_state
    op 8 fetch      request = text(range_id) segment:u64 epoch:u64 data_epoch:u64 offset:u64
                              position:u64 max_bytes:u32
                    ok      = data[rest]         whole batches from ``offset`` (empty at the end)
    op 10 read_committed
                    request = fetch's (``position`` unused, 0)
                    ok      = end_offset:u64 data[rest]
    op 12 copy_health
                    request = (empty)
                    ok      = count:u32 (text(range_id) segment:u64)*
                              the sealed segments whose replica sets name the answering node
                              and that it does not hold whole yet
    op 13 verify_copy
                    request = fence's (text(range_id) segment:u64 epoch:u64)
                    ok      = check:u8 epoch:u64 record_count:u64 byte_size:u64 position:u64
                              the answering node's own check of its sealed copy, read back
                              whole (``CopyCheck``)

    copy_state = outcome:u8 epoch:u64 data_epoch:u64 end_offset:u64 end_position:u64

A fetch sends whatever the copy holds (a node taking a segment over needs the uncommitted tail
too), but only from a copy at ``epoch`` holding ``data_epoch``'s records (a sealed copy's are
its sealed epoch's) whose node is in the segment's replica set (else it fails ``not_primary``:
the copy is stale); ``read_committed`` sends only records the copy knows
are committed (``end_offset``, the end of what it may send: its sealed end, or the commit index
its primary last told it), and only of a copy in the replica set at the segment's epoch, of that
one segment, for reads while the range's primary cannot serve them. With ``max_bytes`` 0 it
sends only ``end_offset``.

``segment`` is the base offset of the segment the request is about; ``offset``/``position`` are
where ``data`` starts, as a record offset and as a byte position in that segment's file;
``data`` is whole stored batches, exactly as the primary's copy holds them, and ``crc`` their
CRC32C (every batch and record in them carries its own checksum too). ``commit`` is how far the
range is committed (acknowledged): a replica's readers never see past it. A replicate request
with no data is a commit notice: a primary that has nothing more to send tells its replicas how
far the range is committed, so that their copies can serve every committed record if the
primary is lost.

``data_epoch`` is the epoch of the primary whose records ``data`` are (a segment's records are
all one primary's: the one that wrote them from the segment's first byte); a node completing
copies after a claim sends an older primary's records at its own ``epoch``. A seal names it too:
only a copy holding that primary's records is sealed (another is fetched whole).

A replica answers every request with the state of its copy: the epoch it is fenced at, the
data epoch of its records (``logbroker.storage.RangeLog.segment_data_epoch``), where the copy's
durable bytes end (``end_offset``, ``end_position``), and the outcome:

- ``ok``: done (the data is durable, the fence or seal recorded);
- ``fenced``: refused, the copy is fenced at a later epoch (``epoch``): the sender is stale;
- ``mismatch``: refused, the copy does not end where the data starts: send from its end;
- ``short``: a seal the copy cannot take, since it holds fewer bytes: it must be fetched whole;
- ``unknown``: refused for now, the replica's view of the control plane does not show the
  sender leading that epoch yet (it lags behind the claim): send again shortly.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import IntEnum

import attrs
from crc32c import crc32c

from logbroker.peer.frames import MalformedPeerMessage, encode_text
from logbroker.peer.frames import read_exactly as _read_exactly
from logbroker.peer.frames import read_text as _read_text
from logbroker.peer.frames import text_field as _text
from logbroker.peer.frames import u32_field as _u32
from logbroker.peer.frames import u64_field as _u64
from logbroker.wire.primitives import Reader, Truncated


class CopyOutcome(IntEnum):
    OK = 0
    FENCED = 1
    MISMATCH = 2
    SHORT = 3
    UNKNOWN = 4


@attrs.frozen
class CopyStatus:
    """What a replica says of its copy of a segment."""

    outcome: CopyOutcome = attrs.field(validator=attrs.validators.instance_of(CopyOutcome))
    epoch: int = attrs.field(validator=_u64)
    end_offset: int = attrs.field(validator=_u64)
    end_position: int = attrs.field(validator=_u64)
    #: The epoch of the primary whose records the copy holds (``epoch`` unless given).
    data_epoch: int = attrs.field(validator=_u64, kw_only=True)

    @data_epoch.default
    def _same_as_epoch(self) -> int:
        return self.epoch


@attrs.frozen
class ReplicateRequest:
    range_id: str = attrs.field(validator=_text)
    segment: int = attrs.field(validator=_u64)
    epoch: int = attrs.field(validator=_u64)
    offset: int = attrs.field(validator=_u64)
    position: int = attrs.field(validator=_u64)
    commit: int = attrs.field(validator=_u64)
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes>")
    #: The epoch of the primary whose records ``data`` are (``epoch`` unless given).
    data_epoch: int = attrs.field(validator=_u64, kw_only=True)

    @data_epoch.default
    def _same_as_epoch(self) -> int:
        return self.epoch


@attrs.frozen
class FenceRequest:
    range_id: str = attrs.field(validator=_text)
    segment: int = attrs.field(validator=_u64)
    epoch: int = attrs.field(validator=_u64)


@attrs.frozen
class SealRequest:
    range_id: str = attrs.field(validator=_text)
    segment: int = attrs.field(validator=_u64)
    epoch: int = attrs.field(validator=_u64)
    record_count: int = attrs.field(validator=_u64)
    byte_size: int = attrs.field(validator=_u64)
    #: The epoch of the primary whose records the sealed segment holds (``epoch`` unless
    #: given).
    data_epoch: int = attrs.field(validator=_u64, kw_only=True)

    @data_epoch.default
    def _same_as_epoch(self) -> int:
        return self.epoch


@attrs.frozen
class FetchRequest:
    range_id: str = attrs.field(validator=_text)
    segment: int = attrs.field(validator=_u64)
    #: The epoch the copy must be at (``read_committed`` ignores it: the copy's node checks
    #: its copy against its own view of the segment).
    epoch: int = attrs.field(validator=_u64)
    offset: int = attrs.field(validator=_u64)
    position: int = attrs.field(validator=_u64)
    max_bytes: int = attrs.field(validator=_u32)
    #: The epoch of the primary whose records the copy must hold (``epoch`` unless given: a
    #: sealed copy's records are its sealed epoch's).
    data_epoch: int = attrs.field(validator=_u64, kw_only=True)

    @data_epoch.default
    def _same_as_epoch(self) -> int:
        return self.epoch


class CheckOutcome(IntEnum):
    #: Every checksum passed; ``record_count`` and ``byte_size`` are what the copy holds.
    INTACT = 0
    #: The copy fails verification at byte ``position``.
    DAMAGED = 1
    #: No sealed copy of the segment at ``epoch`` here, or one no one may believe (stale).
    ABSENT = 2


@attrs.frozen
class CopyCheck:
    """A ``verify_copy`` answer: what a replica found when it read its copy back whole."""

    outcome: CheckOutcome = attrs.field(validator=attrs.validators.instance_of(CheckOutcome))
    epoch: int = attrs.field(validator=_u64, default=0)
    record_count: int = attrs.field(validator=_u64, default=0)
    byte_size: int = attrs.field(validator=_u64, default=0)
    position: int = attrs.field(validator=_u64, default=0)


_STATUS = struct.Struct(">BQQQQ")
_CHECK = struct.Struct(">BQQQQ")
_REPLICATE_HEAD = struct.Struct(">QQQQQQI")
_FENCE = struct.Struct(">QQ")
_SEAL = struct.Struct(">QQQQQ")
_FETCH = struct.Struct(">QQQQQI")


def encode_status(status: CopyStatus) -> bytes:
    return _STATUS.pack(
        status.outcome, status.epoch, status.data_epoch, status.end_offset, status.end_position
    )


def decode_status(payload: bytes) -> CopyStatus:
    def read(reader: Reader) -> CopyStatus:
        outcome = reader.u8()
        if outcome not in CopyOutcome.__members__.values():
            raise Truncated(f"unknown copy outcome {outcome}")
        epoch, data_epoch, end_offset, end_position = (reader.u64() for _ in range(4))
        return CopyStatus(
            CopyOutcome(outcome), epoch, end_offset, end_position, data_epoch=data_epoch
        )

    return _read_exactly(payload, read, "copy status")


def encode_replicate(request: ReplicateRequest) -> bytes:
    head = _REPLICATE_HEAD.pack(
        request.segment,
        request.epoch,
        request.data_epoch,
        request.offset,
        request.position,
        request.commit,
        crc32c(request.data),
    )
    return encode_text(request.range_id) + head + request.data


def decode_replicate(payload: bytes) -> ReplicateRequest:
    def read(reader: Reader) -> ReplicateRequest:
        range_id = _read_text(reader)
        segment, epoch, data_epoch, offset, position, commit = (reader.u64() for _ in range(6))
        crc = reader.u32()
        data = reader.raw(reader.remaining)
        if crc32c(data) != crc:
            # Checked here, before any batch is looked at: bytes damaged on the way never reach
            # a copy, and the primary hears of it as a broken link, not as a bad copy.
            raise MalformedPeerMessage(f"replicated data for {range_id} fails its checksum")
        return ReplicateRequest(
            range_id, segment, epoch, offset, position, commit, data, data_epoch=data_epoch
        )

    return _read_exactly(payload, read, "replicate request")


def encode_fence(request: FenceRequest) -> bytes:
    return encode_text(request.range_id) + _FENCE.pack(request.segment, request.epoch)


def decode_fence(payload: bytes) -> FenceRequest:
    return _read_exactly(
        payload, lambda r: FenceRequest(_read_text(r), r.u64(), r.u64()), "fence request"
    )


def encode_seal(request: SealRequest) -> bytes:
    tail = _SEAL.pack(
        request.segment,
        request.epoch,
        request.data_epoch,
        request.record_count,
        request.byte_size,
    )
    return encode_text(request.range_id) + tail


def decode_seal(payload: bytes) -> SealRequest:
    def read(reader: Reader) -> SealRequest:
        range_id = _read_text(reader)
        segment, epoch, data_epoch, record_count, byte_size = (reader.u64() for _ in range(5))
        return SealRequest(range_id, segment, epoch, record_count, byte_size, data_epoch=data_epoch)

    return _read_exactly(payload, read, "seal request")


_U64 = struct.Struct(">Q")
_U32 = struct.Struct(">I")


@attrs.frozen
class CommittedRecords:
    """A ``read_committed`` answer: whole batches of committed records, and where the copy's
    committed records end."""

    end_offset: int = attrs.field(validator=_u64)
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes>")


def encode_committed(answer: CommittedRecords) -> bytes:
    return _U64.pack(answer.end_offset) + answer.data


def decode_committed(payload: bytes) -> CommittedRecords:
    return _read_exactly(
        payload,
        lambda r: CommittedRecords(r.u64(), r.raw(r.remaining)),
        "read_committed answer",
    )


def encode_fetch(request: FetchRequest) -> bytes:
    tail = _FETCH.pack(
        request.segment,
        request.epoch,
        request.data_epoch,
        request.offset,
        request.position,
        request.max_bytes,
    )
    return encode_text(request.range_id) + tail


def decode_fetch(payload: bytes) -> FetchRequest:
    def read(reader: Reader) -> FetchRequest:
        range_id = _read_text(reader)
        segment, epoch, data_epoch, offset, position = (reader.u64() for _ in range(5))
        return FetchRequest(
            range_id, segment, epoch, offset, position, reader.u32(), data_epoch=data_epoch
        )

    return _read_exactly(payload, read, "fetch request")


def encode_missing(segments: Sequence[tuple[str, int]]) -> bytes:
    """A ``copy_health`` answer: the segments, as ``(range id, base offset)``."""
    return _U32.pack(len(segments)) + b"".join(
        encode_text(range_id) + _U64.pack(base) for range_id, base in segments
    )


def decode_missing(payload: bytes) -> list[tuple[str, int]]:
    def read(reader: Reader) -> list[tuple[str, int]]:
        count = reader.u32()
        # Each entry takes at least 10 bytes (an empty text and the offset).
        if count * 10 > reader.remaining:
            raise Truncated(f"{count} segments cannot fit in {reader.remaining} bytes")
        return [(_read_text(reader), reader.u64()) for _ in range(count)]

    return _read_exactly(payload, read, "copy_health answer")


def encode_check(check: CopyCheck) -> bytes:
    return _CHECK.pack(
        check.outcome, check.epoch, check.record_count, check.byte_size, check.position
    )


def decode_check(payload: bytes) -> CopyCheck:
    def read(reader: Reader) -> CopyCheck:
        outcome = reader.u8()
        if outcome not in CheckOutcome.__members__.values():
            raise Truncated(f"unknown copy check outcome {outcome}")
        return CopyCheck(CheckOutcome(outcome), *(reader.u64() for _ in range(4)))

    return _read_exactly(payload, read, "verify_copy answer")
