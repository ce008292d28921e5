"""Following a prefix of etcd: the decisions, as a sans-IO state machine (no Twisted, no store,
no logging).

A reader that keeps a cache of every key under a prefix (the control plane, the member list,
the shared sessions) loads the prefix, then watches it from the revision after the load's. A
watch ends without a word from the reader's side: its member went away (resume from the
revision after the last one seen, after a pause that doubles up to a cap), or the revision to
resume from was compacted (load the whole prefix again, never skip a gap). A watch on a member
cut off without a word delivers nothing and never ends: a reader that knows a revision should
come (it made the change) says so with ``expect``, and if it has not come in time, the prefix
is loaded again from whichever member answers.

``Following`` is told what happened (``start``, ``loaded``, ``load_failed``, ``events``,
``watch_lost``, ``rejected``, ``timer``, ``stop``) with the time, and answers with the actions
to take, in order; at most one of them is a ``Load`` or a ``Watch``, and it comes last, so a
driver whose store answers within the call can run the rest first. ``wakeup`` is when
``timer`` is due next (``None``: nothing to wait for). ``PrefixFollower``
(``logbroker.controlplane.follower``) drives it through a ``KeyValueStore`` and a clock.

States and transitions (``FollowState``)::

    STOPPED --start---------------------------------> LOADING            (Load)
    LOADING --loaded(R)-----------------------------> WATCHING           (Watch(R + 1))
    LOADING --load_failed---------------------------> WAITING_TO_LOAD    (Trouble)
    LOADING --load_failed, first load, no retry-----> STOPPED            (GiveUp)
    WAITING_TO_LOAD --timer, the pause is over------> LOADING            (Load)
    WATCHING --events(R)----------------------------> WATCHING
    WATCHING --watch_lost, compacted----------------> LOADING            (Load)
    WATCHING --watch_lost---------------------------> WAITING_TO_WATCH   (Trouble)
    WAITING_TO_WATCH --timer, the pause is over-----> WATCHING           (Watch(revision + 1))
    WATCHING, WAITING_TO_WATCH --timer, an expected
        revision has not come in time---------------> LOADING            (CancelWatch, Load)
    WATCHING --rejected (the reader could not apply
        what it was given)--------------------------> LOADING            (CancelWatch, Load)
    any --stop--------------------------------------> STOPPED            (CancelWatch)

The pause before a retry starts at ``first_delay`` and doubles with each failure, up to
``max_delay``; a load, events, or a watch that stayed up for ``max_delay`` before it was lost
bring it back to ``first_delay``. ``Trouble.first`` is true for the first failure after
following last worked (say it loudly once), and ``Recovered`` comes when it works again.
"""

from __future__ import annotations

from enum import Enum, auto

import attrs


class FollowState(Enum):
    STOPPED = auto()
    LOADING = auto()
    WATCHING = auto()
    #: A load failed: loading again once the pause is over.
    WAITING_TO_LOAD = auto()
    #: The watch was lost: watching again, from the revision after the last one seen, once
    #: the pause is over.
    WAITING_TO_WATCH = auto()


class LoadReason(Enum):
    START = "start"
    #: The last load failed.
    RETRY = "retry"
    #: The revision to resume the watch from was compacted.
    COMPACTED = "compacted"
    #: An expected revision did not come in time: the watch may have gone silent.
    SILENT = "silent"
    #: The reader could not apply what the watch brought: start again from a fresh read.
    REJECTED = "rejected"


@attrs.frozen
class Load:
    """Read every key under the prefix, and tell ``loaded`` or ``load_failed``."""

    why: LoadReason
    #: For ``SILENT``: the revision that did not come, and how long it was waited for.
    expected: int = 0
    waited: float = 0.0


@attrs.frozen
class Watch:
    """Watch the prefix from ``start_revision`` on; tell ``events`` and ``watch_lost``."""

    start_revision: int


@attrs.frozen
class CancelWatch:
    """End the watch open now."""


@attrs.frozen
class Trouble:
    """A load failed or the watch was lost: trying again in ``delay`` seconds. ``first``: the
    first failure since following last worked."""

    first: bool
    delay: float


@attrs.frozen
class Recovered:
    """Following works again, after ``Trouble``."""


@attrs.frozen
class GiveUp:
    """The first load failed and ``start`` asked not to retry it: the follower stopped."""


Action = Load | Watch | CancelWatch | Trouble | Recovered | GiveUp


@attrs.define
class _Expected:
    revision: int
    deadline: float
    within: float


class Following:
    """The decisions of one follower of one prefix (module docstring)."""

    def __init__(self, *, first_delay: float, max_delay: float) -> None:
        if not 0 < first_delay <= max_delay:
            raise ValueError(f"retry delays {first_delay} to {max_delay}: need 0 < first <= max")
        self._first_delay = first_delay
        self._max_delay = max_delay
        self.state = FollowState.STOPPED
        #: The revision of the last load or event: the cache is the prefix as of it.
        self.revision = 0
        self._loaded_once = False
        self._retry_first_load = True
        self._delay = first_delay
        #: When the pause of a waiting state is over.
        self._retry_at: float | None = None
        #: When the watch open now was asked for.
        self._watching_since = 0.0
        self._troubled = False
        self._expected: dict[int, _Expected] = {}
        self._next_key = 0

    @property
    def wakeup(self) -> float | None:
        """When ``timer`` is due next."""
        times = [expected.deadline for expected in self._expected.values()]
        if self._retry_at is not None:
            times.append(self._retry_at)
        return min(times, default=None)

    # -- what the driver tells ---------------------------------------------------------------

    def start(self, *, retry_first_load: bool = True) -> list[Action]:
        """Begin following. ``retry_first_load``: a failed first load is retried like any
        other; else it stops the follower (``GiveUp``)."""
        if self.state is not FollowState.STOPPED:
            return []
        self._retry_first_load = retry_first_load
        self._loaded_once = False
        self._troubled = False
        self._delay = self._first_delay
        self.state = FollowState.LOADING
        return [Load(LoadReason.START)]

    def stop(self) -> list[Action]:
        watching = self.state is FollowState.WATCHING
        self.state = FollowState.STOPPED
        self._retry_at = None
        self._expected.clear()
        return [CancelWatch()] if watching else []

    def loaded(self, revision: int, now: float) -> list[Action]:
        """The load read the prefix at ``revision``, and the reader took it."""
        if self.state is not FollowState.LOADING:
            return []
        self._loaded_once = True
        self.revision = revision
        self._satisfied()
        actions = self._worked()
        return [*actions, self._watch(now)]

    def load_failed(self, now: float) -> list[Action]:
        """The load failed, or the reader could not take what it read."""
        if self.state is not FollowState.LOADING:
            return []
        if not self._loaded_once and not self._retry_first_load:
            self.stop()
            return [GiveUp()]
        return self._pause(FollowState.WAITING_TO_LOAD, now)

    def events(self, revision: int, now: float) -> list[Action]:
        """The watch brought changes up to ``revision``, and the reader took them."""
        if self.state is not FollowState.WATCHING:
            return []
        self.revision = max(self.revision, revision)
        self._satisfied()
        return self._worked()

    def watch_lost(self, *, compacted: bool, now: float) -> list[Action]:
        """The watch ended; ``compacted``: its start revision is no longer in etcd's history."""
        if self.state is not FollowState.WATCHING:
            return []
        if now - self._watching_since >= self._max_delay:
            # It stayed up: whatever ended it is new trouble, not more of the last.
            self._delay = self._first_delay
            self._troubled = False
        if compacted:
            self.state = FollowState.LOADING
            return [Load(LoadReason.COMPACTED)]
        return self._pause(FollowState.WAITING_TO_WATCH, now)

    def rejected(self, now: float) -> list[Action]:
        """The reader could not apply what the watch brought."""
        if self.state is not FollowState.WATCHING:
            return []
        self.state = FollowState.LOADING
        return [CancelWatch(), Load(LoadReason.REJECTED)]

    def expect(self, revision: int, deadline: float, within: float) -> int:
        """Note that ``revision`` should have come by ``deadline`` (``within`` seconds from
        now): if it has not, the watch may be silent, and the prefix is loaded again. Returns
        a key for ``forget``."""
        self._next_key += 1
        if revision > self.revision and self.state is not FollowState.STOPPED:
            self._expected[self._next_key] = _Expected(revision, deadline, within)
        return self._next_key

    def forget(self, key: int) -> None:
        """No longer expect what ``expect`` gave ``key`` for."""
        self._expected.pop(key, None)

    def timer(self, now: float) -> list[Action]:
        """``wakeup`` has come."""
        due = [expected for expected in self._expected.values() if expected.deadline <= now]
        self._expected = {
            key: expected for key, expected in self._expected.items() if expected.deadline > now
        }
        if due and self.state in (FollowState.WATCHING, FollowState.WAITING_TO_WATCH):
            # Loading anyway (or about to) otherwise: that brings whatever has come.
            silent = min(due, key=lambda expected: expected.revision)
            actions: list[Action] = []
            if self.state is FollowState.WATCHING:
                actions.append(CancelWatch())
            self.state = FollowState.LOADING
            self._retry_at = None
            return [*actions, Load(LoadReason.SILENT, silent.revision, silent.within)]
        if self._retry_at is None or self._retry_at > now:
            return []
        self._retry_at = None
        if self.state is FollowState.WAITING_TO_LOAD:
            self.state = FollowState.LOADING
            return [Load(LoadReason.RETRY)]
        return [self._watch(now)]

    # -- helpers -------------------------------------------------------------------------------

    def _watch(self, now: float) -> Watch:
        self.state = FollowState.WATCHING
        self._watching_since = now
        return Watch(self.revision + 1)

    def _pause(self, state: FollowState, now: float) -> list[Action]:
        self.state = state
        delay = self._delay
        self._retry_at = now + delay
        self._delay = min(delay * 2, self._max_delay)
        first = not self._troubled
        self._troubled = True
        return [Trouble(first, delay)]

    def _worked(self) -> list[Action]:
        self._delay = self._first_delay
        if not self._troubled:
            return []
        self._troubled = False
        return [Recovered()]

    def _satisfied(self) -> None:
        self._expected = {
            key: expected
            for key, expected in self._expected.items()
            if expected.revision > self.revision
        }
