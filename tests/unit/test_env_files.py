"""The shipped env files: the prod template lists every variable, holds no credential and boots
prod once the operator adds the admin password and the TLS files; the development one is dev."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from logbroker.config import VARIABLES, BrokerConfig, ConfigError, EnvMode, check_built
from tests.certificates import issue, make_ca, write

ETC = Path(__file__).resolve().parents[2] / "etc"
PROD = ETC / "logbroker.env"
DEV = ETC / "logbroker-dev.env"
CREDENTIALS = {
    "SVC_ADMIN_PASS",
    "SVC_PRODUCER_PASS",
    "SVC_CONSUMER_PASS",
    "SVC_APP_PASS",
    "SVC_CLIENT_PASSWORD",
    "SVC_CLUSTER_SECRET",
    "SVC_ETCD_PASSWORD",
}
_ASSIGNMENT = re.compile(r"^(#?)([A-Z_]+)=(.*)$")


def assignments(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The settings a systemd ``EnvironmentFile`` would set, and those commented out."""
    active: dict[str, str] = {}
    commented: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _ASSIGNMENT.match(line)
        if match:
            hashed, name, value = match.groups()
            target = commented if hashed else active
            assert name not in {**active, **commented}, f"{name} twice in {path.name}"
            target[name] = value
    return active, commented


def test_the_prod_template_lists_every_variable_once() -> None:
    active, commented = assignments(PROD)
    assert sorted({**active, **commented}) == sorted(variable.name for variable in VARIABLES)


def test_the_prod_template_sets_no_credential() -> None:
    active, commented = assignments(PROD)
    assert CREDENTIALS.isdisjoint(active)
    assert all(commented[name] == "" for name in CREDENTIALS)


def test_the_commented_defaults_are_the_documented_ones() -> None:
    _, commented = assignments(PROD)
    documented = {variable.name: variable.default for variable in VARIABLES}
    for name, value in commented.items():
        assert value in ("", documented[name]), name


def test_prod_refuses_to_start_from_the_template_without_an_admin_password() -> None:
    active, _ = assignments(PROD)
    with pytest.raises(ConfigError) as error:
        BrokerConfig.from_env(active)
    assert error.value.variable == "SVC_ADMIN_PASS"


def test_the_template_plus_a_password_and_tls_files_is_a_prod_config(tmp_path: Path) -> None:
    active, _ = assignments(PROD)
    server = issue(make_ca())
    files = {
        "SVC_TLS_CERTFILE": write(tmp_path / "server.crt", server.cert_pem),
        "SVC_TLS_KEYFILE": write(tmp_path / "server.key", server.key_pem),
    }

    config, warnings = BrokerConfig.from_env({**active, **files, "SVC_ADMIN_PASS": "s3cret-pass"})

    assert warnings == []
    assert config.mode is EnvMode.PROD
    assert config.storage.data_dir == "/var/lib/logbroker"
    assert (config.tls.required, config.tls.enabled) == (True, True)
    assert config.dashboard.bind_host == "127.0.0.1"
    assert config.rate_limits.enabled
    assert config.connection_limits.enabled


def test_the_development_file_is_dev_and_says_never_for_production(tmp_path: Path) -> None:
    active, _ = assignments(DEV)
    client_settings = {"SVC_CLIENT_USER", "SVC_CLIENT_PASSWORD"}
    broker_settings = {k: v for k, v in active.items() if k not in client_settings}

    config, warnings = BrokerConfig.from_env(broker_settings, cwd=str(tmp_path))

    assert config.mode is EnvMode.DEV
    assert warnings == []
    assert config.server.bind_host == "127.0.0.1"
    assert "NEVER USE THIS FILE IN PRODUCTION" in DEV.read_text(encoding="utf-8")


CLUSTER = ETC / "logbroker-cluster.env"


def test_the_cluster_template_sets_known_cluster_variables_and_no_secret() -> None:
    active, _ = assignments(CLUSTER)
    known = {variable.name for variable in VARIABLES}

    assert set(active) <= known
    assert active["SVC_CLUSTER_SECRET"] == ""
    assert active["SVC_ETCD_PASSWORD"] == ""
    assert active["SVC_CONTROL_PLANE"].startswith("etcd+https://")


def test_a_prod_node_from_the_cluster_template_needs_its_secret(tmp_path: Path) -> None:
    active, _ = assignments(CLUSTER)
    authority = make_ca()
    client = issue(authority, client=True)
    env = {
        **active,
        "SVC_ENV": "prod",
        "SVC_DATA_DIR": "/var/lib/logbroker",
        "SVC_ADMIN_PASS": "a long admin password",
        "SVC_REQUIRE_TLS": "false",
        "SVC_ETCD_CACERTFILE": write(tmp_path / "etcd-ca.crt", authority.cert_pem),
        "SVC_ETCD_CERTFILE": write(tmp_path / "etcd-client.crt", client.cert_pem),
        "SVC_ETCD_KEYFILE": write(tmp_path / "etcd-client.key", client.key_pem),
        "SVC_ETCD_PASSWORD": "the etcd user's password",
    }
    config, _ = BrokerConfig.from_env(env)
    with pytest.raises(ConfigError) as error:
        check_built(config)
    assert error.value.variable == "SVC_CLUSTER_SECRET"

    config, _ = BrokerConfig.from_env({**env, "SVC_CLUSTER_SECRET": "x" * 32})
    assert config.cluster.node_id == "broker-1"
    check_built(config)
