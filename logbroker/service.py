"""The composition root: builds the service tree ``twistd logbroker`` runs.

This is the only module (with the plugin's ``makeService``) that wires the real reactor. Start
order: every range log is recovered before the reactor runs (``build_service``), so a range that
cannot be recovered stops the broker before it serves; the storage writer threads start with
the service; listeners (next milestones) start after storage. Stop order is the reverse: the
store closes last, after every queued append has been flushed and fsynced.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList
from twisted.logger import Logger

from logbroker.config import BrokerConfig
from logbroker.storage import (
    BATCH_ENCODER,
    DataDirectory,
    FileSystem,
    LogConfig,
    OsFileSystem,
    RangeLog,
    ThreadPoolExecutor,
)

log = Logger()

#: How long CPython lets one thread run before a thread waiting for the GIL may take it. Writes
#: and fsyncs run on writer threads, which need the GIL for a moment between ``write`` and
#: ``fdatasync`` and again to hand their result back; at CPython's default of 5 ms, a burst of
#: reactor work (encoding, acknowledging) left the disk idle for a quarter of the time at batch
#: 1000. At 0.5 ms the wait is bounded well below one fsync. See bench/RESULTS.md.
GIL_SWITCH_INTERVAL_SECONDS = 0.0005


def configure_interpreter() -> None:
    """Process-wide interpreter settings the broker runs with (called by the composition root
    and by the benchmarks, so that they measure what the broker does)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)


class StorageService(Service):
    """Owns the writer threads and every open range log of the data directory."""

    def __init__(
        self,
        reactor: Any,
        data_dir: DataDirectory,
        fs: FileSystem,
        log_config: LogConfig,
    ) -> None:
        self._reactor = reactor
        self._data_dir = data_dir
        self._fs = fs
        self._log_config = log_config
        self._executor = ThreadPoolExecutor(reactor)
        self.logs: dict[str, RangeLog] = {}

    def recover(self) -> None:
        """Recover every range of the data directory, in this thread. Blocking: call it before
        the reactor runs. Raises what recovery raises (``StorageError``, ``OSError``)."""
        started = time.monotonic()
        for name in self._data_dir.range_names():
            self.logs[name] = RangeLog.recover(
                self._data_dir.range_path(name),
                fs=self._fs,
                clock=self._reactor,
                executor=self._executor,
                config=self._log_config,
            )
        log.info(
            "Storage recovered in {path}: {ranges} ranges in {seconds:.3f} s",
            path=self._data_dir.path,
            ranges=len(self.logs),
            seconds=time.monotonic() - started,
        )

    def open_range(self, name: str) -> Deferred[RangeLog]:
        """Open (creating if new) the log of range ``name`` while the broker runs."""

        def opened(range_log: RangeLog) -> RangeLog:
            self.logs[name] = range_log
            return range_log

        return RangeLog.open(
            self._data_dir.range_path(name),
            fs=self._fs,
            clock=self._reactor,
            executor=self._executor,
            config=self._log_config,
        ).addCallback(opened)

    def startService(self) -> None:
        super().startService()
        self._executor.start()
        # Once the reactor runs (signal handlers in place), the store serves.
        self._reactor.callWhenRunning(
            log.info,
            "Storage ready: {ranges} ranges open, {encoder} batch encoder",
            ranges=len(self.logs),
            encoder=BATCH_ENCODER,
        )
        if BATCH_ENCODER != "native":
            log.warn(
                "The native batch encoder is not built, so produce throughput is limited by the"
                " {encoder} one: install gcc and python3-dev and reinstall logbroker",
                encoder=BATCH_ENCODER,
            )

    def stopService(self) -> Deferred[None]:
        super().stopService()
        closing = DeferredList([range_log.close() for range_log in self.logs.values()])

        def stop_threads(_: object) -> None:
            self._executor.stop()
            log.info("Storage closed: every range flushed and fsynced")

        return closing.addCallback(stop_threads)


def build_service(reactor: Any, config: BrokerConfig, data_dir: DataDirectory) -> MultiService:
    """Build the service tree, recovering storage first. Blocking; raises on recovery failure.
    ``data_dir`` is ``config.storage.data_dir`` already opened (and locked) by the caller."""
    configure_interpreter()
    root = MultiService()
    storage = StorageService(reactor, data_dir, OsFileSystem(), config.storage.log)
    storage.recover()
    storage.setName("storage")
    storage.setServiceParent(root)
    return root
