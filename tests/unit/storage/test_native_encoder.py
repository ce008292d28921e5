"""The native batch encoder (``logbroker/storage/_speedups.c``) against its Python reference.

The golden-file tests pin both encoders to the documented bytes; these tests hold the native one
to the Python one for any input, its CRC32C (hardware and software paths) to the crc32c package,
and check that input the format cannot hold is refused with an exception, never a crash or a
leaked reference.
"""

from __future__ import annotations

import sys
from typing import Any

import attrs
import pytest
from crc32c import crc32c
from hypothesis import example, given
from hypothesis import strategies as st

from logbroker.records import Record
from logbroker.storage import _format, _speedups
from logbroker.storage._format import encode_batch_python

MAX_U64 = 2**64 - 1

header_parts = st.one_of(st.none(), st.binary(max_size=20))
# Values long enough to cross the 8-byte steps of the hardware CRC with every tail length.
records = st.builds(
    Record,
    value=st.binary(max_size=300),
    key=st.one_of(st.none(), st.binary(max_size=40)),
    timestamp_ms=st.integers(0, MAX_U64),
    headers=st.lists(st.tuples(header_parts, header_parts), max_size=5).map(tuple),
)


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, list[Record]]:
    batch = draw(st.lists(records, min_size=1, max_size=12))
    base = draw(st.one_of(st.integers(0, 1000), st.just(MAX_U64 - len(batch))))
    return base, batch


def test_the_storage_engine_uses_the_native_encoder() -> None:
    # The test command installs a compiler, so a missing build is a failure here, not a skip.
    assert _format.BATCH_ENCODER == "native"
    assert _format.encode_batch is _speedups.encode_batch


def test_the_checksum_runs_on_the_hardware_path_on_this_host() -> None:
    assert _speedups.CRC32C_IMPLEMENTATION in {"sse4.2", "software"}
    if sys.platform == "linux" and "sse4_2" in _cpu_flags():
        assert _speedups.CRC32C_IMPLEMENTATION == "sse4.2"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return {flag for line in cpuinfo if line.startswith("flags") for flag in line.split()}
    except OSError:
        return set()


@given(batches())
@example((0, [Record(b"")]))
@example((MAX_U64 - 1, [Record(b"v", key=b"", headers=((None, None), (b"", b"")))]))
def test_the_native_encoder_writes_the_python_encoders_bytes(
    batch: tuple[int, list[Record]],
) -> None:
    base, records_ = batch
    assert _speedups.encode_batch(base, records_) == encode_batch_python(base, records_)
    assert _speedups.encode_batch(base, tuple(records_)) == encode_batch_python(base, records_)


@given(st.binary(max_size=200), st.integers(0, 2**32 - 1))
@example(b"123456789", 0)
def test_both_native_checksums_match_the_crc32c_package(data: bytes, start: int) -> None:
    expected = crc32c(data, start)
    assert _speedups.checksum(data, start) == expected
    assert _speedups.checksum(data, start, software=True) == expected


@pytest.mark.parametrize("start", [-1, 2**32])
def test_a_checksum_start_value_outside_u32_is_refused(start: int) -> None:
    with pytest.raises(ValueError, match="not a u32"):
        _speedups.checksum(b"data", start)


@pytest.mark.parametrize(
    ("base", "count"), [(-1, 1), (MAX_U64, 1), (MAX_U64 - 1, 2), (2**64, 1), (2**80, 1)]
)
def test_a_base_offset_that_would_overflow_is_refused_like_the_python_encoder(
    base: int, count: int
) -> None:
    batch = [Record(b"v")] * count
    message = f"base offset {base} is out of range"
    with pytest.raises(ValueError, match=message):
        _speedups.encode_batch(base, batch)
    with pytest.raises(ValueError, match=message):
        encode_batch_python(base, batch)


def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one record"):
        _speedups.encode_batch(0, [])


class BytesSubclass(bytes):
    """A bytes subclass could report a length other than what it holds: refused."""


@attrs.define
class LooseRecord:
    """Record's shape without its validation, to reach the native encoder's own checks."""

    value: Any = b"v"
    key: Any = None
    timestamp_ms: Any = 0
    headers: Any = ()


@pytest.mark.parametrize(
    ("record", "error", "message"),
    [
        (LooseRecord(value=None), TypeError, "value must be bytes, not NoneType"),
        (LooseRecord(value=bytearray(b"v")), TypeError, "value must be bytes, not bytearray"),
        (LooseRecord(key="k"), TypeError, "key must be bytes or None, not str"),
        (LooseRecord(key=BytesSubclass(b"k")), TypeError, "not BytesSubclass"),
        (LooseRecord(timestamp_ms=1.5), TypeError, "timestamp_ms must be an int"),
        (LooseRecord(timestamp_ms=-1), OverflowError, "negative"),
        (LooseRecord(timestamp_ms=2**64), OverflowError, "too big"),
        (LooseRecord(headers=[(b"h", b"v")]), TypeError, "headers must be a tuple"),
        (LooseRecord(headers=((b"h",),)), TypeError, r"each header must be a \(name, value\)"),
        (LooseRecord(headers=((b"h", 1),)), TypeError, "header value must be bytes or None"),
        (object(), AttributeError, "key"),
    ],
    ids=[
        "null value",
        "bytearray value",
        "str key",
        "bytes subclass key",
        "float timestamp",
        "negative timestamp",
        "timestamp past u64",
        "headers not a tuple",
        "header not a pair",
        "header value not bytes",
        "not a record",
    ],
)
def test_input_the_format_cannot_hold_is_refused_with_an_exception(
    record: object, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        _speedups.encode_batch(0, [Record(b"first"), record])


def test_a_refused_batch_releases_every_field_it_read() -> None:
    value = b"a value this test alone holds" + bytes(8)
    batch = [Record(value), Record(value), LooseRecord(value=value, headers=None)]
    before = sys.getrefcount(value)
    for _ in range(100):
        with pytest.raises(TypeError, match="headers must be a tuple"):
            _speedups.encode_batch(0, batch)
    assert sys.getrefcount(value) == before


def test_a_record_that_empties_the_callers_list_cannot_corrupt_the_batch() -> None:
    batch: list[Any] = []

    class ShrinkingRecord:
        value = b"first"
        timestamp_ms = 0
        headers = ()

        @property
        def key(self) -> None:
            batch.clear()
            return None

    batch.extend([ShrinkingRecord(), Record(b"second"), Record(b"third")])
    expected = encode_batch_python(0, [Record(b"first"), Record(b"second"), Record(b"third")])

    assert _speedups.encode_batch(0, batch) == expected
    assert batch == []


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: Record(bytearray(b"v")), TypeError, "value must be bytes, not bytearray"),
        (lambda: Record(None), TypeError, "value must be bytes, not NoneType"),  # type: ignore[arg-type]
        (lambda: Record(b"v", key=memoryview(b"k")), TypeError, "key must be bytes or None"),
        (lambda: Record(BytesSubclass(b"v")), TypeError, "not BytesSubclass"),
        (lambda: Record(b"v", timestamp_ms=1.0), TypeError, "timestamp_ms must be an int"),
        (lambda: Record(b"v", headers=[(b"h", b"v")]), TypeError, "headers must be a tuple"),
        (lambda: Record(b"v", headers=((b"h", b"v", b"x"),)), TypeError, "each header"),
        (lambda: Record(b"v", headers=((b"h", "v"),)), TypeError, "header value must be bytes"),
    ],
    ids=[
        "bytearray value",
        "null value",
        "memoryview key",
        "bytes subclass value",
        "float timestamp",
        "headers as a list",
        "header of three parts",
        "str header value",
    ],
)
def test_a_record_checks_its_field_types_when_made(
    make: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make()
