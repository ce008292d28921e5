"""A broker over in-memory storage and control plane, for the core and protocol tests."""

from __future__ import annotations

from collections.abc import Mapping

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from logbroker.broker.core import Broker, BrokerSettings
from logbroker.broker.ranges import LocalRanges
from logbroker.controlplane import LocalControlPlane
from logbroker.metrics import Metrics
from logbroker.storage import Executor, LogConfig, RangeLog
from logbroker.testing import ImmediateExecutor, MemoryFileSystem
from tests.unit.controlplane.helpers import started


class MemoryRangeLogs:
    """Range logs on a MemoryFileSystem (``OpenLogs`` for ``LocalRanges``), opened at once unless
    an executor that holds jobs is given; they report to ``metrics`` as the broker's storage
    service makes them do."""

    def __init__(
        self,
        fs: MemoryFileSystem,
        clock: Clock,
        metrics: Metrics,
        executor: Executor | None = None,
    ) -> None:
        self._fs = fs
        self._clock = clock
        self._metrics = metrics
        self._executor = executor or ImmediateExecutor()
        self._logs: dict[str, RangeLog] = {}

    @property
    def logs(self) -> Mapping[str, RangeLog]:
        return self._logs

    def open_range(self, name: str) -> Deferred[RangeLog]:
        def opened(range_log: RangeLog) -> RangeLog:
            self._logs[name] = range_log
            return range_log

        return RangeLog.open(
            f"/data/ranges/{name}",
            fs=self._fs,
            clock=self._clock,
            executor=self._executor,
            config=LogConfig(),
            on_integrity_event=self._metrics.integrity_event,
            on_flushed=self._metrics.flushed,
        ).addCallback(opened)


def make_broker(
    clock: Clock | None = None, settings: BrokerSettings | None = None
) -> tuple[Broker, MemoryRangeLogs, Clock]:
    broker, storage, clock, _ = make_broker_and_control(clock, settings)
    return broker, storage, clock


def make_broker_and_control(
    clock: Clock | None = None,
    settings: BrokerSettings | None = None,
    metrics: Metrics | None = None,
    executor: Executor | None = None,
) -> tuple[Broker, MemoryRangeLogs, Clock, LocalControlPlane]:
    clock = clock or Clock()
    metrics = metrics or Metrics(clock)
    fs = MemoryFileSystem()
    storage = MemoryRangeLogs(fs, clock, metrics, executor)
    control = started(fs)
    broker = Broker(control, LocalRanges(storage), clock, settings, metrics)
    return broker, storage, clock, control
