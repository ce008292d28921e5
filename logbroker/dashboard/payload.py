"""The dashboard's JSON documents, built from plain values (no HTTP, no reactor).

``metrics_payload`` is what ``GET /metrics`` answers without ``Accept: text/plain`` and what the
operator page polls; ``rate_limits_payload`` is ``GET /rate_limits`` (spec, "Endpoints"). Rates
are computed here, server side, by ``RateMeter`` from successive samples of the counters, so
every viewer of the page sees the same figures and a script polling ``/metrics`` gets them too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs

from logbroker import __version__
from logbroker.controlplane import Topic
from logbroker.maintenance.view import MaintenanceView, ScrubStatus
from logbroker.metrics import MetricsSnapshot
from logbroker.security.guards import Guards
from logbroker.security.ratelimit import Action, RateLimiter
from logbroker.storage import CopyState, SegmentInfo

if TYPE_CHECKING:
    from logbroker.cluster.view import ClusterStatus

#: Entries of the per-IP lists (top blocked, busiest connections).
TOP_COUNT = 10

#: The ``top_blocked`` keys ``/rate_limits`` always has; only ``auth`` is ever populated.
TOP_BLOCKED_KEYS = ("auth", "publish", "subscribe", "channel_publish", "channel_subscribe")


class NodeStatus(StrEnum):
    """Where the node is in its life, as ``/ready`` and the page report it."""

    #: Storage recovering or the broker opening: the client port does not accept yet.
    STARTING = "starting"
    #: The client port accepts.
    READY = "ready"
    #: The client port has begun to stop: no new clients, connections draining.
    DRAINING = "draining"
    #: A cluster node that accepts clients but cannot do its part: it holds no membership
    #: lease (etcd has not answered for a lease TTL), so it leads nothing and its changes fail.
    DEGRADED = "degraded"
    #: The client port accepts, but a range log refuses writes since a write or fsync failed
    #: (a full or failing disk): its produces are answered ``storage_unavailable``.
    STORAGE_FAILED = "storage_failed"


#: What ``/ready`` says of each status that is not ready.
NOT_READY_REASONS = {
    NodeStatus.STARTING: "starting: storage, the control plane or the ranges are not open yet",
    NodeStatus.DRAINING: "stopping: the client port no longer accepts",
    NodeStatus.DEGRADED: (
        "the control plane (etcd) has not answered for a membership lease TTL: this node holds"
        " no lease, so it leads no range and cannot make changes; it recovers by itself"
    ),
    NodeStatus.STORAGE_FAILED: (
        "storage: a write or fsync failed (a full or failing disk), and the ranges it hit refuse"
        " writes (svc_storage_ranges_out_of_service counts them) until a probe write and fsync"
        " succeed again (tried every 5 s); the broker's log names each range and the error"
    ),
}


_K = TypeVar("_K", bound=Hashable)

#: Rates are taken over about this long: long enough to smooth a bursty producer, short enough
#: that the page follows a change within a few polls.
RATE_WINDOW_SECONDS = 5.0
#: Samples closer together than this are not kept (several viewers polling at once would
#: otherwise keep one each): at most two windows over this are held.
MIN_SAMPLE_INTERVAL_SECONDS = 0.5


class RateMeter(Generic[_K]):
    """Per-second rates of monotonic counters from successive samples of them.

    Each ``rates`` call is a sample; a rate is the counter's increase since the newest kept
    sample that is at least ``window`` old (or the oldest kept one, early on) over the time
    between them. Samples older than two windows are forgotten: after nobody has looked for a
    while, the first look has no base and its rates are ``None`` rather than an average over
    the idle time.
    """

    def __init__(
        self,
        window: float = RATE_WINDOW_SECONDS,
        min_interval: float = MIN_SAMPLE_INTERVAL_SECONDS,
    ) -> None:
        self._window = window
        self._min_interval = min_interval
        self._samples: deque[tuple[float, dict[_K, int]]] = deque()

    def rates(self, now: float, counters: Mapping[_K, int]) -> dict[_K, float] | None:
        """Sample ``counters`` at ``now``; their rates, or ``None`` while there is no earlier
        sample to compare with."""
        samples = self._samples
        while samples and samples[0][0] < now - 2 * self._window:
            samples.popleft()
        while len(samples) >= 2 and samples[1][0] <= now - self._window:
            samples.popleft()
        base = samples[0] if samples else None
        if not samples or now - samples[-1][0] >= self._min_interval:
            samples.append((now, dict(counters)))
        if base is None or now <= base[0]:
            return None
        since, before = base
        return {
            key: (value - before.get(key, 0)) / (now - since) for key, value in counters.items()
        }


def _pairs(items: Iterable[tuple[str, int]]) -> list[list[str | int]]:
    return [[name, count] for name, count in items]


def metrics_payload(
    *,
    status: NodeStatus,
    mode: str,
    now: float,
    topics: Sequence[Topic],
    segments: Mapping[str, Sequence[SegmentInfo]],
    snapshot: MetricsSnapshot,
    meter: RateMeter[tuple[str, str]],
    guards: Guards,
    cluster: ClusterStatus | None = None,
    maintenance: MaintenanceView | None = None,
) -> dict[str, Any]:
    """The JSON ``/metrics`` document. ``segments`` maps the open range ids to their segments;
    ``meter`` is sampled once, at ``now``, with the per-topic counters; ``cluster`` is what the
    node's cluster view says now (``null`` in the document without one)."""
    series = {
        "produce": snapshot.produced_records,
        "produce_bytes": snapshot.produced_bytes,
        "consume": snapshot.consumed_records,
        "consume_bytes": snapshot.consumed_bytes,
    }
    counts = {(kind, topic): n for kind, values in series.items() for topic, n in values.items()}
    rates = meter.rates(now, counts)

    def rate(kind: str, topic: str) -> float | None:
        # A topic nothing was produced to has no counter yet: its rate is 0.
        return None if rates is None else rates.get((kind, topic), 0.0)

    def total_rate(kind: str) -> float | None:
        return None if rates is None else sum(v for (k, _), v in rates.items() if k == kind)

    topic_rows = []
    for topic in sorted(topics, key=lambda t: t.name):
        held = [info for range_id in topic.range_ids for info in segments.get(range_id, ())]
        topic_rows.append(
            {
                "name": topic.name,
                "keyspace_bits": topic.keyspace_bits,
                "ranges": len(topic.range_ids),
                "segments": len(held),
                "bytes": sum(info.byte_size for info in held),
                "records_produced": series["produce"].get(topic.name, 0),
                "records_consumed": series["consume"].get(topic.name, 0),
                "produce_rate": rate("produce", topic.name),
                "consume_rate": rate("consume", topic.name),
            }
        )

    blocks = snapshot.rate_limit_blocks
    refused = snapshot.connection_limit_blocks
    limiter = guards.limiter
    return {
        "node": {
            "status": status.value,
            "ready": status is NodeStatus.READY,
            "uptime_seconds": round(snapshot.uptime_seconds, 3),
            "version": __version__,
            "mode": mode,
        },
        "system": {
            "rate_limiting": {
                "enabled": limiter.enabled,
                "auth_blocked": blocks.get(Action.AUTH, 0),
                # Configured and reported, never applied (spec, "Rate limits").
                "publish_blocked": blocks.get(Action.PUBLISH, 0),
                "subscribe_blocked": blocks.get(Action.SUBSCRIBE, 0),
                "connection_blocks": sum(refused.values()),
                "top_auth_blocked": _pairs(limiter.top_blocked(Action.AUTH, TOP_COUNT)),
            },
            "dashboard": {
                "auth_blocked": blocks.get(Action.DASHBOARD_AUTH, 0),
                "top_auth_blocked": _pairs(limiter.top_blocked(Action.DASHBOARD_AUTH, TOP_COUNT)),
            },
            "sessions": {
                "active": len(guards.sessions),
                "expired": snapshot.sessions_expired,
                "hijack_attempts": snapshot.session_hijack_attempts,
            },
        },
        "storage": {
            "topics": snapshot.topics,
            "ranges": snapshot.ranges,
            "segments": sum(snapshot.storage_segments.values()),
            "sealed_segments": snapshot.storage_segments.get(CopyState.SEALED.value, 0),
            "damaged_segments": sum(
                info.damage is not None for infos in segments.values() for info in infos
            ),
            "bytes": snapshot.storage_bytes,
            "integrity_failures": dict(sorted(snapshot.integrity_failures.items())),
            "scrub": {
                **snapshot.scrub_segments,
                **({} if maintenance is None else _scrub(maintenance.scrub())),
            },
            "retention": {
                "segments_removed": snapshot.retention_segments_removed,
                "bytes_removed": snapshot.retention_bytes_removed,
                **({} if maintenance is None else attrs.asdict(maintenance.retention())),
            },
        },
        "throughput": {
            "records_produced": sum(series["produce"].values()),
            "records_consumed": sum(series["consume"].values()),
            "produce_rate": total_rate("produce"),
            "consume_rate": total_rate("consume"),
            "produce_bytes_rate": total_rate("produce_bytes"),
            "consume_bytes_rate": total_rate("consume_bytes"),
        },
        "topics": topic_rows,
        "connections": {
            "open": snapshot.open_connections,
            "refused": {"per_ip": refused.get("per_ip", 0), "global": refused.get("global", 0)},
            "top": _pairs(guards.connections.busiest(TOP_COUNT)),
        },
        "cluster": None if cluster is None else cluster_payload(cluster, snapshot),
    }


def _scrub(status: ScrubStatus) -> dict[str, Any]:
    fields = attrs.asdict(status)
    fields["unrepairable"] = [
        {"segment": segment, "detail": detail} for segment, detail in status.unrepairable
    ]
    # ``unrepairable`` is the count of findings (``svc_storage_scrub_segments_total``); the
    # segments themselves, by name, are listed apart.
    fields["unrepairable_segments"] = fields.pop("unrepairable")
    return fields


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cluster_payload(cluster: ClusterStatus, snapshot: MetricsSnapshot) -> dict[str, Any]:
    """The ``cluster`` object of the JSON ``/metrics``: every node as the node answering sees
    it, who holds the chores lease, and the peer links' traffic."""
    lease = cluster.lease_age_seconds
    return {
        "cluster_id": cluster.cluster_id,
        "node_id": cluster.node_id,
        "control_plane": cluster.control_plane.value,
        "chores_holder": cluster.chores_holder,
        "domain_violations": cluster.domain_violations,
        "under_replicated": cluster.under_replicated,
        "lease_age_seconds": None if lease is None else round(lease, 3),
        "nodes": [
            {
                "node_id": node.node_id,
                "state": "alive" if node.alive else "dead",
                "address": _address(node.record.host, node.record.client_port),
                "dashboard_port": node.record.dashboard_port,
                "peer_port": node.record.peer_port,
                "attributes": dict(node.record.attributes),
                "segments_led": node.segments_led,
                "version": node.record.version,
                "answering": node.node_id == cluster.node_id,
                "chores": node.node_id == cluster.chores_holder,
            }
            for node in cluster.nodes
        ],
        "peers": {
            "connections": snapshot.peer_connections,
            "bytes_in": snapshot.peer_bytes.get("in", 0),
            "bytes_out": snapshot.peer_bytes.get("out", 0),
        },
    }


def rate_limits_payload(limiter: RateLimiter) -> dict[str, Any]:
    """The ``/rate_limits`` document, exactly the spec's shape."""
    top_blocked: dict[str, list[list[str | int]]] = {key: [] for key in TOP_BLOCKED_KEYS}
    top_blocked["auth"] = _pairs(limiter.top_blocked(Action.AUTH, TOP_COUNT))
    return {
        "enabled": limiter.enabled,
        "top_blocked": top_blocked,
        "config": {
            action.value: {
                "limit": limiter.limit(action).limit,
                "window_ms": limiter.limit(action).window_ms,
            }
            for action in (Action.AUTH, Action.PUBLISH, Action.SUBSCRIBE)
        },
    }
