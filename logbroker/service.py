"""The composition root: builds the service tree ``twistd logbroker`` runs.

This is the only module (with the plugin's ``makeService``) that wires the real reactor. Start
order: the storage writer threads and every range log recovered first; listeners (next
milestones) start only once ``StorageService.ready`` has fired. Stop order is the reverse, and
the store closes last, after every queued append has been flushed and fsynced.
"""

from __future__ import annotations

from typing import Any

from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, DeferredList, gatherResults
from twisted.logger import Logger

from logbroker.config import StorageSettings
from logbroker.storage import (
    DataDirectory,
    FileSystem,
    IntegrityEvent,
    LogConfig,
    OsFileSystem,
    RangeLog,
    ThreadPoolExecutor,
)

log = Logger()


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
        self.integrity_events: list[IntegrityEvent] = []
        #: Fires once every existing range is recovered and open.
        self.ready: Deferred[None] = Deferred()

    def open_range(self, name: str) -> Deferred[RangeLog]:
        """Open (creating if new) the log of range ``name``."""

        def opened(range_log: RangeLog) -> RangeLog:
            self.logs[name] = range_log
            return range_log

        return RangeLog.open(
            self._data_dir.range_path(name),
            fs=self._fs,
            clock=self._reactor,
            executor=self._executor,
            config=self._log_config,
            on_integrity_event=self.integrity_events.append,
        ).addCallback(opened)

    def startService(self) -> None:
        super().startService()
        self._executor.start()
        started = self._reactor.seconds()
        names = self._data_dir.range_names()

        def recovered(_: object) -> None:
            log.info(
                "Storage ready in {path}: {ranges} ranges recovered in {seconds:.3f} s",
                path=self._data_dir.path,
                ranges=len(names),
                seconds=self._reactor.seconds() - started,
            )
            self.ready.callback(None)

        def failed(failure: Any) -> None:
            log.failure("Storage recovery failed; stopping", failure)
            self._reactor.stop()

        opening = [self.open_range(name) for name in names]
        gatherResults(opening, consumeErrors=True).addCallbacks(recovered, failed)

    def stopService(self) -> Deferred[None]:
        super().stopService()
        closing = DeferredList([range_log.close() for range_log in self.logs.values()])

        def stop_threads(_: object) -> None:
            self._executor.stop()
            log.info("Storage closed: every range flushed and fsynced")

        return closing.addCallback(stop_threads)


def build_service(reactor: Any, settings: StorageSettings, data_dir: DataDirectory) -> MultiService:
    root = MultiService()
    storage = StorageService(reactor, data_dir, OsFileSystem(), settings.log)
    storage.setName("storage")
    storage.setServiceParent(root)
    return root
