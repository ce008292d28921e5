"""The integrity scrub of one node: which sealed segments it checks next (every one once a
cycle, whatever comes and goes meanwhile), and what a check finds and counts on range logs
and a control plane of a ``MemoryFileSystem``."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.task import Clock

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.maintenance.scrub import (
    NoOtherCopy,
    Scrubber,
    ScrubRotation,
    ScrubTask,
    SegmentKey,
)
from logbroker.metrics import Metrics
from logbroker.storage import RangeLog, SegmentInfo
from logbroker.testing import MemoryFileSystem
from tests.unit.controlplane.helpers import make_topic, started
from tests.unit.metrics.helpers import open_reporting_log
from tests.unit.metrics.test_metrics import value
from tests.unit.storage.helpers import append_each, batch_positions, result_of, segment_path

#: A small key space, so that segments coming and going meet the rotation's place often.
keys = st.tuples(st.sampled_from("ab"), st.integers(0, 9))
KEY_SPACE = 2 * 10


@given(st.sets(keys, max_size=KEY_SPACE), st.integers(1, 8))
def test_a_cycle_checks_every_segment_once_in_order(
    segments: set[SegmentKey], per_tick: int
) -> None:
    available = sorted(segments)
    rotation = ScrubRotation()
    picked: list[SegmentKey] = []
    for _ in range(-(-len(available) // per_tick)):
        picked.extend(rotation.next(available, per_tick))

    assert picked[: len(available)] == available
    assert set(picked) == set(available)
    assert rotation.cycles == (1 if available else 0)


@given(st.data())
def test_a_segment_there_throughout_is_checked_whatever_comes_and_goes(data: st.DataObject) -> None:
    per_tick = data.draw(st.integers(1, 4))
    stable = data.draw(st.sets(keys, min_size=1, max_size=KEY_SPACE))
    rotation = ScrubRotation()
    seen: set[SegmentKey] = set()
    # Each tick moves the rotation's place past at least one key of the key space, and a
    # segment there throughout cannot be stepped over: within two passes over the key space,
    # every one is checked.
    for _ in range(2 * KEY_SPACE + 1):
        others = data.draw(st.sets(keys, max_size=KEY_SPACE))
        picked = rotation.next(sorted(stable | others), per_tick)
        assert len(picked) == len(set(picked)) == min(per_tick, len(stable | others))
        seen.update(picked)
    assert stable <= seen


@attrs.define
class _Node:
    fs: MemoryFileSystem
    metrics: Metrics
    log: RangeLog
    scrubber: Scrubber
    sealed: list[SegmentInfo]
    control: Any

    def record(
        self, info: SegmentInfo, replicas: tuple[str, ...] = ("n1",), **changed: int
    ) -> None:
        """Record ``info`` in the control plane as sealed (with ``changed`` fields)."""
        meta = SegmentMeta(
            "topic.0",
            info.base_offset,
            SegmentState.SEALED,
            changed.get("record_count", info.record_count),
            changed.get("byte_size", info.byte_size),
            replicas,
            0,
        )
        result_of(self.control.put_segment(meta))

    def checks(self) -> dict[str, float]:
        return {
            result: value(self.metrics, "svc_storage_scrub_segments_total", result=result)
            for result in ("verified", "repaired", "unrepairable")
        }


def _node(per_tick: int = 1, recorded: bool = True) -> _Node:
    """A node with two sealed segments of ``topic.0`` (0-4 and 5-7), each recorded in the
    control plane as its seal made it (unless not ``recorded``), and an active one."""
    fs = MemoryFileSystem()
    metrics = Metrics(Clock())
    control = started(fs)
    topic, ranges = make_topic("topic")
    result_of(control.create_topic(topic, ranges))
    log = open_reporting_log(fs, metrics)
    append_each(log, 0, 5)
    first = result_of(log.roll())
    append_each(log, 5, 3)
    second = result_of(log.roll())
    append_each(log, 8, 1)
    node = _Node(
        fs,
        metrics,
        log,
        Scrubber(
            {"topic.0": log},
            control,
            per_tick,
            metrics,
            NoOtherCopy(metrics),
            Clock(),
            node_id="n1",
        ),
        [first, second],
        control,
    )
    if recorded:
        for info in node.sealed:
            node.record(info)
    return node


def test_each_tick_checks_the_next_sealed_segment_and_counts_it_verified() -> None:
    node = _node()
    assert node.scrubber.sealed_segments() == [("topic.0", 0), ("topic.0", 5)]

    for ticks in (1, 2, 3):
        result_of(node.scrubber.tick())
        assert node.checks() == {"verified": ticks, "repaired": 0, "unrepairable": 0}
    assert node.scrubber.rotation.cycles == 1


def test_bit_rot_is_unrepairable_on_one_node_logged_with_its_byte_and_counted_at_each_check(
    logged_errors: list[dict[str, Any]],
) -> None:
    node = _node(per_tick=2)
    damaged_batch, damaged_batch_end = batch_positions(node.fs, segment_path(0))[2]
    node.fs.corrupt(segment_path(0), damaged_batch_end - 2)

    result_of(node.scrubber.tick())

    assert node.checks() == {"verified": 1, "repaired": 0, "unrepairable": 1}
    assert value(node.metrics, "svc_storage_integrity_failures_total", reason="checksum") == 1
    scrub = [e for e in logged_errors if e["log_format"].startswith("Scrub:")]
    assert [(e["segment"], e["log_level"].name) for e in scrub] == [("topic.0@0", "error")]
    # Named by the first byte that fails to verify, in the batch whose byte was flipped.
    assert damaged_batch <= scrub[0]["position"] < damaged_batch_end
    assert "unrepairable" in scrub[0]["log_format"]
    logged_errors.clear()  # and the range log's own line, at the first finding

    logged_errors.clear()
    result_of(node.scrubber.tick())
    # Never cleared by itself: found again at the next cycle, the damage counted once.
    assert node.checks() == {"verified": 2, "repaired": 0, "unrepairable": 2}
    assert value(node.metrics, "svc_storage_integrity_failures_total", reason="checksum") == 1
    assert [e["segment"] for e in logged_errors] == ["topic.0@0"]
    logged_errors.clear()


def test_a_copy_unlike_the_control_plane_s_record_of_its_seal_is_unrepairable(
    logged_errors: list[dict[str, Any]],
) -> None:
    node = _node(per_tick=2, recorded=False)
    node.record(node.sealed[0])
    node.record(node.sealed[1], record_count=4, byte_size=node.sealed[1].byte_size + 90)

    result_of(node.scrubber.tick())

    assert node.checks() == {"verified": 1, "repaired": 0, "unrepairable": 1}
    assert value(node.metrics, "svc_storage_integrity_failures_total", reason="size") == 1
    assert [e["segment"] for e in logged_errors] == ["topic.0@5"]
    assert "the control plane recorded 4 records" in logged_errors[0]["why"]
    logged_errors.clear()

    result_of(node.scrubber.tick())
    # Found again at the next cycle; the failure counted once, as damage in the bytes is.
    assert node.checks() == {"verified": 2, "repaired": 0, "unrepairable": 2}
    assert value(node.metrics, "svc_storage_integrity_failures_total", reason="size") == 1
    assert [e["segment"] for e in logged_errors] == ["topic.0@5"]
    logged_errors.clear()


def test_a_segment_deleted_after_it_was_listed_is_skipped() -> None:
    node = _node(per_tick=2)
    result_of(node.log.delete_segment(0))

    result_of(node.scrubber.tick())

    assert node.checks() == {"verified": 1, "repaired": 0, "unrepairable": 0}


def test_the_task_checks_every_interval_and_says_it_runs_while_it_does() -> None:
    node = _node()
    clock = Clock()
    task = ScrubTask(node.scrubber, 60.0, clock, node.metrics)
    assert value(node.metrics, "svc_scrub_enabled") == 0

    task.startService()
    assert value(node.metrics, "svc_scrub_enabled") == 1
    assert node.checks()["verified"] == 0, "the first check one interval after the start"
    clock.advance(60)
    assert node.checks()["verified"] == 1
    clock.advance(60)
    assert node.checks()["verified"] == 2

    result_of(task.stopService())
    assert value(node.metrics, "svc_scrub_enabled") == 0
    clock.advance(60)
    assert node.checks()["verified"] == 2


@pytest.mark.parametrize("damage", ["flipped", "truncated", "deleted"])
def test_a_rotted_index_is_rebuilt_from_the_intact_log_and_counted(
    damage: str, logged: list[dict[str, Any]]
) -> None:
    node = _node()
    index = segment_path(0, ".index")
    intact = node.fs.read_file(index)
    if damage == "flipped":
        node.fs.corrupt(index, len(intact) - 3)
    elif damage == "truncated":
        node.fs.truncate(index, len(intact) - 4)
    else:
        node.fs.remove(index)

    result_of(node.scrubber.tick())

    # The records are intact: the segment verifies, and its index is as the log makes it.
    assert node.checks() == {"verified": 1, "repaired": 0, "unrepairable": 0}
    assert node.fs.read_file(index) == intact
    assert value(node.metrics, "svc_storage_integrity_failures_total", reason="index") == 1
    [event] = [e for e in logged if e.get("reason") == "index"]
    assert event["segment"] == index
    assert event["log_level"].name == "warn"

    result_of(node.scrubber.tick())
    result_of(node.scrubber.tick())
    assert node.checks()["verified"] == 3
    assert value(node.metrics, "svc_storage_integrity_failures_total", reason="index") == 1


@pytest.mark.parametrize(
    ("damage", "reason", "why"),
    [
        ("deleted", "size", "its .log is gone from disk, or empty"),
        ("truncated", "size", "its .log on disk ends at byte 90, short of its seal"),
        ("unsealed", "metadata", "its seal marker is gone from disk"),
    ],
)
def test_a_sealed_copy_deleted_or_cut_short_on_disk_is_found_at_the_next_tick(
    damage: str, reason: str, why: str, logged_errors: list[dict[str, Any]]
) -> None:
    node = _node(per_tick=1)
    # Segment 5, not the rotation's next: the files are compared at every tick, whatever the
    # rotation checks.
    if damage == "deleted":
        node.fs.remove(segment_path(5))
    elif damage == "truncated":
        node.fs.truncate(segment_path(5), 90)
    else:
        node.fs.remove(segment_path(5, ".sealed"))

    result_of(node.scrubber.tick())

    assert node.checks() == {"verified": 1, "repaired": 0, "unrepairable": 1}
    assert value(node.metrics, "svc_storage_integrity_failures_total", reason=reason) == 1
    [finding] = [e for e in logged_errors if e["log_format"].startswith("Scrub:")]
    assert (finding["segment"], finding["why"]) == ("topic.0@5", why)
    # The copy is known damaged: reads stop before the damage (what the .log still holds of
    # a copy whose marker is gone is whole).
    info = node.log.segment(5)
    assert info is not None
    assert info.damage is not None
    whole = node.sealed[1].byte_size
    assert info.damage.position == {"deleted": 0, "truncated": 90, "unsealed": whole}[damage]
    logged_errors.clear()

    # Known damaged: the rotation's check of it counts it again; the file pass does not.
    result_of(node.scrubber.tick())
    assert node.checks() == {"verified": 1, "repaired": 0, "unrepairable": 2}
    logged_errors.clear()


def test_a_copy_left_behind_on_a_replica_set_without_this_node_is_not_held_to_its_record() -> None:
    # The segment was sealed on n2 and n3 after this node's copy was left behind: healing
    # deletes it once they hold it; it is not damage.
    node = _node(per_tick=2, recorded=False)
    node.record(node.sealed[0])
    node.record(
        node.sealed[1], ("n2", "n3"), record_count=4, byte_size=node.sealed[1].byte_size + 90
    )

    result_of(node.scrubber.tick())

    assert node.checks() == {"verified": 2, "repaired": 0, "unrepairable": 0}
    assert value(node.metrics, "svc_storage_integrity_failures_total", reason="size") == 0
