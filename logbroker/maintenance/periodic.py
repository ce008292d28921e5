"""``PeriodicTask``: the one wrapper every background loop of the broker runs under.

A bare ``LoopingCall`` stops for good on the first exception or failed Deferred of its function,
and nothing says so: a scrub or a retention pass that died that way looks exactly like one that
found nothing to do. A ``PeriodicTask`` runs its work on a ``LoopingCall`` but catches every
failure, logs it with its traceback and the task's name, counts it (``failures``, and
``svc_periodic_task_failures_total{task}`` through the injected metrics), and runs again at the
next interval.

Runs never overlap: when the work returns a Deferred, the next run is scheduled only once it has
fired, at the next whole interval counted from the start; runs that fell due meanwhile are
skipped, not stacked (``LoopingCall``'s own rule). ``stop`` waits for a run in progress.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure

log = Logger()


class TaskMetrics(Protocol):
    """Where a task reports itself (``logbroker.metrics.Metrics``)."""

    def periodic_task_added(self, task: str) -> None: ...

    def periodic_task_failed(self, task: str) -> None: ...

    def periodic_task_succeeded(self, task: str, now: float) -> None: ...


class PeriodicTask(Service):
    """Runs ``work`` every ``interval`` seconds of ``clock`` until stopped.

    ``work`` takes no arguments and returns anything, or a Deferred to wait for. As a service,
    it starts with the service (running at once if ``now``) and its ``stopService`` is ``stop``.

    Lifecycle: stopped -> ``start`` -> running -> ``stop`` -> stopping (while a run is in
    progress) -> stopped; it may be started again once stopped.
    """

    def __init__(
        self,
        name: str,
        interval: float,
        work: Callable[[], object],
        clock: IReactorTime,
        *,
        metrics: TaskMetrics | None = None,
        now: bool = True,
    ) -> None:
        if not interval > 0:
            # LoopingCall would run an interval of 0 back to back, starving the reactor.
            raise ValueError(
                f"the interval of periodic task {name!r} must be above 0, not {interval}"
            )
        self.task_name = name
        self._interval = interval
        self._work = work
        self._clock = clock
        self._metrics = metrics
        self._run_now = now
        self._loop = LoopingCall(self._run)
        self._loop.clock = clock
        #: Fires once the loop has stopped; ``None`` while stopped.
        self._finished: Deferred[None] | None = None
        self._stop_waiters: list[Deferred[None]] = []
        #: Runs that raised or failed since this task was made.
        self.failures = 0
        #: When the last run that succeeded ended (``clock`` seconds), if one has.
        self.last_success: float | None = None
        if metrics is not None:
            metrics.periodic_task_added(name)

    def start(self, now: bool = True) -> None:
        """Run every interval from now on, the first time at once if ``now``."""
        if self._finished is not None:
            raise RuntimeError(f"periodic task {self.task_name!r} is already running")
        self._finished = self._loop.start(self._interval, now).addCallback(self._stopped)

    def stop(self) -> Deferred[None]:
        """Stop running: fires once a run in progress (if any) has ended. Stopping a task that
        is not running does nothing."""
        if self._finished is None:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._stop_waiters.append(waiter)
        if self._loop.running:
            # Between runs this fires the loop's Deferred, and so the waiter, at once.
            self._loop.stop()
        return waiter

    # twisted.application.service is not annotated, hence the two ignores.
    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self.start(self._run_now)

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        return self.stop()

    def _run(self) -> Deferred[None]:
        # The Deferred handed back to the LoopingCall never fails, so the loop never ends on
        # its own; and it fires only when the work has, so runs never overlap.
        running = maybeDeferred(self._work)
        return running.addCallback(self._succeeded).addErrback(self._failed)

    def _succeeded(self, _: object) -> None:
        self.last_success = self._clock.seconds()
        if self._metrics is not None:
            self._metrics.periodic_task_succeeded(self.task_name, self.last_success)

    def _failed(self, failure: Failure) -> None:
        self.failures += 1
        log.failure(
            "Periodic task {task} failed (failure {failures}); it runs again at its next interval"
            " ({interval} s)",
            failure,
            level=LogLevel.error,
            task=self.task_name,
            failures=self.failures,
            interval=self._interval,
        )
        if self._metrics is not None:
            self._metrics.periodic_task_failed(self.task_name)

    def _stopped(self, _: object) -> None:
        self._finished = None
        waiters, self._stop_waiters = self._stop_waiters, []
        for waiter in waiters:
            waiter.callback(None)
