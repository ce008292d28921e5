"""Where storage runs blocking work: writes, fsyncs, recovery scans and verification.

The reactor thread never waits on the disk. Storage hands each blocking job to an ``Executor``
and carries on; the job's result comes back as a Deferred fired in the reactor thread. Each range
log keeps at most one job in flight, so its writes stay in order while different ranges use
different threads.

Tests inject ``logbroker.testing.ImmediateExecutor`` (runs jobs at once) or
``logbroker.testing.ManualExecutor`` (runs them when the test says so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool

_T = TypeVar("_T")


class Executor(Protocol):
    def run(self, job: Callable[..., _T], *args: Any) -> Deferred[_T]:
        """Run ``job(*args)`` off the reactor thread; fire with its result in the reactor."""


class ThreadPoolExecutor:
    """Runs storage jobs on a dedicated pool of writer threads.

    The pool is started and stopped by the service that owns it (see ``logbroker.service``).
    """

    def __init__(
        self, reactor: IReactorFromThreads, threads: int = 4, name: str = "logbroker-storage"
    ) -> None:
        self._reactor = reactor
        self._pool = ThreadPool(minthreads=1, maxthreads=threads, name=name)

    def start(self) -> None:
        self._pool.start()

    def stop(self) -> None:
        self._pool.stop()

    def run(self, job: Callable[..., _T], *args: Any) -> Deferred[_T]:
        return deferToThreadPool(self._reactor, self._pool, job, *args)
