"""Retention: what it removes, decided over random segment sets and clocks (each of the spec's
rules), and a pass on one node's range logs and control plane on a ``MemoryFileSystem``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from logbroker.broker.segments import SegmentRecorder
from logbroker.controlplane import SegmentState
from logbroker.maintenance.retention import (
    Retention,
    RetentionRule,
    RetentionTask,
    SegmentFacts,
    expired,
    local_newest_times,
)
from logbroker.metrics import Metrics
from logbroker.records import Record
from logbroker.storage import CopyState
from logbroker.testing import MemoryFileSystem
from tests.unit.controlplane.helpers import make_topic, started
from tests.unit.metrics.helpers import open_reporting_log
from tests.unit.metrics.test_metrics import value
from tests.unit.storage.helpers import result_of

NOW = 10_000_000


@st.composite
def ranges(draw: st.DrawFn) -> list[SegmentFacts]:
    """A range's segments in offset order: sealed ones, then (usually) an active last one."""
    sealed = draw(st.integers(0, 8))
    segments = [
        SegmentFacts(
            index * 100,
            True,
            draw(st.integers(0, 5000)),
            draw(st.one_of(st.none(), st.integers(NOW - 20_000, NOW))),
        )
        for index in range(sealed)
    ]
    if draw(st.booleans()) or not segments:
        segments.append(SegmentFacts(sealed * 100, False, draw(st.integers(0, 5000))))
    return segments


rules = st.builds(
    RetentionRule,
    st.one_of(st.none(), st.integers(0, 25_000)),
    st.one_of(st.none(), st.integers(0, 30_000)),
)


@given(ranges(), rules, st.integers(NOW - 5_000, NOW + 30_000))
def test_retention_removes_the_oldest_sealed_segments_either_limit_condemns_and_no_more(
    segments: list[SegmentFacts], rule: RetentionRule, now_ms: int
) -> None:
    removed = expired(segments, rule, now_ms)

    # Oldest first, a run from the range's start, sealed only, never the last segment.
    assert removed == [s.base_offset for s in segments[: len(removed)]]
    assert len(removed) < len(segments)
    assert all(s.sealed for s in segments[: len(removed)])
    if not rule.enabled:
        assert removed == []

    def condemned(index: int) -> bool:
        segment = segments[index]
        rest = sum(s.byte_size for s in segments[index:] if s.sealed)
        by_age = (
            rule.max_age_ms is not None
            and segment.newest_ms is not None
            and now_ms - segment.newest_ms > rule.max_age_ms
        )
        by_bytes = rule.max_bytes is not None and (rest > rule.max_bytes or rule.max_bytes == 0)
        return segment.sealed and (by_age or by_bytes)

    # Each removed one is condemned by a limit (with both set, by either) ...
    assert all(condemned(index) for index in range(len(removed)))
    # ... and the first one kept is not, unless it is the last.
    kept = len(removed)
    assert kept == len(segments) - 1 or not condemned(kept)


@given(ranges())
def test_a_budget_of_zero_bytes_removes_every_sealed_segment_but_the_last(
    segments: list[SegmentFacts],
) -> None:
    removed = expired(segments, RetentionRule(max_bytes=0), NOW)

    sealed_before_last = [s.base_offset for s in segments[:-1] if s.sealed]
    assert removed == sealed_before_last


# -- a pass on one node ------------------------------------------------------------------------


class _Node:
    """A node with one range whose log sealed four segments (7 records each, a day apart),
    each recorded in the control plane as the single node records them, and an active one."""

    def __init__(self, rule: RetentionRule) -> None:
        self.fs = MemoryFileSystem()
        self.clock = Clock()
        self.metrics = Metrics(self.clock)
        self.control = started(self.fs)
        topic, ranges = make_topic("topic")
        result_of(self.control.create_topic(topic, ranges))
        self.log = open_reporting_log(self.fs, self.metrics)
        recorder = SegmentRecorder(self.control, "n1")
        for day in range(4):
            records = [
                Record(b"v%d-%d" % (day, n), key=b"k", timestamp_ms=day * 86_400_000 + n)
                for n in range(7)
            ]
            result_of(self.log.append(records))
            recorder.sealed("topic.0", result_of(self.log.roll()))
        result_of(self.log.append([Record(b"active", key=b"k", timestamp_ms=4 * 86_400_000)]))
        self.retention = Retention(
            self.control,
            {"topic.0": self.log},
            rule,
            self.clock,
            self.metrics,
            newest_times=local_newest_times({"topic.0": self.log}),
        )

    def recorded(self) -> list[tuple[int, SegmentState]]:
        return [(m.base_offset, m.state) for m in self.control.segments("topic.0")]

    def held(self) -> list[tuple[int, CopyState]]:
        return [(s.base_offset, s.state) for s in self.log.segments()]

    def files(self) -> list[str]:
        return sorted(self.fs.list_dir(self.log.directory))


SEALED = SegmentState.SEALED


def test_a_budget_of_zero_removes_every_sealed_segment_record_first_and_keeps_the_active_one(
    logged: list[dict[str, Any]],
) -> None:
    node = _Node(RetentionRule(max_bytes=0))
    sealed_bytes = sum(m.byte_size or 0 for m in node.control.segments("topic.0")[:-1])

    result_of(node.retention.tick())

    assert node.recorded() == [(28, SegmentState.ACTIVE)]
    assert node.held() == [(28, CopyState.ACTIVE)]
    assert node.files() == ["00000000000000000028.log"]
    assert value(node.metrics, "svc_retention_segments_removed_total") == 4
    assert value(node.metrics, "svc_retention_bytes_removed_total") == sealed_bytes
    removed = [e["segment"] for e in logged if e.get("log_format", "").startswith("Retention")]
    assert removed == [0, 7, 14, 21]
    # A read from a removed offset goes on from the oldest record left.
    assert [s.record.value for s in node.log.read(max(0, node.log.start_offset))] == [b"active"]


def test_by_age_only_segments_whose_newest_record_is_older_than_the_limit_go() -> None:
    # Now is day 4 and a half: days 0 and 1 are older than two days and a half, day 2 not.
    node = _Node(RetentionRule(max_age_ms=int(2.5 * 86_400_000)))
    node.clock.advance(4.5 * 86_400)

    result_of(node.retention.tick())

    assert node.recorded() == [(14, SEALED), (21, SEALED), (28, SegmentState.ACTIVE)]
    assert [base for base, _ in node.held()] == [14, 21, 28]


def test_with_both_limits_either_one_removes() -> None:
    node = _Node(RetentionRule(max_age_ms=int(3.5 * 86_400_000), max_bytes=0))
    node.clock.advance(4.5 * 86_400)
    # The byte budget alone condemns every sealed segment, whatever the age says.
    result_of(node.retention.tick())
    assert node.recorded() == [(28, SegmentState.ACTIVE)]


def test_a_copy_left_behind_by_a_stop_between_record_and_delete_goes_at_the_next_pass() -> None:
    node = _Node(RetentionRule(max_bytes=0))
    result_of(node.control.delete_segment("topic.0", 0))  # the record went; then the node stopped

    # At the start its seal is recorded again (a record lost looks the same), and it is
    # still the oldest: the next pass removes it with the rest.
    result_of(SegmentRecorder(node.control, "n1").reconcile({"topic.0": node.log}))
    assert node.recorded()[0] == (0, SEALED)
    result_of(node.retention.tick())

    assert node.held() == [(28, CopyState.ACTIVE)]
    assert node.recorded() == [(28, SegmentState.ACTIVE)]


def test_the_task_runs_every_interval() -> None:
    node = _Node(RetentionRule(max_bytes=0))
    task = RetentionTask(node.retention, 60.0, node.clock, node.metrics)
    task.startService()
    assert len(node.recorded()) == 5, "the first pass one interval after the start"
    node.clock.advance(60)
    assert node.recorded() == [(28, SegmentState.ACTIVE)]
    result_of(task.stopService())


def test_only_the_node_that_decides_removes_records_and_every_node_deletes_removed_copies() -> None:
    node = _Node(RetentionRule(max_bytes=0))
    times: list[Sequence[str]] = []

    def newest(range_ids: Sequence[str]) -> Deferred[Mapping[tuple[str, int], int]]:
        times.append(range_ids)
        return succeed({})

    follower = Retention(
        node.control,
        {"topic.0": node.log},
        RetentionRule(max_age_ms=1, max_bytes=0),
        node.clock,
        node.metrics,
        newest_times=newest,
        decides=lambda: False,
    )
    result_of(follower.tick())
    assert len(node.recorded()) == 5
    assert times == [], "a node that does not decide asks no one"

    result_of(node.control.delete_segment("topic.0", 0))  # the decider removed one
    result_of(follower.tick())
    assert [base for base, _ in node.held()] == [7, 14, 21, 28]
