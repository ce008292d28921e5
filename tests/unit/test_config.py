"""``BrokerConfig.from_env``: the spec's defaults, errors naming the variable and the value, the
environment mode and its prod rules, TLS rules, unknown-name warnings and secrets."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from logbroker.config import (
    VARIABLES,
    AccountSettings,
    BrokerConfig,
    ClusterSettings,
    ConfigError,
    ConnectionLimitSettings,
    ControlPlane,
    DashboardSettings,
    EnvMode,
    FsyncScope,
    RateLimit,
    RateLimitSettings,
    RetentionSettings,
    ScrubSettings,
    ServerSettings,
    SpreadPolicy,
    StorageSettings,
    TlsSettings,
    TlsVerify,
    TlsVersion,
    Variable,
    check_built,
)
from logbroker.storage import LogConfig

#: Every variable the spec's text names (its Endpoints, Authentication, TLS, Limits, Durability,
#: Integrity scrub and Retention sections) and the ones the design adds.
SPEC_VARIABLES = [
    "SVC_TCP_PORT",
    "SVC_DASHBOARD_PORT",
    "SVC_LOG_REPLICATION_FACTOR",
    "SVC_SEGMENT_MAX_BYTES",
    "SVC_LOG_ROLL_MAX_BYTES",
    "SVC_ADMIN_PASS",
    "SVC_DASHBOARD_REQUIRE_ADMIN",
    "SVC_ACL_STRICT",
    "SVC_ENABLE_TLS",
    "SVC_REQUIRE_TLS",
    "SVC_TLS_CERTFILE",
    "SVC_TLS_KEYFILE",
    "SVC_TLS_CACERTFILE",
    "SVC_TLS_VERIFY",
    "SVC_TLS_VERSIONS",
    "SVC_RATE_LIMIT_ENABLED",
    "SVC_RATE_LIMIT_CLEANUP_INTERVAL",
    "SVC_AUTH_RATE_LIMIT",
    "SVC_AUTH_RATE_WINDOW_MS",
    "SVC_DASHBOARD_AUTH_RATE_LIMIT",
    "SVC_DASHBOARD_AUTH_RATE_WINDOW_MS",
    "SVC_PUBLISH_RATE_LIMIT",
    "SVC_PUBLISH_RATE_WINDOW_MS",
    "SVC_SUBSCRIBE_RATE_LIMIT",
    "SVC_SUBSCRIBE_RATE_WINDOW_MS",
    "SVC_CONNECTION_LIMIT_ENABLED",
    "SVC_MAX_CONN_PER_IP",
    "SVC_MAX_TOTAL_CONN",
    "SVC_GROUP_COMMIT",
    "SVC_GROUP_COMMIT_INTERVAL_MS",
    "SVC_GROUP_COMMIT_FLUSH_MAX_RECORDS",
    "SVC_GROUP_COMMIT_MAX_INFLIGHT",
    "SVC_REPLICATION_GROUP_COMMIT",
    "SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS",
    "SVC_SCRUB_ENABLED",
    "SVC_SCRUB_INTERVAL_MS",
    "SVC_SCRUB_SEGMENTS_PER_TICK",
    "SVC_RETENTION_MAX_AGE_MS",
    "SVC_RETENTION_MAX_BYTES",
    "SVC_RETENTION_INTERVAL_MS",
    "MIX_ENV",
    "SVC_ENV",
    "SVC_PEER_PORT",
    "SVC_AUTH_TIMEOUT_MS",
    "SVC_MAX_FRAME_SIZE",
    "SVC_CONTROL_PLANE",
    "SVC_LOG_ATTRIBUTES",
    "SVC_LOG_SPREAD_BY",
    "SVC_LOG_MIN_DOMAINS",
]

#: Documented defaults that are rules rather than values (the other literal ones are checked
#: against the parser generically).
RULE_DEFAULTS = {
    "SVC_RATE_LIMIT_ENABLED",
    "SVC_CONNECTION_LIMIT_ENABLED",
    "SVC_REQUIRE_TLS",
    "SVC_ENABLE_TLS",
    "SVC_DASHBOARD_BIND_HOST",
    "SVC_ADMIN_PASS",
    "SVC_NODE_ID",
    "SVC_ADVERTISE_HOST",
    "SVC_PEER_TLS_CACERTFILE",
}


def parse(env: Mapping[str, str], cwd: str = "/srv") -> BrokerConfig:
    """The config of ``env``, which must raise no warning."""
    config, warnings = BrokerConfig.from_env(env, cwd=cwd)
    assert warnings == []
    return config


@pytest.fixture
def prod_env(tmp_path: Path) -> dict[str, str]:
    """The least a prod node needs: absolute data dir, admin password, certificate and key."""
    (tmp_path / "cert.pem").write_text("certificate\n")
    (tmp_path / "key.pem").write_text("key\n")
    return {
        "SVC_ENV": "prod",
        "SVC_DATA_DIR": "/var/lib/logbroker",
        "SVC_ADMIN_PASS": "correct horse",
        "SVC_TLS_CERTFILE": str(tmp_path / "cert.pem"),
        "SVC_TLS_KEYFILE": str(tmp_path / "key.pem"),
    }


def test_defaults_match_the_spec() -> None:
    config = parse({})

    assert config.mode is EnvMode.DEV
    assert config.storage == StorageSettings(
        data_dir="/srv/data",
        log=LogConfig(
            roll_bytes=67108864,
            group_commit=False,
            group_commit_interval_ms=5,
            flush_max_records=8000,
            max_inflight_records=200000,
        ),
        fsync_scope=FsyncScope.FILESYSTEM,
    )
    assert parse({"SVC_FSYNC_SCOPE": "File"}).storage.fsync_scope is FsyncScope.FILE
    assert config.server == ServerSettings(
        bind_host="::", tcp_port=4040, auth_timeout_ms=10000, max_frame_size=16777216
    )
    assert config.dashboard == DashboardSettings(
        bind_host="::",
        port=4041,
        require_admin=True,
        metrics_require_auth=False,
        session_timeout_sec=3600,
        auth_rate_limit=RateLimit(limit=10, window_ms=60000),
    )
    assert config.accounts == AccountSettings(
        admin_pass=None, producer_pass=None, consumer_pass=None, app_pass=None, acl_strict=False
    )
    assert config.rate_limits == RateLimitSettings(
        enabled=True,
        cleanup_interval_ms=300000,
        auth=RateLimit(limit=10, window_ms=60000),
        publish=RateLimit(limit=1000, window_ms=1000),
        subscribe=RateLimit(limit=100, window_ms=60000),
    )
    assert config.connection_limits == ConnectionLimitSettings(
        enabled=True, max_per_ip=100, max_total=10000
    )
    assert config.tls == TlsSettings(
        enabled=False,
        required=False,
        certfile=None,
        keyfile=None,
        cacertfile=None,
        verify=TlsVerify.VERIFY_NONE,
        versions=(TlsVersion.TLSV1_3, TlsVersion.TLSV1_2),
    )
    assert config.retention == RetentionSettings(max_age_ms=None, max_bytes=None, interval_ms=60000)
    assert config.scrub == ScrubSettings(enabled=True, interval_ms=60000, segments_per_tick=1)
    assert config.cluster == ClusterSettings(
        control_plane=ControlPlane.LOCAL,
        etcd_endpoints=(),
        peer_port=4042,
        replication_factor=1,
        attributes=(),
        spread_by=None,
        min_domains=1,
        spread_policy=SpreadPolicy.SOFT,
        replication_group_commit=False,
        replication_group_commit_interval_ms=10,
    )


@pytest.mark.parametrize(
    "variable",
    [
        variable
        for variable in VARIABLES
        if variable.default != "unset" and variable.name not in RULE_DEFAULTS
    ],
    ids=lambda variable: variable.name,
)
def test_each_documented_default_is_the_default(variable: Variable) -> None:
    assert parse({variable.name: variable.default}) == parse({})


class RecordingEnv(Mapping[str, str]):
    """An environment that remembers which variables were looked up."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)
        self.looked_up: set[str] = set()

    def __getitem__(self, name: str) -> str:
        self.looked_up.add(name)
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def test_the_broker_reads_exactly_the_registered_variables_but_the_client_ones() -> None:
    env = RecordingEnv({})

    BrokerConfig.from_env(env)

    assert env.looked_up == {
        variable.name for variable in VARIABLES if variable.section != "Client tools"
    }


def test_every_variable_the_spec_names_is_known() -> None:
    registered = {variable.name for variable in VARIABLES}

    assert set(SPEC_VARIABLES) - registered == set()
    assert len(registered) == len(VARIABLES)


@pytest.mark.parametrize(
    ("segment_max", "roll_max", "expected"),
    [
        ("1048576", None, 1048576),
        (None, "65536", 65536),
        ("65536", "1048576", 65536),
        ("1048576", "65536", 65536),
    ],
)
def test_the_smaller_of_the_two_roll_sizes_wins(
    segment_max: str | None, roll_max: str | None, expected: int
) -> None:
    env = {}
    if segment_max is not None:
        env["SVC_SEGMENT_MAX_BYTES"] = segment_max
    if roll_max is not None:
        env["SVC_LOG_ROLL_MAX_BYTES"] = roll_max

    assert parse(env).storage.log.roll_bytes == expected


@pytest.mark.parametrize("spelling", ["true", "TRUE", "1", "yes", "on", " True "])
def test_booleans_accept_the_usual_true_spellings(spelling: str) -> None:
    assert parse({"SVC_GROUP_COMMIT": spelling}).storage.log.group_commit is True
    assert parse({"SVC_ACL_STRICT": spelling}).accounts.acl_strict is True


def test_a_blank_value_means_the_default() -> None:
    assert parse({"SVC_TCP_PORT": " ", "SVC_SCRUB_ENABLED": ""}) == parse({})


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SVC_ENV", "staging"),
        ("MIX_ENV", "production"),
        ("SVC_GROUP_COMMIT", "maybe"),
        ("SVC_SEGMENT_MAX_BYTES", "64MB"),
        ("SVC_SEGMENT_MAX_BYTES", "-1"),
        ("SVC_SEGMENT_MAX_BYTES", "5000000000"),
        ("SVC_LOG_ROLL_MAX_BYTES", "12.5"),
        ("SVC_GROUP_COMMIT_INTERVAL_MS", "0"),
        ("SVC_GROUP_COMMIT_FLUSH_MAX_RECORDS", "zero"),
        ("SVC_GROUP_COMMIT_MAX_INFLIGHT", "0"),
        ("SVC_TCP_PORT", "abc"),
        ("SVC_TCP_PORT", "65536"),
        ("SVC_DASHBOARD_PORT", "-1"),
        ("SVC_PEER_PORT", "4042.0"),
        ("SVC_BIND_HOST", "localhost"),
        ("SVC_DASHBOARD_BIND_HOST", "10.0.0.256"),
        ("SVC_AUTH_TIMEOUT_MS", "0"),
        ("SVC_MAX_FRAME_SIZE", "1023"),
        ("SVC_MAX_FRAME_SIZE", "1073741825"),
        ("SVC_DASHBOARD_REQUIRE_ADMIN", "yep"),
        ("SVC_METRICS_REQUIRE_AUTH", "2"),
        ("SVC_SESSION_TIMEOUT_SEC", "1h"),
        ("SVC_DASHBOARD_AUTH_RATE_LIMIT", "0"),
        ("SVC_ACL_STRICT", "strict"),
        ("SVC_RATE_LIMIT_ENABLED", "enabled"),
        ("SVC_RATE_LIMIT_CLEANUP_INTERVAL", "5m"),
        ("SVC_AUTH_RATE_LIMIT", "-5"),
        ("SVC_AUTH_RATE_WINDOW_MS", "0"),
        ("SVC_PUBLISH_RATE_LIMIT", "lots"),
        ("SVC_SUBSCRIBE_RATE_WINDOW_MS", "1e3"),
        ("SVC_CONNECTION_LIMIT_ENABLED", "off!"),
        ("SVC_MAX_CONN_PER_IP", "0"),
        ("SVC_MAX_TOTAL_CONN", "ten thousand"),
        ("SVC_RETENTION_MAX_AGE_MS", "-1"),
        ("SVC_RETENTION_MAX_BYTES", "10GiB"),
        ("SVC_RETENTION_INTERVAL_MS", "0"),
        ("SVC_SCRUB_ENABLED", "nope"),
        ("SVC_SCRUB_INTERVAL_MS", "0"),
        ("SVC_SCRUB_SEGMENTS_PER_TICK", "0"),
        ("SVC_CONTROL_PLANE", "zookeeper://zk:2181"),
        ("SVC_CONTROL_PLANE", "etcd://"),
        ("SVC_CONTROL_PLANE", "etcd://etcd-1:2379,etcd-2"),
        ("SVC_CONTROL_PLANE", "etcd://etcd-1:70000"),
        ("SVC_LOG_REPLICATION_FACTOR", "0"),
        ("SVC_LOG_ATTRIBUTES", "zone"),
        ("SVC_LOG_ATTRIBUTES", "zone=a,zone=b"),
        ("SVC_LOG_ATTRIBUTES", "zone=a b"),
        ("SVC_LOG_MIN_DOMAINS", "0"),
        ("SVC_LOG_SPREAD_POLICY", "strict"),
        ("SVC_REPLICATION_GROUP_COMMIT", "sometimes"),
        ("SVC_FSYNC_SCOPE", "range"),
        ("SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS", "0"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_variable_and_the_value(
    variable: str, value: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        BrokerConfig.from_env({variable: value}, cwd="/srv")

    assert raised.value.variable == variable
    assert raised.value.value == value
    assert f"{variable}={value!r} is invalid: expected " in str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("env", "mode"),
    [
        ({}, EnvMode.DEV),
        ({"MIX_ENV": "test"}, EnvMode.TEST),
        ({"SVC_ENV": "test"}, EnvMode.TEST),
        ({"SVC_ENV": "Test "}, EnvMode.TEST),
        ({"SVC_ENV": "dev", "MIX_ENV": "test"}, EnvMode.DEV),
        ({"SVC_ENV": "", "MIX_ENV": "test"}, EnvMode.TEST),
        # SVC_ENV decides, so a MIX_ENV meant for another program is not even looked at.
        ({"SVC_ENV": "test", "MIX_ENV": "docs"}, EnvMode.TEST),
    ],
)
def test_the_mode_comes_from_svc_env_then_mix_env_then_defaults_to_dev(
    env: dict[str, str], mode: EnvMode
) -> None:
    assert parse(env).mode is mode


def test_mix_env_prod_is_prod(prod_env: dict[str, str]) -> None:
    del prod_env["SVC_ENV"]

    assert parse({**prod_env, "MIX_ENV": "prod"}).mode is EnvMode.PROD


def test_test_mode_turns_the_limiters_off_by_default() -> None:
    config = parse({"SVC_ENV": "test"})

    assert config.rate_limits.enabled is False
    assert config.connection_limits.enabled is False
    assert parse({"SVC_ENV": "test", "SVC_RATE_LIMIT_ENABLED": "true"}).rate_limits.enabled


def test_prod_requires_tls_and_an_admin_password_and_an_absolute_data_dir(
    prod_env: dict[str, str], tmp_path: Path
) -> None:
    config = parse(prod_env)

    assert config.mode is EnvMode.PROD
    assert config.storage.data_dir == "/var/lib/logbroker"
    assert config.accounts.admin_pass == "correct horse"
    assert config.tls.required is True
    assert config.tls.enabled is True
    assert config.tls.certfile == str(tmp_path / "cert.pem")
    assert config.tls.keyfile == str(tmp_path / "key.pem")
    assert config.rate_limits.enabled is True
    assert config.connection_limits.enabled is True


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SVC_DATA_DIR": None}, "SVC_DATA_DIR is not set: expected an absolute path"),
        ({"SVC_DATA_DIR": "data"}, "SVC_DATA_DIR='data' is invalid: expected an absolute path"),
        ({"SVC_DATA_DIR": "./data"}, "SVC_DATA_DIR='./data' is invalid"),
        ({"SVC_ADMIN_PASS": None}, "SVC_ADMIN_PASS is not set: expected the admin password"),
        ({"SVC_ADMIN_PASS": ""}, "SVC_ADMIN_PASS is not set: expected the admin password"),
        ({"SVC_TLS_CERTFILE": None}, "SVC_TLS_CERTFILE is not set"),
        ({"SVC_TLS_KEYFILE": "missing.pem"}, "SVC_TLS_KEYFILE='missing.pem' is invalid"),
        ({"SVC_TLS_VERSIONS": "tlsv1.3,sslv3"}, "SVC_TLS_VERSIONS='tlsv1.3,sslv3' is invalid"),
        ({"SVC_TLS_VERIFY": "verify_all"}, "SVC_TLS_VERIFY='verify_all' is invalid"),
        ({"SVC_TLS_VERIFY": "verify_peer"}, "SVC_TLS_CACERTFILE is not set"),
        ({"SVC_ENABLE_TLS": "false"}, "SVC_ENABLE_TLS='false' is invalid"),
        ({"SVC_REQUIRE_TLS": "sure"}, "SVC_REQUIRE_TLS='sure' is invalid"),
    ],
)
def test_prod_refuses_to_boot_on_a_missing_or_invalid_setting(
    prod_env: dict[str, str], change: dict[str, str | None], message: str
) -> None:
    for variable, value in change.items():
        if value is None:
            del prod_env[variable]
        else:
            prod_env[variable] = value

    with pytest.raises(ConfigError, match=message):
        BrokerConfig.from_env(prod_env, cwd="/srv")


def test_relative_data_dir_is_resolved_against_the_working_directory_outside_prod() -> None:
    assert parse({"SVC_DATA_DIR": "var/lb"}).storage.data_dir == "/srv/var/lb"
    assert parse({"SVC_DATA_DIR": "/abs"}).storage.data_dir == "/abs"


def test_require_tls_false_turns_tls_off_in_prod_without_certificates(
    prod_env: dict[str, str],
) -> None:
    del prod_env["SVC_TLS_CERTFILE"], prod_env["SVC_TLS_KEYFILE"]

    tls = parse({**prod_env, "SVC_REQUIRE_TLS": "false"}).tls

    assert (tls.enabled, tls.required) == (False, False)


def test_require_tls_false_overrides_enable_tls_with_a_warning(prod_env: dict[str, str]) -> None:
    config, warnings = BrokerConfig.from_env(
        {**prod_env, "SVC_REQUIRE_TLS": "false", "SVC_ENABLE_TLS": "true"}
    )

    assert (config.tls.enabled, config.tls.required) == (False, False)
    assert warnings == [
        "SVC_ENABLE_TLS='true' is ignored: SVC_REQUIRE_TLS=false turns TLS off",
    ]


def test_outside_prod_tls_may_be_offered_without_being_required(
    prod_env: dict[str, str],
) -> None:
    tls = parse(
        {
            "SVC_ENABLE_TLS": "true",
            "SVC_TLS_CERTFILE": prod_env["SVC_TLS_CERTFILE"],
            "SVC_TLS_KEYFILE": prod_env["SVC_TLS_KEYFILE"],
            "SVC_TLS_VERSIONS": "TLSv1.3",
        }
    ).tls

    assert (tls.enabled, tls.required) == (True, False)
    assert tls.versions == (TlsVersion.TLSV1_3,)


def test_tls_files_resolve_against_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "tls").mkdir()
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / "tls" / name).write_text("pem\n")
    env = {
        "SVC_REQUIRE_TLS": "true",
        "SVC_TLS_CERTFILE": "tls/cert.pem",
        "SVC_TLS_KEYFILE": "tls/key.pem",
        "SVC_TLS_CACERTFILE": "tls/ca.pem",
        "SVC_TLS_VERIFY": "verify_peer",
    }

    tls = parse(env, cwd=str(tmp_path)).tls

    assert (tls.enabled, tls.required, tls.verify) == (True, True, TlsVerify.VERIFY_PEER)
    assert tls.cacertfile == str(tmp_path / "tls" / "ca.pem")


@pytest.mark.parametrize("mode", ["dev", "test"])
def test_outside_prod_invalid_tls_settings_only_warn_and_tls_stays_off(mode: str) -> None:
    config, warnings = BrokerConfig.from_env(
        {
            "SVC_ENV": mode,
            "SVC_ENABLE_TLS": "true",
            "SVC_TLS_KEYFILE": "missing.pem",
            "SVC_TLS_VERSIONS": "tlsv1.0",
        },
        cwd="/srv",
    )

    assert config.tls == parse({}).tls
    suffix = f"; TLS stays off (in {mode} an invalid TLS setting only warns)"
    assert warnings == [
        "SVC_TLS_VERSIONS='tlsv1.0' is invalid: expected a comma list of tlsv1.3 and tlsv1.2"
        + suffix,
        "SVC_TLS_CERTFILE is not set: expected the server certificate (PEM), since TLS is on"
        + suffix,
        "SVC_TLS_KEYFILE='missing.pem' is invalid: expected an existing file"
        " (/srv/missing.pem is not one)" + suffix,
    ]


def test_tls_files_are_not_checked_while_tls_is_off() -> None:
    assert parse({"SVC_TLS_CERTFILE": "missing.pem"}).tls.enabled is False


def test_an_unknown_variable_is_warned_about_with_the_closest_known_name() -> None:
    config, warnings = BrokerConfig.from_env(
        {
            "SVC_TYPO_PORT": "4040",
            "SVC_ADMIN_PASSWORD": "secret",
            "svc_scrub_enabled": "false",
            "SVC_WHATEVER": "1",
            "PATH": "/usr/bin",
            "SVCX_TCP_PORT": "1",
            "SVC_CLIENT_USER": "alice",
            "SVC_CLIENT_PASSWORD": "secret",
        },
        cwd="/srv",
    )

    assert config == parse({})
    assert warnings == [
        "unknown setting SVC_ADMIN_PASSWORD is ignored (did you mean SVC_ADMIN_PASS?)",
        "unknown setting SVC_TYPO_PORT is ignored (did you mean SVC_TCP_PORT?)",
        "unknown setting SVC_WHATEVER is ignored",
        "unknown setting svc_scrub_enabled is ignored (did you mean SVC_SCRUB_ENABLED?)",
    ]
    assert "secret" not in "".join(warnings)


def test_an_error_carries_the_warnings_that_explain_it(prod_env: dict[str, str]) -> None:
    del prod_env["SVC_ADMIN_PASS"]

    with pytest.raises(ConfigError) as raised:
        BrokerConfig.from_env({**prod_env, "SVC_ADMIN_PAS": "correct horse"})

    assert raised.value.variable == "SVC_ADMIN_PASS"
    assert raised.value.warnings == [
        "unknown setting SVC_ADMIN_PAS is ignored (did you mean SVC_ADMIN_PASS?)"
    ]


def test_passwords_are_kept_verbatim_and_left_out_of_repr() -> None:
    env = {
        "SVC_ADMIN_PASS": " admin secret ",
        "SVC_PRODUCER_PASS": "producer-secret",
        "SVC_CONSUMER_PASS": "consumer-secret",
        "SVC_APP_PASS": "app-secret",
    }

    config = parse(env)

    assert config.accounts.admin_pass == " admin secret "
    assert config.accounts.producer_pass == "producer-secret"
    assert config.accounts.consumer_pass == "consumer-secret"
    assert config.accounts.app_pass == "app-secret"
    assert "secret" not in repr(config)
    assert "secret" not in str(config.accounts)


@pytest.mark.parametrize(
    ("env", "variable", "clash"),
    [
        ({"SVC_DASHBOARD_PORT": "4040"}, "SVC_DASHBOARD_PORT", "SVC_TCP_PORT"),
        ({"SVC_TCP_PORT": "4042"}, "SVC_TCP_PORT", "SVC_PEER_PORT"),
        (
            {"SVC_PEER_PORT": "9000", "SVC_DASHBOARD_PORT": "9000"},
            "SVC_PEER_PORT",
            "SVC_DASHBOARD_PORT",
        ),
    ],
)
def test_two_listeners_on_one_port_are_an_error_naming_the_port_set(
    env: dict[str, str], variable: str, clash: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        BrokerConfig.from_env(env)

    assert raised.value.variable == variable
    assert f"expected a port other than {clash}'s" in str(raised.value)


def test_port_zero_asks_for_any_free_port_on_every_listener() -> None:
    config = parse({"SVC_TCP_PORT": "0", "SVC_DASHBOARD_PORT": "0", "SVC_PEER_PORT": "0"})

    assert (config.server.tcp_port, config.dashboard.port, config.cluster.peer_port) == (0, 0, 0)


def test_the_dashboard_listens_where_the_client_port_does_unless_told_otherwise() -> None:
    assert parse({"SVC_BIND_HOST": "::"}).dashboard.bind_host == "::"
    config = parse({"SVC_BIND_HOST": "::", "SVC_DASHBOARD_BIND_HOST": "127.0.0.1"})
    assert (config.server.bind_host, config.dashboard.bind_host) == ("::", "127.0.0.1")


def test_a_cluster_names_its_etcd_members_and_placement() -> None:
    config = parse(
        {
            "SVC_CONTROL_PLANE": "etcd://etcd-1:2379, 10.0.0.2:2379,[::1]:2379",
            "SVC_LOG_REPLICATION_FACTOR": "3",
            "SVC_LOG_ATTRIBUTES": "zone=eu-1a, rack=r7",
            "SVC_LOG_SPREAD_BY": "zone",
            "SVC_LOG_MIN_DOMAINS": "3",
            "SVC_LOG_SPREAD_POLICY": "hard",
        }
    )

    assert config.cluster.control_plane is ControlPlane.ETCD
    assert config.cluster.etcd_endpoints == (
        ("etcd-1", 2379),
        ("10.0.0.2", 2379),
        ("::1", 2379),
    )
    assert config.cluster.replication_factor == 3
    assert config.cluster.attributes == (("zone", "eu-1a"), ("rack", "r7"))
    assert config.cluster.spread_by == "zone"
    assert config.cluster.min_domains == 3
    assert config.cluster.spread_policy is SpreadPolicy.HARD


def test_replication_factor_two_is_warned_about() -> None:
    _, warnings = BrokerConfig.from_env(
        {"SVC_CONTROL_PLANE": "etcd://etcd:2379", "SVC_LOG_REPLICATION_FACTOR": "2"}
    )

    assert warnings == [
        "SVC_LOG_REPLICATION_FACTOR=2 has a quorum of 2, so losing either replica stalls"
        " writes; use 3 to survive the loss of a node"
    ]


@pytest.mark.parametrize(
    ("env", "variable", "expected"),
    [
        (
            {"SVC_LOG_REPLICATION_FACTOR": "3"},
            "SVC_LOG_REPLICATION_FACTOR",
            "1 with SVC_CONTROL_PLANE=local",
        ),
        (
            {"SVC_LOG_SPREAD_BY": "zone"},
            "SVC_LOG_SPREAD_BY",
            "an attribute this node declares in SVC_LOG_ATTRIBUTES, which is not set",
        ),
        (
            {"SVC_LOG_ATTRIBUTES": "rack=r1,row=2", "SVC_LOG_SPREAD_BY": "zone"},
            "SVC_LOG_SPREAD_BY",
            "an attribute this node declares in SVC_LOG_ATTRIBUTES (rack, row)",
        ),
        (
            {"SVC_LOG_MIN_DOMAINS": "2", "SVC_CONTROL_PLANE": "etcd://e:2379"},
            "SVC_LOG_MIN_DOMAINS",
            "1 unless SVC_LOG_SPREAD_BY names the attribute",
        ),
        (
            {
                "SVC_CONTROL_PLANE": "etcd://e:2379",
                "SVC_LOG_REPLICATION_FACTOR": "3",
                "SVC_LOG_ATTRIBUTES": "zone=a",
                "SVC_LOG_SPREAD_BY": "zone",
                "SVC_LOG_MIN_DOMAINS": "4",
            },
            "SVC_LOG_MIN_DOMAINS",
            "at most SVC_LOG_REPLICATION_FACTOR (3)",
        ),
    ],
)
def test_a_cluster_setting_that_cannot_be_served_is_an_error(
    env: dict[str, str], variable: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        BrokerConfig.from_env(env)

    assert raised.value.variable == variable
    assert f"{variable}={env[variable]!r} is invalid: expected {expected}" in str(raised.value)


def test_a_replicated_cluster_boots_without_a_warning_of_its_own() -> None:
    config = parse({"SVC_CONTROL_PLANE": "etcd://e:2379", "SVC_LOG_REPLICATION_FACTOR": "3"})

    # The scrub, on by default, repairs from the replicas (``logbroker.replication.repair``).
    assert check_built(config) == []


def test_a_prod_cluster_node_needs_a_cluster_secret() -> None:
    env = {
        "SVC_ENV": "prod",
        "SVC_DATA_DIR": "/var/lib/logbroker",
        "SVC_ADMIN_PASS": "a long admin password",
        "SVC_REQUIRE_TLS": "false",
        "SVC_CONTROL_PLANE": "etcd://e1:2379",
        "SVC_ETCD_ALLOW_PLAINTEXT": "true",
    }

    with pytest.raises(ConfigError) as raised:
        check_built(parse(env))
    assert raised.value.variable == "SVC_CLUSTER_SECRET"

    secret = {**env, "SVC_CLUSTER_SECRET": "a long random cluster secret"}
    assert check_built(parse(secret))


def test_a_cluster_node_warns_what_of_the_cluster_is_not_built_yet() -> None:
    [cluster] = check_built(parse({"SVC_CONTROL_PLANE": "etcd://e1:2379"}))

    assert cluster.startswith("SVC_LOG_REPLICATION_FACTOR=1: each range has one copy")


def test_retention_limits_boot_without_a_warning() -> None:
    # Retention is built (``logbroker.maintenance.retention``): nothing to warn of.
    env = {"SVC_RETENTION_MAX_AGE_MS": "604800000", "SVC_RETENTION_MAX_BYTES": "0"}
    assert check_built(parse(env)) == []


def test_a_node_s_identity_in_the_cluster() -> None:
    cluster = parse(
        {
            "SVC_NODE_ID": "broker-1",
            "SVC_CLUSTER_ID": "prod-eu",
            "SVC_ADVERTISE_HOST": "10.0.0.5",
            "SVC_NODE_LEASE_MS": "3000",
            "SVC_CLUSTER_SECRET": "a long random cluster secret",
        }
    ).cluster

    assert (cluster.node_id, cluster.cluster_id, cluster.advertise_host) == (
        "broker-1",
        "prod-eu",
        "10.0.0.5",
    )
    assert cluster.node_lease_ms == 3000
    assert cluster.cluster_secret == "a long random cluster secret"
    assert "a long random" not in repr(cluster)
    defaults = parse({}).cluster
    assert (defaults.node_id, defaults.cluster_id, defaults.advertise_host) == (
        None,
        "logbroker",
        None,
    )


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("SVC_NODE_ID", "node/1", "1 to 64 of A-Z a-z 0-9 . _ -, not . or .."),
        ("SVC_CLUSTER_ID", "..", "1 to 64 of A-Z a-z 0-9 . _ -, not . or .."),
        ("SVC_NODE_LEASE_MS", "500", "an integer from 2000 to 600000"),
    ],
)
def test_a_bad_node_identity_names_its_variable(variable: str, value: str, expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse({variable: value})
    assert str(raised.value) == f"{variable}={value!r} is invalid: expected {expected}"


def test_a_short_cluster_secret_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as raised:
        parse({"SVC_CLUSTER_SECRET": "hunter2"})
    assert "hunter2" not in str(raised.value)
    assert raised.value.variable == "SVC_CLUSTER_SECRET"
