"""The native scan of a sealing segment (``scan_sealed`` in ``logbroker/storage/_speedups.c``)
against its Python reference, ``scan_sealed_python``.

The sidecars of a sealed segment (index, seal marker) are derived from its bytes, read back
whole each time a segment seals. Both scans must give the same index, next offset and largest
timestamp for a whole segment, and both must refuse (``None``) anything that is not whole,
verified batches: a changed byte, a cut, a record frame resealed with a length that no longer
fills its batch.
"""

from __future__ import annotations

import struct

from crc32c import crc32c
from hypothesis import given
from hypothesis import strategies as st

from logbroker.records import ProducerStamp, Record
from logbroker.storage import _segment, _speedups
from logbroker.storage._format import INDEX_INTERVAL_BYTES, encode_batch, stamp_batch
from logbroker.storage._segment import scan_sealed_python

MAX_U64 = 2**64 - 1

records = st.builds(
    Record,
    value=st.binary(max_size=1500),
    key=st.one_of(st.none(), st.binary(max_size=12)),
    timestamp_ms=st.integers(0, MAX_U64),
)


@st.composite
def segments(draw: st.DrawFn) -> tuple[bytes, int]:
    """A segment's log: batches (some stamped) from a base offset, back to back."""
    base = draw(st.one_of(st.integers(0, 10**6), st.just(MAX_U64 - 200)))
    parts, offset = [], base
    for batch in draw(st.lists(st.lists(records, min_size=1, max_size=4), min_size=1, max_size=12)):
        frame = encode_batch(offset, batch)
        if draw(st.booleans()):
            frame = stamp_batch(frame, ProducerStamp(draw(st.integers(0, 9)), offset))
        parts.append(frame)
        offset += len(batch)
    return b"".join(parts), base


def reseal_batch(data: bytearray, position: int) -> None:
    """Recompute the checksum of the batch at ``position``, as a buggy writer would."""
    (length,) = struct.unpack_from(">I", data, position + 8)
    if 24 <= length <= len(data) - position:
        struct.pack_into(
            ">I", data, position, crc32c(bytes(data[position + 4 : position + length]))
        )


def both(data: bytes, base: int) -> object:
    native = _speedups.scan_sealed(data, base, INDEX_INTERVAL_BYTES)
    assert native == scan_sealed_python(data, base, INDEX_INTERVAL_BYTES)
    return native


def test_sealing_uses_the_native_scan() -> None:
    # The test command installs a compiler, so a missing build is a failure here, not a skip.
    assert _segment.scan_sealed is not scan_sealed_python


@given(segments())
def test_both_scans_describe_a_whole_segment_alike(segment: tuple[bytes, int]) -> None:
    data, base = segment

    scanned = both(data, base)

    assert scanned is not None
    index, next_offset, _ = scanned  # type: ignore[misc]
    assert index[0] == (base, 0)
    assert next_offset > base


@given(segments(), st.data())
def test_both_scans_refuse_a_changed_byte_or_a_cut(
    segment: tuple[bytes, int], draw: st.DataObject
) -> None:
    data, base = segment
    changed = bytearray(data)
    position = draw.draw(st.integers(0, len(data) - 1), label="position")
    changed[position] ^= draw.draw(st.integers(1, 255), label="mask")
    cut = draw.draw(st.integers(0, len(data) - 1), label="cut")

    assert both(bytes(changed), base) is None
    assert both(data[:cut], base) is None
    assert both(data, base + 1) is None, "the first batch must start at the base offset"


@given(segments(), st.integers(0, 0xFFFFFFFF))
def test_both_scans_refuse_a_record_length_that_no_longer_fills_its_batch(
    segment: tuple[bytes, int], length: int
) -> None:
    data, base = segment
    changed = bytearray(data)
    # The first record of the first batch, its batch checksum recomputed over the change.
    first_record = 24 + (16 if data[6] == 2 else 0)
    struct.pack_into(">I", changed, first_record + 8, length)
    reseal_batch(changed, 0)

    scanned = both(bytes(changed), base)

    if length != struct.unpack_from(">I", data, first_record + 8)[0]:
        assert scanned is None


def test_the_largest_timestamp_and_the_index_rule() -> None:
    batches = [
        encode_batch(0, [Record(b"a" * 3000, timestamp_ms=5), Record(b"b", timestamp_ms=9)]),
        encode_batch(2, [Record(b"c" * 1000, timestamp_ms=2**64 - 2)]),
        encode_batch(3, [Record(b"d", timestamp_ms=1)]),
        encode_batch(4, [Record(b"e" * 10, timestamp_ms=0)]),
    ]
    starts = [sum(len(b) for b in batches[:i]) for i in range(len(batches))]

    scanned = both(b"".join(batches), 0)

    # The second batch starts under 4096 bytes after the first; the third at or past it.
    assert starts[1] < INDEX_INTERVAL_BYTES <= starts[2]
    assert scanned == ([(0, 0), (3, starts[2])], 5, 2**64 - 2)
