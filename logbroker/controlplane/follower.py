"""One follower of one etcd prefix, for every watch-fed cache of the store: the control plane,
the member list and the shared sessions each keep theirs with a ``PrefixFollower``.

It drives ``Following`` (``logbroker.controlplane.following``, where the decisions and their
transitions are) through a ``KeyValueStore`` and a clock: it loads the prefix and hands the
reader the whole of it (``on_load``, with the revision it was read at), watches from the next
revision and hands over every change (``on_events``), resumes a lost watch after a pause that
doubles up to a cap, loads the whole prefix again when the revision to resume from was
compacted, and when a revision the reader expects has not come in time (a watch on a
member cut off without a word delivers nothing and never ends). Trouble is logged once, as a
warning, until following works again.

The callbacks may raise: what ``on_load`` refuses counts as a failed load (retried after the
pause), what ``on_events`` refuses makes the follower load the whole prefix again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.controlplane._kv import KeyValueStore, RangeResult, WatchEvent, WatchHandle
from logbroker.controlplane.errors import CompactedError, ControlPlaneError
from logbroker.controlplane.following import (
    Action,
    CancelWatch,
    Following,
    FollowState,
    GiveUp,
    Load,
    LoadReason,
    Recovered,
    Trouble,
    Watch,
)

log = Logger()

#: The first pause before loading again or resuming a lost watch, and the cap of its doubling.
RESUME_DELAY = 0.1
MAX_RESUME_DELAY = 5.0


@attrs.define(eq=False)
class Expectation:
    """What ``PrefixFollower.expect`` noted; ``cancel`` once it is no longer needed."""

    _follower: PrefixFollower
    _key: int

    def cancel(self) -> None:
        self._follower._forget(self._key)


class PrefixFollower:
    """Keeps a reader up to date with every key under ``prefix`` of ``store``.

    ``name`` says whose follower it is in log lines. ``first_delay`` and ``max_delay`` bound
    the pauses before retrying.
    """

    def __init__(
        self,
        store: KeyValueStore,
        prefix: bytes,
        clock: IReactorTime,
        *,
        name: str,
        on_load: Callable[[RangeResult], None],
        on_events: Callable[[Sequence[WatchEvent]], None],
        first_delay: float = RESUME_DELAY,
        max_delay: float = MAX_RESUME_DELAY,
    ) -> None:
        self._store = store
        self._prefix = prefix
        #: The prefix in log lines.
        self._shown = prefix.decode("utf-8", "replace")
        self._clock = clock
        self._name = name
        self._on_load = on_load
        self._on_events = on_events
        self._following = Following(first_delay=first_delay, max_delay=max_delay)
        self._watch: WatchHandle | None = None
        #: Changes with every load, watch and stop, so that the answers of an abandoned one
        #: are ignored (a watch may report its end before ``watch`` has returned).
        self._attempt = 0
        self._timer: IDelayedCall | None = None
        self._timer_at: float | None = None
        self._started: Deferred[None] | None = None

    @property
    def revision(self) -> int:
        """The revision of the last load or change handed to the reader."""
        return self._following.revision

    @property
    def watching(self) -> bool:
        return self._following.state is FollowState.WATCHING

    def start(self, *, retry_first_load: bool = True) -> Deferred[None]:
        """Load the prefix, then follow it. Fires once the first load is handed over. A first
        load that fails is retried like any other, or, without ``retry_first_load``, fails
        the Deferred and stops the follower. (After ``stop``, it never fires.)"""
        if self._following.state is not FollowState.STOPPED:
            raise RuntimeError(f"{self._name}: already following {self._shown}")
        started: Deferred[None] = Deferred()
        self._started = started
        self._run(self._following.start(retry_first_load=retry_first_load))
        return started

    def stop(self) -> None:
        """Stop following: the watch ends, nothing is retried, no callback is called again."""
        self._attempt += 1
        self._started = None
        self._run(self._following.stop())

    def expect(self, revision: int, within: float) -> Expectation:
        """Load the prefix again unless ``revision`` has come within ``within`` seconds (the
        watch may have gone silent)."""
        deadline = self._clock.seconds() + within
        key = self._following.expect(revision, deadline, within)
        self._arm()
        return Expectation(self, key)

    def _forget(self, key: int) -> None:
        self._following.forget(key)
        self._arm()

    # -- running the actions -----------------------------------------------------------------

    def _run(self, actions: Sequence[Action], error: Failure | Exception | None = None) -> None:
        """Take ``actions``; ``error`` is what they answer, if anything went wrong."""
        for action in actions:
            if isinstance(action, Load):
                self._log_load(action, error)
                self._load()
            elif isinstance(action, Watch):
                self._start_watch(action.start_revision)
            elif isinstance(action, CancelWatch):
                self._cancel_watch()
            elif isinstance(action, Trouble):
                self._log_trouble(action, error)
            elif isinstance(action, Recovered):
                log.info("{name}: following {prefix} again", name=self._name, prefix=self._shown)
            else:
                assert isinstance(action, GiveUp)
                started, self._started = self._started, None
                if started is not None:
                    started.errback(error)
        self._arm()

    def _arm(self) -> None:
        """Have the timer go off at the state machine's ``wakeup``."""
        wakeup = self._following.wakeup
        if wakeup == self._timer_at:
            return
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self._timer_at = wakeup
        if wakeup is not None:
            delay = max(0.0, wakeup - self._clock.seconds())
            self._timer = self._clock.callLater(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._timer_at = None
        self._run(self._following.timer(self._clock.seconds()))

    # -- the store ---------------------------------------------------------------------------

    def _load(self) -> None:
        self._attempt += 1
        attempt = self._attempt

        def hand_over(result: RangeResult) -> RangeResult | None:
            if attempt != self._attempt:
                return None
            # What it raises counts as a failed load.
            self._on_load(result)
            return result

        def loaded(result: RangeResult | None) -> None:
            if result is None or attempt != self._attempt:
                return
            self._run(self._following.loaded(result.revision, self._clock.seconds()))
            started, self._started = self._started, None
            if started is not None:
                started.callback(None)

        def failed(failure: Failure) -> None:
            self._load_failed(attempt, failure)

        loading = self._store.range_prefix(self._prefix).addCallback(hand_over)
        loading.addCallbacks(loaded, failed)

    def _load_failed(self, attempt: int, failure: Failure) -> None:
        if attempt != self._attempt:
            return
        if not isinstance(failure.value, ControlPlaneError):
            log.failure(
                "{name}: loading {prefix} failed unexpectedly",
                failure,
                name=self._name,
                prefix=self._shown,
            )
        self._run(self._following.load_failed(self._clock.seconds()), failure)

    def _start_watch(self, start_revision: int) -> None:
        self._attempt += 1
        attempt = self._attempt

        def events(events: Sequence[WatchEvent]) -> None:
            self._events(attempt, events)

        def lost(error: Exception) -> None:
            self._lost(attempt, error)

        watch = self._store.watch(self._prefix, start_revision, events, lost)
        if attempt == self._attempt:
            self._watch = watch
        else:
            # Over before it was returned (lost, or given up for a load): make sure of it.
            watch.cancel()

    def _events(self, attempt: int, events: Sequence[WatchEvent]) -> None:
        if attempt != self._attempt or not events:
            return
        try:
            self._on_events(events)
        except Exception:
            log.failure(
                "{name}: applying a change under {prefix} failed; loading it all again",
                name=self._name,
                prefix=self._shown,
            )
            if attempt == self._attempt:
                self._run(self._following.rejected(self._clock.seconds()))
            return
        if attempt == self._attempt:
            revision = max(event.kv.mod_revision for event in events)
            self._run(self._following.events(revision, self._clock.seconds()))

    def _lost(self, attempt: int, error: Exception) -> None:
        if attempt != self._attempt:
            return
        # Nothing more comes from this watch.
        self._attempt += 1
        self._watch = None
        now = self._clock.seconds()
        compacted = isinstance(error, CompactedError)
        self._run(self._following.watch_lost(compacted=compacted, now=now), error)

    def _cancel_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()

    # -- the log -----------------------------------------------------------------------------

    def _log_load(self, load: Load, error: Failure | Exception | None) -> None:
        fields = {"name": self._name, "prefix": self._shown, "revision": self.revision}
        if load.why is LoadReason.COMPACTED:
            log.warn(
                "{name}: the watch on {prefix} fell behind a compaction ({error}); loading"
                " it all again",
                error=str(error),
                **fields,
            )
        elif load.why is LoadReason.SILENT:
            log.warn(
                "{name}: the watch on {prefix} has not brought revision {expected} within"
                " {seconds} s (it is at {revision}); loading it all again from a live member in"
                " case the watch went silent",
                expected=load.expected,
                seconds=load.waited,
                **fields,
            )

    def _log_trouble(self, trouble: Trouble, error: Failure | Exception | None) -> None:
        reason = error.getErrorMessage() if isinstance(error, Failure) else str(error)
        if self._following.state is FollowState.WAITING_TO_LOAD:
            what = "could not load {prefix} ({reason}); trying again in {delay} s"
        else:
            what = (
                "lost the watch on {prefix} ({reason}); resuming from revision {next} in {delay} s"
            )
        emit = log.warn if trouble.first else log.debug
        emit(
            "{name}: " + what,
            name=self._name,
            prefix=self._shown,
            reason=reason,
            next=self.revision + 1,
            delay=trouble.delay,
        )
