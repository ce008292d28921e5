"""Property tests of the storage frames (``logbroker.storage._format``).

The exact bytes are pinned by ``test_format_golden.py``; these tests check the rules the frames
must keep for any input: records round-trip exactly, no single changed byte is ever read back as
a valid record, a torn write is told apart from rot, and the index and seal marker detect damage.
The batches are unstamped (version 1) and stamped (version 2) ones, mixed.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import pytest
from crc32c import crc32c
from hypothesis import example, given, settings
from hypothesis import strategies as st

from logbroker.records import ProducerStamp, Record, StoredRecord
from logbroker.storage._format import (
    BATCH_HEADER_SIZE,
    STAMPED_BATCH_HEADER_SIZE,
    BatchInfo,
    Damage,
    DamageReason,
    EpochMarker,
    IndexEntry,
    Scan,
    Seal,
    check_batch_records,
    decode_epoch,
    decode_index,
    decode_seal,
    encode_batch,
    encode_epoch,
    encode_index,
    encode_seal,
    iter_batch_records,
    iter_valid_records,
    scan_batches,
    stamp_batch,
    verify_records_only,
)

MAX_U64 = 2**64 - 1
MAX_U32 = 2**32 - 1

# -- strategies --------------------------------------------------------------------------------

# A null key, an empty key and a non-empty key are three different things on disk.
keys = st.one_of(st.none(), st.just(b""), st.binary(min_size=1, max_size=24))
header_parts = st.one_of(st.none(), st.binary(max_size=12))
records = st.builds(
    Record,
    value=st.binary(max_size=64),
    key=keys,
    timestamp_ms=st.integers(0, MAX_U64),
    headers=st.lists(st.tuples(header_parts, header_parts), max_size=4).map(tuple),
)
record_lists = st.lists(records, min_size=1, max_size=6)
stamps = st.builds(ProducerStamp, st.integers(0, MAX_U64), st.integers(0, MAX_U64))

#: The stamp a batch carries (``None``: an unstamped batch) and its records.
Batch = tuple[ProducerStamp | None, list[Record]]
Batches = tuple[int, list[Batch]]


@st.composite
def batch_inputs(draw: st.DrawFn, max_batches: int = 1) -> Batches:
    """A base offset and one or more consecutive batches starting there."""
    batches = draw(
        st.lists(st.tuples(st.none() | stamps, record_lists), min_size=1, max_size=max_batches)
    )
    total = sum(len(batch) for _, batch in batches)
    base = draw(st.integers(0, MAX_U64 - total))
    return base, batches


def single_batches() -> st.SearchStrategy[Batches]:
    return batch_inputs(max_batches=1)


def several_batches() -> st.SearchStrategy[Batches]:
    return batch_inputs(max_batches=4)


def encode(offset: int, stamp: ProducerStamp | None, batch: Sequence[Record]) -> bytes:
    unstamped = encode_batch(offset, batch)
    return unstamped if stamp is None else stamp_batch(unstamped, stamp)


# -- helpers -----------------------------------------------------------------------------------


class Encoded:
    """Batches encoded back to back, with what a reader must find in them."""

    def __init__(self, base: int, batches: Sequence[Batch]) -> None:
        self.data = b""
        self.infos: list[BatchInfo] = []
        self.stored: list[list[StoredRecord]] = []
        #: The start position of every record frame.
        self.record_starts: list[int] = []
        offset = base
        for stamp, batch in batches:
            frame = encode(offset, stamp, batch)
            self.infos.append(BatchInfo(len(self.data), len(frame), offset, len(batch), stamp))
            self.stored.append([StoredRecord(offset + i, record) for i, record in enumerate(batch)])
            position = self.infos[-1].records_start
            for record in batch:
                self.record_starts.append(position)
                # A record frame's size does not depend on its offset.
                position += len(encode_batch(0, [record])) - BATCH_HEADER_SIZE
            self.data += frame
            offset += len(batch)

    def batch_at(self, position: int) -> int:
        return max(i for i, info in enumerate(self.infos) if info.position <= position)

    def record_start(self, position: int) -> int:
        return max(start for start in self.record_starts if start <= position)

    def all_stored(self, batches: int | None = None) -> list[StoredRecord]:
        return [stored for batch in self.stored[:batches] for stored in batch]


def read_scanned(data: bytes, scan: Scan) -> list[StoredRecord]:
    view = memoryview(data)
    return [stored for batch in scan.batches for stored in iter_batch_records(view, batch)]


def flip(data: bytes, position: int, mask: int) -> bytes:
    changed = bytearray(data)
    changed[position] ^= mask
    return bytes(changed)


def set_batch_length(data: bytes, start: int, length: int) -> bytes:
    changed = bytearray(data)
    struct.pack_into(">I", changed, start + 8, length)
    return bytes(changed)


# -- round trips -------------------------------------------------------------------------------


@settings(max_examples=200)
@given(single_batches())
def test_a_batch_gives_back_exactly_its_records_at_consecutive_offsets(
    given_batch: Batches,
) -> None:
    base, [(stamp, batch)] = given_batch
    data = encode(base, stamp, batch)

    scan = scan_batches(data, 0, base)

    assert scan == Scan([BatchInfo(0, len(data), base, len(batch), stamp)], len(data), None)
    assert read_scanned(data, scan) == [
        StoredRecord(base + i, record) for i, record in enumerate(batch)
    ]
    assert verify_records_only(data) is None


@settings(max_examples=100)
@given(several_batches())
def test_concatenated_batches_scan_as_consecutive_batches(
    given_batches: Batches,
) -> None:
    base, batches = given_batches
    encoded = Encoded(base, batches)

    scan = scan_batches(encoded.data, 0, base)

    assert scan == Scan(encoded.infos, len(encoded.data), None)
    assert read_scanned(encoded.data, scan) == encoded.all_stored()
    assert scan_batches(encoded.data) == scan
    assert verify_records_only(encoded.data) is None
    # The scan can start at any batch, given that batch's offset.
    last = encoded.infos[-1]
    assert scan_batches(encoded.data, last.position, last.base_offset).batches == [last]


@settings(max_examples=50)
@given(several_batches())
def test_a_batch_at_an_unexpected_offset_is_a_sequence_error(
    given_batches: Batches,
) -> None:
    base, batches = given_batches
    encoded = Encoded(base, batches)
    wrong = base + 1 if base < MAX_U64 - 64 else base - 1

    scan = scan_batches(encoded.data, 0, wrong)

    assert scan == Scan([], 0, Damage(0, DamageReason.SEQUENCE))


def test_null_empty_and_present_keys_and_header_parts_stay_distinct() -> None:
    batch = [
        Record(b"", key=None),
        Record(b"", key=b""),
        Record(b"v", key=b"\xff\xff\xff\xff", headers=((None, b""), (b"", None), (None, None))),
    ]
    data = encode_batch(0, batch)

    decoded = [stored.record for stored in read_scanned(data, scan_batches(data))]

    assert decoded == batch
    assert [record.key for record in decoded] == [None, b"", b"\xff\xff\xff\xff"]
    assert decoded[2].headers == ((None, b""), (b"", None), (None, None))


# -- stamped batches ---------------------------------------------------------------------------


@settings(max_examples=100)
@given(single_batches(), stamps)
def test_a_stamped_batch_is_the_unstamped_one_with_its_stamp_after_the_header(
    given_batch: Batches, stamp: ProducerStamp
) -> None:
    base, [(_, batch)] = given_batch
    unstamped = encode_batch(base, batch)

    stamped = stamp_batch(unstamped, stamp)

    assert len(stamped) == len(unstamped) + STAMPED_BATCH_HEADER_SIZE - BATCH_HEADER_SIZE
    assert stamped[4:6] == unstamped[4:6] == b"LB"
    assert (stamped[6], unstamped[6]) == (2, 1)
    assert stamped[7] == unstamped[7] == 0
    assert struct.unpack_from(">I", stamped, 8) == (len(stamped),)
    assert stamped[12:24] == unstamped[12:24]
    assert struct.unpack_from(">QQ", stamped, 24) == (stamp.producer_id, stamp.sequence)
    assert stamped[40:] == unstamped[24:]
    [info] = scan_batches(stamped, 0, base).batches
    assert info.stamp == stamp
    assert check_batch_records(stamped, info) is None
    assert read_scanned(stamped, scan_batches(stamped)) == read_scanned(
        unstamped, scan_batches(unstamped)
    )


def test_stamped_and_unstamped_batches_follow_each_other_in_one_segment() -> None:
    first, second = ProducerStamp(1, 0), ProducerStamp(MAX_U64, MAX_U64)
    data = (
        encode(0, first, [Record(b"a"), Record(b"b")])
        + encode(2, None, [Record(b"c")])
        + encode(3, second, [Record(b"d")])
    )

    scan = scan_batches(data, 0, 0)

    assert scan.damage is None
    assert [(info.base_offset, info.stamp) for info in scan.batches] == [
        (0, first),
        (2, None),
        (3, second),
    ]
    assert [stored.record.value for stored in read_scanned(data, scan)] == [b"a", b"b", b"c", b"d"]
    assert verify_records_only(data) is None
    assert all(check_batch_records(data, info) is None for info in scan.batches)


def test_the_records_of_a_damaged_stamped_batch_before_the_damage_are_salvaged() -> None:
    batch = [Record(b"first"), Record(b"second"), Record(b"third")]
    data = encode(9, ProducerStamp(5, 6), batch)
    last_record = Encoded(9, [(ProducerStamp(5, 6), batch)]).record_starts[-1]
    damaged = flip(data, last_record + 40, 0x01)

    scan = scan_batches(damaged, 0, 9)
    salvaged = list(iter_valid_records(memoryview(damaged), 0, len(damaged), 9))

    assert scan == Scan([], 0, Damage(last_record, DamageReason.CHECKSUM))
    assert salvaged == [StoredRecord(9, batch[0]), StoredRecord(10, batch[1])]


@pytest.mark.parametrize("version", [0, 3, 255])
def test_a_batch_of_a_version_this_build_does_not_know_is_header_damage(version: int) -> None:
    data = bytearray(encode_batch(0, [Record(b"v")]))
    data[6] = version
    struct.pack_into(">I", data, 0, crc32c(bytes(data[4:])))

    assert scan_batches(bytes(data), 0, 0) == Scan([], 0, Damage(0, DamageReason.HEADER))
    assert verify_records_only(bytes(data)) == Damage(0, DamageReason.HEADER)


def test_a_stamped_batch_holds_at_least_its_header_and_one_record() -> None:
    data = bytearray(encode(0, ProducerStamp(1, 1), [Record(b"")]))
    assert len(data) == STAMPED_BATCH_HEADER_SIZE + 40
    # One byte short of a stamped header and one record: not sane, however the checksum reads.
    struct.pack_into(">I", data, 8, STAMPED_BATCH_HEADER_SIZE + 39)
    struct.pack_into(">I", data, 0, crc32c(bytes(data[4:-1])))

    scan = scan_batches(bytes(data[:-1]), 0, 0)

    assert scan == Scan([], 0, Damage(0, DamageReason.HEADER))


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("timestamp_ms", [-1, -(2**64), 2**64, 2**70])
def test_a_record_timestamp_outside_u64_is_rejected(timestamp_ms: int) -> None:
    with pytest.raises(ValueError, match="timestamp_ms"):
        Record(b"value", timestamp_ms=timestamp_ms)


@pytest.mark.parametrize("timestamp_ms", [0, MAX_U64])
def test_the_u64_bounds_are_valid_timestamps(timestamp_ms: int) -> None:
    data = encode_batch(0, [Record(b"value", timestamp_ms=timestamp_ms)])

    [stored] = read_scanned(data, scan_batches(data))

    assert stored.record.timestamp_ms == timestamp_ms


def test_an_empty_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one record"):
        encode_batch(0, [])


# -- damage ------------------------------------------------------------------------------------


FlipInput = tuple[int, list[Batch], int, int]


@st.composite
def flipped_bytes(draw: st.DrawFn) -> FlipInput:
    """Batches, plus one byte position in them and a non-zero mask to XOR into it."""
    base, batches = draw(several_batches())
    encoded = Encoded(base, batches)
    # Half the time, somewhere in a batch header (its stamp included): few bytes, but the ones
    # with the most meaning.
    in_header = st.sampled_from(encoded.infos).flatmap(
        lambda info: st.integers(info.position, info.records_start - 1)
    )
    position = draw(st.one_of(st.integers(0, len(encoded.data) - 1), in_header))
    mask = draw(st.integers(1, 255))
    return base, batches, position, mask


def test_a_count_claiming_more_records_than_its_batch_holds_is_blamed_on_the_header() -> None:
    # A record long enough that a header claiming 3 records of it still looks sane.
    encoded = Encoded(0, [(None, [Record(b"a"), Record(b"b")]), (None, [Record(b"c" * 200)])])
    second = encoded.infos[1]
    # The count's low byte: 1 record claimed as 3. The one there verifies; the walk runs out at
    # the batch's end, which is not where the damage is.
    corrupted = flip(encoded.data, second.position + BATCH_HEADER_SIZE - 1, 0x02)

    scan = scan_batches(corrupted, 0, 0)

    assert scan.damage == Damage(second.position, DamageReason.HEADER)
    assert verify_records_only(corrupted) == Damage(second.position, DamageReason.HEADER)


@settings(max_examples=500)
@given(flipped_bytes())
def test_no_single_changed_byte_is_ever_read_back_as_a_valid_record(flipped: FlipInput) -> None:
    base, batches, position, mask = flipped
    encoded = Encoded(base, batches)
    corrupted = flip(encoded.data, position, mask)
    hit = encoded.batch_at(position)
    batch = encoded.infos[hit]
    in_records = position >= batch.records_start

    scan = scan_batches(corrupted, 0, base)

    # The batches before the changed one verify and read back unchanged; the scan stops there.
    assert scan.batches == encoded.infos[:hit]
    assert scan.end == batch.position
    assert read_scanned(corrupted, scan) == encoded.all_stored(hit)
    assert scan.damage is not None
    assert batch.position <= scan.damage.position < batch.end
    if in_records:
        # Damage inside a record frame is blamed on that record, not on anything before it.
        assert scan.damage.position == encoded.record_start(position)
    # Salvaging the damaged batch (as reads do) yields only original records.
    (claimed_length,) = struct.unpack_from(">I", corrupted, batch.position + 8)
    end = min(len(corrupted), batch.position + claimed_length)
    salvaged = list(
        iter_valid_records(memoryview(corrupted), batch.position, end, batch.base_offset)
    )
    assert salvaged == encoded.stored[hit][: len(salvaged)]
    # The record checksums alone catch it too, except in the batch checksum field and the stamp:
    # the only bytes no record checksum covers, and they carry no record data.
    records_only = verify_records_only(corrupted)
    in_stamp = batch.position + BATCH_HEADER_SIZE <= position < batch.records_start
    if batch.position <= position < batch.position + 4 or in_stamp:
        assert records_only is None
    else:
        assert records_only is not None
        assert batch.position <= records_only.position < batch.end
        if in_records:
            assert records_only.position == encoded.record_start(position)


@settings(max_examples=500)
@given(flipped_bytes())
# Regression: byte 8, the high byte of the first batch's length, XOR 0x01 makes the first of
# two batches claim 16 MiB more than the data holds.
@example((0, [(None, [Record(b"a")]), (None, [Record(b"b")])], 8, 0x01))
def test_a_single_changed_byte_in_whole_batches_is_never_taken_for_a_torn_write(
    flipped: FlipInput,
) -> None:
    """Rot must never be reported as INCOMPLETE: recovery truncates an incomplete tail.

    This once failed: when the length field of a batch that is *not* the last one grew past the
    end of the data, the scan reported INCOMPLETE because the batch's whole, valid records did
    not fill the data exactly (the next batch was in the way), and recovery truncated the
    segment there, losing every acknowledged batch from it on.
    """
    base, batches, position, mask = flipped
    encoded = Encoded(base, batches)

    scan = scan_batches(flip(encoded.data, position, mask), 0, base)

    assert scan.damage is not None
    assert scan.damage.reason is not DamageReason.INCOMPLETE, scan.damage


@st.composite
def grown_last_lengths(draw: st.DrawFn) -> tuple[int, list[Batch], int]:
    base, batches = draw(several_batches())
    last = Encoded(base, batches).infos[-1]
    return base, batches, draw(st.integers(last.length + 1, MAX_U32))


@settings(max_examples=200)
@given(grown_last_lengths())
def test_a_whole_last_batch_whose_length_grew_past_the_end_is_rot_not_torn(
    grown: tuple[int, list[Batch], int],
) -> None:
    base, batches, length = grown
    encoded = Encoded(base, batches)
    last = encoded.infos[-1]

    scan = scan_batches(set_batch_length(encoded.data, last.position, length), 0, base)

    assert scan == Scan(
        encoded.infos[:-1], last.position, Damage(last.position, DamageReason.HEADER)
    )


# -- torn writes and unwritten tails -----------------------------------------------------------


def test_empty_data_scans_clean_with_no_batches() -> None:
    assert scan_batches(b"") == Scan([], 0, None)
    assert scan_batches(b"", 0, 42) == Scan([], 0, None)
    assert verify_records_only(b"") is None
    data = encode_batch(0, [Record(b"v")])
    assert scan_batches(data, len(data), 1) == Scan([], len(data), None)


@settings(max_examples=100)
@given(st.integers(1, 20_000))
def test_all_zero_bytes_never_verify_and_are_an_unwritten_tail(size: int) -> None:
    zeros = bytes(size)

    assert scan_batches(zeros) == Scan([], 0, Damage(0, DamageReason.INCOMPLETE))
    assert scan_batches(zeros, 0, 0) == Scan([], 0, Damage(0, DamageReason.INCOMPLETE))
    assert verify_records_only(zeros) is not None


@settings(max_examples=100)
@given(several_batches(), st.integers(1, 5000))
def test_zeros_after_whole_batches_are_an_unwritten_tail(
    given_batches: Batches, zeros: int
) -> None:
    base, batches = given_batches
    encoded = Encoded(base, batches)
    end = len(encoded.data)

    scan = scan_batches(encoded.data + bytes(zeros), 0, base)

    assert scan == Scan(encoded.infos, end, Damage(end, DamageReason.INCOMPLETE))


@st.composite
def cuts(draw: st.DrawFn) -> tuple[int, list[Batch], int]:
    base, batches = draw(several_batches())
    return base, batches, draw(st.integers(0, len(Encoded(base, batches).data) - 1))


@settings(max_examples=300)
@given(cuts())
def test_batches_cut_short_anywhere_end_in_a_torn_write(
    cut_input: tuple[int, list[Batch], int],
) -> None:
    base, batches, cut = cut_input
    encoded = Encoded(base, batches)
    whole = [info for info in encoded.infos if info.end <= cut]
    end = whole[-1].end if whole else 0

    scan = scan_batches(encoded.data[:cut], 0, base)

    if cut == end:
        assert scan == Scan(whole, end, None)
    else:
        assert scan == Scan(whole, end, Damage(end, DamageReason.INCOMPLETE))


def test_every_prefix_of_a_batch_is_a_torn_write_at_its_start() -> None:
    records = [
        Record(b"\x00" * 9, key=None, timestamp_ms=1),
        Record(b"", key=b"", headers=((b"h", None),)),
        Record(b"LBLR" * 5, key=b"LB\x01\x00", timestamp_ms=MAX_U64),
    ]
    data = encode_batch(7, records)

    for cut in range(1, len(data)):
        scan = scan_batches(data[:cut], 0, 7)
        assert scan == Scan([], 0, Damage(0, DamageReason.INCOMPLETE)), cut
    assert scan_batches(data[:0], 0, 7) == Scan([], 0, None)
    assert scan_batches(data, 0, 7).damage is None


@st.composite
def zero_filled_cuts(draw: st.DrawFn) -> tuple[int, list[Batch], int, int]:
    """Batches whose last one was written only up to a cut, then zeros (unwritten blocks)."""
    base, batches = draw(several_batches())
    last = Encoded(base, batches).infos[-1]
    cut = draw(st.integers(1, last.length - 1))
    zeros = draw(st.integers(1, 2 * last.length))
    return base, batches, cut, zeros


@settings(max_examples=300)
@given(zero_filled_cuts())
@example((0, [(None, [Record(b"value")])], 30, 64))
@example((0, [(ProducerStamp(1, 2), [Record(b"value")])], 30, 64))
# A batch whose checksum starts with a zero byte, cut after that byte: nothing but zeros.
@example((0, [(ProducerStamp(1, 119), [Record(b"v119")])], 1, 200))
def test_zeros_from_inside_a_batch_are_torn_only_while_the_data_ends_inside_it(
    zero_filled: tuple[int, list[Batch], int, int],
) -> None:
    """Zeros are an unwritten tail only from a batch boundary on.

    A last batch cut short after its whole 24-byte header and followed by zeros is INCOMPLETE
    (torn) as long as the data ends before the length the header claims. Once the zeros reach
    that length, the batch is a whole frame with wrong contents: CHECKSUM or HEADER. Zeros from
    inside the header leave a mangled header with bytes after it: HEADER. Both are rot, which
    recovery never truncates: from the bytes alone, a page that was never written cannot be told
    from acknowledged bytes that rotted to zeros, and the scan takes the side that never drops
    acknowledged data.
    """
    base, batches, cut, zeros = zero_filled
    encoded = Encoded(base, batches)
    last = encoded.infos[-1]
    original = encoded.data[last.position :]
    written = original[:cut] + bytes(zeros)
    data = encoded.data[: last.position] + written

    scan = scan_batches(data, 0, base)

    if written[: len(original)] == original:
        # The bytes cut off were zeros anyway (a record's header count): the batch is whole.
        tail = Damage(last.end, DamageReason.INCOMPLETE) if len(written) > len(original) else None
        assert scan == Scan(encoded.infos, last.end, tail)
        return
    assert scan.batches == encoded.infos[:-1]
    assert scan.end == last.position
    assert scan.damage is not None
    # Written bytes that are all zeros (the checksum's first byte was 0, say) are unwritten.
    if (
        len(written) < BATCH_HEADER_SIZE
        or not any(written)
        or (cut >= BATCH_HEADER_SIZE and len(written) < len(original))
    ):
        assert scan.damage == Damage(last.position, DamageReason.INCOMPLETE)
    elif cut < BATCH_HEADER_SIZE:
        assert scan.damage == Damage(last.position, DamageReason.HEADER)
    else:
        assert scan.damage.reason in (DamageReason.CHECKSUM, DamageReason.HEADER)
        assert last.position < scan.damage.position < last.end


# -- index sidecar -----------------------------------------------------------------------------


@st.composite
def indexes(draw: st.DrawFn) -> tuple[int, list[IndexEntry]]:
    base = draw(st.integers(0, MAX_U64 - MAX_U32))
    pairs = draw(st.lists(st.tuples(st.integers(0, MAX_U32), st.integers(0, MAX_U32)), max_size=20))
    return base, [IndexEntry(base + relative, position) for relative, position in pairs]


@settings(max_examples=200)
@given(indexes())
def test_an_index_round_trips(index: tuple[int, list[IndexEntry]]) -> None:
    base, entries = index

    data = encode_index(base, entries)

    assert len(data) == 20 + 8 * len(entries)
    assert decode_index(data, base) == entries


@settings(max_examples=50)
@given(indexes())
def test_an_index_of_another_segment_is_rejected(index: tuple[int, list[IndexEntry]]) -> None:
    base, entries = index

    with pytest.raises(ValueError, match="base offset"):
        decode_index(encode_index(base, entries), base + 1)


@st.composite
def flipped_indexes(draw: st.DrawFn) -> tuple[int, bytes, int, int]:
    base, entries = draw(indexes())
    data = encode_index(base, entries)
    return base, data, draw(st.integers(0, len(data) - 1)), draw(st.integers(1, 255))


@settings(max_examples=300)
@given(flipped_indexes())
def test_a_single_changed_byte_in_an_index_is_detected(
    flipped: tuple[int, bytes, int, int],
) -> None:
    base, data, position, mask = flipped

    with pytest.raises(ValueError, match="index"):
        decode_index(flip(data, position, mask), base)


@settings(max_examples=50)
@given(indexes(), st.data())
def test_a_cut_or_extended_index_is_detected(
    index: tuple[int, list[IndexEntry]], draw: st.DataObject
) -> None:
    base, entries = index
    data = encode_index(base, entries)
    cut = draw.draw(st.integers(0, len(data) - 1), label="cut")

    with pytest.raises(ValueError, match="index"):
        decode_index(data[:cut], base)
    with pytest.raises(ValueError, match="index"):
        decode_index(data + bytes(draw.draw(st.integers(1, 16), label="extra")), base)


# -- seal marker -------------------------------------------------------------------------------

seals = st.builds(
    Seal,
    base_offset=st.integers(0, MAX_U64),
    record_count=st.integers(0, MAX_U64),
    byte_size=st.integers(0, MAX_U64),
    max_timestamp_ms=st.integers(0, MAX_U64),
)


@settings(max_examples=200)
@given(seals)
def test_a_seal_marker_round_trips(seal: Seal) -> None:
    data = encode_seal(seal)

    assert len(data) == 48
    assert decode_seal(data) == seal


def test_a_seal_marker_always_records_the_largest_timestamp() -> None:
    # Only a version 1 marker (of an earlier build) reads without one; none is written so.
    with pytest.raises(ValueError, match="largest record timestamp"):
        encode_seal(Seal(0, 1, 64, max_timestamp_ms=None))


@settings(max_examples=300)
@given(seals, st.integers(0, 47), st.integers(1, 255))
def test_a_single_changed_byte_in_a_seal_marker_is_detected(
    seal: Seal, position: int, mask: int
) -> None:
    with pytest.raises(ValueError, match="seal marker"):
        decode_seal(flip(encode_seal(seal), position, mask))


@settings(max_examples=50)
@given(seals, st.integers(0, 47), st.integers(1, 16))
def test_a_cut_or_extended_seal_marker_is_detected(seal: Seal, cut: int, extra: int) -> None:
    data = encode_seal(seal)

    with pytest.raises(ValueError, match="seal marker"):
        decode_seal(data[:cut])
    with pytest.raises(ValueError, match="seal marker"):
        decode_seal(data + bytes(extra))


# -- epoch marker ------------------------------------------------------------------------------

epochs = st.builds(EpochMarker, base_offset=st.integers(0, MAX_U64), epoch=st.integers(0, MAX_U64))


@settings(max_examples=200)
@given(epochs)
def test_an_epoch_marker_round_trips(marker: EpochMarker) -> None:
    data = encode_epoch(marker)

    assert len(data) == 32
    assert decode_epoch(data) == marker


@settings(max_examples=300)
@given(epochs, st.integers(0, 31), st.integers(1, 255))
def test_a_single_changed_byte_in_an_epoch_marker_is_detected(
    marker: EpochMarker, position: int, mask: int
) -> None:
    with pytest.raises(ValueError, match="epoch marker"):
        decode_epoch(flip(encode_epoch(marker), position, mask))


@settings(max_examples=50)
@given(epochs, st.integers(0, 31), st.integers(1, 16))
def test_a_cut_or_extended_epoch_marker_is_detected(
    marker: EpochMarker, cut: int, extra: int
) -> None:
    data = encode_epoch(marker)

    with pytest.raises(ValueError, match="epoch marker"):
        decode_epoch(data[:cut])
    with pytest.raises(ValueError, match="epoch marker"):
        decode_epoch(data + bytes(extra))
