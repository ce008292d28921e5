"""Both ends of the peer port's connections: the listener's factory and the outbound links.

``PeerServerFactory`` builds the accepting side (one connection per peer node: a newer one from
the same node replaces the older). ``PeerConnections`` keeps one outbound connection per peer
node, each a ``ClientService`` that reconnects with backoff; its ``request`` answers
``unreachable`` at once while there is no established connection to that node. Both give their
``PeerObserver`` to each of their connections (``logbroker.peer.link``).

Given ``tls`` options (mutual TLS: this node's certificate, the peer's required and verified),
both put each connection's ``PeerProtocol`` behind a TLS layer of its own: the listener as the
TLS server, the dialer as the TLS client, with the same options. The factories wrap the
protocol themselves, rather than the listening port or the endpoint being wrapped, so that the
``PeerProtocol`` is the TLS layer's own protocol and hears that the TLS handshake is through
(``handshakeCompleted``), and so that a connection is refused before any TLS work is done.

The accepting side caps the connections that have not finished their handshake (TLS, then the
peer handshake), whose peer is not known to be a node of the cluster yet: past
``PeerSettings.max_handshakes_per_ip`` from one source address, or ``max_handshakes`` in all, a
new connection is closed at accept, counted (``per_ip_limit``, ``total_limit``) and logged at
most once a minute. A connection leaves the count when its peer handshake succeeds or when it
ends; an idle one ends at the handshake timeout.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from twisted.application.internet import ClientService, backoffPolicy
from twisted.application.service import Service
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import (
    Deferred,
    fail,
    gatherResults,
    succeed,
)
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.interfaces import (
    IAddress,
    IProtocol,
    IProtocolFactory,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.ssl import CertificateOptions
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from zope.interface import implementer

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
    PeerObserver,
    PeerProtocol,
    PeerSettings,
    RequestHandler,
)
from logbroker.peer.window import PeerError

log = Logger()

#: The least time between two log lines about connections refused at accept.
REFUSAL_LOG_SECONDS = 60.0

#: Seconds before the ``attempt``-th try of a link in a row: 0.2 s after a link is lost (or a
#: first try failed), doubling up to 30 s. Peers are near (one data centre): a link lost is
#: tried again at once, so that a dead peer is found refusing within a fifth of a second.
PEER_RETRY_POLICY = backoffPolicy(
    initialDelay=0.1, factor=2.0, maxDelay=30.0, jitter=lambda: random.random() / 10
)


def _source(addr: IAddress | None) -> str:
    """The address a connection comes from, as the caps count it."""
    return addr.host if isinstance(addr, IPv4Address | IPv6Address) else "unknown"


class _Handshaking:
    """Accepted connections still in their handshake, by source address."""

    def __init__(self, per_source: int, total: int) -> None:
        self._per_source = per_source
        self._total = total
        self._counts: dict[str, int] = {}
        self.total = 0

    def admit(self, source: str) -> str | None:
        """Count a new connection from ``source``; the refusal (a ``REFUSALS`` reason) if it
        would take a count past its cap, then nothing is counted."""
        if self._counts.get(source, 0) >= self._per_source:
            return "per_ip_limit"
        if self.total >= self._total:
            return "total_limit"
        self._counts[source] = self._counts.get(source, 0) + 1
        self.total += 1
        return None

    def release(self, source: str) -> None:
        count = self._counts.pop(source) - 1
        if count:
            self._counts[source] = count
        self.total -= 1


class _Build(Factory):
    """The protocol factory a TLS layer wraps: ``build`` makes each connection's protocol."""

    def __init__(self, build: Callable[[IAddress | None], PeerProtocol]) -> None:
        self._build = build

    def buildProtocol(self, addr: IAddress | None) -> PeerProtocol:
        return self._build(addr)


class PeerServerFactory(Factory):
    """The accepting side of the peer port: serves each established peer's requests with
    ``handler``, one connection per peer node (a newer connection from a node replaces its
    older one, which is likely half-open from before the node reconnected). ``tls``: mutual
    TLS on every connection."""

    def __init__(
        self,
        identity: PeerIdentity,
        clock: IReactorTime,
        handler: RequestHandler,
        settings: PeerSettings | None = None,
        observer: PeerObserver = UNOBSERVED,
        tls: CertificateOptions | None = None,
        on_refused: Callable[[str, float], None] = lambda node_id, began: None,
    ) -> None:
        if identity.mutual_tls != (tls is not None):
            raise ValueError("an identity is mutual TLS exactly when TLS options are given")
        self._identity = identity
        self._clock = clock
        self._handler = handler
        self._settings = settings = settings or PeerSettings()
        self._observer = observer
        self._tls: TLSMemoryBIOFactory | None = None
        if tls is not None:
            self._tls = TLSMemoryBIOFactory(tls, False, _Build(self._peer_protocol), clock)
        #: Every open connection, established or not.
        self.connections: set[PeerProtocol] = set()
        self._by_peer: dict[str, PeerProtocol] = {}
        self._handshaking = _Handshaking(settings.max_handshakes_per_ip, settings.max_handshakes)
        #: The source address of each connection still in its handshake.
        self._sources: dict[PeerProtocol, str] = {}
        self._refusals_unlogged = 0
        self._refusal_logged_at: float | None = None

    @property
    def handshaking(self) -> int:
        """Connections still in their handshake."""
        return self._handshaking.total

    def buildProtocol(self, addr: IAddress | None) -> Protocol | None:
        source = _source(addr)
        refusal = self._handshaking.admit(source)
        if refusal is not None:
            self._observer.refused(refusal)
            self._log_refusal(source, refusal)
            return None
        if self._tls is None:
            return self._peer_protocol(addr)
        assert addr is not None  # a listening port always knows where a connection is from
        return self._tls.buildProtocol(addr)

    def _peer_protocol(self, addr: IAddress | None) -> PeerProtocol:
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
        self._sources[protocol] = _source(addr)
        return protocol

    def _log_refusal(self, source: str, refusal: str) -> None:
        self._refusals_unlogged += 1
        now = self._clock.seconds()
        logged_at = self._refusal_logged_at
        if logged_at is not None and now - logged_at < REFUSAL_LOG_SECONDS:
            return
        settings = self._settings
        log.warn(
            "Refused {count} peer port connection(s) at accept, the latest from {source}:"
            " {cap} (connections in their handshake: {handshaking}; SVC_PEER_MAX_HANDSHAKES"
            "_PER_IP={per_ip}, SVC_PEER_MAX_HANDSHAKES={total})",
            count=self._refusals_unlogged,
            source=source,
            cap=refusal,
            handshaking=self._handshaking.total,
            per_ip=settings.max_handshakes_per_ip,
            total=settings.max_handshakes,
        )
        self._refusals_unlogged = 0
        self._refusal_logged_at = now

    def _handshake_over(self, protocol: PeerProtocol) -> None:
        source = self._sources.pop(protocol, None)
        if source is not None:
            self._handshaking.release(source)

    def _established(self, protocol: PeerProtocol) -> None:
        self._handshake_over(protocol)
        peer = protocol.peer_node_id
        assert peer is not None
        older = self._by_peer.get(peer)
        self._by_peer[peer] = protocol
        if older is not None:
            older.close()

    def _ended(self, protocol: PeerProtocol) -> None:
        self._handshake_over(protocol)
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
        factory: IProtocolFactory = _DialerFactory(self)
        if owner._tls is not None:
            factory = TLSMemoryBIOFactory(owner._tls, True, factory, owner._clock)
        self.service = ClientService(
            _RefusalReporting(
                owner._endpoint_for(node_id),
                owner._clock,
                lambda began: owner._on_refused(node_id, began),
            ),
            factory,
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


@implementer(IStreamClientEndpoint)
class _RefusalReporting:
    """A link's endpoint that reports each connection attempt the peer's host refused, with
    when the attempt began: nothing listened on the peer port then."""

    def __init__(
        self,
        endpoint: IStreamClientEndpoint,
        clock: IReactorTime,
        report: Callable[[float], None],
    ) -> None:
        self._endpoint = endpoint
        self._clock = clock
        self._report = report

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        began = self._clock.seconds()

        def failed(failure: Failure) -> Failure:
            if isinstance(failure.value, ConnectionRefusedError):
                self._report(began)
            return failure

        connecting: Deferred[IProtocol] = self._endpoint.connect(factory)
        return connecting.addErrback(failed)


class _DialerFactory(Factory):
    def __init__(self, link: _Link) -> None:
        self._link = link

    def buildProtocol(self, addr: IAddress | None) -> PeerProtocol:
        protocol = self._link.build()
        protocol.factory = self
        return protocol


class PeerConnections(Service):
    """One outbound peer link per peer node, each kept up by a ``ClientService``.

    ``endpoint_for(node_id)`` gives the endpoint to dial a node at; ``tls``, mutual TLS on
    every connection. ``retry_policy`` maps failed attempts in a row to the seconds to wait
    (default ``PEER_RETRY_POLICY``). The handshake runs inside the connection rather than in
    ``ClientService``'s ``prepareConnection``, which cannot take a connection that closes
    before it was handed over (as a refused one does); so the backoff adds the handshakes that
    failed in a row to the attempts ``ClientService`` counts, and a refusing peer is retried
    ever more slowly rather than every second.

    ``on_refused(node_id, began)`` is told of every connection attempt to a peer that its host
    refused (nothing listened on the peer port when the attempt ``began``): the peer's process
    is gone, which the node acts on long before the peer's membership lease runs out. The
    default retry policy tries a lost link again within a fifth of a second, so that a peer
    killed is found gone at once, then backs off.
    """

    def __init__(
        self,
        identity: PeerIdentity,
        clock: IReactorTime,
        endpoint_for: Callable[[str], IStreamClientEndpoint],
        settings: PeerSettings | None = None,
        retry_policy: Callable[[int], float] | None = None,
        observer: PeerObserver = UNOBSERVED,
        tls: CertificateOptions | None = None,
        on_refused: Callable[[str, float], None] = lambda node_id, began: None,
    ) -> None:
        if identity.mutual_tls != (tls is not None):
            raise ValueError("an identity is mutual TLS exactly when TLS options are given")
        self._identity = identity
        self._tls = tls
        self._clock = clock
        self._endpoint_for = endpoint_for
        self._settings = settings or PeerSettings()
        self._retry_policy = retry_policy or PEER_RETRY_POLICY
        self._on_refused = on_refused
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
