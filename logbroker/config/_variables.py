"""The one list of every environment variable logbroker knows.

It serves two readers: ``BrokerConfig.from_env`` warns about any ``SVC_*`` name not in it, and a
test holds ``docs/configuration.md`` to it (same sections, names, defaults and meanings), so the
docs cannot drift from what the broker reads. Add a variable here, to its parser and to the docs
in the same change; the tests fail until all three agree.
"""

from __future__ import annotations

import attrs

#: Every broker setting starts with this; other variables of the environment are none of ours.
PREFIX = "SVC_"


@attrs.frozen
class Variable:
    """One environment variable as the docs present it."""

    #: The documentation section (a heading of docs/configuration.md) it is listed under.
    section: str
    name: str
    #: The default exactly as the docs show it: a literal value, ``unset``, or a rule.
    default: str
    meaning: str


def _section(section: str, *rows: tuple[str, str, str]) -> tuple[Variable, ...]:
    return tuple(Variable(section, name, default, meaning) for name, default, meaning in rows)


VARIABLES: tuple[Variable, ...] = (
    *_section(
        "Environment mode",
        ("SVC_ENV", "dev", "environment mode: prod, dev or test"),
        ("MIX_ENV", "unset", "environment mode when SVC_ENV is unset (the name the spec uses)"),
    ),
    *_section(
        "Storage",
        (
            "SVC_DATA_DIR",
            "./data",
            "data directory; a relative path resolves against the working directory and is"
            " refused in prod",
        ),
        ("SVC_SEGMENT_MAX_BYTES", "67108864", "active segment roll size in bytes (64 MiB)"),
        (
            "SVC_LOG_ROLL_MAX_BYTES",
            "unset",
            "a second roll size; the smaller of the two set values wins",
        ),
        (
            "SVC_GROUP_COMMIT",
            "false",
            "park appends (replication factor 1) for up to the interval so one fsync covers"
            " them; only with `SVC_FSYNC_SCOPE=file`",
        ),
        (
            "SVC_GROUP_COMMIT_INTERVAL_MS",
            "5",
            "how long an append may be parked; only with `SVC_FSYNC_SCOPE=file`",
        ),
        ("SVC_GROUP_COMMIT_FLUSH_MAX_RECORDS", "8000", "parked records that flush at once"),
        (
            "SVC_GROUP_COMMIT_MAX_INFLIGHT",
            "200000",
            "records waiting for their fsync past which produces fail with `overloaded`",
        ),
        (
            "SVC_FSYNC_SCOPE",
            "filesystem",
            "`filesystem`: one syncfs makes the writes of every range durable together; `file`:"
            " an fsync for each range's file",
        ),
    ),
    *_section(
        "Client port",
        (
            "SVC_BIND_HOST",
            "::",
            "address the client and peer ports listen on; the default `::` takes IPv6 and IPv4"
            " clients on every interface (on a host without IPv6 the broker falls back to"
            " `0.0.0.0` with a warning)",
        ),
        ("SVC_TCP_PORT", "4040", "client port (binary log protocol); 0 picks a free port"),
        ("SVC_AUTH_TIMEOUT_MS", "10000", "time a new connection has to send its auth frame"),
        (
            "SVC_MAX_FRAME_SIZE",
            "16777216",
            "largest frame body accepted, in bytes (16 MiB; at most 1 GiB)",
        ),
    ),
    *_section(
        "Topics and consumer groups",
        (
            "SVC_TOPIC_RANGES",
            "4",
            "ranges a new topic's keyspace is cut into, 1 to 64 (fewer if its keyspace has fewer"
            " slots)",
        ),
        (
            "SVC_GROUP_SESSION_TIMEOUT_MS",
            "30000",
            "a consumer group member not seen for this long loses its share of the ranges",
        ),
    ),
    *_section(
        "Dashboard",
        (
            "SVC_DASHBOARD_BIND_HOST",
            "SVC_BIND_HOST",
            "address the dashboard port listens on; set 127.0.0.1 or an internal address to"
            " keep it private",
        ),
        (
            "SVC_DASHBOARD_PORT",
            "4041",
            "dashboard, health, readiness and metrics (HTTP); 0 picks a free port",
        ),
        (
            "SVC_DASHBOARD_REQUIRE_ADMIN",
            "true",
            "only admin accounts may use the dashboard (it manages users)",
        ),
        (
            "SVC_METRICS_REQUIRE_AUTH",
            "false",
            "`/metrics` and `/rate_limits` require a dashboard session; off so Prometheus can"
            " scrape them",
        ),
        ("SVC_SESSION_TIMEOUT_SEC", "3600", "lifetime of a dashboard session"),
        (
            "SVC_DASHBOARD_AUTH_RATE_LIMIT",
            "10",
            "dashboard login and session checks allowed per client IP per window",
        ),
        ("SVC_DASHBOARD_AUTH_RATE_WINDOW_MS", "60000", "window of the dashboard auth limit"),
    ),
    *_section(
        "Accounts and ACLs",
        (
            "SVC_ADMIN_PASS",
            "unset; required in prod",
            "password of the built-in `admin` account (secret)",
        ),
        ("SVC_PRODUCER_PASS", "unset", "password of the built-in `producer` account (secret)"),
        ("SVC_CONSUMER_PASS", "unset", "password of the built-in `consumer` account (secret)"),
        ("SVC_APP_PASS", "unset", "password of the built-in `app` account (secret)"),
        (
            "SVC_ACL_STRICT",
            "false",
            "enforce per-topic ACL grants; when off, grants are inert and global permissions"
            " allow everything",
        ),
    ),
    *_section(
        "Rate limits",
        (
            "SVC_RATE_LIMIT_ENABLED",
            "false in test, else true",
            "enforce the TCP and dashboard auth rate limits",
        ),
        (
            "SVC_RATE_LIMIT_CLEANUP_INTERVAL",
            "300000",
            "milliseconds between removals of expired buckets",
        ),
        ("SVC_AUTH_RATE_LIMIT", "10", "TCP auth attempts allowed per client IP per window"),
        ("SVC_AUTH_RATE_WINDOW_MS", "60000", "window of the TCP auth limit"),
        (
            "SVC_PUBLISH_RATE_LIMIT",
            "1000",
            "produces per user per window; reported in `/rate_limits`, not enforced",
        ),
        ("SVC_PUBLISH_RATE_WINDOW_MS", "1000", "window of the publish limit"),
        (
            "SVC_SUBSCRIBE_RATE_LIMIT",
            "100",
            "subscribes per user per window; reported in `/rate_limits`, not enforced",
        ),
        ("SVC_SUBSCRIBE_RATE_WINDOW_MS", "60000", "window of the subscribe limit"),
    ),
    *_section(
        "Connection limits",
        (
            "SVC_CONNECTION_LIMIT_ENABLED",
            "false in test, else true",
            "refuse connections past the limits below",
        ),
        ("SVC_MAX_CONN_PER_IP", "100", "concurrent client connections per IP"),
        ("SVC_MAX_TOTAL_CONN", "10000", "concurrent client connections in total"),
    ),
    *_section(
        "TLS",
        (
            "SVC_REQUIRE_TLS",
            "true in prod, else false",
            "refuse plaintext on the client port; false turns TLS off altogether",
        ),
        ("SVC_ENABLE_TLS", "SVC_REQUIRE_TLS", "offer TLS on the client port"),
        ("SVC_TLS_CERTFILE", "unset", "server certificate file (PEM); needed when TLS is on"),
        ("SVC_TLS_KEYFILE", "unset", "server private key file (PEM); needed when TLS is on"),
        (
            "SVC_TLS_CACERTFILE",
            "unset",
            "CA certificate file (PEM) for client certificates; needed with verify_peer",
        ),
        (
            "SVC_TLS_VERIFY",
            "verify_none",
            "client certificates: verify_none, or verify_peer to require one signed by a CA of"
            " SVC_TLS_CACERTFILE",
        ),
        (
            "SVC_TLS_VERSIONS",
            "tlsv1.3,tlsv1.2",
            "allowed protocol versions, a comma list of tlsv1.3 and tlsv1.2",
        ),
    ),
    *_section(
        "Retention",
        (
            "SVC_RETENTION_MAX_AGE_MS",
            "unset",
            "sealed segments older than this are removed; unset keeps them",
        ),
        (
            "SVC_RETENTION_MAX_BYTES",
            "unset",
            "byte budget per range (not per topic or node); 0 is a real budget of zero bytes",
        ),
        ("SVC_RETENTION_INTERVAL_MS", "60000", "period of the retention check"),
    ),
    *_section(
        "Integrity scrub",
        ("SVC_SCRUB_ENABLED", "true", "verify the checksums of sealed segments in the background"),
        ("SVC_SCRUB_INTERVAL_MS", "60000", "time between scrub passes"),
        ("SVC_SCRUB_SEGMENTS_PER_TICK", "1", "sealed segments verified per pass"),
    ),
    *_section(
        "Cluster",
        (
            "SVC_CONTROL_PLANE",
            "local",
            "`local` (one node, state in the data directory), `etcd://host:port,...`"
            " (plaintext) or `etcd+https://host:port,...` (TLS)",
        ),
        ("SVC_PEER_PORT", "4042", "peer replication port; 0 picks a free port"),
        (
            "SVC_NODE_ID",
            "generated",
            "this node's stable id; unset: generated once and kept in the data directory",
        ),
        (
            "SVC_CLUSTER_ID",
            "logbroker",
            "the cluster's name: peers of another cluster are refused at the handshake",
        ),
        ("SVC_ADVERTISE_HOST", "the host's name", "the address other nodes dial this node at"),
        (
            "SVC_NODE_LEASE_MS",
            "5000",
            "membership lease TTL: a node silent this long is dead to the cluster",
        ),
        (
            "SVC_REPLICA_REPLACE_AFTER_MS",
            "300000",
            "a replica dead this long is replaced in its replica sets and the new one backfilled",
        ),
        (
            "SVC_CLUSTER_SECRET",
            "unset",
            "shared secret peers prove they know at the handshake (secret; 16+ characters)",
        ),
        (
            "SVC_LOG_REPLICATION_FACTOR",
            "1",
            "replicas per segment; writes wait for floor(RF/2)+1 of them",
        ),
        (
            "SVC_LOG_ATTRIBUTES",
            "unset",
            "this node's placement attributes, such as `zone=a,rack=r1`",
        ),
        (
            "SVC_LOG_SPREAD_BY",
            "unset",
            "the attribute whose values a segment's replicas spread across",
        ),
        (
            "SVC_LOG_MIN_DOMAINS",
            "1",
            "distinct values of that attribute a segment's replicas must span",
        ),
        (
            "SVC_LOG_SPREAD_POLICY",
            "soft",
            "`soft`: place anyway and count it in `svc_domain_violations`; `hard`: refuse",
        ),
        (
            "SVC_REPLICATION_GROUP_COMMIT",
            "false",
            "group commit for replication factor above 1; only for hot, fsync-bound ranges;"
            " only with `SVC_FSYNC_SCOPE=file`",
        ),
        (
            "SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS",
            "10",
            "flush period of replicated group commit; only with `SVC_FSYNC_SCOPE=file`",
        ),
    ),
    *_section(
        "Cluster security",
        (
            "SVC_PEER_TLS_CACERTFILE",
            "SVC_TLS_CACERTFILE",
            "CA certificates (PEM) that sign the cluster's node certificates; with TLS on, the"
            " peer port requires one of every peer",
        ),
        (
            "SVC_PEER_MAX_HANDSHAKES_PER_IP",
            "8",
            "peer port connections from one address still in their handshake; more are refused",
        ),
        (
            "SVC_PEER_MAX_HANDSHAKES",
            "64",
            "peer port connections still in their handshake in total; more are refused",
        ),
        (
            "SVC_ETCD_CACERTFILE",
            "unset",
            "CA certificates (PEM) etcd's certificate must be signed by (`etcd+https://`);"
            " unset: the system's trusted CAs",
        ),
        (
            "SVC_ETCD_CERTFILE",
            "unset",
            "client certificate (PEM) presented to etcd (`etcd+https://`); with SVC_ETCD_KEYFILE",
        ),
        ("SVC_ETCD_KEYFILE", "unset", "its private key (PEM, not encrypted)"),
        (
            "SVC_ETCD_USER",
            "unset",
            "etcd user the node authenticates as, when etcd's auth is on; with SVC_ETCD_PASSWORD",
        ),
        ("SVC_ETCD_PASSWORD", "unset", "that user's password (secret)"),
        (
            "SVC_ETCD_ALLOW_PLAINTEXT",
            "false",
            "let prod reach etcd over plaintext `etcd://` on a non-loopback address: on a"
            " private network only",
        ),
    ),
    *_section(
        "Client tools",
        ("SVC_CLIENT_USER", "unset", "account the `logbroker` command logs in as"),
        ("SVC_CLIENT_PASSWORD", "unset", "its password (secret)"),
    ),
)

#: The ``SVC_*`` names of ``VARIABLES``: any other ``SVC_*`` name in the environment is a typo or
#: a setting this version does not have, and is warned about.
KNOWN_NAMES: frozenset[str] = frozenset(
    variable.name for variable in VARIABLES if variable.name.startswith(PREFIX)
)
