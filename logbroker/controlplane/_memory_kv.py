"""A ``KeyValueStore`` in memory that behaves like etcd, for tests: deterministic, synchronous.

Revisions, transactions with compares, prefix watches from any retained revision, compaction,
and leases that expire on an injected clock, as etcd does them (the store contract tests hold
this double to a real etcd). Several clients may share one store, as nodes share an etcd cluster.

Deferreds fire before the call returns, and watchers hear about a change before the call that
made it returns. Hooks make failures happen on demand: ``unavailable`` (every request fails with
``ControlPlaneUnavailableError``), ``lost_answers`` (that many transactions are applied, then
reported as ``OutcomeUnknownError``), ``drop_watches()`` (every watch ends as if its member
went away), ``silence_watches()`` (every watch stays open and delivers nothing, as one on a
member cut off without a word does), ``compact(revision)``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from logbroker.controlplane._kv import (
    Compare,
    Delete,
    DeletePrefix,
    EventType,
    Get,
    KeyValue,
    OnEvents,
    OnLost,
    Operation,
    Put,
    RangeResult,
    TxnResult,
    WatchEvent,
    prefix_end,
)
from logbroker.controlplane.errors import (
    AlreadyCompactedError,
    CompactedError,
    ControlPlaneUnavailableError,
    LeaseNotFoundError,
    OutcomeUnknownError,
    StoreError,
)

_T = TypeVar("_T")

#: etcd's first lease ids are large; so are these, so nobody relies on small ones.
_FIRST_LEASE = 7_587_000_000_000_000_001
#: etcd's default limit on the compares, and on the operations of each branch, of a transaction.
MAX_TXN_OPS = 128


@attrs.define
class _Lease:
    ttl: int
    expiry: IDelayedCall
    keys: set[bytes] = attrs.Factory(set)


@attrs.define(eq=False)
class _Watch:
    store: MemoryKeyValueStore
    start: bytes
    end: bytes
    on_events: OnEvents
    on_lost: OnLost
    active: bool = True
    #: Open, but delivering nothing (``silence_watches``).
    silent: bool = False

    def cancel(self) -> None:
        self.active = False
        self.store._watches.pop(self, None)

    def covers(self, key: bytes) -> bool:
        return self.start <= key < self.end


class MemoryKeyValueStore:
    """An etcd in memory; ``clock`` expires leases."""

    def __init__(self, clock: IReactorTime) -> None:
        self._clock = clock
        self._data: dict[bytes, KeyValue] = {}
        #: A new etcd cluster is at revision 1.
        self.revision = 1
        #: Watches from below this revision fail with ``CompactedError``.
        self.compact_revision = 0
        #: Every retained revision's events, in revision order.
        self._history: list[tuple[int, tuple[WatchEvent, ...]]] = []
        #: In the order they were made (a dict), so that events reach them in a repeatable
        #: order: the simulation replays a seed exactly.
        self._watches: dict[_Watch, None] = {}
        self._leases: dict[int, _Lease] = {}
        self._next_lease = _FIRST_LEASE
        #: While true, every request fails as if no member answered.
        self.unavailable = False
        #: While above 0, each transaction takes effect, then reports ``OutcomeUnknownError``
        #: (and counts it down): its answer was lost.
        self.lost_answers = 0
        #: While not None, requests wait here until ``release()`` (see ``hold``).
        self._held: list[tuple[Callable[[], object], Deferred[object]]] | None = None
        #: Every transaction asked for, for tests that check what was sent.
        self.transactions: list[tuple[tuple[Compare, ...], tuple[Operation, ...]]] = []

    # -- failure hooks -------------------------------------------------------------------------

    def drop_watches(self) -> None:
        """End every watch as if its member went away."""
        dropped, self._watches = list(self._watches), {}
        for watch in dropped:
            watch.active = False
            watch.on_lost(ControlPlaneUnavailableError("the watch's etcd member went away"))

    def silence_watches(self) -> None:
        """Keep every watch open now from delivering anything more, and from ending: a watch
        on a member cut off without a word (no reset, no "no leader") does that."""
        for watch in self._watches:
            watch.silent = True

    def compact(self, revision: int) -> Deferred[None]:
        """Forget history below ``revision``, as etcd's compaction does (fired at once)."""
        if revision > self.revision:
            raise ValueError(f"cannot compact to {revision}, after the store's {self.revision}")
        if revision <= self.compact_revision:
            return fail(
                AlreadyCompactedError(f"mvcc: required revision {revision} has been compacted")
            )
        self.compact_revision = revision
        self._history = [entry for entry in self._history if entry[0] >= revision]
        return succeed(None)

    def hold(self) -> None:
        """Keep requests from now on waiting, unanswered, until ``release()``: what several
        clients ask for meanwhile races, as it does over a network."""
        if self._held is None:
            self._held = []

    def release(self, count: int | None = None) -> None:
        """Answer the held requests, in the order they were made, and stop holding; or only
        the first ``count`` of them, holding on."""
        held = self._held or []
        if count is None:
            self._held = None
        else:
            held, self._held = held[:count], held[count:]
        for call, answered in held:
            if self._held is None:
                self._answer(call).chainDeferred(answered)
            else:
                self._run(call).chainDeferred(answered)

    @property
    def watch_count(self) -> int:
        return len(self._watches)

    def _check(self) -> None:
        if self.unavailable:
            raise ControlPlaneUnavailableError("no etcd member answered (the double is down)")

    def _answer(self, call: Callable[[], _T]) -> Deferred[_T]:
        if self._held is not None:
            answered: Deferred[_T] = Deferred()
            self._held.append((call, answered))  # type: ignore[arg-type]
            return answered
        return self._run(call)

    def _run(self, call: Callable[[], _T]) -> Deferred[_T]:
        try:
            self._check()
            return succeed(call())
        except Exception:
            return fail()

    # -- reads and writes ----------------------------------------------------------------------

    def get(self, key: bytes) -> KeyValue | None:
        """The key as it is now (for tests)."""
        return self._data.get(key)

    def range_prefix(self, prefix: bytes) -> Deferred[RangeResult]:
        def read() -> RangeResult:
            end = prefix_end(prefix)
            kvs = tuple(kv for key, kv in sorted(self._data.items()) if prefix <= key < end)
            return RangeResult(kvs, self.revision)

        return self._answer(read)

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Operation],
        failure: Sequence[Operation] = (),
    ) -> Deferred[TxnResult]:
        def txn() -> TxnResult:
            self.transactions.append((tuple(compares), tuple(success)))
            result = self._txn(compares, success, failure)
            if self.lost_answers > 0:
                self.lost_answers -= 1
                raise OutcomeUnknownError("the etcd member did not answer (the double said so)")
            return result

        return self._answer(txn)

    def _txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Operation],
        failure: Sequence[Operation],
    ) -> TxnResult:
        if max(len(compares), len(success), len(failure)) > MAX_TXN_OPS:
            # etcd's --max-txn-ops, per list.
            raise StoreError("etcdserver: too many operations in txn request")
        succeeded = all(compare.holds(self._data.get(compare.key)) for compare in compares)
        operations = success if succeeded else failure
        for op in operations:
            if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                raise LeaseNotFoundError(f"lease {op.lease} not found")
        gets = tuple(self._data.get(op.key) for op in operations if isinstance(op, Get))
        self._write([op for op in operations if not isinstance(op, Get)])
        return TxnResult(succeeded, self.revision, gets)

    def _write(self, operations: Sequence[Operation]) -> int:
        """Apply ``operations`` as one revision (none if nothing changes); return the number
        of keys deleted."""
        revision = self.revision + 1
        events: list[WatchEvent] = []
        deleted = 0
        for op in operations:
            if isinstance(op, Put):
                old = self._data.get(op.key)
                if old is not None and old.lease:
                    self._leases[old.lease].keys.discard(op.key)
                created = old.create_revision if old is not None else revision
                kv = KeyValue(op.key, op.value, created, revision, op.lease)
                self._data[op.key] = kv
                if op.lease:
                    self._leases[op.lease].keys.add(op.key)
                events.append(WatchEvent(EventType.PUT, kv))
            else:
                if isinstance(op, Delete):
                    keys = [op.key] if op.key in self._data else []
                else:
                    assert isinstance(op, DeletePrefix)
                    end = prefix_end(op.prefix)
                    keys = sorted(key for key in self._data if op.prefix <= key < end)
                for key in keys:
                    old = self._data.pop(key)
                    if old.lease and old.lease in self._leases:
                        self._leases[old.lease].keys.discard(key)
                    events.append(WatchEvent(EventType.DELETE, KeyValue(key, b"", 0, revision)))
                deleted += len(keys)
        if events:
            self.revision = revision
            self._history.append((revision, tuple(events)))
            self._notify(events)
        return deleted

    def _notify(self, events: Sequence[WatchEvent]) -> None:
        for watch in list(self._watches):
            if not watch.active or watch.silent:
                continue
            mine = [event for event in events if watch.covers(event.kv.key)]
            if mine:
                watch.on_events(mine)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> Deferred[int]:
        return self.txn([], [Put(key, value, lease)]).addCallback(lambda r: r.revision)

    def delete(self, key: bytes) -> Deferred[int]:
        return self._answer(lambda: self._write([Delete(key)]))

    def delete_prefix(self, prefix: bytes) -> Deferred[int]:
        return self._answer(lambda: self._write([DeletePrefix(prefix)]))

    # -- watches -------------------------------------------------------------------------------

    def watch(
        self, prefix: bytes, start_revision: int, on_events: OnEvents, on_lost: OnLost
    ) -> _Watch:
        watch = _Watch(self, prefix, prefix_end(prefix), on_events, on_lost)
        if self.unavailable:
            watch.active = False
            on_lost(ControlPlaneUnavailableError("no etcd member answered (the double is down)"))
            return watch
        if start_revision < self.compact_revision:
            watch.active = False
            on_lost(
                CompactedError(
                    f"revision {start_revision} has been compacted (to {self.compact_revision})",
                    self.compact_revision,
                )
            )
            return watch
        self._watches[watch] = None
        first = bisect.bisect_left(self._history, start_revision, key=lambda entry: entry[0])
        past = [
            event
            for _, events in self._history[first:]
            for event in events
            if watch.covers(event.kv.key)
        ]
        if past:
            on_events(past)
        return watch

    # -- leases --------------------------------------------------------------------------------

    def grant(self, ttl_seconds: int) -> Deferred[int]:
        def grant() -> int:
            lease = self._next_lease
            self._next_lease += 1
            expiry = self._clock.callLater(ttl_seconds, self._expire, lease)
            self._leases[lease] = _Lease(ttl_seconds, expiry)
            return lease

        return self._answer(grant)

    def keepalive(self, lease: int) -> Deferred[int]:
        def keepalive() -> int:
            found = self._leases.get(lease)
            if found is None:
                return 0
            found.expiry.reset(found.ttl)
            return found.ttl

        return self._answer(keepalive)

    def revoke(self, lease: int) -> Deferred[None]:
        def revoke() -> None:
            found = self._leases.get(lease)
            if found is None:
                raise LeaseNotFoundError(f"lease {lease} not found")
            found.expiry.cancel()
            self._expire(lease)

        return self._answer(revoke)

    def _expire(self, lease: int) -> None:
        found = self._leases.pop(lease)
        self._write([Delete(key) for key in sorted(found.keys)])

    def close(self) -> Deferred[None]:
        """Nothing to release: the store stays usable, as other clients may share it."""
        return succeed(None)

    def stop(self) -> None:
        """Cancel every lease's timer (the leases are gone), for a test's clean shutdown."""
        for lease in self._leases.values():
            if lease.expiry.active():
                lease.expiry.cancel()
        self._leases.clear()
