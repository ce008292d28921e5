from logbroker.records import Record

def read_records(
    record_type: type[Record], data: bytes | memoryview, position: int, count: int, /
) -> tuple[tuple[Record, ...], int] | None: ...
def scan_wire_records(
    data: bytes | memoryview, position: int, count: int, /
) -> tuple[int, int] | None: ...
