"""Salvage of a damaged segment (``logbroker storage salvage``): what of it is kept, and the
range's files and control plane afterwards, on a ``MemoryFileSystem``."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.controlplane.local import forget_segments
from logbroker.metrics import Metrics
from logbroker.storage import RangeLog
from logbroker.storage.salvage import plan_salvage, salvage_range
from logbroker.testing import MemoryFileSystem
from tests.unit.controlplane.helpers import make_topic, started
from tests.unit.metrics.helpers import open_reporting_log
from tests.unit.storage.helpers import (
    append_each,
    batch_positions,
    offsets,
    result_of,
    segment_path,
)


def _sealed_log(batches: int = 6) -> tuple[MemoryFileSystem, RangeLog]:
    """A range whose first segment holds ``batches`` batches of one record (offsets 0 to
    ``batches - 1``), sealed, followed by an active segment of two."""
    fs = MemoryFileSystem()
    log = open_reporting_log(fs, Metrics(Clock()))
    append_each(log, 0, batches)
    result_of(log.roll())
    append_each(log, batches, 2)
    return fs, log


@given(st.sets(st.integers(0, 5), min_size=1))
def test_salvage_keeps_every_batch_that_verifies_and_nothing_else(damaged: set[int]) -> None:
    fs, _ = _sealed_log()
    path = segment_path(0)
    positions = batch_positions(fs, path)
    for index in damaged:
        _, end = positions[index]
        fs.corrupt(path, end - 2)

    plan = plan_salvage(fs.read_file(path), 0)

    assert plan is not None
    kept = [o for run in plan.runs for o in range(run.base_offset, run.next_offset)]
    assert kept == [o for o in range(6) if o not in damaged]
    # Runs are whole batches, in order, each with its own bytes; the range may go on past them.
    assert all(run.record_count == len(run.data) // (positions[0][1]) for run in plan.runs)
    assert plan.resume_offset >= max(damaged) + 1
    first = positions[min(damaged)]
    assert first[0] <= plan.damage.position < first[1]


def test_an_intact_segment_has_nothing_to_salvage() -> None:
    fs, _ = _sealed_log()
    assert plan_salvage(fs.read_file(segment_path(0)), 0) is None


def test_salvage_sets_the_damaged_segment_aside_and_the_range_reads_past_it(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs, log = _sealed_log()
    result_of(log.close())
    positions = batch_positions(fs, segment_path(0))
    fs.corrupt(segment_path(0), positions[2][1] - 2)
    original = fs.read_file(segment_path(0))

    [found] = salvage_range(fs, "/data", "topic/0")

    assert [(r.base_offset, r.next_offset) for r in found.plan.runs] == [(0, 2), (3, 6)]
    assert found.started is None, "not the range's last segment"
    assert fs.read_file(f"{found.kept_in}/{0:020d}.log") == original
    result = open_reporting_log(fs, Metrics(Clock()))
    # Offset 2 is lost with its batch; every other record reads, the later segments included.
    assert offsets(result) == [0, 1, 3, 4, 5, 6, 7]
    assert [(s.base_offset, s.record_count) for s in result.segments()][:2] == [(0, 2), (3, 3)]
    assert all(
        not result_of(result.verify_segment(s.base_offset)).damage for s in result.segments()
    )
    logged_errors.clear()


def test_a_damaged_last_segment_leaves_an_active_one_past_every_offset_it_may_hold(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    log = open_reporting_log(fs, Metrics(Clock()))
    append_each(log, 0, 5)
    result_of(log.close())
    positions = batch_positions(fs, segment_path(0))
    fs.corrupt(segment_path(0), positions[1][1] - 2)

    [found] = salvage_range(fs, "/data", "topic/0")

    assert found.started == 5
    result = open_reporting_log(fs, Metrics(Clock()))
    assert offsets(result) == [0, 2, 3, 4]
    assert result.next_offset == 5
    logged_errors.clear()


def test_the_control_plane_forgets_the_salvaged_segments_records() -> None:
    fs = MemoryFileSystem()
    control = started(fs)
    topic, ranges = make_topic("topic")
    result_of(control.create_topic(topic, ranges))
    for base, state in ((0, SegmentState.SEALED), (5, SegmentState.ACTIVE)):
        count = 5 if state is SegmentState.SEALED else None
        result_of(
            control.put_segment(
                SegmentMeta("topic.0", base, state, count, count and 400, ("n1",), 0)
            )
        )
    result_of(control.close())

    forgotten = forget_segments(fs, "/data/control", [("topic.0", 0), ("topic.0", 99)])

    assert forgotten == [("topic.0", 0)]
    reloaded = started(fs)
    assert [m.base_offset for m in reloaded.segments("topic.0")] == [5]


def test_the_control_plane_of_a_running_broker_is_not_touched() -> None:
    fs = MemoryFileSystem()
    control = started(fs)
    with pytest.raises(Exception, match="in use by a running logbroker"):
        forget_segments(fs, "/data/control", [("topic.0", 0)])
    result_of(control.close())
