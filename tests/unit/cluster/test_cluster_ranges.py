"""The directory of a cluster node: where each range is served from, and opening on first use."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import LocalRanges, RangeHandle
from logbroker.cluster.ranges import ClusterRanges
from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.errors import Reason
from logbroker.metrics import Metrics
from logbroker.placement import PlacementNode, PlacementRule
from logbroker.records import Record
from logbroker.storage import LogConfig, RangeLog
from logbroker.testing import ManualExecutor, MemoryFileSystem
from tests.unit.controlplane.helpers import make_topic, started
from tests.unit.storage.helpers import result_of


class _Logs:
    """Range logs whose opens run when the test says (each open is a held storage job)."""

    def __init__(self, executor: ManualExecutor) -> None:
        self._fs = MemoryFileSystem()
        self._executor = executor
        self.logs: dict[str, RangeLog] = {}
        self.opens = 0

    def open_range(self, name: str) -> object:
        self.opens += 1

        def opened(range_log: RangeLog) -> RangeLog:
            self.logs[name] = range_log
            return range_log

        return RangeLog.open(
            f"/data/ranges/{name}",
            fs=self._fs,
            clock=Clock(),
            executor=self._executor,
            config=LogConfig(),
            on_integrity_event=Metrics(Clock()).integrity_event,
        ).addCallback(opened)


def world(
    leader: str | None, holds_lease: bool = True
) -> tuple[ClusterRanges, _Logs, ManualExecutor]:
    executor = ManualExecutor()
    control = started(MemoryFileSystem())
    topic, ranges = make_topic("t", ranges=1)
    result_of(control.create_topic(topic, ranges))
    if leader is not None:
        meta = SegmentMeta("t.0", 0, SegmentState.ACTIVE, None, None, (leader,), 0)
        result_of(control.put_segment(meta))
    logs = _Logs(executor)

    def forward(primary: str, range_id: str) -> RangeHandle:
        raise AssertionError(f"forwarded {range_id} to {primary}")

    directory = ClusterRanges(
        "me",
        control,
        LocalRanges(logs),  # type: ignore[arg-type]
        forward,
        lambda: [PlacementNode("me")],
        PlacementRule(1),
        holds_lease=lambda: holds_lease,
    )
    return directory, logs, executor


def test_a_range_placed_here_opens_once_on_first_use_and_keeps_the_appends_in_order() -> None:
    directory, logs, executor = world(leader="me")

    first = directory.handle("t.0").append([Record(b"first", b"k")])
    second = directory.handle("t.0").append([Record(b"second", b"k")])
    executor.run_all()
    while executor.pending:
        executor.run_all()

    assert logs.opens == 1
    result_of(first)
    result_of(second)
    stored = [r.record.value for r in logs.logs["t.0"].read(0, 10)]
    assert stored == [b"first", b"second"]


def test_a_node_without_its_lease_acts_as_no_range_s_primary() -> None:
    directory, _, _ = world(leader="me", holds_lease=False)

    with pytest.raises(BrokerError) as raised:
        directory.handle("t.0")
    assert raised.value.reason is Reason.UNREACHABLE
    assert "holds no membership lease" in raised.value.detail


def test_a_range_whose_placement_was_never_recorded_is_placed_on_first_use() -> None:
    directory, logs, executor = world(leader=None)

    appending = directory.handle("t.0").append([Record(b"v", b"k")])
    while executor.pending:
        executor.run_all()

    result_of(appending)
    assert directory.primary("t.0") == "me"
    assert [r.record.value for r in logs.logs["t.0"].read(0, 10)] == [b"v"]
