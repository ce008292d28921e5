"""Which segments a new primary reads producer stamps from (``replication.stamps``)."""

from __future__ import annotations

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.replication.stamps import _recent_segments


def sealed(base: int, count: int, size: int) -> SegmentMeta:
    return SegmentMeta("r", base, SegmentState.SEALED, count, size, ("a", "b", "c"), 1)


def active(base: int) -> SegmentMeta:
    return SegmentMeta("r", base, SegmentState.ACTIVE, None, None, ("a", "b", "c"), 1)


def test_the_newest_segments_holding_the_last_bytes_are_read_the_oldest_in_part() -> None:
    segments = [sealed(0, 100, 1000), sealed(100, 100, 1000), sealed(200, 50, 500), active(250)]

    recent = _recent_segments(segments, active_bytes=300, max_bytes=1200)

    # 300 active + 500 + the last 400 of 1000 bytes: from about 60 records in.
    assert [(meta.base_offset, start) for meta, start in recent] == [
        (100, 160),
        (200, 200),
        (250, 250),
    ]


def test_a_range_smaller_than_the_window_is_read_whole() -> None:
    segments = [sealed(0, 10, 100), active(10)]
    recent = _recent_segments(segments, active_bytes=50, max_bytes=1 << 20)
    assert [(meta.base_offset, start) for meta, start in recent] == [(0, 0), (10, 10)]
