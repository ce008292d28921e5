"""The replica's native record check (``check_records`` in ``logbroker/storage/_speedups.c``)
against its Python reference, ``check_batch_records_python``.

A replica checks every record of the bytes a peer sends, so a sender that recomputes the batch
checksum over records it mangled is still caught. The native check must report exactly what
the Python one reports (the same first damage, at the same position, for the same reason) for
any change to a batch's records, including changes whose record checksums were recomputed.
"""

from __future__ import annotations

import struct

import pytest
from crc32c import crc32c
from hypothesis import given
from hypothesis import strategies as st

from logbroker.records import ProducerStamp, Record
from logbroker.storage import _format, _speedups
from logbroker.storage._format import (
    BatchInfo,
    Damage,
    DamageReason,
    check_batch_records,
    check_batch_records_python,
    encode_batch,
    scan_batches,
    stamp_batch,
)

MAX_U64 = 2**64 - 1

header_parts = st.one_of(st.none(), st.binary(max_size=10))
records = st.builds(
    Record,
    value=st.binary(max_size=40),
    key=st.one_of(st.none(), st.binary(max_size=12)),
    timestamp_ms=st.integers(0, MAX_U64),
    headers=st.lists(st.tuples(header_parts, header_parts), max_size=3).map(tuple),
)


def frame_starts(data: bytes, info: BatchInfo) -> list[int]:
    starts, position = [], info.records_start
    for _ in range(info.record_count):
        starts.append(position)
        position += struct.unpack_from(">I", data, position + 8)[0]
    return starts


def reseal(data: bytearray, start: int) -> None:
    """Recompute the checksum of the record frame at ``start``, as a hostile sender would."""
    (length,) = struct.unpack_from(">I", data, start + 8)
    if 40 <= length <= len(data) - start:
        struct.pack_into(">I", data, start, crc32c(bytes(data[start + 4 : start + length])))


@st.composite
def changed_batches(draw: st.DrawFn) -> tuple[bytes, BatchInfo]:
    """One batch (stamped or not) with some of its record bytes changed, and the batch as its
    header (whose checksum is not in question here) described it before the change."""
    batch = draw(st.lists(records, min_size=1, max_size=5))
    base = draw(st.one_of(st.integers(0, 1000), st.just(MAX_U64 - len(batch))))
    stamp = draw(st.none() | st.builds(ProducerStamp, st.integers(0, 9), st.integers(0, 9)))
    unstamped = encode_batch(base, batch)
    frame = unstamped if stamp is None else stamp_batch(unstamped, stamp)
    prefix = draw(st.binary(max_size=8))
    [info] = scan_batches(prefix + frame, len(prefix), base).batches
    data = bytearray(prefix + frame)
    starts = frame_starts(bytes(data), info)
    for _ in range(draw(st.integers(0, 3))):
        position = draw(st.integers(info.records_start, info.end - 1))
        data[position] = draw(st.integers(0, 255))
        if draw(st.booleans()):
            reseal(data, max(start for start in starts if start <= position))
    count = draw(st.sampled_from([info.record_count, info.record_count + 1, info.record_count - 1]))
    return bytes(data), BatchInfo(info.position, info.length, base, max(count, 0), stamp)


def native(data: bytes, info: BatchInfo) -> Damage | None:
    found = _speedups.check_records(
        data, info.position, info.records_start, info.end, info.base_offset, info.record_count
    )
    return None if found is None else Damage(found[0], DamageReason(found[1]))


def test_replicas_use_the_native_check() -> None:
    # The test command installs a compiler, so a missing build is a failure here, not a skip.
    assert _format.check_batch_records is not check_batch_records_python


@given(changed_batches())
def test_the_native_check_reports_what_the_python_check_reports(
    changed: tuple[bytes, BatchInfo],
) -> None:
    data, info = changed
    assert native(data, info) == check_batch_records_python(data, info)
    assert check_batch_records(data, info) == check_batch_records_python(data, info)


def one_batch(*batch: Record, base: int = 7) -> tuple[bytearray, BatchInfo, list[int]]:
    data = encode_batch(base, batch)
    [info] = scan_batches(data, 0, base).batches
    return bytearray(data), info, frame_starts(data, info)


@pytest.mark.parametrize("check", [check_batch_records, check_batch_records_python])
def test_whole_records_pass(check: object) -> None:
    data, info, _ = one_batch(Record(b"a", key=b"k", headers=((b"h", None),)), Record(b""))
    assert check(bytes(data), info) is None  # type: ignore[operator]


def test_a_changed_byte_is_a_checksum_error_at_its_record() -> None:
    data, info, starts = one_batch(Record(b"first"), Record(b"second"))
    data[starts[1] + 40] ^= 0x01
    assert check_batch_records(bytes(data), info) == Damage(starts[1], DamageReason.CHECKSUM)


def test_a_resealed_record_at_another_offset_is_a_sequence_error() -> None:
    data, info, starts = one_batch(Record(b"first"), Record(b"second"))
    struct.pack_into(">Q", data, starts[1] + 12, 100)
    reseal(data, starts[1])
    assert check_batch_records(bytes(data), info) == Damage(starts[1], DamageReason.SEQUENCE)


def test_a_resealed_record_whose_fields_do_not_decode_is_header_damage() -> None:
    data, info, starts = one_batch(Record(b"first"), Record(b"second"))
    struct.pack_into(">I", data, starts[0] + 32, 0xFFFFFFFF)  # a null value
    reseal(data, starts[0])
    assert check_batch_records(bytes(data), info) == Damage(starts[0], DamageReason.HEADER)


def test_records_that_do_not_fill_their_batch_are_header_damage_of_the_batch() -> None:
    data, info, _ = one_batch(Record(b"first"), Record(b"second"))
    shorter = BatchInfo(info.position, info.length, info.base_offset, 1)
    assert check_batch_records(bytes(data), shorter) == Damage(0, DamageReason.HEADER)


def test_an_offset_past_u64_never_matches() -> None:
    # Offsets MAX_U64 and then 0: in u64 arithmetic the second one would follow the first.
    data, info, starts = one_batch(Record(b"a"), Record(b"b"), base=MAX_U64 - 2)
    struct.pack_into(">Q", data, starts[0] + 12, MAX_U64)
    struct.pack_into(">Q", data, starts[1] + 12, 0)
    reseal(data, starts[0])
    reseal(data, starts[1])
    claimed = BatchInfo(info.position, info.length, MAX_U64, 2)
    expected = Damage(starts[1], DamageReason.SEQUENCE)
    assert check_batch_records_python(bytes(data), claimed) == expected
    assert check_batch_records(bytes(data), claimed) == expected


@pytest.mark.parametrize(
    ("batch_position", "start", "end", "count"),
    [(-1, 0, 10, 1), (5, 4, 10, 1), (0, 6, 5, 1), (0, 0, 11, 1), (0, 0, 10, -1)],
)
def test_a_batch_outside_the_data_is_refused(
    batch_position: int, start: int, end: int, count: int
) -> None:
    with pytest.raises(ValueError, match="must lie in data"):
        _speedups.check_records(bytes(10), batch_position, start, end, 0, count)
