from collections.abc import Sequence

from logbroker.records import Record

CRC32C_IMPLEMENTATION: str

def encode_batch(base_offset: int, records: Sequence[Record], /) -> bytes: ...
def checksum(data: bytes, value: int = 0, /, *, software: bool = False) -> int: ...
def wire_records(
    data: memoryview | bytes,
    start: int,
    end: int,
    first_offset: int,
    max_records: int,
    max_bytes: int,
    /,
) -> tuple[bytes, int, int, int]: ...
def check_records(
    data: memoryview | bytes,
    batch_position: int,
    start: int,
    end: int,
    base_offset: int,
    count: int,
    /,
) -> tuple[int, str] | None: ...
def scan_sealed(
    data: memoryview | bytes, base_offset: int, interval: int, /
) -> tuple[list[tuple[int, int]], int, int] | None: ...
def frame_wire_records(base_offset: int, data: bytes, count: int, /) -> bytes | None: ...
def split_wire_records(
    data: bytes, count: int, bits: int, starts: Sequence[int], keyless: int, /
) -> list[tuple[int, int, bytes, int]] | None: ...
