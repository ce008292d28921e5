"""The native produce path against its Python reference: a produce's records checked where they
enter (``scan_wire_records``), split by key into their ranges' shares (``split_wire_records``)
and framed for storage (``frame_wire_records``), all from their wire bytes, must give exactly
what the Python path gives (decode the records, route each, encode each share, encode the
batch): the same shares, the same frames, and for malformed bytes the same error, whole and
at any chunking of the stream.
"""

from __future__ import annotations

import struct
import sys

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from logbroker import key_routing, wire
from logbroker.broker.keyspace import split_keyspace
from logbroker.errors import Reason
from logbroker.key_routing import split_records, split_records_python
from logbroker.records import Record, WireRecords
from logbroker.storage import _speedups as storage_native
from logbroker.storage._format import encode_batch_python, iter_record_frames
from logbroker.transcode import frame_wire_records, frame_wire_records_python
from logbroker.wire import FrameDecoder, WireError, primitives
from logbroker.wire import _speedups as wire_native

MAX_U64 = 2**64 - 1
parts = st.one_of(st.none(), st.binary(max_size=12))
records = st.builds(
    Record,
    value=st.binary(max_size=40),
    key=st.one_of(st.none(), st.binary(max_size=12)),
    timestamp_ms=st.integers(0, MAX_U64),
    headers=st.lists(st.tuples(parts, parts), max_size=3).map(tuple),
)
# Keyed records as users send them: few keys, so that ranges get several each.
keyed = st.builds(
    Record,
    value=st.binary(max_size=20),
    key=st.sampled_from([b"a", b"b", b"customer-1", b"customer-2", b"", b"\xff" * 9]),
)


def _python_scan(data: bytes, count: int) -> WireRecords:
    """``Reader.wire_records`` with the native scan taken away."""
    saved = primitives._scan_wire_records_native
    primitives._scan_wire_records_native = None
    try:
        return primitives.Reader(data).wire_records(count)
    finally:
        primitives._scan_wire_records_native = saved


def _starts(bits: int, ranges: int) -> list[int]:
    return [start for start, _ in split_keyspace(bits, ranges)]


def test_the_produce_path_is_native_here() -> None:
    # The test command installs a compiler, so a missing build is a failure here, not a skip.
    assert primitives._scan_wire_records_native is not None
    assert key_routing._split_native is not None


# -- scan ----------------------------------------------------------------------------------


@given(st.lists(records, max_size=8), st.binary(max_size=6), st.binary(max_size=6))
@example([Record(b"")], b"", b"")
def test_valid_records_scan_as_the_python_reader_reads_them(
    batch: list[Record], before: bytes, after: bytes
) -> None:
    encoded = wire.encode_wire_records(batch)
    data = before + encoded.data + after
    native = wire_native.scan_wire_records(data, len(before), len(batch))
    assert native == (len(before) + len(encoded.data), encoded.size)
    reader = primitives.Reader(data, len(before))
    assert reader.wire_records(len(batch)) == encoded
    assert wire.decode_wire_records(encoded) == tuple(batch)


@given(st.lists(records, min_size=1, max_size=4), st.data())
def test_changed_or_cut_records_scan_as_the_python_reader_reads_them(
    batch: list[Record], data: st.DataObject
) -> None:
    encoded = bytearray(wire.encode_wire_records(batch).data)
    for _ in range(data.draw(st.integers(1, 3))):
        encoded[data.draw(st.integers(0, len(encoded) - 1))] = data.draw(st.integers(0, 255))
    cut = bytes(encoded[: data.draw(st.integers(0, len(encoded)))])
    count = data.draw(st.integers(0, len(batch) + 1))
    native = wire_native.scan_wire_records(cut, 0, count)
    try:
        expected = _python_scan(cut, count)
    except primitives.Truncated:
        assert native is None
    else:
        assert native == (len(expected.data), expected.size)


# -- a produce request, whole and in chunks ----------------------------------------------


def _request(topic: str, batch: list[Record]) -> bytes:
    return wire.encode_request(9, wire.Produce(topic, batch))


def _decoded(frame: bytes, chunks: list[int]) -> wire.Request | Reason:
    """The request the server decodes from ``frame`` fed in pieces of the given sizes (the
    rest in one), or the reason it refuses it for."""
    decoder = FrameDecoder()
    bodies: list[bytes] = []
    position = 0
    for size in [*chunks, len(frame)]:
        bodies += decoder.feed(frame[position : position + size])
        position += size
    [body] = bodies
    try:
        return wire.decode_request(body).request
    except WireError as error:
        return error.reason


@given(st.lists(records, max_size=6), st.lists(st.integers(0, 40), max_size=6))
def test_a_produce_decodes_to_the_same_records_whatever_its_chunking(
    batch: list[Record], chunks: list[int]
) -> None:
    request = _decoded(_request("orders", batch), chunks)
    assert isinstance(request, wire.Produce)
    assert request.records == wire.encode_wire_records(batch)
    assert wire.decode_wire_records(request.records) == tuple(batch)


@given(st.lists(records, min_size=1, max_size=4), st.data())
def test_a_malformed_produce_is_refused_for_the_same_reason_on_both_paths(
    batch: list[Record], data: st.DataObject
) -> None:
    frame = bytearray(_request("orders", batch))
    # Past the frame's length prefix and the request head: the records' bytes and count.
    head = 4 + 6 + 11
    for _ in range(data.draw(st.integers(1, 3))):
        frame[data.draw(st.integers(head - 4, len(frame) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(head, len(frame) - 4))
    body = bytes(frame[4:cut])
    frame = bytearray(struct.pack(">I", len(body)) + body)
    chunks = data.draw(st.lists(st.integers(0, 30), max_size=5))
    native = _decoded(bytes(frame), chunks)
    saved = primitives._scan_wire_records_native
    primitives._scan_wire_records_native = None
    try:
        python = _decoded(bytes(frame), chunks)
    finally:
        primitives._scan_wire_records_native = saved
    assert native == python
    if isinstance(native, Reason):
        assert native is Reason.MALFORMED_REQUEST


# -- split by key --------------------------------------------------------------------------


@given(
    st.lists(st.one_of(keyed, records), max_size=30),
    st.integers(1, 32),
    st.integers(1, 16),
    st.data(),
)
@example([Record(b"v", key=b"k")], 1, 1, None)
def test_records_split_into_the_same_shares_as_the_python_router(
    batch: list[Record], bits: int, ranges: int, data: st.DataObject | None
) -> None:
    starts = _starts(bits, ranges)
    keyless = 0 if data is None else data.draw(st.integers(0, len(starts) - 1))
    produced = wire.encode_wire_records(batch)
    native = split_records(produced, bits, starts, keyless)
    assert native == split_records_python(produced, bits, starts, keyless)
    # Every record is in exactly one share, in its range, in the order it came.
    assert sum(share.count for _, share in native) == len(batch)
    assert sum(share.size for _, share in native) == produced.size
    for index, share in native:
        for record in wire.decode_wire_records(share):
            if record.key is None:
                assert index == keyless
            else:
                slot = key_routing.key_slot(record.key, bits)
                assert starts[index] <= slot
                assert index + 1 == len(starts) or slot < starts[index + 1]


def test_a_share_of_every_record_is_the_bytes_as_they_came() -> None:
    produced = wire.encode_wire_records([Record(b"v", key=b"k"), Record(b"w", key=b"k")])
    [(_, share)] = split_records(produced, 8, [0, 64, 128, 192], 0)
    assert share.data is produced.data


def test_keys_land_where_the_documented_hash_puts_them() -> None:
    # The hash is the crc32c package's CRC32C of the key; in a keyspace of one bit, the hash's
    # top bit picks the range.
    key = b"customer-1"
    produced = wire.encode_wire_records([Record(b"v", key=key)])
    [(index, _)] = split_records(produced, 1, [0, 1], 0)
    assert index == key_routing.key_hash(key) >> 31


@pytest.mark.parametrize(
    ("bits", "starts", "keyless"),
    [(0, [0], 0), (33, [0], 0), (8, [], 0), (8, [1], 0), (8, [0, 5, 5], 0), (8, [0], 1)],
)
def test_a_split_with_impossible_ranges_is_refused(
    bits: int, starts: list[int], keyless: int
) -> None:
    with pytest.raises(ValueError, match="split_wire_records"):
        storage_native.split_wire_records(b"", 0, bits, starts, keyless)


# -- frames for storage --------------------------------------------------------------------


@given(st.lists(records, min_size=1, max_size=8), st.integers(0, 2**63))
def test_records_frame_as_the_python_encoder_frames_them(
    batch: list[Record], base_offset: int
) -> None:
    produced = wire.encode_wire_records(batch)
    framed = frame_wire_records(base_offset, produced)
    assert framed == encode_batch_python(base_offset, batch)
    assert framed == frame_wire_records_python(base_offset, produced)
    frames = iter_record_frames(memoryview(framed), 24, len(framed))
    assert [stored.record for stored in frames] == batch


@given(st.lists(records, min_size=1, max_size=4), st.data())
def test_bytes_that_are_not_exactly_the_records_are_left_to_the_python_path(
    batch: list[Record], data: st.DataObject
) -> None:
    encoded = wire.encode_wire_records(batch).data
    extra = data.draw(st.binary(min_size=1, max_size=4))
    count = data.draw(st.sampled_from([len(batch) - 1, len(batch) + 1])) or len(batch) + 1
    assert storage_native.frame_wire_records(0, encoded + extra, len(batch)) is None
    assert storage_native.frame_wire_records(0, encoded, count) is None


@pytest.mark.parametrize(("base_offset", "count"), [(0, 0), (MAX_U64, 2)])
def test_a_batch_without_records_or_offsets_is_refused(base_offset: int, count: int) -> None:
    with pytest.raises(ValueError, match=r"at least one record|out of range"):
        storage_native.frame_wire_records(base_offset, b"", count)


def test_the_native_path_leaks_no_reference() -> None:
    produced = wire.encode_wire_records(
        [Record(b"v" * 10, key=bytes([n]), headers=((b"h", None),)) for n in range(20)]
    )
    data = produced.data
    bad = data[:-3]
    before = sys.getrefcount(data), sys.getrefcount(bad)
    for _ in range(200):
        assert storage_native.split_wire_records(data, 20, 8, [0, 100, 200], 1) is not None
        assert storage_native.split_wire_records(bad, 20, 8, [0, 100, 200], 1) is None
        assert storage_native.frame_wire_records(5, data, 20) is not None
        assert storage_native.frame_wire_records(5, bad, 20) is None
        assert wire_native.scan_wire_records(data, 0, 20) is not None
        assert wire_native.scan_wire_records(bad, 0, 20) is None
    assert (sys.getrefcount(data), sys.getrefcount(bad)) == before
