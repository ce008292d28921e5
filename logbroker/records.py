"""Records as producers give them and consumers get them back: the value type shared by the wire
protocol, the broker and the storage engine. Pure: no I/O, no Twisted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import attrs

#: A length field of this value stands for null, so no key, value or header part may be as long.
NULL_LENGTH = 0xFFFFFFFF
MAX_U64 = 0xFFFFFFFFFFFFFFFF


def _check_nbytes(what: str, value: object, *, nullable: bool = True) -> None:
    if value is None and nullable:
        return
    if type(value) is not bytes:
        expected = "bytes or None" if nullable else "bytes"
        raise TypeError(f"{what} must be {expected}, not {type(value).__name__}")
    if len(value) >= NULL_LENGTH:
        raise ValueError(f"{what} of {len(value)} bytes is too long for a record")


@attrs.frozen
class Record:
    """One record as a producer gives it and a consumer gets it back, byte for byte."""

    value: bytes
    key: bytes | None = None
    timestamp_ms: int = 0
    headers: tuple[tuple[bytes | None, bytes | None], ...] = ()

    def __attrs_post_init__(self) -> None:
        # Checked exactly, types included (subclasses of bytes and tuple are refused: they could
        # report a length other than what they hold): both encoders rely on it, and the native
        # one reads the bytes objects' buffers directly. Every produced record passes here, so
        # the common shape (bytes, maybe a key, no headers) is checked inline first.
        value, key, timestamp_ms, headers = self.value, self.key, self.timestamp_ms, self.headers
        if (
            type(value) is bytes
            and len(value) < NULL_LENGTH
            and (key is None or (type(key) is bytes and len(key) < NULL_LENGTH))
            and type(timestamp_ms) is int
            and 0 <= timestamp_ms <= MAX_U64
            and headers == ()
            and type(headers) is tuple
        ):
            return
        if not isinstance(self.timestamp_ms, int):
            raise TypeError(f"timestamp_ms must be an int, not {type(self.timestamp_ms).__name__}")
        if not 0 <= self.timestamp_ms <= MAX_U64:
            raise ValueError(f"timestamp_ms {self.timestamp_ms} is outside 0..2**64-1")
        _check_nbytes("key", self.key)
        _check_nbytes("value", self.value, nullable=False)
        if type(self.headers) is not tuple:
            raise TypeError(f"headers must be a tuple, not {type(self.headers).__name__}")
        for header in self.headers:
            if not (type(header) is tuple and len(header) == 2):
                raise TypeError(f"each header must be a (name, value) tuple, not {header!r}")
            _check_nbytes("header name", header[0])
            _check_nbytes("header value", header[1])


@attrs.frozen
class WireRecords:
    """Records still in the client protocol's encoding (docs/protocol.md), one after the other:
    how a produce's records go from the client port to the log, split by range, forwarded and
    framed for storage, without an object per record
    (docs/decisions/0022-a-produce-stays-in-its-wire-bytes.md).

    Made only by the codecs that check the bytes (``Reader.wire_records``,
    ``encode_wire_records`` in ``logbroker.wire``) or cut checked ones
    (``logbroker.key_routing``).
    """

    #: How many records ``data`` holds.
    count: int
    #: Exactly ``count`` records, in the client protocol's record encoding.
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes>")
    #: Their keys' and values' bytes: what the produce metrics count.
    size: int

    def __len__(self) -> int:
        return self.count


#: A produce's records as an append takes them: objects, from a caller in this process, or
#: the bytes a request carried them in.
Records: TypeAlias = Sequence[Record] | WireRecords


@attrs.frozen
class StoredRecord:
    """A record read back from a log, with the offset the log gave it."""

    offset: int
    record: Record


def _u64(_: object, attribute: attrs.Attribute[int], value: object) -> None:
    if type(value) is not int:
        raise TypeError(f"{attribute.name} must be an int, not {type(value).__name__}")
    if not 0 <= value <= MAX_U64:
        raise ValueError(f"{attribute.name} {value} is outside 0..2**64-1")


@attrs.frozen
class ProducerStamp:
    """Who sent a produce and which of its produces it is (``produce_idempotent``): a retry
    carries the stamp of its first try, so that the ranges that stored it know it again."""

    #: Chosen at random by each producer (a client object), so that producers never share one.
    producer_id: int = attrs.field(validator=_u64)
    #: Counts the producer's produces from 0; never reused for another produce.
    sequence: int = attrs.field(validator=_u64)
