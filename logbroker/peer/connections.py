"""Both ends of the peer port's connections: the listener's factory and the outbound links.

``PeerServerFactory`` builds the accepting side (one connection per peer node: a newer one from
the same node replaces the older). ``PeerConnections`` keeps one outbound connection per peer
node, each a ``ClientService`` that reconnects with backoff; its ``request`` answers
``unreachable`` at once while there is no established connection to that node. Both give their
``PeerObserver`` to each of their connections (``logbroker.peer.link``).
"""

from __future__ import annotations

from collections.abc import Callable

from twisted.application.internet import ClientService, backoffPolicy
from twisted.application.service import Service
from twisted.internet.defer import (
    Deferred,
    fail,
    gatherResults,
    succeed,
)
from twisted.internet.interfaces import IAddress, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory

from logbroker.peer.frames import (
    PeerOp,
    PeerReason,
)
from logbroker.peer.handshake import (
    Established,
    Handshake,
    PeerIdentity,
    Role,
)
from logbroker.peer.link import (
    UNOBSERVED,
    PeerError,
    PeerObserver,
    PeerProtocol,
    PeerSettings,
    RequestHandler,
)


class PeerServerFactory(Factory):
    """The accepting side of the peer port: serves each established peer's requests with
    ``handler``, one connection per peer node (a newer connection from a node replaces its
    older one, which is likely half-open from before the node reconnected)."""

    def __init__(
        self,
        identity: PeerIdentity,
        clock: IReactorTime,
        handler: RequestHandler,
        settings: PeerSettings | None = None,
        observer: PeerObserver = UNOBSERVED,
    ) -> None:
        self._identity = identity
        self._clock = clock
        self._handler = handler
        self._settings = settings or PeerSettings()
        self._observer = observer
        #: Every open connection, established or not.
        self.connections: set[PeerProtocol] = set()
        self._by_peer: dict[str, PeerProtocol] = {}

    def buildProtocol(self, addr: IAddress | None) -> PeerProtocol:
        protocol = PeerProtocol(
            Handshake(Role.LISTENER, self._identity),
            self._clock,
            self._settings,
            handler=self._handler,
            on_established=self._established,
            on_ended=self._ended,
            observer=self._observer,
        )
        protocol.factory = self
        self.connections.add(protocol)
        return protocol

    def _established(self, protocol: PeerProtocol) -> None:
        peer = protocol.peer_node_id
        assert peer is not None
        older = self._by_peer.get(peer)
        self._by_peer[peer] = protocol
        if older is not None:
            older.close()

    def _ended(self, protocol: PeerProtocol) -> None:
        self.connections.discard(protocol)
        peer = protocol.peer_node_id
        if peer is not None and self._by_peer.get(peer) is protocol:
            del self._by_peer[peer]

    def close_all(self) -> None:
        for protocol in list(self.connections):
            protocol.close()


class _Link:
    """The outbound connection to one peer node."""

    def __init__(self, owner: PeerConnections, node_id: str) -> None:
        self.node_id = node_id
        self._owner = owner
        #: The established connection, if there is one.
        self.protocol: PeerProtocol | None = None
        #: Connections in a row that ended before their handshake succeeded.
        self.failed_handshakes = 0
        #: When the link last heard from its peer over a connection now ended (or was made).
        self.last_heard = owner._clock.seconds()
        self.service = ClientService(
            owner._endpoint_for(node_id),
            _DialerFactory(self),
            retryPolicy=lambda attempt: owner._retry_policy(attempt + self.failed_handshakes),
            clock=owner._clock,
        )

    def build(self) -> PeerProtocol:
        owner = self._owner
        return PeerProtocol(
            Handshake(Role.DIALER, owner._identity, expected_peer=self.node_id),
            owner._clock,
            owner._settings,
            on_established=self._established,
            on_ended=self._ended,
            observer=owner._observer,
        )

    def _established(self, protocol: PeerProtocol) -> None:
        self.failed_handshakes = 0
        self.protocol = protocol

    def _ended(self, protocol: PeerProtocol) -> None:
        if self.protocol is protocol:
            self.protocol = None
            self.last_heard = max(self.last_heard, protocol.last_received)
        if not isinstance(protocol.handshake.outcome, Established):
            self.failed_handshakes += 1


class _DialerFactory(Factory):
    def __init__(self, link: _Link) -> None:
        self._link = link

    def buildProtocol(self, addr: IAddress | None) -> PeerProtocol:
        protocol = self._link.build()
        protocol.factory = self
        return protocol


class PeerConnections(Service):
    """One outbound peer link per peer node, each kept up by a ``ClientService``.

    ``endpoint_for(node_id)`` gives the endpoint to dial a node at (wrapped for TLS by the
    caller when TLS is on). ``retry_policy`` maps failed attempts in a row to the seconds to wait
    (default ``backoffPolicy()``). The handshake runs inside the connection rather than in
    ``ClientService``'s ``prepareConnection``, which cannot take a connection that closes
    before it was handed over (as a refused one does); so the backoff adds the handshakes that
    failed in a row to the attempts ``ClientService`` counts, and a refusing peer is retried
    ever more slowly rather than every second.
    """

    def __init__(
        self,
        identity: PeerIdentity,
        clock: IReactorTime,
        endpoint_for: Callable[[str], IStreamClientEndpoint],
        settings: PeerSettings | None = None,
        retry_policy: Callable[[int], float] | None = None,
        observer: PeerObserver = UNOBSERVED,
    ) -> None:
        self._identity = identity
        self._clock = clock
        self._endpoint_for = endpoint_for
        self._settings = settings or PeerSettings()
        self._retry_policy = retry_policy or backoffPolicy()
        self._observer = observer
        self._links: dict[str, _Link] = {}

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._links)

    def add_peer(self, node_id: str) -> None:
        """Keep a link to ``node_id`` (dialing at once if the service runs)."""
        if node_id == self._identity.node_id:
            raise ValueError(f"node {node_id!r} is this node")
        if node_id in self._links:
            return
        link = _Link(self, node_id)
        self._links[node_id] = link
        if self.running:
            link.service.startService()

    def remove_peer(self, node_id: str) -> Deferred[None]:
        """Stop keeping a link to ``node_id``; fires once its connection is closed."""
        link = self._links.pop(node_id, None)
        if link is None or not link.service.running:
            return succeed(None)
        return link.service.stopService()

    def established(self, node_id: str) -> PeerProtocol | None:
        """The established connection to ``node_id``, if there is one now."""
        link = self._links.get(node_id)
        return None if link is None else link.protocol

    def heard_at(self, node_id: str) -> float | None:
        """When the link to ``node_id`` last heard from it: the established connection's last
        receipt, or else when the link was last up (or made); ``None`` for an unknown peer."""
        link = self._links.get(node_id)
        if link is None:
            return None
        if link.protocol is not None:
            return link.protocol.last_received
        return link.last_heard

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        """Send a request to ``node_id``: fails with ``unreachable`` at once when there is no
        established connection to it (never waits for one)."""
        protocol = self.established(node_id)
        if protocol is None:
            known = "no established link" if node_id in self._links else "not a known peer"
            return fail(PeerError(PeerReason.UNREACHABLE, f"node {node_id!r}: {known}"))
        return protocol.request(op, payload)

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        for link in self._links.values():
            link.service.startService()

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        stopping = [link.service.stopService() for link in self._links.values()]
        return gatherResults(stopping).addCallback(lambda _: None)
