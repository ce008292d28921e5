"""Sessions valid on every node: each node's ``SessionStore`` published to, and kept from, etcd.

Keys, under the cluster's prefix (``/logbroker/<cluster id>/``)::

    sessions/<hex SHA-256 of the token>   JSON: user, client_ip, origin, created_ms, expires_ms,
                                          under a lease that outlives expires_ms
    sessions/revoked/<user>               JSON: revoked_ms, under a lease that outlives every
                                          session opened before it

The token itself never leaves the node that made it; the others know a session by its key, and
validating it there hands back the token presented (it hashes to the key). Validation stays a
synchronous lookup in the local ``SessionStore``, with its expiry and hijack semantics and its
counters: a session adopted from etcd is stored like a local one, so a node reports an expired or
hijacked token it learnt from etcd exactly as one it made, and counts it itself.

Writing. ``SessionStore``'s hooks queue what to publish: a created session (a put), the keys of
revoked ones (deletes), a user's revocation (a ``revoked/<user>`` marker). One transaction at a
time carries everything queued (up to ``MAX_OPS`` operations), so a burst of logins costs a few
etcd round trips, not one each. Nothing waits for etcd: ``create`` returns at once and the
session is valid on this node at once; on the others once the write and their watch have gone
round (``login`` waits for that write, at most ``write_wait_sec``, for callers that want the
session valid everywhere before they answer).

Which sessions: both origins, by default. Dashboard sessions must be (the browser's next request
may reach any node). Client-port sessions are what a producer resumes with (``auth`` by token)
after its connection moved to another node, which a cluster makes common; a fleet logging in on
every connection costs etcd at most one transaction per round trip whatever the login rate,
since writes are batched, plus each node's memory for the whole cluster's sessions (a few
hundred bytes each, bounded by ``MAX_SESSIONS_PER_USER`` per user and origin as before, a
bound that now holds for the cluster rather than for each node). A deployment that finds that
too much passes ``origins={Origin.DASHBOARD}``.

Leases: one per node per expiry bucket (``lease_bucket_sec`` of expiry times), not one per
session: a lease per session would double the writes of a login (a grant, then the put) and
leave etcd with as many leases as sessions to expire and checkpoint. A bucket's lease runs out
at the bucket's end, ``KEPT_EXPIRED_SEC`` to ``KEPT_EXPIRED_SEC + lease_bucket_sec`` after the
sessions under it expire (etcd's TTLs are whole seconds; rounded up). Every node treats a
session as expired at ``expires_ms`` (its own validation, as for a local session), whether or
not the key is still there; the margin lets a node whose clock lags a little still report an
expired token as expired rather than unknown. Leases are never revoked when a node stops: its
sessions stay valid on the others until they expire. (An etcd leader change restarts the TTL
of leases nobody keeps alive unless etcd checkpoints them: a key may then linger longer, still
treated as expired by every node.)

Revocation. ``revoke`` and ``revoke_user`` on any node delete the keys of the sessions that node
knows, and the others forget them when their watch sees the deletes. ``revoke_user`` also puts
the user's ``revoked/`` marker: every node drops the user's sessions opened at or before it,
including those it has not published yet (etcd was unreachable from it), and ignores such
sessions should they be written later; the marker lives as long as a session can, so that a
session opened elsewhere before a password change cannot come back. (Nodes compare their own
clocks: a session opened within the clocks' skew of the revocation may fall on either side.)

Reading. Every node follows the prefix with a ``PrefixFollower``: it ranges the prefix, then
watches it from the next revision; a lost watch resumes from the last revision seen (every
``retry_interval_sec``), a compacted one reloads the whole prefix, and a reload forgets the
shared sessions that are no longer in etcd.

etcd unreachable: logins go on, their sessions valid on this node only, queued (bounded by the
store itself: a queued session that ends is dropped from the queue) and written once etcd
answers; sessions already known validate as before. A ``PeriodicTask`` retries the writes every
``retry_interval_sec``; the trouble is logged once when it starts and once when it ends.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from typing import Any, cast

import attrs
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker._deferreds import gather
from logbroker.controlplane._kv import (
    Delete,
    EventType,
    KeyValueStore,
    Operation,
    Put,
    RangeResult,
    TxnResult,
    WatchEvent,
)
from logbroker.controlplane.errors import ControlPlaneError, LeaseNotFoundError
from logbroker.controlplane.follower import PrefixFollower
from logbroker.maintenance.periodic import PeriodicTask, TaskMetrics
from logbroker.security.sessions import Origin, Session, SessionStore, session_key

log = Logger()

#: The operations of one transaction, below etcd's default ``--max-txn-ops`` (128).
MAX_OPS = 100
#: The width of a lease's expiry bucket.
LEASE_BUCKET_SEC = 60
#: How long at least a session's key outlives the session, so that a node whose clock lags a
#: little still finds it at its expiry and reports it expired, not unknown. With the bucket, a
#: key outlives its session by 10 to 70 s.
KEPT_EXPIRED_SEC = 10
#: How often a node retries what etcd did not take, and resumes a lost watch.
RETRY_INTERVAL_SEC = 1.0
#: How long ``login`` waits for its session to reach etcd.
WRITE_WAIT_SEC = 0.5

_REVOKED = b"revoked/"


def encode_session(session: Session) -> bytes:
    """The value of a session's key: everything but the token."""
    document = {
        "user": session.user,
        "client_ip": session.client_ip,
        "origin": session.origin.value,
        "created_ms": session.created_ms,
        "expires_ms": session.expires_ms,
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def decode_session(data: bytes) -> Session:
    """A session from its key's value, its token unknown (``""``); ``ValueError`` if malformed."""
    try:
        document: dict[str, Any] = json.loads(data)
        session = Session(
            "",
            document["user"],
            document["client_ip"],
            Origin(document["origin"]),
            document["created_ms"],
            document["expires_ms"],
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a session record: {e}") from e
    fields = (session.user, session.client_ip, session.created_ms, session.expires_ms)
    if not all(
        isinstance(field, kind) for field, kind in zip(fields, (str, str, int, int), strict=True)
    ):
        raise ValueError("not a session record: a field has the wrong type")
    return session


def _encode_marker(revoked_ms: int) -> bytes:
    return json.dumps({"revoked_ms": revoked_ms}).encode()


def _decode_marker(data: bytes) -> int:
    try:
        revoked_ms = json.loads(data)["revoked_ms"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a revocation record: {e}") from e
    if not isinstance(revoked_ms, int):
        raise ValueError("not a revocation record: revoked_ms is not an integer")
    return revoked_ms


@attrs.frozen
class _SessionEntry:
    key: bytes
    #: ``None`` for a delete.
    session: Session | None


@attrs.frozen
class _MarkerEntry:
    user: str
    #: ``None`` for a delete.
    revoked_ms: int | None


class SharedSessions(MultiService):
    """Publishes ``sessions``' sessions under ``prefix`` + ``sessions/`` in ``store`` and keeps
    the cluster's there in ``sessions``.

    ``prefix`` is the cluster's (``/logbroker/<cluster id>/``). Constructing it hooks it into
    ``sessions``; starting it loads and watches; stopping it stops following (the sessions
    written stay, under their leases).
    """

    def __init__(
        self,
        sessions: SessionStore,
        store: KeyValueStore,
        prefix: bytes,
        clock: IReactorTime,
        *,
        origins: Collection[Origin] = frozenset(Origin),
        retry_interval_sec: float = RETRY_INTERVAL_SEC,
        write_wait_sec: float = WRITE_WAIT_SEC,
        lease_bucket_sec: int = LEASE_BUCKET_SEC,
        metrics: TaskMetrics | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._sessions = sessions
        self._store = store
        self._prefix = prefix + b"sessions/"
        self._clock = clock
        self._origins = frozenset(origins)
        self._retry_interval_sec = retry_interval_sec
        self._write_wait_sec = write_wait_sec
        self._bucket_sec = lease_bucket_sec
        #: Created sessions not yet written, by key, oldest first.
        self._puts: dict[bytes, Session] = {}
        #: Keys to delete.
        self._deletes: set[bytes] = set()
        #: Revocation markers not yet written: user -> revoked_ms.
        self._markers: dict[str, int] = {}
        #: Keys that may be in etcd, with the revision they were known there at.
        self._shared: dict[bytes, int] = {}
        #: The keys of the puts, and of the deletes, of the transaction in flight.
        self._writing: set[bytes] = set()
        self._deleting: set[bytes] = set()
        #: Each user's latest revocation, from etcd or made here: user -> revoked_ms. One that
        #: outlived its marker would be harmless (what it covers is over): bounded by the users.
        self._revoked_at: dict[str, int] = {}
        #: expiry bucket (its end, in clock seconds) -> this node's lease for it.
        self._leases: dict[int, int] = {}
        self._flushing = False
        self._write_troubled = False
        #: ``login``'s waits for a key's write: key -> the waits and their timeouts.
        self._waiters: dict[bytes, list[_Wait]] = {}
        self._follower = PrefixFollower(
            store,
            self._prefix,
            clock,
            name="Shared sessions",
            on_load=self._reset,
            on_events=self._events,
            first_delay=retry_interval_sec,
            max_delay=retry_interval_sec,
        )
        self._retry = PeriodicTask(
            "shared_sessions_retry",
            retry_interval_sec,
            self._tick,
            clock,
            metrics=metrics,
            now=False,
        )
        self._retry.setServiceParent(self)  # type: ignore[no-untyped-call]
        sessions.on_created.append(self._created)
        sessions.on_revoked.append(self._revoked)
        sessions.on_user_revoked.append(self._user_revoked)

    # -- the API ---------------------------------------------------------------------------

    def login(self, user: str, client_ip: str, origin: Origin) -> Deferred[Session]:
        """Open a session (``SessionStore.create``), firing with it once it is in etcd, or
        after ``write_wait_sec``, or at once while etcd is in trouble: never fails."""
        session = self._sessions.create(user, client_ip, origin)
        key = session_key(session.token)
        queued = key in self._puts or key in self._writing
        if self._write_troubled or not self.running or not queued:
            return succeed(session)
        wait = _Wait(session, Deferred())
        wait.timeout = self._clock.callLater(self._write_wait_sec, self._give_up, key, wait)
        self._waiters.setdefault(key, []).append(wait)
        return wait.done

    @property
    def pending(self) -> int:
        """How many writes wait for etcd."""
        return len(self._puts) + len(self._deletes) + len(self._markers)

    @property
    def following(self) -> bool:
        """Whether this node watches the shared sessions now."""
        return self._follower.watching

    # -- lifecycle -------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._follower.start()
        self._flush()

    def stopService(self) -> Deferred[None]:
        stopped: Deferred[None] = super().stopService()  # type: ignore[no-untyped-call]
        self._follower.stop()
        self._release_waiters()
        return stopped

    def _tick(self) -> None:
        self._flush(retry=True)

    # -- the hooks: what to publish --------------------------------------------------------

    def _created(self, key: bytes, session: Session) -> None:
        if session.origin in self._origins:
            self._puts[key] = session
            self._flush()

    def _revoked(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._unpublish(key)
        self._flush()

    def _unpublish(self, key: bytes) -> None:
        self._puts.pop(key, None)
        if key in self._shared or key in self._writing:
            self._deletes.add(key)

    def _user_revoked(self, user: str, revoked_ms: int) -> None:
        self._markers[user] = max(revoked_ms, self._markers.get(user, revoked_ms))
        self._revoke_locally(user, revoked_ms)
        self._flush()

    # -- writing ---------------------------------------------------------------------------

    def _flush(self, *, retry: bool = False) -> None:
        """Write what is queued, one transaction at a time; while etcd is in trouble, only the
        retry task tries (not every login)."""
        if not self.running or self._flushing or (self._write_troubled and not retry):
            return
        now_ms = self._now_ms()
        deletes = sorted(self._deletes)[:MAX_OPS]
        markers = list(self._markers.items())[: MAX_OPS - len(deletes)]
        puts: list[tuple[bytes, Session]] = []
        for key, session in list(self._puts.items()):
            if len(deletes) + len(markers) + len(puts) >= MAX_OPS:
                break
            if self._sessions.find(key) is None or session.expires_ms <= now_ms:
                # Over before it could be written: nothing to share.
                del self._puts[key]
                self._release_waiters(key)
            else:
                puts.append((key, session))
        if not (deletes or markers or puts):
            return
        self._flushing = True
        self._deletes.difference_update(deletes)
        for user, _ in markers:
            del self._markers[user]
        for key, _ in puts:
            del self._puts[key]
        self._writing = {key for key, _ in puts}
        self._deleting = set(deletes)
        timeout_ms = self._sessions.timeout_ms
        buckets = {self._bucket(session.expires_ms) for _, session in puts}
        buckets |= {self._bucket(revoked_ms + timeout_ms) for _, revoked_ms in markers}

        def write(_: object) -> Deferred[TxnResult]:
            ops: list[Operation] = [Delete(self._session_key(key)) for key in deletes]
            for user, revoked_ms in markers:
                lease = self._leases[self._bucket(revoked_ms + timeout_ms)]
                ops.append(Put(self._marker_key(user), _encode_marker(revoked_ms), lease))
            for key, session in puts:
                lease = self._leases[self._bucket(session.expires_ms)]
                ops.append(Put(self._session_key(key), encode_session(session), lease))
            return self._store.txn([], ops)

        def written(result: TxnResult) -> None:
            for key, _ in puts:
                self._shared.setdefault(key, result.revision)
                self._release_waiters(key)
            if self._write_troubled:
                self._write_troubled = False
                log.info("Shared sessions: etcd takes writes again")

        def failed(failure: Failure) -> None:
            # Back into the queue, unless over meanwhile.
            for key, session in puts:
                if self._sessions.find(key) is not None:
                    self._puts[key] = session
            self._puts = dict(sorted(self._puts.items(), key=lambda item: item[1].created_ms))
            self._deletes.update(deletes)
            for user, revoked_ms in markers:
                self._markers[user] = max(revoked_ms, self._markers.get(user, revoked_ms))
            if isinstance(failure.value, LeaseNotFoundError):
                # etcd lost a lease (restored from a backup, say): the next write grants anew.
                log.info("Shared sessions: a lease was gone from etcd; granting a new one")
                for bucket in buckets:
                    self._leases.pop(bucket, None)
                return
            if self._write_troubled:
                log.debug("Shared sessions: etcd still fails: {error}", error=str(failure.value))
            elif not isinstance(failure.value, ControlPlaneError):
                log.failure("Shared sessions: a write failed unexpectedly", failure)
            else:
                log.warn(
                    "Shared sessions: could not write to etcd ({error}); sessions opened here"
                    " are valid on this node only until it answers (retrying every {interval} s)",
                    error=str(failure.value),
                    interval=self._retry_interval_sec,
                )
            self._write_troubled = True
            self._release_waiters()

        def done(_: object) -> None:
            self._flushing = False
            self._writing = set()
            self._deleting = set()
            if not self._write_troubled and self.pending:
                self._flush()

        writing = self._grant(buckets).addCallback(write).addCallbacks(written, failed)
        writing.addBoth(done)

    def _grant(self, buckets: set[int]) -> Deferred[object]:
        """Have a lease for each bucket, granting the missing ones."""
        now = self._clock.seconds()
        for bucket in [bucket for bucket in self._leases if bucket <= now]:
            del self._leases[bucket]

        def grant(bucket: int) -> Deferred[None]:
            def granted(lease: int) -> None:
                self._leases[bucket] = lease

            # Whole seconds, rounded up: the lease outlives every session of the bucket.
            return self._store.grant(max(1, math.ceil(bucket - now))).addCallback(granted)

        missing = [grant(bucket) for bucket in sorted(buckets) if bucket not in self._leases]
        if not missing:
            return succeed(None)
        granting = gather(missing)
        return cast(Deferred[object], granting)

    def _bucket(self, expires_ms: int) -> int:
        """The end (clock seconds) of the lease bucket of what expires at ``expires_ms``."""
        width = self._bucket_sec
        return math.ceil((expires_ms / 1000 + KEPT_EXPIRED_SEC) / width) * width

    def _release_waiters(self, key: bytes | None = None) -> None:
        """Answer the ``login``s waiting for ``key``'s write (all of them if ``None``)."""
        keys = list(self._waiters) if key is None else [key]
        for waited in keys:
            for wait in self._waiters.pop(waited, []):
                wait.answer()

    def _give_up(self, key: bytes, wait: _Wait) -> None:
        waits = [other for other in self._waiters.pop(key, []) if other is not wait]
        if waits:
            self._waiters[key] = waits
        wait.answer()

    # -- reading ---------------------------------------------------------------------------

    def _reset(self, loaded: RangeResult) -> None:
        revision = loaded.revision
        sessions: dict[bytes, tuple[Session, int]] = {}
        markers: dict[str, int] = {}
        for kv in loaded.kvs:
            entry = self._parse(kv.key, kv.value)
            if isinstance(entry, _SessionEntry) and entry.session is not None:
                sessions[entry.key] = (entry.session, kv.mod_revision)
            elif isinstance(entry, _MarkerEntry) and entry.revoked_ms is not None:
                markers[entry.user] = entry.revoked_ms
        # Gone from etcd since this node knew them there (and not written since the read).
        for key, known_at in list(self._shared.items()):
            if key not in sessions and known_at <= revision:
                del self._shared[key]
                self._sessions.drop(key)
        for user, revoked_ms in markers.items():
            self._marker_seen(user, revoked_ms)
        for key, (session, mod_revision) in sessions.items():
            self._session_seen(key, session, mod_revision)
        # Deletes of this node's sessions that a revocation marker covers.
        self._flush()

    def _events(self, events: Sequence[WatchEvent]) -> None:
        for event in events:
            value = None if event.type is EventType.DELETE else event.kv.value
            entry = self._parse(event.kv.key, value)
            if isinstance(entry, _SessionEntry):
                if entry.session is not None:
                    self._session_seen(entry.key, entry.session, event.kv.mod_revision)
                else:
                    self._shared.pop(entry.key, None)
                    self._sessions.drop(entry.key)
            elif isinstance(entry, _MarkerEntry):
                if entry.revoked_ms is not None:
                    self._marker_seen(entry.user, entry.revoked_ms)
                elif entry.user not in self._markers:
                    # Its lease ran out: every session it could concern is over.
                    self._revoked_at.pop(entry.user, None)
        self._flush()

    def _parse(self, key: bytes, value: bytes | None) -> _SessionEntry | _MarkerEntry | None:
        """What a key (and its value, ``None`` for a delete) under the prefix is; ``None``,
        warned about, for what is not ours."""
        name = key[len(self._prefix) :]
        try:
            if name.startswith(_REVOKED):
                user = name[len(_REVOKED) :].decode("utf-8")
                return _MarkerEntry(user, None if value is None else _decode_marker(value))
            hashed = bytes.fromhex(name.decode("ascii"))
            if len(hashed) != 32:
                raise ValueError("not a SHA-256")
            return _SessionEntry(hashed, None if value is None else decode_session(value))
        except ValueError as e:
            log.warn("Shared sessions: ignored the key {key!r}: {error}", key=key, error=str(e))
            return None

    def _session_seen(self, key: bytes, session: Session, mod_revision: int) -> None:
        self._shared[key] = max(mod_revision, self._shared.get(key, 0))
        if key in self._deletes or key in self._deleting:
            # Revoked here while its put was on the way.
            return
        if session.created_ms <= self._revoked_at.get(session.user, -1):
            # Opened before its user's revocation, written after it: never valid again.
            self._sessions.drop(key)
            return
        self._sessions.adopt(key, session)

    def _marker_seen(self, user: str, revoked_ms: int) -> None:
        if revoked_ms > self._revoked_at.get(user, -1):
            self._revoke_locally(user, revoked_ms)

    def _revoke_locally(self, user: str, revoked_ms: int) -> None:
        """Forget ``user``'s sessions opened at or before ``revoked_ms``, and delete from etcd
        those this node opened (the others delete theirs)."""
        self._revoked_at[user] = max(revoked_ms, self._revoked_at.get(user, revoked_ms))
        for key, session in self._sessions.sessions_of(user):
            if session.created_ms <= revoked_ms:
                self._sessions.drop(key)
                if session.token:
                    self._unpublish(key)

    def _session_key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _marker_key(self, user: str) -> bytes:
        return self._prefix + _REVOKED + user.encode()

    def _now_ms(self) -> int:
        return round(self._clock.seconds() * 1000)


@attrs.define(eq=False)
class _Wait:
    """A ``login`` waiting for its session's write."""

    session: Session
    done: Deferred[Session]
    timeout: IDelayedCall | None = None

    def answer(self) -> None:
        if self.timeout is not None and self.timeout.active():
            self.timeout.cancel()
        if not self.done.called:
            self.done.callback(self.session)
