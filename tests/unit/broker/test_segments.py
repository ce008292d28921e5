"""The control plane's record of this node's segments follows its range logs' seals."""

from __future__ import annotations

from twisted.internet.task import Clock

from logbroker.broker.segments import SegmentRecorder
from logbroker.controlplane import LocalControlPlane, SegmentMeta, SegmentState
from logbroker.records import Record
from logbroker.storage import LogConfig, RangeLog, SegmentInfo
from logbroker.testing import ImmediateExecutor, MemoryFileSystem
from tests.unit.controlplane.helpers import make_topic, started
from tests.unit.storage.helpers import result_of


def world(recorder_for: list[SegmentRecorder]) -> tuple[LocalControlPlane, RangeLog]:
    fs = MemoryFileSystem()
    control = started(fs)
    topic, ranges = make_topic("orders")
    result_of(control.create_topic(topic, ranges))
    recorder = SegmentRecorder(control, "node-a")
    recorder_for.append(recorder)

    def sealed(info: SegmentInfo) -> None:
        recorder.sealed("orders.0", info)

    range_log = result_of(
        RangeLog.open(
            "/data/ranges/orders.0",
            fs=fs,
            clock=Clock(),
            executor=ImmediateExecutor(),
            config=LogConfig(roll_bytes=1024),
            on_sealed=sealed,
        )
    )
    return control, range_log


def fill(range_log: RangeLog, count: int) -> None:
    for i in range(count):
        result_of(range_log.append([Record(b"x" * 100, b"k%d" % i)]))


def test_a_seal_records_the_segment_s_counts_and_the_next_active_segment() -> None:
    recorders: list[SegmentRecorder] = []
    control, range_log = world(recorders)

    fill(range_log, 20)

    local = range_log.segments()
    recorded = control.segments("orders.0")
    assert len(local) >= 2
    assert recorded == [
        SegmentMeta(
            "orders.0",
            info.base_offset,
            SegmentState(info.state.value),
            info.record_count if info.state.value == "sealed" else None,
            info.byte_size if info.state.value == "sealed" else None,
            ("node-a",),
            0,
        )
        for info in local
    ]


def test_reconcile_records_what_the_control_plane_missed_and_nothing_twice() -> None:
    recorders: list[SegmentRecorder] = []
    control, range_log = world(recorders)
    fill(range_log, 20)
    sealed = [m for m in control.segments("orders.0") if m.state is SegmentState.SEALED]
    # As if the control plane had lost the first seal (it failed while the log sealed).
    result_of(control.delete_segment("orders.0", sealed[0].base_offset))
    before = control.segments("orders.0")

    result_of(recorders[0].reconcile({"orders.0": range_log}))

    after = control.segments("orders.0")
    assert len(after) == len(before) + 1
    assert after[0] == sealed[0]
    result_of(recorders[0].reconcile({"orders.0": range_log}))
    assert control.segments("orders.0") == after
