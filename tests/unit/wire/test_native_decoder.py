"""The native record decoder (``logbroker/wire/_speedups.c``) against its Python reference,
``Reader.record``: the same records (equal, and as good as any other ``Record``) for every
valid encoding, and ``None`` (so that the Python reader reports the error) for every invalid
one."""

from __future__ import annotations

import sys

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from logbroker.records import Record
from logbroker.wire import _speedups, primitives
from logbroker.wire.primitives import Reader, Truncated
from logbroker.wire.primitives import record as encode_record

MAX_U64 = 2**64 - 1
parts = st.one_of(st.none(), st.binary(max_size=20))
records = st.builds(
    Record,
    value=st.binary(max_size=60),
    key=st.one_of(st.none(), st.binary(max_size=20)),
    timestamp_ms=st.integers(0, MAX_U64),
    headers=st.lists(st.tuples(parts, parts), max_size=4).map(tuple),
)


def python_read(data: bytes, position: int, count: int) -> tuple[tuple[Record, ...], int]:
    reader = Reader(data, position)
    found = tuple(reader.record() for _ in range(count))
    return found, len(data) - reader.remaining


def test_the_protocol_uses_the_native_decoder() -> None:
    # The test command installs a compiler, so a missing build is a failure here, not a skip.
    assert primitives.RECORD_DECODER == "native"


@given(st.lists(records, max_size=8), st.binary(max_size=6), st.binary(max_size=6))
@example([Record(b"")], b"", b"")
@example([Record(b"v", key=b"", headers=((None, None), (b"", b"")))], b"", b"")
def test_valid_records_read_as_the_python_reader_reads_them(
    batch: list[Record], before: bytes, after: bytes
) -> None:
    data = before + b"".join(encode_record(record) for record in batch) + after
    native = _speedups.read_records(Record, data, len(before), len(batch))
    assert native == python_read(data, len(before), len(batch))
    assert native is not None
    assert list(native[0]) == batch
    assert Reader(data, len(before)).records(len(batch)) == tuple(batch)


@given(st.lists(records, min_size=1, max_size=4), st.data())
def test_any_changed_or_cut_encoding_reads_as_the_python_reader_or_is_left_to_it(
    batch: list[Record], data: st.DataObject
) -> None:
    encoded = bytearray(b"".join(encode_record(record) for record in batch))
    for _ in range(data.draw(st.integers(1, 3))):
        position = data.draw(st.integers(0, len(encoded) - 1))
        encoded[position] = data.draw(st.integers(0, 255))
    cut = bytes(encoded[: data.draw(st.integers(0, len(encoded)))])
    count = data.draw(st.integers(0, len(batch) + 1))
    native = _speedups.read_records(Record, cut, 0, count)
    try:
        expected = python_read(cut, 0, count)
    except Truncated:
        assert native is None
    else:
        assert native == expected


def test_a_count_the_data_cannot_hold_is_left_to_the_python_reader() -> None:
    assert _speedups.read_records(Record, bytes(16), 0, 1) is None
    with pytest.raises(Truncated):
        Reader(bytes(16)).records(1)


def test_decoded_records_are_ordinary_records() -> None:
    [record], _ = _speedups.read_records(Record, encode_record(Record(b"v", b"k", 7)), 0, 1)
    assert type(record) is Record
    assert hash(record) == hash(Record(b"v", b"k", 7))
    assert attrs.evolve(record, value=b"w") == Record(b"w", b"k", 7)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        record.value = b"x"  # type: ignore[misc]


def test_reading_leaks_no_reference() -> None:
    data = b"".join(encode_record(Record(b"v" * 10, b"k", 1, ((b"h", None),))) for _ in range(5))
    bad = data[:-3]
    before = sys.getrefcount(data), sys.getrefcount(bad), sys.getrefcount(Record)
    for _ in range(200):
        assert _speedups.read_records(Record, data, 0, 5) is not None
        assert _speedups.read_records(Record, bad, 0, 5) is None
    assert (sys.getrefcount(data), sys.getrefcount(bad), sys.getrefcount(Record)) == before


@pytest.mark.parametrize(("position", "count"), [(-1, 1), (11, 0), (0, -1)])
def test_a_position_or_count_out_of_range_is_refused(position: int, count: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        _speedups.read_records(Record, bytes(10), position, count)
