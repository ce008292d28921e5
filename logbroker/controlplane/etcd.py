"""The control plane of a cluster, in etcd (DESIGN section 7), behind the same interface.

Key layout under the cluster prefix (say ``/logbroker/<cluster>/``); each value is the same JSON
object as that entity's entry in the local state file (``_format``), canonically serialized::

    topics/<name>
    ranges/<range id>
    segments/<range id>/<base offset, 20 digits>
    users/<name>
    acls/<user>/<operation>/<pattern>
    positions/<topic>/<group>

Reads come from a cache: a ``ControlState`` loaded by one range of the prefix, then kept up to
date by a watch from the revision of that range, both by a ``PrefixFollower``: a watch that ends
is resumed from the last revision seen + 1 (through the store, which picks a live member); a
compacted revision forces a full reload, never a silent gap.

A change is checked at once against the state as it will be once the changes asked for before it
are done (as with the local control plane), then queued. Changes go to etcd one transaction at a
time, in order; a run of queued group commits, or of segment records, shares one transaction
(group commit, as the local control plane does), other changes go one per transaction. A
transaction compares what its changes depend on: that new keys are absent, that the keys they
change or delete and the ones they rely on (the range of a new segment, the user of a grant, the
topic of a group position) are at the revisions the cache holds. A change to a segment that
exists compares only the segment's own key: a range record is never deleted (topics are not), so
a segment still at the revision the cache holds has its range, and a transaction carries twice
as many claims. The writes are the difference between the cached state and the state
``change.apply`` makes of it, so the rules live in one place (``_state``). A user's grants are
deleted by prefix, so a grant racing with the deletion cannot outlive the user.

When a compare fails, another node got there first: the change waits until the cache has seen
what the store holds for the compared keys, is applied again to that state (which may now raise
the typed error: ``AlreadyExistsError`` for the loser of a race to create a topic) and retried,
up to ``MAX_ATTEMPTS`` times (then ``ContendedError``). A segment change that names the record
it expects (``put_segment(..., expected=)``) is a compare-and-swap on etcd's own revision of
the segment's key: it is applied only if the cache holds exactly that record when the
transaction is made, and the transaction compares the key's revision in etcd to the cache's; so
if another node changed the segment meanwhile (even to the same epoch), the change fails
(``InvalidChangeError``) rather than overwrite it, and of two nodes claiming an epoch one wins.
A change's Deferred fires once the watch has brought its revision into the cache, so the node
that made a change reads it at once; if the watch has not brought it within
``CATCH_UP_SECONDS``, the follower loads the whole prefix again (the watch may have gone silent).

When no member answers, the change fails with ``ControlPlaneUnavailableError`` (reason
``unreachable``), and so does every change queued behind it (they were checked against a state
that now will not be). When a transaction's answer is lost (a timeout, a member dying), it is
sent again, which its compares make safe: if the first took effect, the second fails its
compares and finds the change's writes in place. Only if that cannot be told does the change
fail with ``OutcomeUnknownError``: it may or may not have taken effect.
"""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, assert_never

import attrs
from immutables import MapMutation
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from logbroker.controlplane import _format
from logbroker.controlplane._interface import ControlPlane
from logbroker.controlplane._kv import (
    Compare,
    Delete,
    DeletePrefix,
    EventType,
    Get,
    KeyValue,
    KeyValueStore,
    Operation,
    Put,
    RangeResult,
    TxnResult,
    WatchEvent,
)
from logbroker.controlplane._model import AclGrant, Range, SegmentMeta, Topic, User
from logbroker.controlplane._reads import StateControlPlane
from logbroker.controlplane._state import (
    Change,
    CommitGroupPosition,
    ControlState,
    CreateTopic,
    CreateUser,
    DeleteSegment,
    DeleteUser,
    GrantAcl,
    PutSegment,
    PutSegments,
    RevokeAcl,
    UpdateUser,
)
from logbroker.controlplane.errors import (
    ContendedError,
    ControlPlaneClosedError,
    ControlPlaneError,
    ControlPlaneUnavailableError,
    OutcomeUnknownError,
    StateFileError,
)
from logbroker.controlplane.follower import Expectation, PrefixFollower

log = Logger()

_K = TypeVar("_K")
_V = TypeVar("_V")

#: How often a change is tried when other nodes keep changing what it depends on.
MAX_ATTEMPTS = 5
#: How often a transaction whose answer was lost is sent again to find out whether it took
#: effect, while no member answers (a member that died with the answer may have been the
#: leader: the others answer only once they have elected another, within a few election
#: timeouts), and how long apart.
RESOLVE_ATTEMPTS = 6
RESOLVE_RETRY_SECONDS = 0.5
#: The most keys one transaction compares: etcd takes at most 128 compares, and as many writes
#: (``--max-txn-ops``). A group commit or a new segment's record compares two keys (its own and
#: its topic's or range's) and writes one; a change to a segment that exists compares one.
MAX_TXN_COMPARES = 128
#: The changes that go out together when they are queued right behind one another: group
#: commits, and segment records (a node back from an outage joins the replica sets of hundreds
#: of sealed segments at once; one transaction each, each waiting for the one before, made its
#: catch-up wait on etcd's round trips). A ``PutSegments`` goes with ``PutSegment`` changes.
_BATCHED = (CommitGroupPosition, PutSegment, PutSegments)
#: How long a change that took effect may wait for the watch to bring it back before the cache
#: is reloaded: a watch on a member cut off without a word (no reset, no "no leader") delivers
#: nothing and never ends, and a change must not wait on it for ever.
CATCH_UP_SECONDS = 5.0

_MISSING: Any = object()


def _nothing(_: object) -> None:
    return None


class _Keys:
    """The key of each entity under one cluster prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.encode()

    def _key(self, *parts: str) -> bytes:
        return self.prefix + "/".join(parts).encode()

    def topic(self, name: str) -> bytes:
        return self._key("topics", name)

    def range(self, range_id: str) -> bytes:
        return self._key("ranges", range_id)

    def segment(self, range_id: str, base_offset: int) -> bytes:
        # Zero-padded, so keys sort by offset.
        return self._key("segments", range_id, f"{base_offset:020d}")

    def user(self, name: str) -> bytes:
        return self._key("users", name)

    def user_acls(self, user: str) -> bytes:
        return self._key("acls", user, "")

    def acl(self, grant: AclGrant) -> bytes:
        return self._key("acls", grant.user, grant.operation, grant.pattern)

    def position(self, topic: str, group: str) -> bytes:
        # Topic names hold no "/", so the group (which may) is everything after it.
        return self._key("positions", topic, group)


def _value(record: dict[str, Any]) -> bytes:
    return _format.canonical(record)


def _changed(old: Mapping[_K, _V], new: Mapping[_K, _V]) -> Iterator[tuple[_K, _V | None]]:
    """``(key, new value or None if removed)`` for each key whose value differs."""
    if old is new:
        return
    for key, value in new.items():
        # Most values are the very objects they were (a change copies the mapping, not what
        # it holds): told apart by identity first, without comparing their contents.
        found = old.get(key, _MISSING)
        if found is not value and found != value:
            yield key, value
    for key in old:
        if key not in new:
            yield key, None


def _segment_puts(change: Change) -> tuple[PutSegment, ...]:
    """The segment records ``change`` puts (none for a change of anything else)."""
    if isinstance(change, PutSegments):
        return change.puts
    return (change,) if isinstance(change, PutSegment) else ()


@attrs.define
class _Named:
    """The keys of the cluster-sized mappings (topics, ranges, segments, group positions) that
    a batch of changes may change: each kind of change names its own. A transaction's writes
    are looked for among them, not among every range of the cluster (tens of thousands, for
    every transaction). Users and grants are few, and compared whole."""

    topics: set[str] = attrs.Factory(set)
    ranges: set[str] = attrs.Factory(set)
    segments: set[str] = attrs.Factory(set)
    positions: set[tuple[str, str]] = attrs.Factory(set)

    @classmethod
    def by(cls, changes: Sequence[Change]) -> _Named:
        named = cls()
        for change in changes:
            if isinstance(change, CreateTopic):
                named.topics.add(change.topic.name)
                named.ranges.update(range_.range_id for range_ in change.ranges)
            elif isinstance(change, DeleteSegment):
                named.segments.add(change.range_id)
            elif isinstance(change, (PutSegment, PutSegments)):
                named.segments.update(put.meta.range_id for put in _segment_puts(change))
            elif isinstance(change, CommitGroupPosition):
                named.positions.add((change.topic, change.group))
            elif not isinstance(change, (CreateUser, UpdateUser, DeleteUser, GrantAcl, RevokeAcl)):
                # Every kind of change is one of the above: a new kind must say what it names.
                assert_never(change)
        return named


def _changed_among(
    old: Mapping[_K, _V], new: Mapping[_K, _V], keys: set[_K]
) -> Iterator[tuple[_K, _V | None]]:
    """``_changed``, among ``keys`` only (in their order)."""
    if old is new:
        return
    for key in sorted(keys):  # type: ignore[type-var]  # str or tuples of str
        found = old.get(key, _MISSING)
        value = new.get(key, _MISSING)
        if found is not value and found != value:
            yield key, None if value is _MISSING else value


def _batch_kind(change: Change) -> type | None:
    """The kind of changes ``change`` goes out with in one transaction (``None``: alone)."""
    kind = type(change)
    if kind not in _BATCHED:
        return None
    return PutSegment if _segment_puts(change) else kind


def _compares(change: Change) -> int:
    """The most keys ``change`` compares (and at least as many as it writes), as a share of one
    transaction: two per group commit or new segment record, one per change to a segment record
    it names as expected (a claim, a seal: the record exists, see ``_plan``)."""
    puts = _segment_puts(change)
    if not puts:
        return 2
    return sum(1 if isinstance(put.expected, SegmentMeta) else 2 for put in puts)


def _landed(operations: Sequence[Operation], found: Mapping[bytes, KeyValue | None]) -> bool:
    """Whether the store holds what ``operations`` write, all put at one revision."""
    revisions = set()
    for op in operations:
        kv = found.get(op.key) if isinstance(op, (Put, Delete)) else None
        if isinstance(op, Put):
            if kv is None or kv.value != op.value:
                return False
            revisions.add(kv.mod_revision)
        elif isinstance(op, Delete) and kv is not None:
            return False
    return len(revisions) <= 1


class _Working:
    """A state being brought up to date by watch events: a mutation of each persistent map it
    touches, and a copy of each range's segments it touches."""

    def __init__(self, state: ControlState) -> None:
        self.state = state
        self.topics: MapMutation[str, Topic] | None = None
        self.ranges: MapMutation[str, Range] | None = None
        self.segments: dict[str, dict[int, SegmentMeta]] = {}
        self.users: MapMutation[str, User] | None = None
        self.acls: MapMutation[str, frozenset[AclGrant]] | None = None
        self.positions: MapMutation[tuple[str, str], str] | None = None

    def _topics(self) -> MapMutation[str, Topic]:
        if self.topics is None:
            self.topics = self.state.topics.mutate()
        return self.topics

    def _ranges(self) -> MapMutation[str, Range]:
        if self.ranges is None:
            self.ranges = self.state.ranges.mutate()
        return self.ranges

    def _segments(self, range_id: str) -> dict[int, SegmentMeta]:
        if range_id not in self.segments:
            self.segments[range_id] = dict(self.state.segments.get(range_id, {}))
        return self.segments[range_id]

    def _users(self) -> MapMutation[str, User]:
        if self.users is None:
            self.users = self.state.users.mutate()
        return self.users

    def _acls(self) -> MapMutation[str, frozenset[AclGrant]]:
        if self.acls is None:
            self.acls = self.state.acls.mutate()
        return self.acls

    def _positions(self) -> MapMutation[tuple[str, str], str]:
        if self.positions is None:
            self.positions = self.state.positions.mutate()
        return self.positions

    def apply(self, relative: str, value: bytes | None) -> bool:
        """Record ``value`` (``None``: deleted) at the key ``relative`` to the prefix; false for
        a key that is not the control plane's."""
        kind, _, rest = relative.partition("/")
        record = None if value is None else json.loads(value)
        # Entities kept by name alone: their mapping (copied on first change), and the decoder.
        by_name: dict[str, tuple[Callable[[], MapMutation[str, Any]], Callable[[Any], Any]]] = {
            "topics": (self._topics, _format.topic_from_record),
            "ranges": (self._ranges, _format.range_from_record),
            "users": (self._users, _format.user_from_record),
        }
        if kind in by_name:
            mapping, decode = by_name[kind]
            if record is None:
                mapping().pop(rest, None)
            else:
                mapping()[rest] = decode(record)
        elif kind == "segments":
            range_id, _, base = rest.partition("/")
            if record is None:
                self._segments(range_id).pop(int(base), None)
            else:
                self._segments(range_id)[int(base)] = _format.segment_from_record(record)
        elif kind == "acls":
            user, _, grant_part = rest.partition("/")
            operation, _, pattern = grant_part.partition("/")
            acls = self._acls()
            grants = acls.get(user, frozenset())
            if record is None:
                grants -= {AclGrant(user, operation, pattern)}
            else:
                grants |= {_format.grant_from_record(record)}
            if grants:
                acls[user] = grants
            else:
                acls.pop(user, None)
        elif kind == "positions":
            topic, _, group = rest.partition("/")
            if record is None:
                self._positions().pop((topic, group), None)
            else:
                key, cursor = _format.position_from_record(record)
                self._positions()[key] = cursor
        else:
            return False
        return True

    def finish(self) -> ControlState:
        changes: dict[str, Any] = {}
        for name in ("topics", "ranges", "users", "acls", "positions"):
            mutation = getattr(self, name)
            if mutation is not None:
                changes[name] = mutation.finish()
        if self.segments:
            segments = self.state.segments.mutate()
            for range_id, inner in self.segments.items():
                # No empty entries, as in the state file: equal states compare equal.
                if inner:
                    segments[range_id] = inner
                else:
                    segments.pop(range_id, None)
            changes["segments"] = segments.finish()
        return attrs.evolve(self.state, **changes) if changes else self.state


@attrs.define
class _Queued:
    change: Change
    done: Deferred[ControlState]


@attrs.frozen
class _Wanted:
    """What a change waits for the cache to show: true at the latest once the cache is at
    ``revision``."""

    revision: int
    ready: Callable[[], bool]


@attrs.define
class _Waiter:
    wanted: _Wanted
    done: Deferred[None]
    #: The cache is reloaded if the watch has not brought ``wanted.revision`` in time.
    catch_up: Expectation


class EtcdControlPlane(StateControlPlane):
    """A ``ControlPlane`` in a ``KeyValueStore`` (etcd) under ``prefix``; ``clock`` schedules
    watch resumption and reloads."""

    def __init__(self, store: KeyValueStore, *, prefix: str, clock: IReactorTime) -> None:
        super().__init__()
        if not prefix.endswith("/"):
            prefix += "/"
        self.prefix = prefix
        self._store = store
        self._clock = clock
        self._keys = _Keys(prefix)
        #: What reads see: the store's state under the prefix at ``_revision``.
        self._state: ControlState | None = None
        #: mod revision of each key the cache holds, for compares.
        self._revisions: dict[bytes, int] = {}
        self._revision = 0
        #: The cache with every queued change applied; meaningful only while ``_queue`` is not
        #: empty (when it is, that is the cache itself).
        self._pending = ControlState()
        #: The cache ``_pending`` was made from, and how many changes had left the queue then.
        #: While both are as they are now, what ``_pending`` refuses is refused; once either
        #: has changed, it is checked again on the cache as it is.
        self._pending_from: tuple[ControlState, int] | None = None
        self._queue: collections.deque[_Queued] = collections.deque()
        #: How many changes have left the queue (sent, or failed with it).
        self._sent = 0
        self._sending = False
        self._waiters: list[_Waiter] = []
        self._follower = PrefixFollower(
            store,
            self._keys.prefix,
            clock,
            name="Control plane",
            on_load=self._loaded,
            on_events=self._on_events,
        )
        self._closing = False
        self._closed = False
        self._close_waiters: list[Deferred[None]] = []
        self._load_waiters: list[Deferred[None]] = []

    @property
    def loaded(self) -> bool:
        """Whether the cache has been loaded (``start`` has fired): reads work from then on."""
        return self._state is not None

    def when_loaded(self) -> Deferred[None]:
        """Fires once the cache has been loaded (at once if it has)."""
        if self.loaded:
            return succeed(None)
        waiter: Deferred[None] = Deferred()
        self._load_waiters.append(waiter)
        return waiter

    @property
    def following(self) -> bool:
        """Whether the cache follows etcd now (its watch runs): when it does not (etcd was out
        of reach, and the watch is not resumed yet), what it shows may be stale."""
        return self._follower.watching

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> Deferred[None]:
        """Load every key under the prefix, then follow the prefix from that revision on;
        fails if the first load does (no member answered, or etcd holds an unreadable
        state)."""
        return self._follower.start(retry_first_load=False)

    def _loaded(self, result: RangeResult) -> None:
        working = _Working(ControlState())
        revisions: dict[bytes, int] = {}
        try:
            for kv in result.kvs:
                if working.apply(self._relative(kv.key), kv.value):
                    revisions[kv.key] = kv.mod_revision
        except (KeyError, TypeError, ValueError) as e:
            raise StateFileError(
                f"etcd holds an invalid control state under {self.prefix} ({e!r}); restore it "
                "from a backup (etcdctl snapshot restore)"
            ) from e
        before, self._state = self._state, working.finish()
        self._revisions = revisions
        self._revision = result.revision
        log.info(
            "Control plane loaded from etcd under {prefix} at revision {revision}: {topics} "
            "topics, {users} users",
            prefix=self.prefix,
            revision=result.revision,
            topics=len(self._state.topics),
            users=len(self._state.users),
        )
        self._view_replaced(before, self._state)
        self._wake()
        waiters, self._load_waiters = self._load_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    def _relative(self, key: bytes) -> str:
        return key[len(self._keys.prefix) :].decode()

    def close(self) -> Deferred[None]:
        """Refuse further changes; once the queued ones are settled, stop watching."""
        if self._closed:
            return succeed(None)
        self._closing = True
        closed: Deferred[None] = Deferred()
        self._close_waiters.append(closed)
        self._maybe_finish_close()
        return closed

    def _maybe_finish_close(self) -> None:
        if not self._closing or self._closed or self._sending or self._queue:
            return
        self._closed = True
        self._follower.stop()
        waiters, self._close_waiters = self._close_waiters, []
        for closed in waiters:
            closed.callback(None)

    # -- following the store -------------------------------------------------------------------

    def _on_events(self, events: Sequence[WatchEvent]) -> None:
        assert self._state is not None
        working = _Working(self._state)
        for event in events:
            kv = event.kv
            value = kv.value if event.type is EventType.PUT else None
            try:
                ours = working.apply(self._relative(kv.key), value)
            except (KeyError, TypeError, ValueError) as e:
                log.error(
                    "Ignored an invalid control plane entry {key} at revision {revision} "
                    "({error!r}); another node wrote something this one cannot read",
                    key=kv.key,
                    revision=kv.mod_revision,
                    error=e,
                )
                ours = False
            if ours and value is not None:
                self._revisions[kv.key] = kv.mod_revision
            else:
                self._revisions.pop(kv.key, None)
            self._revision = max(self._revision, kv.mod_revision)
        before, self._state = self._state, working.finish()
        self._view_replaced(before, self._state, touched=working.segments.keys())
        self._wake()

    def _until(self, wanted: _Wanted) -> Deferred[None]:
        """Fire once the cache makes ``wanted.ready()`` true."""
        if wanted.ready():
            return succeed(None)
        done: Deferred[None] = Deferred()
        catch_up = self._follower.expect(wanted.revision, CATCH_UP_SECONDS)
        self._waiters.append(_Waiter(wanted, done, catch_up))
        return done

    def _wake(self) -> None:
        ready = [waiter for waiter in self._waiters if waiter.wanted.ready()]
        if ready:
            self._waiters = [waiter for waiter in self._waiters if waiter not in ready]
            for waiter in ready:
                waiter.catch_up.cancel()
                waiter.done.callback(None)

    # -- reads ---------------------------------------------------------------------------------

    def _read(self) -> ControlState:
        if self._state is None:
            raise ControlPlaneClosedError(f"the control plane under {self.prefix} is not started")
        return self._state

    # -- the writer ----------------------------------------------------------------------------

    def _submit(self, change: Change) -> Deferred[ControlState]:
        """Check ``change`` and queue it; fire, once it is in the cache, with the state as it
        left it."""
        if self._state is None or self._closing:
            state = "closing" if self._closing else "not started"
            return fail(
                ControlPlaneClosedError(f"the control plane under {self.prefix} is {state}")
            )
        try:
            if self._queue:
                self._pending = change.apply(self._pending)
            else:
                self._pending = change.apply(self._state)
                self._pending_from = (self._state, self._sent)
        except ControlPlaneError:
            if not self._queue or self._pending_is_fresh():
                return fail()
            # Under a steady stream of changes the queue does not empty, and ``_pending``
            # misses what other nodes did since it was made (a topic another node created).
            # Decided again on the cache as it is now.
            self._refresh_pending()
            try:
                self._pending = change.apply(self._pending)
            except ControlPlaneError:
                return fail()
        done: Deferred[ControlState] = Deferred()
        self._queue.append(_Queued(change, done))
        if not self._sending:
            Deferred.fromCoroutine(self._send_queued())
        return done

    def _pending_is_fresh(self) -> bool:
        """Whether ``_pending`` is the cache as it is now with the queue applied. A node
        giving up thousands of ranges in one turn queues thousands of changes; applying the
        whole queue again for each of its claims refused meanwhile took its reactor for
        seconds, until its membership lease ran out."""
        made = self._pending_from
        return made is not None and made[0] is self._state and made[1] == self._sent

    def _refresh_pending(self) -> None:
        """``_pending`` made anew: the cache as it is now, with every queued change that still
        applies to it."""
        state = self._read()
        self._pending_from = (state, self._sent)
        for queued in self._queue:
            try:
                state = queued.change.apply(state)
            except ControlPlaneError:
                continue
        self._pending = state

    async def _send_queued(self) -> None:
        self._sending = True
        try:
            while self._queue:
                batch = self._next_batch()
                outcomes: Sequence[ControlState | Exception]
                try:
                    outcomes = await self._send([queued.change for queued in batch])
                except ControlPlaneUnavailableError as e:
                    self._fail_queue(e, len(batch))
                    continue
                except ControlPlaneError as e:
                    outcomes = [e] * len(batch)
                except Exception as e:
                    log.failure("A control plane change under {prefix} failed", prefix=self.prefix)
                    outcomes = [e] * len(batch)
                for queued, outcome in zip(batch, outcomes, strict=True):
                    self._queue.popleft()
                    self._sent += 1
                    if isinstance(outcome, ControlState):
                        queued.done.callback(outcome)
                    else:
                        queued.done.errback(outcome)
        finally:
            self._sending = False
        self._maybe_finish_close()

    def _next_batch(self) -> list[_Queued]:
        """The head of the queue, with the changes of its kind right behind it if it is a
        kind that batches: they go out in one transaction (group commit, as the local control
        plane does). Each is decided on the state the ones before it leave, as if sent alone,
        and one refused does not stop the others."""
        batch = [self._queue[0]]
        kind = _batch_kind(batch[0].change)
        if kind is None:
            return batch
        compares = _compares(batch[0].change)
        for queued in itertools.islice(self._queue, 1, None):
            compares += _compares(queued.change)
            if _batch_kind(queued.change) is not kind or compares > MAX_TXN_COMPARES:
                break
            batch.append(queued)
        return batch

    def _fail_queue(self, error: ControlPlaneUnavailableError, tried: int) -> None:
        failed, self._queue = self._queue, collections.deque()
        self._sent += len(failed)
        log.warn(
            "etcd did not take {count} control plane changes under {prefix}: {error}",
            count=len(failed),
            prefix=self.prefix,
            error=str(error),
        )
        for _ in range(tried):
            failed.popleft().done.errback(error)
        for queued in failed:
            queued.done.errback(
                ControlPlaneUnavailableError(
                    f"{error} (for a change asked for before this one, so this change was not "
                    "tried; retry it)"
                )
            )

    async def _send(self, changes: Sequence[Change]) -> list[ControlState | ControlPlaneError]:
        """Make ``changes`` in the store, in one transaction; return, for each, the state as
        it left the cache's, or the typed error that refused it."""
        for _ in range(MAX_ATTEMPTS):
            before = after = self._read()
            outcomes: list[ControlState | ControlPlaneError] = []
            for change in changes:
                try:
                    after = change.apply(after)
                except ControlPlaneError as e:
                    outcomes.append(e)
                else:
                    outcomes.append(after)
            made = [
                c for c, o in zip(changes, outcomes, strict=True) if isinstance(o, ControlState)
            ]
            compares, operations = self._plan(made, before, after)
            if not operations:
                # They change nothing (granting a grant that exists): nothing to write.
                return outcomes
            gets = [Get(compare.key) for compare in compares]
            try:
                result = await self._store.txn(compares, operations, gets)
            except OutcomeUnknownError as unknown:
                result = await self._resolve(unknown, compares, operations, gets)
            if result.succeeded:
                await self._until(self._reached(result.revision))
                return outcomes
            # Another node changed what these changes depend on: wait until the cache shows
            # what the store held then, and decide again on that.
            await self._until(self._agrees(result.revision, compares, result.gets))
        raise ContendedError(
            f"gave up on {type(changes[0]).__name__} under {self.prefix} after {MAX_ATTEMPTS} "
            "attempts: other nodes kept changing what it depends on; retry it"
        )

    async def _resolve(
        self,
        unknown: OutcomeUnknownError,
        compares: list[Compare],
        operations: list[Operation],
        gets: list[Get],
    ) -> TxnResult:
        """Find out whether a transaction whose answer was lost took effect, by sending it
        again (to another member): its compares make that safe. If the first one took effect,
        the second fails its compares and finds this change's writes in place. While no member
        answers (or an answer is lost again) it is sent again ``RESOLVE_RETRY_SECONDS`` later,
        ``RESOLVE_ATTEMPTS`` times in all: the member that died with the answer may have led,
        and the others answer only once they elected another."""
        log.warn(
            "Lost the answer to a control plane transaction under {prefix} ({error}); "
            "sending it again to find out whether it took effect",
            prefix=self.prefix,
            error=str(unknown),
        )
        again = None
        for attempt in range(RESOLVE_ATTEMPTS):
            if attempt:
                await deferLater(self._clock, RESOLVE_RETRY_SECONDS, lambda: None)
            try:
                again = await self._store.txn(compares, operations, gets)
                break
            except ControlPlaneUnavailableError:
                # No member answers yet: a killed leader's successor is being elected.
                continue
        if again is None:
            raise unknown
        if again.succeeded:
            return again
        found = dict(zip((compare.key for compare in compares), again.gets, strict=True))
        if not _landed(operations, found):
            raise unknown
        # It did: once the cache shows the keys as the store had them, this change is done.
        await self._until(self._agrees(again.revision, compares, again.gets))
        return attrs.evolve(again, succeeded=True, revision=0)

    def _reached(self, revision: int) -> _Wanted:
        return _Wanted(revision, lambda: self._revision >= revision)

    def _agrees(
        self, revision: int, compares: Sequence[Compare], found: Sequence[KeyValue | None]
    ) -> _Wanted:
        def ready() -> bool:
            if self._revision >= revision:
                return True
            return all(
                self._revisions.get(compare.key, 0) == (0 if kv is None else kv.mod_revision)
                for compare, kv in zip(compares, found, strict=True)
            )

        return _Wanted(revision, ready)

    def _plan(
        self, changes: Sequence[Change], before: ControlState, after: ControlState
    ) -> tuple[list[Compare], list[Operation]]:
        """The compares and writes that turn ``before`` into ``after`` (what ``changes`` made
        of it) in the store, and only in the state ``before`` is."""
        keys = self._keys
        compares: dict[bytes, Compare] = {}
        operations: list[Operation] = []

        revisions = self._revisions

        def guard(key: bytes) -> None:
            revision = revisions.get(key, 0)
            compares[key] = Compare.unchanged(key, revision) if revision else Compare.absent(key)

        def write(key: bytes, record: dict[str, Any] | None) -> None:
            guard(key)
            operations.append(Delete(key) if record is None else Put(key, _value(record)))

        named = _Named.by(changes)
        for name, new_topic in _changed_among(before.topics, after.topics, named.topics):
            record = None if new_topic is None else _format.topic_record(new_topic)
            write(keys.topic(name), record)
        for range_id, range_ in _changed_among(before.ranges, after.ranges, named.ranges):
            write(keys.range(range_id), None if range_ is None else _format.range_record(range_))
        for range_id, _ in _changed_among(before.segments, after.segments, named.segments):
            old = before.segments.get(range_id, {})
            new = after.segments.get(range_id, {})
            for base, meta in _changed(old, new):
                record = None if meta is None else _format.segment_record(meta)
                write(keys.segment(range_id, base), record)
        for name, user in _changed(before.users, after.users):
            write(keys.user(name), None if user is None else _format.user_record(user))
        for name, user in _changed(before.users, after.users):
            if user is None:
                # By prefix, and whatever the cache holds: a grant another node made before
                # this deletion goes too (one made after fails its compare on the user).
                operations.append(DeletePrefix(keys.user_acls(name)))
        for name, _ in _changed(before.acls, after.acls):
            if name in before.users and name not in after.users:
                continue
            old_grants = before.acls.get(name, frozenset())
            new_grants = after.acls.get(name, frozenset())
            for grant in sorted(new_grants - old_grants, key=keys.acl):
                write(keys.acl(grant), _format.grant_record(grant))
            for grant in sorted(old_grants - new_grants, key=keys.acl):
                write(keys.acl(grant), None)
        for (topic, group), cursor in _changed_among(
            before.positions, after.positions, named.positions
        ):
            record = None if cursor is None else _format.position_record(topic, group, cursor)
            write(keys.position(topic, group), record)
        # What the changes rely on without changing it.
        for change in changes:
            for put in _segment_puts(change):
                # A segment the store holds at the compared revision has its range (range
                # records are never deleted); only a new one relies on the range's record.
                if not revisions.get(keys.segment(put.meta.range_id, put.meta.base_offset)):
                    guard(keys.range(put.meta.range_id))
            if isinstance(change, GrantAcl):
                guard(keys.user(change.grant.user))
            elif isinstance(change, CommitGroupPosition):
                guard(keys.topic(change.topic))
        return list(compares.values()), operations


if TYPE_CHECKING:
    # mypy proves here that EtcdControlPlane implements the whole ControlPlane interface.
    _implements: type[ControlPlane] = EtcdControlPlane
