from collections.abc import Sequence

from logbroker.records import Record

CRC32C_IMPLEMENTATION: str

def encode_batch(base_offset: int, records: Sequence[Record], /) -> bytes: ...
def checksum(data: bytes, value: int = 0, /, *, software: bool = False) -> int: ...
