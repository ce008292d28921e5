r"""Golden files: the exact bytes logbroker stores, pinned.

Each test encodes a fixed input with the real encoder and compares the result byte for byte with
a file under ``golden/``, then decodes that stored file with the real decoder and checks every
value. A failure here means the storage format changed, so data written by earlier builds may no
longer read back: that takes a new format version and code that still reads the old one (see
``docs/storage-format.md``, "Versioning"), not just new golden files.

To regenerate the files deliberately (a new format version, or a new golden case)::

    LOGBROKER_REGENERATE_GOLDEN=1 .venv/bin/python -m pytest \
        tests/unit/storage/test_format_golden.py

In that mode each test rewrites its file and then fails, so a regeneration never passes by
accident. Review the change (``git diff --stat tests/unit/storage/golden``), then run again
without the variable.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from crc32c import crc32c

from logbroker.records import ProducerStamp, Record, StoredRecord
from logbroker.storage import _format
from logbroker.storage._format import (
    FORMAT_VERSION,
    STAMPED_BATCH_VERSION,
    BatchInfo,
    EpochMarker,
    IndexEntry,
    Scan,
    Seal,
    decode_epoch,
    decode_index,
    decode_seal,
    encode_batch_python,
    encode_epoch,
    encode_index,
    encode_seal,
    iter_batch_records,
    scan_batches,
    stamp_batch,
    verify_records_only,
)
from logbroker.storage.errors import FormatTooNewError
from logbroker.storage.store import DataDirectory
from logbroker.testing import MemoryFileSystem
from logbroker.transcode import frame_wire_records
from logbroker.wire import encode_wire_records

BatchEncoder = Callable[[int, Sequence[Record]], bytes]

GOLDEN = Path(__file__).parent / "golden"
REGENERATE = os.environ.get("LOGBROKER_REGENERATE_GOLDEN") == "1"

# An offset above 2**32, so that all eight bytes of the offset fields matter.
BASE = 2**32 + 5
NULL = b"\xff\xff\xff\xff"


def _from_wire_bytes(base_offset: int, records: Sequence[Record]) -> bytes:
    """The produce path's framer: the batch made straight from the records' wire bytes."""
    return frame_wire_records(base_offset, encode_wire_records(records))


#: Every batch encoder must write the pinned bytes: the broker's (the native one where it is
#: built, ``tests/unit/storage/test_native_encoder.py``), the Python one it falls back to, and the
#: produce path's, which frames records from their wire bytes.
BATCH_ENCODERS = pytest.mark.parametrize(
    "encode_batch",
    [_format.encode_batch, encode_batch_python, _from_wire_bytes],
    ids=["broker", "python", "from-wire-bytes"],
)

ONE_RECORD = [Record(b"hello, logbroker", key=None, timestamp_ms=1_700_000_000_000)]

THREE_RECORDS = [
    # An empty key (length 0, not null), a binary value holding the null marker's bytes, and
    # headers with a null value.
    Record(
        b"\x00\xff\xff\xff\xff\x80\x7f\n\r\x00",
        key=b"",
        timestamp_ms=1_700_000_000_001,
        headers=((b"content-type", b"application/octet-stream"), (b"trace-id", None)),
    ),
    # An empty value, no headers, the smallest timestamp.
    Record(b"", key=b"user-42", timestamp_ms=0),
    # A null key, a null header name, an empty header name and value, the largest timestamp.
    Record(
        b"third",
        key=None,
        timestamp_ms=2**64 - 1,
        headers=((None, b"anonymous"), (b"", b"")),
    ),
]

# Both fields above 2**32, so that all eight bytes of each matter.
STAMP = ProducerStamp(producer_id=0x0102_0304_0506_0708, sequence=2**32 + 9)

INDEX_ENTRIES = [
    IndexEntry(BASE, 0),
    IndexEntry(BASE + 97, 4105),
    IndexEntry(BASE + 201, 8230),
]

# The largest record timestamp above 2**32, so that all eight bytes of the field matter.
SEAL = Seal(
    base_offset=BASE, record_count=317, byte_size=12_345, max_timestamp_ms=1_700_000_123_456
)

# An epoch above 2**32, so that all eight bytes of the epoch field matter.
EPOCH = EpochMarker(base_offset=BASE, epoch=2**40 + 3)
# A copy fenced at a later epoch than its records' (version 2): both above 2**32.
EPOCH_WITH_DATA = EpochMarker(base_offset=BASE, epoch=2**40 + 3, data_epoch=2**33 + 5)


def golden(name: str, encoded: bytes) -> bytes:
    """The stored golden file ``name`` (or, when regenerating, write ``encoded`` and fail)."""
    path = GOLDEN / name
    if REGENERATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_bytes(encoded)
        pytest.fail(
            f"rewrote {path} ({len(encoded)} bytes); review the change, then run again "
            "without LOGBROKER_REGENERATE_GOLDEN"
        )
    if not path.exists():
        pytest.fail(f"{path} is missing; see the module docstring to generate it")
    return path.read_bytes()


def assert_same_bytes(encoded: bytes, stored: bytes) -> None:
    if encoded == stored:
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(encoded, stored, strict=False)) if a != b),
        min(len(encoded), len(stored)),
    )
    pytest.fail(
        f"the encoding differs from the golden file at byte {first} "
        f"(encoded {len(encoded)} bytes, golden {len(stored)}):\n"
        f"  encoded {encoded[first : first + 16].hex(' ')}\n"
        f"  golden  {stored[first : first + 16].hex(' ')}\n"
        "The storage format changed; see the module docstring before regenerating."
    )


def stored_crc(frame: bytes) -> int:
    (crc,) = struct.unpack_from(">I", frame, 0)
    return crc


def computed_crc(frame: bytes) -> int:
    """CRC32C of every byte of the frame but its own checksum field, bytes [0, 4)."""
    return int(crc32c(frame[4:]))


def test_the_checksum_is_standard_crc32c() -> None:
    # The Castagnoli check value: any other polynomial, init or final XOR gives another.
    assert crc32c(b"123456789") == 0xE3069283
    assert FORMAT_VERSION == 1
    assert STAMPED_BATCH_VERSION == 2


@BATCH_ENCODERS
def test_batch_of_one_record_with_a_null_key(encode_batch: BatchEncoder) -> None:
    encoded = encode_batch(BASE, ONE_RECORD)
    stored = golden("batch-one-record-null-key.bin", encoded)

    scan = scan_batches(stored, 0, BASE)
    assert scan == Scan([BatchInfo(0, len(stored), BASE, 1)], len(stored), None)
    assert list(iter_batch_records(memoryview(stored), scan.batches[0])) == [
        StoredRecord(BASE, ONE_RECORD[0])
    ]
    assert verify_records_only(stored) is None
    # The documented layout, field by field.
    assert len(stored) == 24 + 28 + 4 + 4 + 16 + 4
    assert struct.unpack_from(">I2sBBIQI", stored, 0) == (
        computed_crc(stored),
        b"LB",
        1,
        0,
        len(stored),
        BASE,
        1,
    )
    record = stored[24:]
    assert struct.unpack_from(">I2sBBIQQ", record, 0) == (
        computed_crc(record),
        b"LR",
        1,
        0,
        len(record),
        BASE,
        1_700_000_000_000,
    )
    assert record[28:] == NULL + b"\x00\x00\x00\x10" + b"hello, logbroker" + b"\x00\x00\x00\x00"
    assert_same_bytes(encoded, stored)


@BATCH_ENCODERS
def test_batch_of_three_records_with_empty_and_null_fields(encode_batch: BatchEncoder) -> None:
    encoded = encode_batch(BASE, THREE_RECORDS)
    stored = golden("batch-three-records.bin", encoded)

    scan = scan_batches(stored, 0, BASE)
    assert scan == Scan([BatchInfo(0, len(stored), BASE, 3)], len(stored), None)
    read = list(iter_batch_records(memoryview(stored), scan.batches[0]))
    assert read == [StoredRecord(BASE + i, record) for i, record in enumerate(THREE_RECORDS)]
    assert [stored_record.record.key for stored_record in read] == [b"", b"user-42", None]
    assert read[0].record.headers[1] == (b"trace-id", None)
    assert read[2].record.headers == ((None, b"anonymous"), (b"", b""))
    assert verify_records_only(stored) is None
    # The batch checksum covers the header (but its own field) and every record frame.
    assert stored_crc(stored) == computed_crc(stored)
    first = stored[24 : 24 + struct.unpack_from(">I", stored, 24 + 8)[0]]
    assert stored_crc(first) == computed_crc(first)
    # The empty key is a zero length, where a null key would be 0xFFFFFFFF.
    assert first[28:32] == b"\x00\x00\x00\x00"
    assert_same_bytes(encoded, stored)


@BATCH_ENCODERS
def test_stamped_batch_of_three_records(encode_batch: BatchEncoder) -> None:
    encoded = stamp_batch(encode_batch(BASE, THREE_RECORDS), STAMP)
    stored = golden("batch-stamped-three-records.bin", encoded)

    scan = scan_batches(stored, 0, BASE)
    assert scan == Scan([BatchInfo(0, len(stored), BASE, 3, STAMP)], len(stored), None)
    read = list(iter_batch_records(memoryview(stored), scan.batches[0]))
    assert read == [StoredRecord(BASE + i, record) for i, record in enumerate(THREE_RECORDS)]
    assert verify_records_only(stored) is None
    # The documented layout: the version 1 header but for its version and length, the stamp,
    # then the record frames of the unstamped batch, unchanged.
    unstamped = (GOLDEN / "batch-three-records.bin").read_bytes()
    assert len(stored) == len(unstamped) + 16
    assert struct.unpack_from(">I2sBBIQI", stored, 0) == (
        computed_crc(stored),
        b"LB",
        2,
        0,
        len(stored),
        BASE,
        3,
    )
    assert stored[24:40] == bytes.fromhex("0102030405060708 0000000100000009")
    assert stored[40:] == unstamped[24:]
    assert_same_bytes(encoded, stored)


def test_index_sidecar() -> None:
    encoded = encode_index(BASE, INDEX_ENTRIES)
    stored = golden("index.bin", encoded)

    assert decode_index(stored, BASE) == INDEX_ENTRIES
    assert len(stored) == 20 + 8 * len(INDEX_ENTRIES)
    assert struct.unpack_from(">I2sBBIQ", stored, 0) == (
        computed_crc(stored),
        b"LI",
        1,
        0,
        3,
        BASE,
    )
    # Entries hold the offset relative to the segment's base offset.
    assert list(struct.iter_unpack(">II", stored[20:])) == [(0, 0), (97, 4105), (201, 8230)]
    assert_same_bytes(encoded, stored)


def test_seal_marker() -> None:
    encoded = encode_seal(SEAL)
    stored = golden("seal.bin", encoded)

    assert decode_seal(stored) == SEAL
    assert struct.unpack(">I2sBBIQQQQI", stored) == (
        computed_crc(stored),
        b"LS",
        2,
        0,
        0,
        BASE,
        317,
        12_345,
        1_700_000_123_456,
        0,
    )
    assert_same_bytes(encoded, stored)


def test_a_version_1_seal_marker_of_an_earlier_build_still_reads() -> None:
    # Pinned when version 1 was the one written; no build writes it any more. Its timestamp
    # field held when the node sealed the segment: not the segment's, so it is not reported.
    stored = (GOLDEN / "seal-version-1.bin").read_bytes()

    assert decode_seal(stored) == Seal(BASE, 317, 12_345, max_timestamp_ms=None)
    assert struct.unpack(">I2sBBIQQQQI", stored) == (
        computed_crc(stored),
        b"LS",
        1,
        0,
        0,
        BASE,
        317,
        12_345,
        1_700_000_123_456,
        0,
    )


def test_epoch_marker() -> None:
    encoded = encode_epoch(EPOCH)
    stored = golden("epoch.bin", encoded)

    assert decode_epoch(stored) == EPOCH
    assert struct.unpack(">I2sBBIQQI", stored) == (
        computed_crc(stored),
        b"LE",
        1,
        0,
        0,
        BASE,
        2**40 + 3,
        0,
    )
    assert_same_bytes(encoded, stored)


def test_epoch_marker_with_a_data_epoch() -> None:
    encoded = encode_epoch(EPOCH_WITH_DATA)
    stored = golden("epoch-data.bin", encoded)

    assert decode_epoch(stored) == EPOCH_WITH_DATA
    assert struct.unpack(">I2sBBIQQQI", stored) == (
        computed_crc(stored),
        b"LE",
        2,
        0,
        0,
        BASE,
        2**40 + 3,
        2**33 + 5,
        0,
    )
    assert_same_bytes(encoded, stored)
    # A version 1 marker's data epoch is its epoch.
    assert decode_epoch(golden("epoch.bin", encode_epoch(EPOCH))).data_epoch == 2**40 + 3


def test_format_marker() -> None:
    fs = MemoryFileSystem()
    DataDirectory.open("/data", fs)
    encoded = fs.read_file("/data/FORMAT")
    stored = golden("FORMAT", encoded)

    assert stored == b"logbroker storage format 1\n"
    # A directory holding the stored marker opens; one naming a newer format is refused.
    existing = MemoryFileSystem()
    existing.write_atomic("/data/FORMAT", stored)
    DataDirectory.open("/data", existing, create=False)
    newer = MemoryFileSystem()
    newer.write_atomic("/data/FORMAT", stored.replace(b"1", b"2"))
    with pytest.raises(FormatTooNewError) as raised:
        DataDirectory.open("/data", newer, create=False)
    assert (raised.value.found, raised.value.supported) == (2, 1)
    assert_same_bytes(encoded, stored)
