"""The parts of a broker node that make it a member of a cluster, assembled from the config.

``build_cluster`` makes the etcd control plane, the node's membership (registered under a lease),
the peer port's listener and one outbound peer link per live member, and the range directory that
serves this node's ranges locally and forwards the others. etcd is reached as
``SVC_CONTROL_PLANE`` and ``SVC_ETCD_*`` say (TLS, client certificate, etcd user); with the
node's TLS on, the peer port and links run mutual TLS with the node's certificate, which must
name the node (``URI:logbroker://<cluster id>/<node id>``). The composition root
adds the services to its tree where ``logbroker.node_modes.ClusterMember`` says, and fills in
the node's record once its ports are bound. Nothing here touches the global reactor:
everything that schedules or connects is given ``reactor``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import attrs
from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IListeningPort, IStreamClientEndpoint
from twisted.logger import Logger

from logbroker import __version__
from logbroker.broker.groups import LocalGroups
from logbroker.cluster.assembly import assemble_ranges
from logbroker.cluster.digests import DigestServer
from logbroker.cluster.groups import ClusterGroups, group_handler
from logbroker.cluster.membership import Membership, NodeRecord
from logbroker.cluster.ranges import ClusterRanges
from logbroker.cluster.retention import SegmentTimesServer, cluster_newest_times
from logbroker.cluster.verify import ClusterVerifier, recorded_segments
from logbroker.cluster.view import MembershipView
from logbroker.config import BrokerConfig, ConfigError, EnvMode
from logbroker.controlplane import EtcdControlPlane, EtcdGatewayStore, EtcdUser
from logbroker.controlplane.compaction import COMPACT_EVERY_SECONDS, HistoryCompaction
from logbroker.maintenance.periodic import PeriodicTask
from logbroker.maintenance.retention import NewestTimes
from logbroker.metrics import Metrics
from logbroker.peer.connections import PeerConnections, PeerServerFactory
from logbroker.peer.frames import PeerOp
from logbroker.peer.handshake import PeerIdentity, certificate_uris, node_uri
from logbroker.peer.link import PeerSettings
from logbroker.peer.requester import Loopback
from logbroker.placement import PlacementNode, PlacementRule
from logbroker.replication.core.actions import ReplicationSettings
from logbroker.replication.repair import SegmentRepairs
from logbroker.security.etcd_tls import load_etcd_tls
from logbroker.security.tls import PeerTls
from logbroker.storage import OpenLogs

log = Logger()

#: Peers of a development or test cluster without ``SVC_CLUSTER_SECRET`` prove they know this.
#: It keeps apart clusters that happen to share a network, nothing more: prod refuses it.
DEVELOPMENT_CLUSTER_SECRET = b"logbroker development cluster secret, never for production"
#: How often a node looks for ranges whose primary died and that it should take over.
TAKEOVER_SWEEP_SECONDS = 0.5
#: How often a node heals one copy it lacks and one weak replica set.
HEALING_SECONDS = 1.0


@attrs.define
class ClusterParts:
    control: EtcdControlPlane
    membership: Membership
    ranges: ClusterRanges
    #: Takes over the ranges whose primary died, and heals copies and replica sets
    #: (replication factor above 1 only).
    chores: list[PeriodicTask]
    view: MembershipView
    peers: PeerConnections
    groups: ClusterGroups
    peer_factory: PeerServerFactory
    store: EtcdGatewayStore
    #: Checks that every sealed segment's copies are complete and identical on every node.
    verifier: ClusterVerifier
    #: Repairs this node's damaged sealed copies (replication factor above 1 only).
    repairs: SegmentRepairs | None
    #: When the sealed segments' newest records were written, for retention by age.
    newest_times: NewestTimes

    def set_record(self, host: str, client_port: int, dashboard_port: int, peer_port: int) -> None:
        """The node's record, once its ports are bound (a port of 0 is a free one)."""
        self.membership.record = attrs.evolve(
            self.membership.record,
            host=host,
            client_port=client_port,
            dashboard_port=dashboard_port,
            peer_port=peer_port,
        )


def cluster_secret(config: BrokerConfig) -> bytes:
    """The secret peers prove they know; ``ConfigError`` in prod without one (checked by
    ``logbroker.config.check_built``), the development secret elsewhere."""
    secret = config.cluster.cluster_secret
    if secret is not None:
        return secret.encode()
    assert config.mode is not EnvMode.PROD
    log.warn(
        "SVC_CLUSTER_SECRET is not set: peers authenticate with the development secret, which"
        " any logbroker knows; set a long random SVC_CLUSTER_SECRET on every node"
    )
    return DEVELOPMENT_CLUSTER_SECRET


@attrs.frozen
class _PeerMetrics:
    """The peer port's and links' ``PeerObserver``, counting into ``metrics``."""

    metrics: Metrics

    def opened(self) -> None:
        self.metrics.peer_connection_opened()

    def closed(self) -> None:
        self.metrics.peer_connection_closed()

    def bytes(self, direction: str, n: int) -> None:
        self.metrics.peer_bytes(direction, n)

    def refused(self, reason: str) -> None:
        self.metrics.peer_connection_refused(reason)


def _etcd_store(reactor: Any, config: BrokerConfig, metrics: Metrics) -> EtcdGatewayStore:
    """The etcd store, its TLS files read and checked now (``ConfigError`` if they fail)."""
    cluster = config.cluster
    access = cluster.etcd
    now = datetime.fromtimestamp(reactor.seconds(), UTC)
    return EtcdGatewayStore(
        [f"{access.scheme}://{_bracketed(host)}:{port}" for host, port in cluster.etcd_endpoints],
        reactor=reactor,
        on_request=metrics.controlplane_request,
        tls=load_etcd_tls(access, [host for host, _ in cluster.etcd_endpoints], now),
        user=(
            None
            if access.user is None or access.password is None
            else EtcdUser(access.user, access.password)
        ),
    )


def _check_names_node(config: BrokerConfig, node_id: str, tls: PeerTls) -> None:
    """The certificate a node shows its peers must name it, or every peer would refuse it."""
    named = node_uri(config.cluster.cluster_id, node_id)
    uris = certificate_uris(tls.certificate)
    if named not in uris:
        raise ConfigError(
            "SVC_TLS_CERTFILE",
            config.tls.certfile,
            f"a certificate naming this node, URI:{named} in its subjectAltName, since the peer"
            f" port runs mutual TLS (it names {', '.join(sorted(uris)) or 'no URI'})",
        )


def build_cluster(
    reactor: Any,
    config: BrokerConfig,
    node_id: str,
    storage: OpenLogs,
    metrics: Metrics,
    peer_tls: PeerTls | None = None,
) -> ClusterParts:
    """The node's cluster parts; the etcd store, the peer port and the peer links count their
    requests, connections and bytes into ``metrics``. ``peer_tls``: the peer port's and links'
    mutual TLS (``ServerTls.peer``). Raises ``ConfigError`` for TLS files that do not serve."""
    cluster = config.cluster
    store = _etcd_store(reactor, config, metrics)
    if peer_tls is not None:
        _check_names_node(config, node_id, peer_tls)
    tls_options = None if peer_tls is None else peer_tls.options
    prefix = f"/logbroker/{cluster.cluster_id}/"
    control = EtcdControlPlane(store, prefix=prefix + "state/", clock=reactor)
    record = NodeRecord(
        node_id=node_id,
        host=cluster.advertise_host or "localhost",
        client_port=0,
        dashboard_port=0,
        peer_port=0,
        attributes=cluster.attributes,
        version=__version__,
    )
    membership = Membership(
        store,
        (prefix + "cluster/").encode(),
        record,
        reactor,
        cluster.node_lease_ms,
        registers_after=control.when_loaded,
    )
    identity = PeerIdentity(
        cluster.cluster_id, node_id, cluster_secret(config), mutual_tls=peer_tls is not None
    )
    # Pings often enough that a leader can tell within a lease TTL whether it still hears its
    # replicas (CheckQuorum), however idle the links are.
    lease_seconds = cluster.node_lease_ms / 1000
    peer_settings = PeerSettings(
        ping_interval_s=lease_seconds / 5,
        dead_after_s=max(3 * lease_seconds, 15.0),
        max_handshakes_per_ip=cluster.peer_limits.max_handshakes_per_ip,
        max_handshakes=cluster.peer_limits.max_handshakes,
    )

    def endpoint_for(peer: str) -> IStreamClientEndpoint:
        found = next((r for r in membership.live_nodes() if r.node_id == peer), None)
        if found is None:
            raise ValueError(f"node {peer!r} is not a live member")
        return HostnameEndpoint(reactor, found.host, found.peer_port)

    peer_metrics = _PeerMetrics(metrics)
    peers = PeerConnections(
        identity,
        reactor,
        endpoint_for,
        peer_settings,
        observer=peer_metrics,
        tls=tls_options,
        on_refused=membership.report_gone,
    )

    def keep_links() -> None:
        live = {r.node_id for r in membership.live_nodes()} - {node_id}
        for gone in peers.peers - live:
            peers.remove_peer(gone)
        for new in sorted(live - peers.peers):
            peers.add_peer(new)

    membership.on_change.append(keep_links)
    rule = PlacementRule.from_settings(cluster)

    def live_nodes() -> list[PlacementNode]:
        return [PlacementNode(r.node_id, r.attributes, True) for r in membership.live_nodes()]

    parts = assemble_ranges(
        node_id=node_id,
        control=control,
        storage=storage,
        peers=peers,
        clock=reactor,
        rule=rule,
        live_nodes=live_nodes,
        holds_lease=lambda: membership.holds_lease,
        replication=ReplicationSettings(
            replication_factor=cluster.replication_factor,
            ack_timeout_seconds=cluster.node_lease_ms / 1000,
        ),
        roll_bytes=config.storage.log.roll_bytes,
        is_live=membership.is_alive,
        repair_metrics=metrics,
        holds_chores=lambda: membership.holds_chores,
        replace_after_seconds=cluster.replica_replace_after_ms / 1000,
        heard_at=peers.heard_at,
        control_follows=lambda: control.following,
        on_forwarded=metrics.forwarded,
    )
    chores: list[PeriodicTask] = []
    replication = parts.replication
    if replication is not None:
        # A node without its lease leads nothing, at once.
        membership.on_lease_lost.append(replication.lead.stop)

        def sweep() -> None:
            # Nothing to do before the control plane has loaded: the first interval can end
            # before etcd has answered (a state of thousands of ranges takes a while).
            if control.loaded:
                replication.sweep(control.range_ids())

        def heal() -> Deferred[None] | None:
            return replication.heal(control.range_ids()) if control.loaded else None

        chores = [
            PeriodicTask(
                "takeover_sweep", TAKEOVER_SWEEP_SECONDS, sweep, reactor, metrics=metrics, now=False
            ),
            PeriodicTask("healing", HEALING_SECONDS, heal, reactor, metrics=metrics, now=False),
        ]
    compaction = HistoryCompaction(store, membership.chores_key, lambda: membership.holds_chores)
    chores.append(
        PeriodicTask(
            "etcd_compaction",
            COMPACT_EVERY_SECONDS,
            compaction.run,
            reactor,
            metrics=metrics,
            now=False,
        )
    )
    local_groups = LocalGroups(reactor, config.topics.group_session_timeout_ms)
    groups = ClusterGroups(node_id, local_groups, live_nodes, peers)
    serve_group = group_handler(local_groups)
    digests = DigestServer(storage)
    times = SegmentTimesServer(storage)
    verifier = ClusterVerifier(
        node_id,
        lambda: recorded_segments(control),
        lambda: [(view.record.node_id, view.alive) for view in membership.nodes()],
        Loopback(node_id, peers, {PeerOp.DIGESTS: lambda sender, payload: digests.serve(payload)}),
        reactor,
    )

    def serve(peer: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        if op is PeerOp.GROUP:
            return serve_group(payload)
        if op is PeerOp.DIGESTS:
            return digests.serve(payload)
        if op is PeerOp.SEGMENT_TIMES:
            return times.serve(payload)
        return parts.serve(peer, op, payload)

    return ClusterParts(
        control=control,
        membership=membership,
        ranges=parts.ranges,
        chores=chores,
        view=MembershipView(
            cluster.cluster_id,
            membership,
            control,
            rule,
            None if replication is None else replication.health,
        ),
        peers=peers,
        groups=groups,
        peer_factory=PeerServerFactory(
            identity, reactor, serve, peer_settings, observer=peer_metrics, tls=tls_options
        ),
        store=store,
        verifier=verifier,
        repairs=None if replication is None else replication.repairs,
        newest_times=cluster_newest_times(
            node_id,
            control,
            Loopback(
                node_id, peers, {PeerOp.SEGMENT_TIMES: lambda sender, payload: times.serve(payload)}
            ),
            membership.is_alive,
        ),
    )


class PeerPortService(Service):
    """The peer port: bound at build time, closing its connections when it stops."""

    def __init__(self, factory: PeerServerFactory, port: IListeningPort) -> None:
        self._factory = factory
        self.port = port

    def stopService(self) -> Deferred[None]:
        super().stopService()  # type: ignore[no-untyped-call]
        self._factory.close_all()
        return maybeDeferred(self.port.stopListening).addCallback(lambda _: None)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
