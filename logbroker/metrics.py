"""Every ``svc_`` series the broker exports, on one injected ``CollectorRegistry``.

The composition root makes one ``Metrics`` and hands it to what feeds it: the range logs' hooks
(integrity events, flushes), the broker core (records and bytes produced and consumed), periodic
tasks, the client port's guards (auth attempts, limits, sessions), the etcd store (control-plane
requests) and the peer port and links (connections, bytes) through the methods below, whose hooks
the composition root connects; the cluster's state is read from a watched ``ClusterView``.
Nothing here touches prometheus_client's global default registry, so tests and several brokers
in one process never see each other's counts. ``docs/metrics.md`` lists every series and what to
do about it.

Every label value of a labelled series (topics aside) is created at construction, so each series
shows, at 0, from the first scrape: a rate over a series that appears only at its first increment
misses that increment, and an absent series cannot tell "none happened" from "not exported".

Everything here runs in the reactor thread, scrapes included: the scrape-time gauges read the
range logs' state, which only the reactor thread changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import attrs
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import deferLater

from logbroker import __version__
from logbroker.controlplane import ControlPlane, ControlPlaneClosedError
from logbroker.peer.link import REFUSALS
from logbroker.storage import CopyState, DamageReason, Flush, IntegrityEvent, OpenLogs

if TYPE_CHECKING:
    # Only for annotations: the cluster package may import this module.
    from logbroker.cluster.view import ClusterView

# The label values of each labelled series (topics and tasks aside). The methods take them as
# strings, so that the callers' own string enums (``AuthResult``, ``Action``) pass as they are;
# a value outside these raises ``KeyError`` rather than starting a new series.
AUTH_RESULTS = ("ok", "invalid_credentials", "rate_limited")
RATE_LIMIT_ACTIONS = ("auth", "dashboard_auth", "publish", "subscribe")
CONNECTION_LIMITS = ("per_ip", "global")
TLS_OUTCOMES = ("ok", "failed")
SCRUB_RESULTS = ("verified", "repaired", "unrepairable")
#: The etcd requests the control plane and the membership make, and how each can end: ``ok`` an
#: answer (a transaction whose compare failed included: etcd answered it), ``error`` an answer
#: refusing the request (an unknown lease, a request etcd rejects), ``unavailable`` no answer at
#: all (no member reachable, a timeout).
CONTROLPLANE_OPS = ("range", "txn", "watch", "grant", "keepalive", "revoke", "authenticate")
CONTROLPLANE_RESULTS = ("ok", "error", "unavailable")
PEER_DIRECTIONS = ("in", "out")
#: Why a node refused a peer connection.
PEER_REFUSALS = REFUSALS
NODE_STATES = ("alive", "dead")

#: Records per flush: one append alone up to well past the default ``flush_max_records`` (8000).
FLUSH_RECORDS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
#: Seconds per flush: from an NVMe fsync (about 0.1 ms) to a disk in trouble.
FLUSH_SECONDS_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
#: Seconds per etcd request: from a member on the same host to one timing out.
CONTROLPLANE_SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: How far ahead the reactor-lag probe asks for its call.
REACTOR_LAG_PROBE_DELAY_SECONDS = 0.1


@attrs.frozen
class MetricsSnapshot:
    """The counters and gauges as plain numbers, for the dashboard's JSON payload. Labelled
    series are dicts by label value."""

    produced_records: dict[str, int]
    produced_bytes: dict[str, int]
    consumed_records: dict[str, int]
    consumed_bytes: dict[str, int]
    auth_attempts: dict[str, int]
    rate_limit_blocks: dict[str, int]
    connection_limit_blocks: dict[str, int]
    sessions_expired: int
    session_hijack_attempts: int
    tls_handshakes: dict[str, int]
    open_connections: int
    integrity_failures: dict[str, int]
    scrub_segments: dict[str, int]
    retention_segments_removed: int
    retention_bytes_removed: int
    domain_violations: int
    periodic_task_failures: dict[str, int]
    group_commit_flushes: int
    reactor_lag_seconds: float
    ready: bool
    uptime_seconds: float
    topics: int
    ranges: int
    storage_bytes: int
    storage_segments: dict[str, int]
    #: Nodes of the cluster by state (``alive``, ``dead``); both 0 until a view is watched.
    cluster_nodes: dict[str, int]
    peer_connections: int
    #: Peer-port bytes by direction (``in``, ``out``).
    peer_bytes: dict[str, int]


class Metrics:
    """The broker's series on ``registry`` (a new one unless given); ``clock`` gives uptime."""

    def __init__(self, clock: IReactorTime, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self._started = clock.seconds()
        r = self.registry

        # -- storage ---------------------------------------------------------------------
        self._integrity_failures = Counter(
            "svc_storage_integrity_failures_total",
            "Stored data that failed verification, by reason (torn tails of active segments"
            " after a crash are not counted).",
            ["reason"],
            registry=r,
        )
        self._integrity = _children(
            self._integrity_failures, [reason.value for reason in DamageReason]
        )
        # The subset that is corruption at rest, apart, so that an alert need not tell it from
        # ordinary crash recovery (which only active segments see).
        self._sealed_integrity_failures = Counter(
            "svc_storage_sealed_integrity_failures_total",
            "Integrity failures found in sealed segments (corruption at rest), by reason.",
            ["reason"],
            registry=r,
        )
        self._sealed_integrity = _children(
            self._sealed_integrity_failures, [reason.value for reason in DamageReason]
        )
        self._scrub_segments = Counter(
            "svc_storage_scrub_segments_total",
            "Sealed segments the integrity scrub checked, by result.",
            ["result"],
            registry=r,
        )
        # Every result shown from the start (the spec's alerts watch ``verified`` advance).
        self._scrub = _children(self._scrub_segments, SCRUB_RESULTS)
        self._retention_segments = Counter(
            "svc_retention_segments_removed_total",
            "Sealed segments retention removed (counted by the node that decided: the chores"
            " lease holder in a cluster).",
            registry=r,
        )
        self._retention_bytes = Counter(
            "svc_retention_bytes_removed_total",
            "Bytes of the sealed segments retention removed (one copy's; each replica"
            " reclaims as much).",
            registry=r,
        )
        # The "scrub stalled" alert keys on it being 1.
        self._scrub_enabled = Gauge(
            "svc_scrub_enabled",
            "1 while the integrity scrub runs on this node (SVC_SCRUB_ENABLED, on a node that"
            " scrubs).",
            registry=r,
        )
        self._flush_records = Histogram(
            "svc_group_commit_flush_records",
            "Records written by one write and fsync of a range log.",
            buckets=FLUSH_RECORDS_BUCKETS,
            registry=r,
        )
        self._flush_seconds = Histogram(
            "svc_group_commit_flush_duration_seconds",
            "Time a writer thread took for one write and fsync of a range log.",
            buckets=FLUSH_SECONDS_BUCKETS,
            registry=r,
        )
        self._inventory = _Inventory()
        r.register(self._inventory)

        # -- broker ----------------------------------------------------------------------
        self._produced_records = Counter(
            "svc_produced_records_total",
            "Records acknowledged to producers (durable), by topic.",
            ["topic"],
            registry=r,
        )
        self._produced_bytes = Counter(
            "svc_produced_bytes_total",
            "Key and value bytes of the records acknowledged to producers, by topic.",
            ["topic"],
            registry=r,
        )
        self._forwarded_records = Counter(
            "svc_forwarded_records_total",
            "Records of produces taken here that were appended by another node, the primary"
            " of their range.",
            registry=r,
        )
        self._consumed_records = Counter(
            "svc_consumed_records_total",
            "Records handed out by fetches and subscription pushes, by topic.",
            ["topic"],
            registry=r,
        )
        self._consumed_bytes = Counter(
            "svc_consumed_bytes_total",
            "Key and value bytes of the records handed out by fetches and subscription pushes,"
            " by topic.",
            ["topic"],
            registry=r,
        )
        #: Per topic: (produced records, produced bytes, consumed records, consumed bytes),
        #: looked up once per produce or fetch instead of through ``labels``.
        self._topics: dict[str, tuple[Counter, Counter, Counter, Counter]] = {}

        # -- clients, security -----------------------------------------------------------
        self._auth_attempts = Counter(
            "svc_auth_attempts_total",
            "Authentication attempts, by result.",
            ["result"],
            registry=r,
        )
        self._auth = _children(self._auth_attempts, AUTH_RESULTS)
        self._rate_limit_blocks = Counter(
            "svc_rate_limit_blocks_total",
            "Requests the rate limiter refused, by action.",
            ["action"],
            registry=r,
        )
        self._blocks = _children(self._rate_limit_blocks, RATE_LIMIT_ACTIONS)
        self._connection_limit_blocks = Counter(
            "svc_connection_limit_blocks_total",
            "Connections refused at accept by a connection limit, by limit.",
            ["limit"],
            registry=r,
        )
        self._refused = _children(self._connection_limit_blocks, CONNECTION_LIMITS)
        self._sessions_expired = Counter(
            "svc_session_expired_total",
            "Session validations that found the session expired.",
            registry=r,
        )
        self._session_hijacks = Counter(
            "svc_session_hijack_attempt_total",
            "Session tokens presented from another IP than the session's (NAT rotation too).",
            registry=r,
        )
        self._tls_handshakes = Counter(
            "svc_tls_handshakes_total",
            "TLS handshakes on the client port, by outcome.",
            ["outcome"],
            registry=r,
        )
        self._tls = _children(self._tls_handshakes, TLS_OUTCOMES)
        self._open_connections = Gauge(
            "svc_open_connections",
            "Client connections open now.",
            registry=r,
        )

        # -- cluster ---------------------------------------------------------------------
        self._cluster = _ClusterGauges()
        r.register(self._cluster)
        self._controlplane_requests = Counter(
            "svc_controlplane_requests_total",
            "Requests to etcd by the control plane and the membership, by operation and result.",
            ["op", "result"],
            registry=r,
        )
        self._controlplane = {
            (op, result): self._controlplane_requests.labels(op, result)
            for op in CONTROLPLANE_OPS
            for result in CONTROLPLANE_RESULTS
        }
        self._controlplane_seconds = Histogram(
            "svc_controlplane_request_seconds",
            "Time from sending a request to etcd to its answer (or its failure), by operation.",
            ["op"],
            buckets=CONTROLPLANE_SECONDS_BUCKETS,
            registry=r,
        )
        self._controlplane_latency = {
            op: self._controlplane_seconds.labels(op) for op in CONTROLPLANE_OPS
        }
        self._peer_connections = Gauge(
            "svc_peer_connections",
            "Peer-port connections open now, accepted and dialled.",
            registry=r,
        )
        self._peer_bytes_total = Counter(
            "svc_peer_bytes_total",
            "Bytes received from and sent to peers, by direction.",
            ["direction"],
            registry=r,
        )
        self._peer_bytes = _children(self._peer_bytes_total, PEER_DIRECTIONS)
        self._peer_refusals = _children(
            Counter(
                "svc_peer_connections_refused_total",
                "Peer-port connections this node refused, accepted and dialled, by reason.",
                ["reason"],
                registry=r,
            ),
            PEER_REFUSALS,
        )

        # -- process ---------------------------------------------------------------------
        ProcessCollector(namespace="svc", registry=r)
        Gauge(
            "svc_build_info",
            "The running logbroker's version (the value is always 1).",
            ["version"],
            registry=r,
        ).labels(__version__).set(1)
        Gauge(
            "svc_uptime_seconds",
            "Seconds since the broker was built.",
            registry=r,
        ).set_function(lambda: self._clock.seconds() - self._started)
        self._ready = Gauge(
            "svc_ready",
            "1 while the broker accepts clients, else 0.",
            registry=r,
        )
        self._reactor_lag = Gauge(
            "svc_reactor_lag_seconds",
            "How late the reactor ran the last probe's timed call.",
            registry=r,
        )
        self._task_failures = Counter(
            "svc_periodic_task_failures_total",
            "Runs of a periodic task that failed, by task.",
            ["task"],
            registry=r,
        )
        self._task_last_success = Gauge(
            "svc_periodic_task_last_success_timestamp_seconds",
            "When a periodic task last ran successfully, by task (absent until it has).",
            ["task"],
            registry=r,
        )

    # -- storage ---------------------------------------------------------------------------

    def integrity_event(self, event: IntegrityEvent) -> None:
        """A range log's ``on_integrity_event`` hook: counts what it reports as a failure."""
        if event.counted:
            self._integrity[event.reason.value].inc()
        if event.sealed:
            self._sealed_integrity[event.reason.value].inc()

    def scrub_running(self, running: bool) -> None:
        """The integrity scrub started (or stopped) on this node."""
        self._scrub_enabled.set(1 if running else 0)

    def retention_removed(self, segments: int, byte_size: int) -> None:
        """Retention removed ``segments`` sealed segments of ``byte_size`` bytes."""
        self._retention_segments.inc(segments)
        self._retention_bytes.inc(byte_size)

    def scrub_checked(self, result: str) -> None:
        """The scrub checked a sealed segment: ``verified``, ``repaired`` or ``unrepairable``."""
        self._scrub[result].inc()

    def flushed(self, flush: Flush) -> None:
        """A range log's ``on_flushed`` hook."""
        self._flush_records.observe(flush.records)
        self._flush_seconds.observe(flush.seconds)

    def watch(self, control: ControlPlane, storage: OpenLogs) -> None:
        """Report topics, ranges and the segments held, read from these at every scrape."""
        self._inventory.control = control
        self._inventory.storage = storage

    # -- broker ----------------------------------------------------------------------------

    def _topic(self, topic: str) -> tuple[Counter, Counter, Counter, Counter]:
        children = self._topics.get(topic)
        if children is None:
            children = self._topics[topic] = (
                self._produced_records.labels(topic),
                self._produced_bytes.labels(topic),
                self._consumed_records.labels(topic),
                self._consumed_bytes.labels(topic),
            )
        return children

    def produced(self, topic: str, records: int, size: int) -> None:
        """``records`` records with ``size`` bytes of keys and values were acknowledged."""
        children = self._topic(topic)
        children[0].inc(records)
        children[1].inc(size)

    def forwarded(self, records: int) -> None:
        """``records`` records taken here were appended by their range's primary, another
        node, which acknowledged them."""
        self._forwarded_records.inc(records)

    def consumed(self, topic: str, records: int, size: int) -> None:
        """``records`` records with ``size`` bytes of keys and values were handed out."""
        children = self._topic(topic)
        children[2].inc(records)
        children[3].inc(size)

    # -- clients, security ------------------------------------------------------------------

    def auth_attempt(self, result: str) -> None:
        """An authentication attempt ended with ``result``, one of ``AUTH_RESULTS``."""
        self._auth[result].inc()

    def rate_limit_blocked(self, action: str) -> None:
        """The rate limiter refused a request of ``action``, one of ``RATE_LIMIT_ACTIONS`` (an
        authentication it refused is also an ``auth_attempt("rate_limited")``)."""
        self._blocks[action].inc()

    def connection_refused(self, limit: str) -> None:
        """A connection was refused at accept by a cap: ``limit`` in ``CONNECTION_LIMITS``."""
        self._refused[limit].inc()

    def session_expired(self) -> None:
        """A session validation found the session expired."""
        self._sessions_expired.inc()

    def session_hijack_attempt(self) -> None:
        """A session token arrived from another IP than its session's."""
        self._session_hijacks.inc()

    def tls_handshake(self, outcome: str) -> None:
        """A TLS handshake ended with ``outcome``, one of ``TLS_OUTCOMES``."""
        self._tls[outcome].inc()

    def watch_connections(self, count: Callable[[], int]) -> None:
        """Read the open client connections from ``count`` at every scrape (the connection
        registry's total: it already counts every accept and every way a connection ends)."""
        self._open_connections.set_function(count)

    # -- cluster ---------------------------------------------------------------------------

    def watch_cluster(self, view: ClusterView) -> None:
        """Report the cluster's nodes, domain violations and this node's lease age, read from
        ``view`` at every scrape."""
        self._cluster.view = view

    def controlplane_request(self, op: str, result: str, seconds: float) -> None:
        """An etcd request ``op`` (one of ``CONTROLPLANE_OPS``) ended with ``result`` (one of
        ``CONTROLPLANE_RESULTS``) after ``seconds``."""
        self._controlplane[op, result].inc()
        self._controlplane_latency[op].observe(seconds)

    def peer_connection_opened(self) -> None:
        """A peer connection, accepted or dialled, is made."""
        self._peer_connections.inc()

    def peer_connection_closed(self) -> None:
        """A peer connection counted by ``peer_connection_opened`` is lost."""
        self._peer_connections.dec()

    def peer_connection_refused(self, reason: str) -> None:
        """This node refused a peer connection, for ``reason`` (one of ``PEER_REFUSALS``)."""
        self._peer_refusals[reason].inc()

    def peer_bytes(self, direction: str, count: int) -> None:
        """``count`` bytes went ``direction`` (``in`` or ``out``) on a peer connection."""
        self._peer_bytes[direction].inc(count)

    # -- process ---------------------------------------------------------------------------

    def set_ready(self, ready: bool) -> None:
        """Whether the broker accepts clients (the composition root says)."""
        self._ready.set(1 if ready else 0)

    def reactor_lag(self, seconds: float) -> None:
        """The reactor-lag probe measured ``seconds`` of lateness."""
        self._reactor_lag.set(seconds)

    def periodic_task_added(self, task: str) -> None:
        """A ``PeriodicTask`` named ``task`` exists: its failure count shows from now on."""
        self._task_failures.labels(task)

    def periodic_task_failed(self, task: str) -> None:
        self._task_failures.labels(task).inc()

    def periodic_task_succeeded(self, task: str, now: float) -> None:
        self._task_last_success.labels(task).set(now)

    # -- output ----------------------------------------------------------------------------

    def render_text(self) -> bytes:
        """Every series in Prometheus' text exposition format (``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry)

    def snapshot(self) -> MetricsSnapshot:
        """The current values, as plain numbers."""
        inventory = self._inventory.values()
        cluster = self._cluster.values()
        flushes = _samples(self._flush_records, "_count")
        return MetricsSnapshot(
            produced_records=_counts(self._produced_records),
            produced_bytes=_counts(self._produced_bytes),
            consumed_records=_counts(self._consumed_records),
            consumed_bytes=_counts(self._consumed_bytes),
            auth_attempts=_counts(self._auth_attempts),
            rate_limit_blocks=_counts(self._rate_limit_blocks),
            connection_limit_blocks=_counts(self._connection_limit_blocks),
            sessions_expired=_count(self._sessions_expired),
            session_hijack_attempts=_count(self._session_hijacks),
            tls_handshakes=_counts(self._tls_handshakes),
            open_connections=int(_value(self._open_connections)),
            integrity_failures=_counts(self._integrity_failures),
            scrub_segments=_counts(self._scrub_segments),
            retention_segments_removed=_count(self._retention_segments),
            retention_bytes_removed=_count(self._retention_bytes),
            domain_violations=cluster.domain_violations,
            periodic_task_failures=_counts(self._task_failures),
            group_commit_flushes=int(flushes[0]),
            reactor_lag_seconds=_value(self._reactor_lag),
            ready=_value(self._ready) == 1,
            uptime_seconds=self._clock.seconds() - self._started,
            topics=inventory.topics,
            ranges=inventory.ranges,
            storage_bytes=inventory.storage_bytes,
            storage_segments=inventory.segments,
            cluster_nodes=cluster.nodes,
            peer_connections=int(_value(self._peer_connections)),
            peer_bytes=_counts(self._peer_bytes_total),
        )


class ReactorLagProbe:
    """The work of the reactor-lag ``PeriodicTask``: each run asks ``clock`` for a call
    ``delay`` seconds later and reports how much later than that it came. A reactor busy with
    a long callback, or starved of the GIL, runs every timer (group commit's among them) and
    every read that late."""

    def __init__(
        self,
        clock: IReactorTime,
        report: Callable[[float], None],
        delay: float = REACTOR_LAG_PROBE_DELAY_SECONDS,
    ) -> None:
        self._clock = clock
        self._report = report
        self._delay = delay

    def __call__(self) -> Deferred[None]:
        asked = self._clock.seconds()

        def fired() -> None:
            self._report(max(0.0, self._clock.seconds() - asked - self._delay))

        return deferLater(self._clock, self._delay, fired)


@attrs.frozen
class _InventoryValues:
    topics: int
    ranges: int
    storage_bytes: int
    segments: dict[str, int]
    out_of_service: int = 0


class _Inventory:
    """Gauges computed at scrape time from the control plane and the open range logs."""

    def __init__(self) -> None:
        self.control: ControlPlane | None = None
        self.storage: OpenLogs | None = None

    def values(self) -> _InventoryValues:
        control = self.control
        try:
            topics = control.topics() if control is not None else []
            ranges = sum(len(control.ranges(t.name)) for t in topics) if control is not None else 0
        except ControlPlaneClosedError:
            # Not started yet (or stopping): no topics to report meanwhile.
            topics, ranges = [], 0
        segments = dict.fromkeys((state.value for state in CopyState), 0)
        size = 0
        logs = self.storage.logs.values() if self.storage is not None else ()
        out_of_service = 0
        for range_log in logs:
            out_of_service += range_log.failed
            for info in range_log.segments():
                segments[info.state.value] += 1
                size += info.byte_size
        return _InventoryValues(len(topics), ranges, size, segments, out_of_service)

    def describe(self) -> Iterable[Metric]:
        return self._families(_InventoryValues(0, 0, 0, {}))

    def collect(self) -> Iterable[Metric]:
        return self._families(self.values())

    def _families(self, values: _InventoryValues) -> list[Metric]:
        segments = GaugeMetricFamily(
            "svc_storage_segments",
            "Segments this node holds, by state.",
            labels=["state"],
        )
        for state, count in values.segments.items():
            segments.add_metric([state], count)
        return [
            GaugeMetricFamily("svc_topics", "Topics.", value=values.topics),
            GaugeMetricFamily("svc_ranges", "Ranges of every topic.", value=values.ranges),
            GaugeMetricFamily(
                "svc_storage_bytes",
                "Bytes of record data in the segments this node holds (readable bytes of a"
                " damaged copy).",
                value=values.storage_bytes,
            ),
            segments,
            GaugeMetricFamily(
                "svc_storage_ranges_out_of_service",
                "Range logs that refuse writes after a write or fsync failed (a full or failing"
                " disk), until a probe write and fsync succeed again.",
                value=values.out_of_service,
            ),
        ]


@attrs.frozen
class _ClusterValues:
    nodes: dict[str, int]
    domain_violations: int
    lease_age_seconds: float | None
    under_replicated: int | None
    unavailable_ranges: int | None


def _no_cluster() -> _ClusterValues:
    return _ClusterValues(dict.fromkeys(NODE_STATES, 0), 0, None, 0, 0)


class _ClusterGauges:
    """Gauges computed at scrape time from the watched ``ClusterView`` (none: one node's worth
    of nothing, every count 0 and no lease)."""

    def __init__(self) -> None:
        self.view: ClusterView | None = None

    def values(self) -> _ClusterValues:
        if self.view is None:
            return _no_cluster()
        status = self.view.status()
        alive = sum(node.alive for node in status.nodes)
        return _ClusterValues(
            {"alive": alive, "dead": len(status.nodes) - alive},
            status.domain_violations,
            status.lease_age_seconds,
            status.under_replicated,
            status.unavailable_ranges,
        )

    def describe(self) -> Iterable[Metric]:
        return self._families(_no_cluster())

    def collect(self) -> Iterable[Metric]:
        return self._families(self.values())

    def _families(self, values: _ClusterValues) -> list[Metric]:
        nodes = GaugeMetricFamily(
            "svc_cluster_nodes",
            "Nodes of the cluster as this node sees them, by state.",
            labels=["state"],
        )
        for state, count in values.nodes.items():
            nodes.add_metric([state], count)
        # Absent (no sample) without a lease: on one node, or before the first registration.
        lease = GaugeMetricFamily(
            "svc_membership_lease_age_seconds",
            "Seconds since etcd last renewed this node's membership lease (absent without one).",
            labels=[],
        )
        if values.lease_age_seconds is not None:
            lease.add_metric([], values.lease_age_seconds)
        # Absent until this node has first counted: a node just started knows nothing yet.
        under_replicated = GaugeMetricFamily(
            "svc_under_replicated_segments",
            "Segments of the cluster with fewer whole copies on live nodes than the"
            " replication factor, as this node last counted them (0 is healthy).",
            labels=[],
        )
        if values.under_replicated is not None:
            under_replicated.add_metric([], values.under_replicated)
        unavailable = GaugeMetricFamily(
            "svc_unavailable_ranges",
            "Ranges whose active segment has fewer live replicas than a quorum, so that no"
            " node leads them until enough are back, as this node last counted them (0 is"
            " healthy).",
            labels=[],
        )
        if values.unavailable_ranges is not None:
            unavailable.add_metric([], values.unavailable_ranges)
        return [
            nodes,
            GaugeMetricFamily(
                "svc_domain_violations",
                "Segments whose replicas do not meet their placement spread.",
                value=values.domain_violations,
            ),
            under_replicated,
            unavailable,
            lease,
        ]


def _children(counter: Counter, values: Iterable[str]) -> dict[str, Counter]:
    """Every label value's child of a one-label counter, created now so each shows at 0."""
    return {value: counter.labels(value) for value in values}


def _samples(metric: Counter | Gauge | Histogram, suffix: str) -> list[float]:
    (family,) = metric.collect()
    return [sample.value for sample in family.samples if sample.name == family.name + suffix]


def _value(gauge: Gauge) -> float:
    (value,) = _samples(gauge, "")
    return value


def _count(counter: Counter) -> int:
    (value,) = _samples(counter, "_total")
    return int(value)


def _counts(counter: Counter) -> dict[str, int]:
    """A one-label counter's values by label value."""
    (family,) = counter.collect()
    return {
        next(iter(sample.labels.values())): int(sample.value)
        for sample in family.samples
        if sample.name == family.name + "_total"
    }
