"""etcd's history, compacted by the node that holds the cluster's chores.

etcd keeps every revision of every key until it is compacted, and counts them against its space
quota (2 GB unless ``--quota-backend-bytes`` says otherwise); at the quota it raises an alarm
and refuses every write, so the cluster could no longer roll a segment, take a range over or
commit a consumer group's offset. Every claim, seal and group commit is a revision: a soak of
an hour of failovers at 4,000 ranges wrote 30 MB of values in its first 18 minutes, and
consumer groups committing once a second each add up to gigabytes a day.

So the chores holder compacts, every ``COMPACT_EVERY_SECONDS``, to the revision it read one run
before: the last interval's history stays, and only a watch that fell further behind than that
(a node cut off from etcd for longer) loads its prefix whole again, as after any compaction.

etcd 3.4 lets the brokers' user, confined to ``/logbroker/``, compact while its auth is on;
other versions give compaction to etcd's ``root`` alone. Where etcd refuses it, the node says
once how to have etcd compact itself (``--auto-compaction-mode``) and stops asking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.controlplane._kv import RangeResult
from logbroker.controlplane.errors import AlreadyCompactedError, ControlPlaneAccessError

log = Logger()

#: How often the chores holder compacts, and so how much history etcd keeps (at least this
#: much, at most twice). Kubernetes' API server compacts its etcd every 5 minutes too.
COMPACT_EVERY_SECONDS = 300.0

#: What operators give etcd when it must compact itself.
AUTO_COMPACTION = "--auto-compaction-mode=periodic --auto-compaction-retention=5m"


class CompactableStore(Protocol):
    def range_prefix(self, prefix: bytes) -> Deferred[RangeResult]: ...

    def compact(self, revision: int) -> Deferred[None]: ...


class HistoryCompaction:
    """``run`` compacts ``store`` to the revision the previous run read, when ``decides()``
    (this node holds the cluster's chores). ``probe`` is a key read for the store's revision:
    one of the cluster's own, which its etcd user may read."""

    def __init__(self, store: CompactableStore, probe: bytes, decides: Callable[[], bool]) -> None:
        self._store = store
        self._probe = probe
        self._decides = decides
        #: The revision the last run read; None before the first run as the chores holder.
        self._previous: int | None = None
        #: etcd refused compaction to this node's user: said once, never asked again.
        self.refused = False

    def run(self) -> Deferred[None] | None:
        if self.refused:
            return None
        if not self._decides():
            # Another node compacts; if this one becomes the holder again, it starts over
            # from a revision it reads then, keeping a whole interval of history.
            self._previous = None
            return None
        compacted: Deferred[None] = self._store.range_prefix(self._probe).addCallback(self._read)
        return compacted.addErrback(self._failed)

    def _read(self, result: RangeResult) -> Deferred[None] | None:
        previous, self._previous = self._previous, result.revision
        if previous is None:
            return None
        compacted = self._store.compact(previous)
        compacted.addCallback(
            lambda _: log.info(
                "Compacted etcd's history below revision {revision} (now at {now})",
                revision=previous,
                now=result.revision,
            )
        )
        return compacted

    def _failed(self, failure: Failure) -> None:
        error = failure.getErrorMessage()
        if isinstance(failure.value, ControlPlaneAccessError):
            self.refused = True
            log.warn(
                "etcd refused to compact its history for this node ({error}): some etcd"
                " versions give compaction to their root user alone while auth is on. Run"
                " every etcd member with {flags}, or etcd's history grows until its space"
                " quota and then it refuses every write",
                error=error,
                flags=AUTO_COMPACTION,
            )
        elif isinstance(failure.value, AlreadyCompactedError):
            # Another node compacted past it meanwhile (the chores changed hands), or etcd did.
            log.debug("etcd's history was compacted already: {error}", error=error)
        else:
            log.warn(
                "Compacting etcd's history failed: {error}; tried again in {seconds:.0f} s",
                error=error,
                seconds=COMPACT_EVERY_SECONDS,
            )
