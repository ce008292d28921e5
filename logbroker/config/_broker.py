"""The broker's whole configuration: every ``SVC_*`` setting that applies to one node, parsed once
at boot into frozen sections. docs/configuration.md lists the variables; ``_variables`` is the
list the docs and the unknown-name warning are checked against.

Rules that span several variables live here too, so that a node refuses a configuration it
could never serve (spec, Guarantees 5: a bad config pushed to one node must stop that node at
boot, not degrade it later).
"""

from __future__ import annotations

import difflib
import enum
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import attrs

from logbroker.config._cluster_access import (
    ETCD_PLAINTEXT,
    ETCD_TLS,
    EtcdAccess,
    PeerPortLimits,
    etcd_access,
    peer_port_limits,
)
from logbroker.config._env import (
    ConfigError,
    parse_address,
    parse_bool,
    parse_choice,
    parse_int,
    parse_port,
    parse_text,
)
from logbroker.config._variables import KNOWN_NAMES, PREFIX
from logbroker.storage import LogConfig
from logbroker.storage.log import DEFAULT_SEGMENT_MAX_BYTES, MAX_SEGMENT_BYTES

_T = TypeVar("_T")

#: Bounds of ``SVC_MAX_FRAME_SIZE``. A frame is buffered whole before it is decoded, so the upper
#: bound caps what one connection can make the broker hold; below the lower one not even an
#: auth request with real credentials would fit.
MIN_FRAME_SIZE = 1024
MAX_FRAME_SIZE = 1 << 30

#: The default listening address: every interface, IPv6 and IPv4 (a dual-stack socket).
ANY_ADDRESS = "::"

_ATTRIBUTE_WORD = re.compile(r"[A-Za-z0-9_.-]+")


class EnvMode(enum.Enum):
    """Environment mode: prod turns on the strict rules (absolute data directory, an explicit
    admin password, TLS required, invalid TLS settings fatal); test turns the limiters off."""

    PROD = "prod"
    DEV = "dev"
    TEST = "test"


class TlsVerify(enum.Enum):
    """Whether the client port asks clients for a certificate (named as the spec's example)."""

    VERIFY_NONE = "verify_none"
    VERIFY_PEER = "verify_peer"


class TlsVersion(enum.Enum):
    """Protocol versions the client port may offer; older ones are broken and not accepted."""

    TLSV1_3 = "tlsv1.3"
    TLSV1_2 = "tlsv1.2"


class ControlPlane(enum.Enum):
    """``local``: one node, state in its data directory; ``etcd``: a cluster."""

    LOCAL = "local"
    ETCD = "etcd"


class SpreadPolicy(enum.Enum):
    """What placement does when a segment's replicas cannot span ``min_domains`` domains."""

    #: Place the segment anyway and count it in ``svc_domain_violations``.
    SOFT = "soft"
    #: Refuse to place it, trading availability for the spread.
    HARD = "hard"


class FsyncScope(enum.Enum):
    """What one sync makes durable: see ``logbroker.storage._flush``."""

    FILESYSTEM = "filesystem"
    FILE = "file"


@attrs.frozen
class StorageSettings:
    """Where data lives and how range logs roll and commit."""

    #: Absolute: a relative ``SVC_DATA_DIR`` is resolved against the working directory at boot.
    data_dir: str
    log: LogConfig
    fsync_scope: FsyncScope = FsyncScope.FILESYSTEM


@attrs.frozen
class ServerSettings:
    """The client port (binary log protocol)."""

    bind_host: str
    tcp_port: int
    auth_timeout_ms: int
    max_frame_size: int


#: Ranges a topic may be created with: keeps every cursor under ``MAX_CURSOR_LENGTH``.
MAX_TOPIC_RANGES = 64


@attrs.frozen
class TopicSettings:
    """New topics' ranges and consumer group sessions."""

    initial_ranges: int
    group_session_timeout_ms: int


@attrs.frozen
class RateLimit:
    """A token bucket: ``limit`` requests per ``window_ms`` per identifier."""

    limit: int
    window_ms: int


@attrs.frozen
class DashboardSettings:
    """The HTTP port: dashboard, health, readiness, metrics and user management."""

    bind_host: str
    port: int
    require_admin: bool
    metrics_require_auth: bool
    session_timeout_sec: int
    #: The ``dashboard_auth`` limit, by client IP; counted apart from the TCP ``auth`` one.
    auth_rate_limit: RateLimit


@attrs.frozen
class AccountSettings:
    """Passwords of the built-in accounts (None: the account is not created) and ACL mode.
    The passwords are left out of ``repr`` so that no log or traceback shows them."""

    admin_pass: str | None = attrs.field(repr=False)
    producer_pass: str | None = attrs.field(repr=False)
    consumer_pass: str | None = attrs.field(repr=False)
    app_pass: str | None = attrs.field(repr=False)
    acl_strict: bool


@attrs.frozen
class RateLimitSettings:
    """Token-bucket limits of the client port; ``enabled`` also governs the dashboard's."""

    enabled: bool
    cleanup_interval_ms: int
    auth: RateLimit
    #: Configured and reported in ``/rate_limits`` but never applied (spec, Rate limits).
    publish: RateLimit
    subscribe: RateLimit


@attrs.frozen
class ConnectionLimitSettings:
    enabled: bool
    max_per_ip: int
    max_total: int


@attrs.frozen
class TlsSettings:
    """TLS on the client port. File paths are absolute and were found to exist at boot."""

    enabled: bool
    required: bool
    certfile: str | None
    keyfile: str | None
    cacertfile: str | None
    verify: TlsVerify
    versions: tuple[TlsVersion, ...]
    #: The CA certificates that sign the cluster's node certificates (``SVC_PEER_TLS_CACERTFILE``,
    #: else ``SVC_TLS_CACERTFILE``): set on a cluster node with TLS on, whose peer port then
    #: runs mutual TLS; None otherwise.
    peer_cacertfile: str | None = None


@attrs.frozen
class RetentionSettings:
    """None disables a limit; with both None nothing is ever removed. 0 bytes is a real budget."""

    max_age_ms: int | None
    max_bytes: int | None
    interval_ms: int


@attrs.frozen
class ScrubSettings:
    enabled: bool
    interval_ms: int
    segments_per_tick: int


@attrs.frozen
class ClusterSettings:
    """The control plane, the peer port, replication and placement."""

    control_plane: ControlPlane
    #: ``(host, port)`` of each etcd member; empty with the local control plane.
    etcd_endpoints: tuple[tuple[str, int], ...]
    peer_port: int
    replication_factor: int
    #: This node's placement attributes, in the order given, such as ``(("zone", "a"),)``.
    attributes: tuple[tuple[str, str], ...]
    spread_by: str | None
    min_domains: int
    spread_policy: SpreadPolicy
    replication_group_commit: bool
    replication_group_commit_interval_ms: int
    #: This node's stable id; None: generated once and kept in the data directory.
    node_id: str | None = None
    #: The cluster this node belongs to: peers of another cluster are refused, and the
    #: control plane keeps its keys under it.
    cluster_id: str = "logbroker"
    #: The address peers dial; None: the host's name.
    advertise_host: str | None = None
    #: The TTL of the node's membership lease: this long without a keepalive, it is dead.
    node_lease_ms: int = 5000
    #: A replica dead this long is replaced in the replica sets that name it (and backfilled).
    replica_replace_after_ms: int = 300_000
    #: Peers prove they know it (HMAC) at the peer handshake, inside TLS when TLS is on.
    cluster_secret: str | None = attrs.field(default=None, repr=False)
    #: How the node reaches etcd (TLS, client certificate, etcd user).
    etcd: EtcdAccess = attrs.field(factory=EtcdAccess)
    #: Caps on the peer port's connections still in their handshake.
    peer_limits: PeerPortLimits = attrs.field(factory=PeerPortLimits)


_DEFAULT_TLS_VERSIONS: tuple[TlsVersion, ...] = (TlsVersion.TLSV1_3, TlsVersion.TLSV1_2)
#: What dev and test run with when a TLS setting is invalid.
_TLS_OFF = TlsSettings(
    enabled=False,
    required=False,
    certfile=None,
    keyfile=None,
    cacertfile=None,
    verify=TlsVerify.VERIFY_NONE,
    versions=_DEFAULT_TLS_VERSIONS,
)


@attrs.frozen
class BrokerConfig:
    """Every setting of one broker node, validated. Build it with ``from_env``."""

    mode: EnvMode
    storage: StorageSettings
    server: ServerSettings
    topics: TopicSettings
    dashboard: DashboardSettings
    accounts: AccountSettings
    rate_limits: RateLimitSettings
    connection_limits: ConnectionLimitSettings
    tls: TlsSettings
    retention: RetentionSettings
    scrub: ScrubSettings
    cluster: ClusterSettings

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], cwd: str | None = None
    ) -> tuple[BrokerConfig, list[str]]:
        """Parse ``env`` (relative paths resolve against ``cwd``, default the working
        directory) into a config and the lines to warn about: unknown ``SVC_*`` names and, outside
        prod, invalid TLS settings. Raises ``ConfigError`` on the first bad value; its
        ``warnings`` holds the lines gathered until then, since an unknown name is often the
        reason a required one is missing."""
        warnings = _unknown_names(env)
        try:
            config = cls._parse(env, cwd or os.getcwd(), warnings)
        except ConfigError as error:
            error.warnings = warnings
            raise
        return config, warnings

    @classmethod
    def _parse(cls, env: Mapping[str, str], cwd: str, warnings: list[str]) -> BrokerConfig:
        # In the docs' order, so that the first bad setting reported is the first one listed.
        mode = _env_mode(env)
        storage = _storage(env, mode, cwd)
        server = _server(env)
        config = cls(
            mode=mode,
            storage=storage,
            server=server,
            topics=TopicSettings(
                initial_ranges=parse_int(env, "SVC_TOPIC_RANGES", 4, 1, MAX_TOPIC_RANGES),
                group_session_timeout_ms=parse_int(env, "SVC_GROUP_SESSION_TIMEOUT_MS", 30_000, 1),
            ),
            dashboard=_dashboard(env, server.bind_host),
            accounts=_accounts(env, mode),
            rate_limits=_rate_limits(env, mode),
            connection_limits=ConnectionLimitSettings(
                enabled=parse_bool(env, "SVC_CONNECTION_LIMIT_ENABLED", mode is not EnvMode.TEST),
                max_per_ip=parse_int(env, "SVC_MAX_CONN_PER_IP", 100, 1),
                max_total=parse_int(env, "SVC_MAX_TOTAL_CONN", 10_000, 1),
            ),
            tls=_tls(env, mode, cwd, warnings),
            retention=RetentionSettings(
                max_age_ms=parse_int(env, "SVC_RETENTION_MAX_AGE_MS", None, 0),
                max_bytes=parse_int(env, "SVC_RETENTION_MAX_BYTES", None, 0),
                interval_ms=parse_int(env, "SVC_RETENTION_INTERVAL_MS", 60_000, 1),
            ),
            scrub=ScrubSettings(
                enabled=parse_bool(env, "SVC_SCRUB_ENABLED", True),
                interval_ms=parse_int(env, "SVC_SCRUB_INTERVAL_MS", 60_000, 1),
                segments_per_tick=parse_int(env, "SVC_SCRUB_SEGMENTS_PER_TICK", 1, 1),
            ),
            cluster=_cluster(env, mode, cwd, warnings),
        )
        _check_ports_differ(
            env,
            [
                ("SVC_TCP_PORT", config.server.tcp_port),
                ("SVC_DASHBOARD_PORT", config.dashboard.port),
                ("SVC_PEER_PORT", config.cluster.peer_port),
            ],
        )
        return attrs.evolve(config, tls=_peer_tls(env, config, cwd, warnings))


def _unknown_names(env: Mapping[str, str]) -> list[str]:
    """A warning for each ``SVC_*`` name logbroker does not know, with the closest known name.
    Lower-case spellings count too: the variable is case-sensitive, so ``svc_tcp_port`` would
    otherwise be ignored without a word. Names are compared without the common prefix, which
    would otherwise make every pair look alike."""
    known = {name.removeprefix(PREFIX): name for name in KNOWN_NAMES}
    lines = []
    for name in sorted(env):
        if not name.upper().startswith(PREFIX) or name in KNOWN_NAMES:
            continue
        close = difflib.get_close_matches(name.upper().removeprefix(PREFIX), sorted(known), n=1)
        hint = f" (did you mean {known[close[0]]}?)" if close else ""
        lines.append(f"unknown setting {name} is ignored{hint}")
    return lines


def _env_mode(env: Mapping[str, str]) -> EnvMode:
    """``SVC_ENV``, else ``MIX_ENV`` (the name the spec uses), else dev."""
    for variable in ("SVC_ENV", "MIX_ENV"):
        if parse_text(env, variable) is not None:
            return parse_choice(env, variable, EnvMode, EnvMode.DEV)
    return EnvMode.DEV


def _storage(env: Mapping[str, str], mode: EnvMode, cwd: str) -> StorageSettings:
    data_dir = parse_text(env, "SVC_DATA_DIR")
    # A production node must not depend on the directory its supervisor happens to start it in.
    if mode is EnvMode.PROD and (data_dir is None or not os.path.isabs(data_dir)):
        raise ConfigError(
            "SVC_DATA_DIR", env.get("SVC_DATA_DIR"), "an absolute path, which prod requires"
        )
    segment_max = parse_int(
        env, "SVC_SEGMENT_MAX_BYTES", DEFAULT_SEGMENT_MAX_BYTES, 1024, MAX_SEGMENT_BYTES
    )
    roll_max = parse_int(env, "SVC_LOG_ROLL_MAX_BYTES", None, 1024, MAX_SEGMENT_BYTES)
    log_config = LogConfig(
        roll_bytes=min(segment_max, roll_max) if roll_max is not None else segment_max,
        group_commit=parse_bool(env, "SVC_GROUP_COMMIT", False),
        group_commit_interval_ms=parse_int(env, "SVC_GROUP_COMMIT_INTERVAL_MS", 5, 1, 60_000),
        flush_max_records=parse_int(env, "SVC_GROUP_COMMIT_FLUSH_MAX_RECORDS", 8000, 1),
        max_inflight_records=parse_int(env, "SVC_GROUP_COMMIT_MAX_INFLIGHT", 200_000, 1),
    )
    return StorageSettings(
        os.path.abspath(os.path.join(cwd, data_dir or "data")),
        log_config,
        parse_choice(env, "SVC_FSYNC_SCOPE", FsyncScope, FsyncScope.FILESYSTEM),
    )


def _server(env: Mapping[str, str]) -> ServerSettings:
    return ServerSettings(
        # Every interface, IPv6 and IPv4 alike (a dual-stack socket; see ``listen_tcp``).
        bind_host=parse_address(env, "SVC_BIND_HOST", ANY_ADDRESS),
        tcp_port=parse_port(env, "SVC_TCP_PORT", 4040),
        auth_timeout_ms=parse_int(env, "SVC_AUTH_TIMEOUT_MS", 10_000, 1),
        max_frame_size=parse_int(
            env, "SVC_MAX_FRAME_SIZE", 16 * 1024 * 1024, MIN_FRAME_SIZE, MAX_FRAME_SIZE
        ),
    )


def _dashboard(env: Mapping[str, str], bind_host: str) -> DashboardSettings:
    return DashboardSettings(
        # Its own setting, so that the dashboard can stay on an internal network.
        bind_host=parse_address(env, "SVC_DASHBOARD_BIND_HOST", bind_host),
        port=parse_port(env, "SVC_DASHBOARD_PORT", 4041),
        require_admin=parse_bool(env, "SVC_DASHBOARD_REQUIRE_ADMIN", True),
        metrics_require_auth=parse_bool(env, "SVC_METRICS_REQUIRE_AUTH", False),
        session_timeout_sec=parse_int(env, "SVC_SESSION_TIMEOUT_SEC", 3600, 1),
        auth_rate_limit=RateLimit(
            limit=parse_int(env, "SVC_DASHBOARD_AUTH_RATE_LIMIT", 10, 1),
            window_ms=parse_int(env, "SVC_DASHBOARD_AUTH_RATE_WINDOW_MS", 60_000, 1),
        ),
    )


def _secret(env: Mapping[str, str], variable: str) -> str | None:
    """Taken as given, blanks included (they may be part of the password); empty is unset."""
    return env.get(variable) or None


def _accounts(env: Mapping[str, str], mode: EnvMode) -> AccountSettings:
    accounts = AccountSettings(
        admin_pass=_secret(env, "SVC_ADMIN_PASS"),
        producer_pass=_secret(env, "SVC_PRODUCER_PASS"),
        consumer_pass=_secret(env, "SVC_CONSUMER_PASS"),
        app_pass=_secret(env, "SVC_APP_PASS"),
        acl_strict=parse_bool(env, "SVC_ACL_STRICT", False),
    )
    if mode is EnvMode.PROD and accounts.admin_pass is None:
        raise ConfigError(
            "SVC_ADMIN_PASS",
            None,
            "the admin password, which prod requires (no credentials ship with logbroker)",
        )
    return accounts


def _rate_limits(env: Mapping[str, str], mode: EnvMode) -> RateLimitSettings:
    return RateLimitSettings(
        enabled=parse_bool(env, "SVC_RATE_LIMIT_ENABLED", mode is not EnvMode.TEST),
        cleanup_interval_ms=parse_int(env, "SVC_RATE_LIMIT_CLEANUP_INTERVAL", 300_000, 1),
        auth=RateLimit(
            limit=parse_int(env, "SVC_AUTH_RATE_LIMIT", 10, 1),
            window_ms=parse_int(env, "SVC_AUTH_RATE_WINDOW_MS", 60_000, 1),
        ),
        publish=RateLimit(
            limit=parse_int(env, "SVC_PUBLISH_RATE_LIMIT", 1000, 1),
            window_ms=parse_int(env, "SVC_PUBLISH_RATE_WINDOW_MS", 1000, 1),
        ),
        subscribe=RateLimit(
            limit=parse_int(env, "SVC_SUBSCRIBE_RATE_LIMIT", 100, 1),
            window_ms=parse_int(env, "SVC_SUBSCRIBE_RATE_WINDOW_MS", 60_000, 1),
        ),
    )


def _tls(env: Mapping[str, str], mode: EnvMode, cwd: str, warnings: list[str]) -> TlsSettings:
    """The spec's TLS rules: prod requires TLS unless ``SVC_REQUIRE_TLS=false``, which turns TLS
    off altogether; offering follows requiring; outside prod both are off. Every problem is
    gathered: prod refuses to boot on the first, dev and test warn about each and run without
    TLS (a TLS listener cannot be half set up)."""
    problems: list[ConfigError] = []

    def attempt(parse: Callable[[], _T], fallback: _T) -> _T:
        try:
            return parse()
        except ConfigError as error:
            problems.append(error)
            return fallback

    prod = mode is EnvMode.PROD
    required = attempt(lambda: parse_bool(env, "SVC_REQUIRE_TLS", prod), prod)
    turned_off = not problems and not required and parse_text(env, "SVC_REQUIRE_TLS") is not None
    enabled = attempt(lambda: parse_bool(env, "SVC_ENABLE_TLS", required), required)
    if turned_off and enabled:
        warnings.append(
            f"SVC_ENABLE_TLS={env['SVC_ENABLE_TLS']!r} is ignored: SVC_REQUIRE_TLS=false turns"
            " TLS off"
        )
        enabled = False
    elif required and not enabled:
        problems.append(
            ConfigError(
                "SVC_ENABLE_TLS",
                env.get("SVC_ENABLE_TLS"),
                "true while SVC_REQUIRE_TLS is true: requiring TLS means offering it",
            )
        )
    files = {
        variable: _path(env, variable, cwd)
        for variable in ("SVC_TLS_CERTFILE", "SVC_TLS_KEYFILE", "SVC_TLS_CACERTFILE")
    }
    verify = attempt(
        lambda: parse_choice(env, "SVC_TLS_VERIFY", TlsVerify, TlsVerify.VERIFY_NONE),
        TlsVerify.VERIFY_NONE,
    )
    versions = attempt(lambda: _tls_versions(env), _DEFAULT_TLS_VERSIONS)
    if enabled:
        needed = {
            "SVC_TLS_CERTFILE": "the server certificate (PEM), since TLS is on",
            "SVC_TLS_KEYFILE": "the server private key (PEM), since TLS is on",
        }
        if verify is TlsVerify.VERIFY_PEER:
            needed["SVC_TLS_CACERTFILE"] = (
                "the CA certificates (PEM) that sign client certificates, since SVC_TLS_VERIFY"
                " is verify_peer"
            )
        for variable, path in files.items():
            if path is None and variable in needed:
                problems.append(ConfigError(variable, None, needed[variable]))
            elif path is not None and not os.path.isfile(path):
                problems.append(
                    ConfigError(variable, env[variable], f"an existing file ({path} is not one)")
                )
    if not problems:
        return TlsSettings(
            enabled=enabled,
            required=required,
            certfile=files["SVC_TLS_CERTFILE"],
            keyfile=files["SVC_TLS_KEYFILE"],
            cacertfile=files["SVC_TLS_CACERTFILE"],
            verify=verify,
            versions=versions,
        )
    if prod:
        raise problems[0]
    warnings.extend(tls_off_warning(problem, mode) for problem in problems)
    return _TLS_OFF


def tls_off_warning(problem: ConfigError, mode: EnvMode) -> str:
    """What dev and test say of an invalid TLS setting, which they run without TLS for."""
    return f"{problem}; TLS stays off (in {mode.value} an invalid TLS setting only warns)"


def _path(env: Mapping[str, str], variable: str, cwd: str) -> str | None:
    text = parse_text(env, variable)
    return None if text is None else os.path.abspath(os.path.join(cwd, text))


def _tls_versions(env: Mapping[str, str]) -> tuple[TlsVersion, ...]:
    text = parse_text(env, "SVC_TLS_VERSIONS")
    if text is None:
        return _DEFAULT_TLS_VERSIONS
    try:
        versions = [TlsVersion(name.strip().lower()) for name in text.split(",")]
    except ValueError:
        raise ConfigError(
            "SVC_TLS_VERSIONS", env["SVC_TLS_VERSIONS"], "a comma list of tlsv1.3 and tlsv1.2"
        ) from None
    return tuple(dict.fromkeys(versions))


def _peer_tls(
    env: Mapping[str, str], config: BrokerConfig, cwd: str, warnings: list[str]
) -> TlsSettings:
    """A cluster node with TLS on runs its peer port with mutual TLS, so it needs the CA of
    the cluster's node certificates. A problem with it follows the TLS rules: fatal in prod; in
    dev and test a warning, and TLS off altogether (a node has TLS on both its client and peer
    ports, or on neither)."""
    tls = config.tls
    variable = "SVC_PEER_TLS_CACERTFILE"
    path = _path(env, variable, cwd)
    if not tls.enabled or config.cluster.control_plane is not ControlPlane.ETCD:
        return tls
    problem = None
    if path is None:
        path = tls.cacertfile
        if path is None:
            problem = ConfigError(
                variable,
                None,
                "the CA certificates (PEM) that sign the cluster's node certificates (or"
                " SVC_TLS_CACERTFILE), since TLS is on for this cluster node and its peer port"
                " requires a certificate of every peer",
            )
    elif not os.path.isfile(path):
        problem = ConfigError(variable, env[variable], f"an existing file ({path} is not one)")
    if problem is None:
        return attrs.evolve(tls, peer_cacertfile=path)
    if config.mode is EnvMode.PROD:
        raise problem
    warnings.append(tls_off_warning(problem, config.mode))
    return _TLS_OFF


def _cluster(
    env: Mapping[str, str], mode: EnvMode, cwd: str, warnings: list[str]
) -> ClusterSettings:
    control_plane, etcd_endpoints, https = _control_plane(env)
    replication_factor = parse_int(env, "SVC_LOG_REPLICATION_FACTOR", 1, 1)
    if replication_factor > 1 and control_plane is ControlPlane.LOCAL:
        raise ConfigError(
            "SVC_LOG_REPLICATION_FACTOR",
            env["SVC_LOG_REPLICATION_FACTOR"],
            "1 with SVC_CONTROL_PLANE=local, which runs a single node; a cluster needs etcd",
        )
    if replication_factor == 2:
        warnings.append(
            "SVC_LOG_REPLICATION_FACTOR=2 has a quorum of 2, so losing either replica stalls"
            " writes; use 3 to survive the loss of a node"
        )
    attributes = _attributes(env)
    spread_by = parse_text(env, "SVC_LOG_SPREAD_BY")
    declared = [name for name, _ in attributes]
    if spread_by is not None and spread_by not in declared:
        raise ConfigError(
            "SVC_LOG_SPREAD_BY",
            env["SVC_LOG_SPREAD_BY"],
            "an attribute this node declares in SVC_LOG_ATTRIBUTES"
            + (f" ({', '.join(declared)})" if declared else ", which is not set"),
        )
    min_domains = parse_int(env, "SVC_LOG_MIN_DOMAINS", 1, 1)
    if min_domains > 1 and spread_by is None:
        raise ConfigError(
            "SVC_LOG_MIN_DOMAINS",
            env["SVC_LOG_MIN_DOMAINS"],
            "1 unless SVC_LOG_SPREAD_BY names the attribute to spread across",
        )
    if min_domains > replication_factor:
        raise ConfigError(
            "SVC_LOG_MIN_DOMAINS",
            env["SVC_LOG_MIN_DOMAINS"],
            f"at most SVC_LOG_REPLICATION_FACTOR ({replication_factor}): replicas cannot span"
            " more domains than there are replicas",
        )
    return ClusterSettings(
        control_plane=control_plane,
        etcd_endpoints=etcd_endpoints,
        peer_port=parse_port(env, "SVC_PEER_PORT", 4042),
        replication_factor=replication_factor,
        attributes=attributes,
        spread_by=spread_by,
        min_domains=min_domains,
        spread_policy=parse_choice(env, "SVC_LOG_SPREAD_POLICY", SpreadPolicy, SpreadPolicy.SOFT),
        replication_group_commit=parse_bool(env, "SVC_REPLICATION_GROUP_COMMIT", False),
        replication_group_commit_interval_ms=parse_int(
            env, "SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS", 10, 1, 60_000
        ),
        node_id=_identifier(env, "SVC_NODE_ID"),
        cluster_id=_identifier(env, "SVC_CLUSTER_ID") or "logbroker",
        advertise_host=parse_text(env, "SVC_ADVERTISE_HOST"),
        node_lease_ms=parse_int(env, "SVC_NODE_LEASE_MS", 5000, 2000, 600_000),
        replica_replace_after_ms=parse_int(
            env, "SVC_REPLICA_REPLACE_AFTER_MS", 300_000, 1000, 7 * 24 * 3600 * 1000
        ),
        cluster_secret=_cluster_secret(env),
        etcd=etcd_access(env, https, etcd_endpoints, mode is EnvMode.PROD, cwd, warnings),
        peer_limits=peer_port_limits(env),
    )


#: Node and cluster ids travel in the peer handshake and name control-plane keys.
_IDENTIFIER = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: Shorter secrets are too easy to guess offline from one recorded handshake.
MIN_CLUSTER_SECRET_LENGTH = 16


def _identifier(env: Mapping[str, str], variable: str) -> str | None:
    text = parse_text(env, variable)
    if text is not None and (not _IDENTIFIER.fullmatch(text) or text in (".", "..")):
        raise ConfigError(variable, env[variable], "1 to 64 of A-Z a-z 0-9 . _ -, not . or ..")
    return text


def _cluster_secret(env: Mapping[str, str]) -> str | None:
    secret = _secret(env, "SVC_CLUSTER_SECRET")
    if secret is not None and len(secret) < MIN_CLUSTER_SECRET_LENGTH:
        # The value is a secret: never echoed back.
        raise ConfigError(
            "SVC_CLUSTER_SECRET",
            "<hidden>",
            f"at least {MIN_CLUSTER_SECRET_LENGTH} characters (a long random string)",
        )
    return secret


def _control_plane(
    env: Mapping[str, str],
) -> tuple[ControlPlane, tuple[tuple[str, int], ...], bool]:
    """``local``, or ``etcd://host:port,host:port,...`` (IPv6 hosts in brackets), or the same
    with ``etcd+https://`` for TLS (the last of the three values)."""
    text = parse_text(env, "SVC_CONTROL_PLANE")
    if text is None or text.lower() == ControlPlane.LOCAL.value:
        return ControlPlane.LOCAL, (), False
    error = ConfigError(
        "SVC_CONTROL_PLANE",
        env["SVC_CONTROL_PLANE"],
        "local, etcd://host:port,host:port,... or etcd+https://host:port,host:port,...",
    )
    scheme = next((s for s in (ETCD_PLAINTEXT, ETCD_TLS) if text.lower().startswith(s)), None)
    if scheme is None:
        raise error
    endpoints = []
    for member in text[len(scheme) :].split(","):
        host, colon, port = member.strip().rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not (colon and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise error
        endpoints.append((host, int(port)))
    return ControlPlane.ETCD, tuple(endpoints), scheme == ETCD_TLS


def _attributes(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """``name=value,name=value``: letters, digits, ``_``, ``.`` and ``-``; each name once."""
    text = parse_text(env, "SVC_LOG_ATTRIBUTES")
    if text is None:
        return ()
    pairs: dict[str, str] = {}
    for item in text.split(","):
        name, equals, value = (part.strip() for part in item.partition("="))
        if not (
            equals
            and _ATTRIBUTE_WORD.fullmatch(name)
            and _ATTRIBUTE_WORD.fullmatch(value)
            and name not in pairs
        ):
            raise ConfigError(
                "SVC_LOG_ATTRIBUTES",
                env["SVC_LOG_ATTRIBUTES"],
                "name=value pairs separated by commas, each name once, such as zone=a,rack=r1",
            )
        pairs[name] = value
    return tuple(pairs.items())


def _check_ports_differ(env: Mapping[str, str], ports: Sequence[tuple[str, int]]) -> None:
    """Two listeners on one port would fail at listen time; say so at parse time instead, naming
    the variable the operator set (the other may be a default)."""
    for index, (first, port) in enumerate(ports):
        for second, other in ports[index + 1 :]:
            if port != 0 and port == other:
                named, clash = (second, first) if parse_text(env, second) else (first, second)
                raise ConfigError(
                    named, str(port), f"a port other than {clash}'s: each listener needs its own"
                )
