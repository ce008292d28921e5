"""Shared set-up for storage unit tests: logs on a MemoryFileSystem, opened synchronously."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure

from logbroker.storage import (
    Executor,
    Flush,
    IntegrityEvent,
    LogConfig,
    OpenOnce,
    RangeLog,
    Record,
    SharedFlush,
)
from logbroker.storage._format import scan_batches
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem

RANGE_DIR = "/data/ranges/topic/0"


def segment_path(base_offset: int, suffix: str = ".log") -> str:
    return f"{RANGE_DIR}/{base_offset:020d}{suffix}"


def result_of(deferred: Deferred[Any]) -> Any:
    """The result of a Deferred that has already fired; raise its failure if it failed."""
    results: list[Any] = []
    deferred.addBoth(results.append)
    assert results, "the Deferred has not fired"
    if isinstance(results[0], Failure):
        results[0].raiseException()
    return results[0]


def result_of_running(deferred: Deferred[Any], executor: ManualExecutor) -> Any:
    """Run every held storage job, then return the Deferred's result."""
    executor.run_all()
    return result_of(deferred)


class MemoryLogs:
    """Range logs on a ``MemoryFileSystem``: the ``OpenLogs`` of one node, for tests of what
    runs over a node's storage (ranges, replication). Opened through ``executor`` (at once
    with the default ``ImmediateExecutor``)."""

    def __init__(
        self,
        fs: MemoryFileSystem | None = None,
        *,
        clock: Clock | None = None,
        executor: Executor | None = None,
        config: LogConfig | None = None,
        on_integrity_event: Callable[[IntegrityEvent], None] = lambda event: None,
        on_flushed: Callable[[Flush], None] = lambda flush: None,
    ) -> None:
        self.fs = fs or MemoryFileSystem()
        self._clock = clock or Clock()
        self._executor = executor or ImmediateExecutor()
        self._config = config or LogConfig()
        self._on_integrity_event = on_integrity_event
        self._on_flushed = on_flushed
        self.logs: dict[str, RangeLog] = {}
        self._opener = OpenOnce(self.logs, self._open)

    def open_range(self, name: str) -> Deferred[RangeLog]:
        return self._opener.open_range(name)

    def _open(self, name: str) -> Deferred[RangeLog]:
        return RangeLog.open(
            f"/data/ranges/{name}",
            fs=self.fs,
            clock=self._clock,
            executor=self._executor,
            config=self._config,
            on_integrity_event=self._on_integrity_event,
            on_flushed=self._on_flushed,
        )


def run_until_idle(clock: Clock, executors: Iterable[ManualExecutor]) -> None:
    """Run held storage jobs and the calls due now (such as a primary's pump, which waits for
    the end of the reactor turn) until neither is left."""
    executors = list(executors)

    def due() -> bool:
        return any(call.getTime() <= clock.seconds() for call in clock.getDelayedCalls())

    while due() or any(executor.pending for executor in executors):
        clock.advance(0)
        for executor in executors:
            executor.run_all()


def failure_of(deferred: Deferred[Any]) -> Failure:
    results: list[Any] = []
    deferred.addBoth(results.append)
    assert results, "the Deferred has not fired"
    assert isinstance(results[0], Failure), f"expected a failure, got {results[0]!r}"
    return results[0]


def open_log(
    fs: MemoryFileSystem,
    config: LogConfig | None = None,
    events: list[IntegrityEvent] | None = None,
    clock: Clock | None = None,
    shared_flush: bool = False,
) -> RangeLog:
    """A log of ``fs`` whose jobs run at once; with ``shared_flush``, its syncs go through a
    ``SharedFlush`` (as on a broker with ``SVC_FSYNC_SCOPE=filesystem``)."""
    sink = events if events is not None else []
    clock = clock or Clock()
    executor = ImmediateExecutor()
    log: RangeLog = result_of(
        RangeLog.open(
            RANGE_DIR,
            fs=fs,
            clock=clock,
            executor=executor,
            config=config,
            on_integrity_event=sink.append,
            shared_flush=SharedFlush(fs, executor, clock) if shared_flush else None,
        )
    )
    return log


def record(number: int) -> Record:
    return Record(
        b"value-%d" % number, key=b"key-%d" % number, timestamp_ms=1_700_000_000_000 + number
    )


def append_each(log: RangeLog, first: int, count: int) -> None:
    """Append records ``first .. first+count-1`` one batch each, and wait for each to be durable."""
    for number in range(first, first + count):
        appended = result_of(log.append([record(number)]))
        assert appended.base_offset == number


def batch_positions(fs: MemoryFileSystem, path: str) -> list[tuple[int, int]]:
    """(start, end) byte positions of each batch in a segment file."""
    return [(b.position, b.end) for b in scan_batches(fs.read_file(path)).batches]


def offsets(log: RangeLog, start: int = 0) -> list[int]:
    return [stored.offset for stored in log.read(start, max_records=10_000)]


def descriptors_open_under(path: Path, suffix: str = "") -> int:
    """How many of this process's file descriptors are open on files under ``path`` whose
    names end with ``suffix``."""
    count = 0
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # a descriptor closed meanwhile
            target = fd.readlink()
            if target.name.endswith(suffix) and target.is_relative_to(path):
                count += 1
    return count
