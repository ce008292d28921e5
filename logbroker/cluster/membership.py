"""Node membership: who is in the cluster, who is alive, and who does the cluster's chores.

Keys, under the cluster's control-plane prefix (``/logbroker/<cluster id>/``)::

    members/<node id>   the node's record (JSON: address, ports, attributes), kept forever:
                        a node that was ever a member shows as dead, not as unknown
    alive/<node id>     the same record under the node's lease: present while the node lives
    chores              the id of the node holding the cluster-chores lease, under its lease

A node registers by putting both keys, the second under a lease of ``SVC_NODE_LEASE_MS`` that it
keeps alive. etcd starts a lease's TTL when it grants it, so the node counts it from the grant's
sending; a registration that took longer than a keepalive's turn counts only once a keepalive is
answered. When etcd says the lease is gone, or the node has not had a keepalive answered for a
whole TTL (etcd may have expired it meanwhile: the node cannot know), the node has lost its
lease: it tells its listeners at once, so that it stops acting as a primary, and registers anew
with a new lease when it can. The chores key is taken with a create-if-absent transaction under
the lease, so exactly one node holds it; losing the lease loses it, and the others race for it
when they see it go.

Every node keeps the member list from a watch on ``members/``, ``alive/`` and ``chores`` (a
``PrefixFollower``: loaded, then watched, resumed and reloaded as the control plane's state is),
so ``nodes()`` is a synchronous read of the latest view.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
from twisted.application.service import MultiService
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.controlplane._kv import (
    Compare,
    EventType,
    KeyValueStore,
    Put,
    RangeResult,
    WatchEvent,
)
from logbroker.controlplane.errors import ControlPlaneError
from logbroker.controlplane.follower import PrefixFollower
from logbroker.maintenance.periodic import PeriodicTask

log = Logger()

_T = TypeVar("_T")

#: Keepalives per lease TTL: two may be lost before the lease is at risk.
KEEPALIVES_PER_TTL = 3


@attrs.frozen
class NodeRecord:
    """What the cluster knows of a node: where to reach it and how to place replicas on it."""

    node_id: str
    host: str
    client_port: int
    dashboard_port: int
    peer_port: int
    attributes: tuple[tuple[str, str], ...] = ()
    version: str = ""

    def encode(self) -> bytes:
        document = attrs.asdict(self)
        document["attributes"] = [list(pair) for pair in self.attributes]
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> NodeRecord:
        """The record in ``data``; fields a newer node added are left out (so a rolling upgrade
        keeps every node visible to the others)."""
        document: dict[str, Any] = json.loads(data)
        known = {field.name for field in attrs.fields(cls)}
        fields = {name: value for name, value in document.items() if name in known}
        fields["attributes"] = tuple(tuple(pair) for pair in fields.get("attributes", ()))
        return cls(**fields)


@attrs.frozen
class NodeView:
    record: NodeRecord
    alive: bool


class Membership(MultiService):
    """This node's registration under a lease, and the cluster's member list as it changes.

    ``on_lease_lost`` listeners are told, at once, when this node may no longer hold its lease;
    ``on_lease_regained`` when it holds a new one.
    """

    def __init__(
        self,
        store: KeyValueStore,
        prefix: bytes,
        record: NodeRecord,
        clock: IReactorTime,
        lease_ttl_ms: int,
        registers_after: Callable[[], Deferred[None]] = lambda: succeed(None),
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._store = store
        self._registers_after = registers_after
        #: Whether this node may register (``registers_after`` has fired).
        self._may_register = False
        self._prefix = prefix
        self.record = record
        self._clock = clock
        #: etcd counts lease TTLs in whole seconds.
        self._ttl = max(1, -(-lease_ttl_ms // 1000))
        self._lease = 0
        #: When the last keepalive that etcd answered was sent: etcd restarted the TTL then.
        self._renewed_at: float | None = None
        self._registering: Deferred[None] | None = None
        #: Fires when the lease may have run out unless a keepalive is answered first.
        self._expiry: IDelayedCall | None = None
        #: The deadline of each keepalive not answered yet.
        self._giving_up: set[IDelayedCall] = set()
        self._members: dict[str, NodeRecord] = {}
        self._alive: set[str] = set()
        #: Each live node's lease, and when this node first saw it.
        self._leases: dict[str, tuple[int, float]] = {}
        #: The lease this node revoked last for each node it found gone.
        self._revoked: dict[str, int] = {}
        self._chores_holder: str | None = None
        self._follower = PrefixFollower(
            store,
            prefix,
            clock,
            name="Membership",
            on_load=self._loaded,
            on_events=self._events,
        )
        self.on_lease_lost: list[Callable[[], None]] = []
        self.on_lease_regained: list[Callable[[], None]] = []
        self.on_change: list[Callable[[], None]] = []
        self._registered_waiters: list[Deferred[None]] = []
        self._keepalive = PeriodicTask(
            "membership_keepalive", self._ttl / KEEPALIVES_PER_TTL, self._renew, clock, now=False
        )
        self._keepalive.setServiceParent(self)  # type: ignore[no-untyped-call]

    # -- reads -----------------------------------------------------------------------------

    @property
    def holds_lease(self) -> bool:
        """Whether this node may still hold its lease: one etcd renewed less than a TTL ago.
        Read from the clock, not from the expiry timer: a process resumed after a stall runs
        its due calls in whatever order, and none may act as if the lease were still held."""
        renewed = self._renewed_at
        return (
            self._lease != 0 and renewed is not None and self._clock.seconds() < renewed + self._ttl
        )

    @property
    def holds_chores(self) -> bool:
        return self.holds_lease and self._chores_holder == self.record.node_id

    @property
    def chores_holder(self) -> str | None:
        return self._chores_holder

    @property
    def chores_key(self) -> bytes:
        """The key naming the chores holder (any of the cluster's nodes may read it)."""
        return self._key("chores")

    def registered(self) -> Deferred[None]:
        """Fires once this node holds a lease (at once if it does now)."""
        if self._lease and self._renewed_at is not None:
            return succeed(None)
        waiting: Deferred[None] = Deferred()
        self._registered_waiters.append(waiting)
        return waiting

    def lease_age(self) -> float | None:
        """Seconds since etcd last renewed this node's lease; None without a lease."""
        if self._renewed_at is None or not self._lease:
            return None
        return self._clock.seconds() - self._renewed_at

    def nodes(self) -> list[NodeView]:
        """Every node that was ever a member, by id, alive or not."""
        return [
            NodeView(record, node_id in self._alive)
            for node_id, record in sorted(self._members.items())
        ]

    def live_nodes(self) -> list[NodeRecord]:
        return [view.record for view in self.nodes() if view.alive]

    def is_alive(self, node_id: str) -> bool:
        """Whether ``node_id`` holds its membership lease, as this node last heard (asked for
        every replica of every produce: a set lookup)."""
        return node_id in self._alive and node_id in self._members

    def report_gone(self, node_id: str, began: float) -> None:
        """``node_id``'s process is gone: its host refused a connection to its peer port that
        began at ``began``. Revoke its membership lease, so that the cluster takes over its
        ranges now rather than when the lease runs out: a killed process is found gone within
        a fifth of a second, its lease only after up to a TTL. Only a lease this node saw
        before the refused attempt began is revoked (a node restarted since registered under
        a new one, and listened before registering), and only while this node holds its own.
        Revoking is safe whoever is wrong: a node whose lease is gone stops leading at once,
        and registers again."""
        seen = self._leases.get(node_id)
        if node_id == self.record.node_id or seen is None or not self.holds_lease:
            return
        lease, seen_at = seen
        if seen_at >= began or self._revoked.get(node_id) == lease:
            return
        self._revoked[node_id] = lease
        log.warn(
            "The peer port of {node_id} refuses connections: its process is gone. Revoking its"
            " membership lease so that its ranges are taken over now",
            node_id=node_id,
        )
        self._store.revoke(lease).addErrback(_ignore)

    # -- lifecycle -------------------------------------------------------------------------

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        self._follower.start()
        # A node registered is alive to the others, who at once send it what its copies lack
        # and lead with it: it registers only once it can answer. At 40,000 ranges a node
        # that registered while its control plane loaded (14 s without a turn of its reactor)
        # lost its lease on the spot, and its peers their links to it.
        self._registers_after().addCallback(self._may_register_now)

    def _may_register_now(self, _: object) -> None:
        self._may_register = True
        if self.running:
            self._register()

    def _cancel_expiry(self) -> None:
        if self._expiry is not None and self._expiry.active():
            self._expiry.cancel()
        self._expiry = None

    def stopService(self) -> Deferred[None]:
        stopped: Deferred[None] = super().stopService()  # type: ignore[no-untyped-call]
        self._cancel_expiry()
        # Keepalives still out are left to end on their own; their answers renew nothing now.
        for give_up in self._giving_up:
            if give_up.active():
                give_up.cancel()
        self._giving_up.clear()
        self._follower.stop()
        lease, self._lease = self._lease, 0
        if not lease:
            return stopped
        # Leave at once rather than when the TTL runs out: the others see it now.
        revoked = self._store.revoke(lease).addErrback(_ignore)
        return stopped.addCallback(lambda _: revoked)

    # -- registration and the lease --------------------------------------------------------

    def _key(self, *parts: str) -> bytes:
        return self._prefix + "/".join(parts).encode()

    def _register(self) -> Deferred[None]:
        if self._registering is not None:
            return self._registering

        # etcd starts the lease's TTL when it grants it: count from before asking.
        sent = self._clock.seconds()

        def granted(lease: int) -> Deferred[None]:
            record = self.record.encode()
            node_id = self.record.node_id
            registering = self._store.txn(
                [],
                [
                    Put(self._key("members", node_id), record),
                    Put(self._key("alive", node_id), record, lease),
                ],
            )
            return registering.addCallback(lambda _: self._registered(lease, sent))

        def failed(failure: Failure) -> None:
            log.warn(
                "Could not register with the control plane ({error}); retrying",
                error=failure.getErrorMessage(),
            )

        def done(_: object) -> None:
            self._registering = None

        self._registering = self._store.grant(self._ttl).addCallback(granted)
        self._registering.addErrback(failed).addBoth(done)
        return self._registering

    def _registered(self, lease: int, sent: float) -> None:
        if not self.running:
            self._store.revoke(lease).addErrback(_ignore)
            return
        self._lease = lease
        if self._clock.seconds() - sent <= self._ttl / KEEPALIVES_PER_TTL:
            self._renewed(sent)
            self._announce_registered()
            return
        # The grant and the registration took longer than a keepalive's turn: etcd is loaded,
        # or was out of reach (a grant sent as a node lost etcd was answered 11 s later, once
        # the node reached it again). etcd started the TTL when it granted the lease, at some
        # point since ``sent``: counted from ``sent``, the lease may have run out already,
        # though etcd holds it. Taken as held, it was lost on the spot and registered again,
        # its listeners told both; under an etcd answering each request in half the TTL, no
        # registration ever lasted. It counts once a keepalive sent now is answered, as each
        # later one does; with none answered within a TTL, it is lost.
        self._expiry = self._clock.callLater(self._ttl, self._expired)
        self._renew()

    def _announce_registered(self) -> None:
        log.info(
            "Registered as {node_id} with a {ttl} s lease",
            node_id=self.record.node_id,
            ttl=self._ttl,
        )
        for listener in self.on_lease_regained:
            listener()
        waiters, self._registered_waiters = self._registered_waiters, []
        for waiting in waiters:
            waiting.callback(None)
        self._claim_chores()

    def _renew(self) -> None:
        if not self._lease:
            if self._may_register:
                self._register()
            return
        lease = self._lease
        sent = self._clock.seconds()

        def answered(remaining: int) -> None:
            if lease != self._lease:
                return
            if remaining <= 0:
                self._lost("etcd says the lease expired")
                return
            if self._renewed_at is None:
                # The first renewal of a lease whose registration took too long to count.
                self._renewed(sent)
                self._announce_registered()
            elif sent > self._renewed_at:
                self._renewed(sent)

        def failed(failure: Failure) -> None:
            # Unanswered: etcd may still hold the lease, or may have let it expire; the expiry
            # timer decides.
            log.debug("A lease keepalive failed: {error}", error=failure.getErrorMessage())

        # Keepalives go out on time whatever became of the ones before, and each counts if it
        # is answered before the renewal it asks for would have run out. A loaded etcd (a
        # thousand claims at once after a node went) answers a keepalive in more than a third
        # of the TTL: giving each up by the next one's turn lost the lease every TTL, though
        # etcd renewed it each time. The next keepalive does not wait behind a member that
        # holds this one (hung, or waiting for an election): the store tries the others first.
        asked = self._store.keepalive(lease)
        give_up = self._clock.callLater(
            self._ttl, self._after_pending_io, _cancel_unless_fired, asked
        )
        self._giving_up.add(give_up)

        def ended(result: _T) -> _T:
            self._giving_up.discard(give_up)
            if give_up.active():
                give_up.cancel()
            return result

        asked.addBoth(ended).addCallbacks(answered, failed)

    def _after_pending_io(self, call: Callable[..., object], *args: object) -> None:
        """Run ``call`` only once the reactor has read what came in meanwhile (a call made
        from a timer at delay 0 runs after the reactor's next poll of its connections). A
        reactor turn that ran long, taking or giving up thousands of ranges, ends with its
        timers first: a keepalive etcd answered in time was given up, and the lease taken
        for lost, with the answer unread in its connection; such a node lost its lease every
        3 s for 13 s on end, all its ranges each time, after a peer partition at 4,000 ranges.
        This delays a decision by one turn of the reactor, no more than a late timer already
        does; fencing, not the lease's timing, keeps an old primary from acknowledging."""
        self._clock.callLater(0, call, *args)

    def _renewed(self, sent: float) -> None:
        """etcd restarted the lease's TTL no earlier than ``sent``: it runs out no earlier than
        ``sent`` + TTL, whatever happens to the requests after this one."""
        self._renewed_at = sent
        if self._expiry is not None and self._expiry.active():
            self._expiry.cancel()
        remaining = max(0.0, sent + self._ttl - self._clock.seconds())
        self._expiry = self._clock.callLater(remaining, self._expired)

    def _expired(self) -> None:
        self._expiry = None
        if self._lease:
            self._after_pending_io(self._expired_after_pending_io, self._lease)

    def _expired_after_pending_io(self, lease: int) -> None:
        # Renewed by an answer read meanwhile (a new expiry is set), or lost and registered
        # again under another lease: nothing ran out.
        if lease == self._lease and self._expiry is None:
            self._lost(f"no keepalive answered for {self._ttl} s")

    def _lost(self, why: str) -> None:
        log.warn(
            "Lost the membership lease of {node_id} ({why}): acting as no range's primary until"
            " registered again",
            node_id=self.record.node_id,
            why=why,
        )
        self._lease = 0
        self._renewed_at = None
        self._cancel_expiry()
        for listener in self.on_lease_lost:
            listener()
        self._register()

    # -- chores ----------------------------------------------------------------------------

    def _claim_chores(self) -> None:
        if not self._lease or self._chores_holder is not None:
            return
        key = self.chores_key
        self._store.txn(
            [Compare.absent(key)], [Put(key, self.record.node_id.encode(), self._lease)]
        ).addErrback(_ignore)

    # -- the member list -------------------------------------------------------------------

    def _loaded(self, result: RangeResult) -> None:
        self._members.clear()
        self._alive.clear()
        self._chores_holder = None
        for kv in result.kvs:
            self._apply(kv.key, kv.value, kv.lease)
        self._leases = {n: seen for n, seen in self._leases.items() if n in self._alive}
        self._changed()

    def _events(self, events: Sequence[WatchEvent]) -> None:
        for event in events:
            kv = event.kv
            self._apply(kv.key, None if event.type is EventType.DELETE else kv.value, kv.lease)
        self._changed()

    def _apply(self, key: bytes, value: bytes | None, lease: int) -> None:
        name = key[len(self._prefix) :].decode()
        kind, _, node_id = name.partition("/")
        if kind == "members" and value is not None:
            self._members[node_id] = NodeRecord.decode(value)
        elif kind == "members":
            self._members.pop(node_id, None)
        elif kind == "alive" and value is not None:
            self._alive.add(node_id)
            self._members.setdefault(node_id, NodeRecord.decode(value))
            if self._leases.get(node_id, (None,))[0] != lease:
                self._leases[node_id] = (lease, self._clock.seconds())
        elif kind == "alive":
            self._alive.discard(node_id)
            self._leases.pop(node_id, None)
        elif name == "chores":
            self._chores_holder = value.decode() if value is not None else None

    def _changed(self) -> None:
        if self._chores_holder is None:
            self._claim_chores()
        for listener in self.on_change:
            listener()


def _ignore(failure: Failure) -> None:
    """For requests whose failure changes nothing: the next keepalive or event retries."""
    if not isinstance(failure.value, ControlPlaneError):
        log.failure("A membership request failed unexpectedly", failure)


def _cancel_unless_fired(request: Deferred[Any]) -> None:
    if not request.called:
        request.cancel()
