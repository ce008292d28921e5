"""A broker over in-memory storage and control plane, for the core and protocol tests."""

from __future__ import annotations

from twisted.internet.task import Clock

from logbroker.broker.core import Broker, BrokerSettings
from logbroker.broker.ranges import LocalRanges
from logbroker.controlplane import LocalControlPlane
from logbroker.metrics import Metrics
from logbroker.storage import Executor
from logbroker.testing import MemoryFileSystem
from tests.unit.controlplane.helpers import started
from tests.unit.storage.helpers import MemoryLogs


class MemoryRangeLogs(MemoryLogs):
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
        super().__init__(
            fs,
            clock=clock,
            executor=executor,
            on_integrity_event=metrics.integrity_event,
            on_flushed=metrics.flushed,
        )


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
