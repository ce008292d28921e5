"""Stored record frames to client protocol records: the native transcoder against its Python
reference, and both against decoding and re-encoding the records."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from logbroker import transcode, wire
from logbroker.records import Record
from logbroker.storage import _speedups
from logbroker.storage._format import BATCH_HEADER_SIZE, encode_batch
from logbroker.transcode import wire_records_python

parts = st.one_of(st.none(), st.binary(max_size=12))
records = st.builds(
    Record,
    value=st.binary(max_size=60),
    key=parts,
    timestamp_ms=st.integers(0, 2**64 - 1),
    headers=st.lists(st.tuples(parts, parts), max_size=3).map(tuple),
)


def test_the_broker_uses_the_native_transcoder() -> None:
    assert transcode.wire_records is _speedups.wire_records


@given(
    st.lists(records, min_size=1, max_size=10),
    st.integers(0, 2**40),
    st.data(),
)
@example([Record(b"")], 0, None)
def test_the_native_transcoder_matches_the_reference_and_the_records(
    batch: list[Record], base: int, data: st.DataObject | None
) -> None:
    stored = memoryview(encode_batch(base, batch))
    start, end = BATCH_HEADER_SIZE, len(stored)
    if data is None:
        skip, limit, budget = 0, 1000, 1 << 20
    else:
        skip = data.draw(st.integers(0, len(batch)))
        limit = data.draw(st.integers(1, 12))
        budget = data.draw(st.integers(1, 400))

    native = _speedups.wire_records(stored, start, end, base + skip, limit, budget)
    reference = wire_records_python(stored, start, end, base + skip, limit, budget)

    assert native == reference
    encoded, count, next_offset, _ = native
    payload = wire.encode_records_data(count, encoded, "c")
    assert list(wire.decode_records(payload).records) == batch[skip : skip + count]
    assert next_offset == (base + skip + count)
    if skip < len(batch):
        assert count >= 1  # always at least one record when there is one


@pytest.mark.parametrize("cut", [1, 20, 39, 41])
def test_a_frame_cut_short_is_refused_not_read_past(cut: int) -> None:
    stored = encode_batch(0, [Record(b"value", key=b"key", headers=((b"h", b"v"),))])
    end = len(stored) - cut

    with pytest.raises(ValueError, match="malformed"):
        _speedups.wire_records(memoryview(stored), BATCH_HEADER_SIZE, end, 0, 10, 1000)


def test_bounds_outside_the_data_are_refused() -> None:
    stored = encode_batch(0, [Record(b"v")])

    with pytest.raises(ValueError, match="must lie in data"):
        _speedups.wire_records(stored, 10, len(stored) + 1, 0, 10, 1000)
