"""Metrics fed through the real paths: range logs with hooks, a broker, a periodic task."""

from __future__ import annotations

from typing import Any

from twisted.internet.task import Clock

from logbroker.maintenance.periodic import PeriodicTask
from logbroker.metrics import Metrics, ReactorLagProbe
from logbroker.records import Record
from logbroker.storage import LogConfig, RangeLog
from logbroker.testing import ImmediateExecutor, MemoryFileSystem
from tests.unit.broker.helpers import make_broker_and_control
from tests.unit.storage.helpers import (
    RANGE_DIR,
    append_each,
    batch_positions,
    result_of,
    segment_path,
)

GROUP_COMMIT = LogConfig(group_commit=True, group_commit_interval_ms=5, flush_max_records=3)


def open_reporting_log(
    fs: MemoryFileSystem,
    metrics: Metrics,
    config: LogConfig | None = None,
    clock: Clock | None = None,
) -> RangeLog:
    """A range log on ``fs`` whose hooks feed ``metrics``, as the storage service wires them."""
    opened = RangeLog.open(
        RANGE_DIR,
        fs=fs,
        clock=clock or Clock(),
        executor=ImmediateExecutor(),
        config=config,
        on_integrity_event=metrics.integrity_event,
        on_flushed=metrics.flushed,
    )
    range_log: RangeLog = result_of(opened)
    return range_log


def reopen_with_rot(metrics: Metrics) -> RangeLog:
    """Five batches with a flipped byte in the third: reopening reports checksum damage (and
    logs it as an error, which the caller expects)."""
    fs = MemoryFileSystem()
    range_log = open_reporting_log(fs, Metrics(Clock()))
    append_each(range_log, 0, 5)
    result_of(range_log.close())
    fs.corrupt(segment_path(0), batch_positions(fs, segment_path(0))[2][1] - 3)
    return open_reporting_log(fs, metrics)


def populated_metrics(logged_errors: list[dict[str, Any]]) -> Metrics:
    """A ``Metrics`` with every kind of series holding values, fed through the real paths."""
    clock = Clock()
    metrics = Metrics(clock)
    broker, storage, _, control = make_broker_and_control(clock, metrics=metrics)
    metrics.watch(control, storage)
    result_of(broker.create_topic("orders", 0))
    result_of(broker.produce("orders", [Record(b"v%d" % n, key=b"k%d" % n) for n in range(10)]))
    result_of(broker.fetch("orders", None, None, None, 0, 0))

    reopen_with_rot(metrics)
    assert len(logged_errors) == 1, logged_errors
    logged_errors.clear()

    group_commit = open_reporting_log(MemoryFileSystem(), metrics, GROUP_COMMIT, clock)
    for n in range(4):
        group_commit.append([Record(b"value-%d" % n)])
    clock.advance(0.005)

    probe = ReactorLagProbe(clock, metrics.reactor_lag)
    lag = PeriodicTask("reactor_lag", 1.0, probe, clock, metrics=metrics)
    lag.start(now=True)
    clock.advance(0.25)
    result_of(lag.stop())

    metrics.auth_attempt("ok")
    metrics.auth_attempt("invalid_credentials")
    metrics.rate_limit_blocked("dashboard_auth")
    metrics.connection_refused("per_ip")
    metrics.session_expired()
    metrics.session_hijack_attempt()
    metrics.tls_handshake("failed")
    metrics.watch_connections(lambda: 1)
    metrics.set_ready(True)
    metrics.periodic_task_added("retention")
    metrics.periodic_task_failed("retention")
    metrics.periodic_task_succeeded("retention", clock.seconds())
    return metrics
