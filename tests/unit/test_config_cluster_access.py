"""The settings of a cluster node's access to etcd and of its peer port: ``etcd+https://``,
the ``SVC_ETCD_*`` files and credentials, prod's refusal of plaintext etcd off the machine, the
peer CA under the TLS rules, and the caps on peer connections in their handshake."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from logbroker.config import BrokerConfig, ConfigError, EtcdAccess, PeerPortLimits

REMOTE_ETCD = "etcd://10.0.0.11:2379,10.0.0.12:2379"


def parse(env: Mapping[str, str], cwd: str = "/srv") -> tuple[BrokerConfig, list[str]]:
    return BrokerConfig.from_env(env, cwd=cwd)


def refused(env: Mapping[str, str], cwd: str = "/srv") -> ConfigError:
    with pytest.raises(ConfigError) as raised:
        BrokerConfig.from_env(env, cwd=cwd)
    return raised.value


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    for name in ("ca.pem", "cert.pem", "key.pem", "peer-ca.pem"):
        (tmp_path / name).write_text("PEM\n")
    return {name: str(tmp_path / name) for name in ("ca.pem", "cert.pem", "key.pem", "peer-ca.pem")}


@pytest.fixture
def prod(files: dict[str, str]) -> dict[str, str]:
    """A prod cluster node with TLS (its own certificate) but no peer CA yet."""
    return {
        "SVC_ENV": "prod",
        "SVC_DATA_DIR": "/var/lib/logbroker",
        "SVC_ADMIN_PASS": "correct horse",
        "SVC_TLS_CERTFILE": files["cert.pem"],
        "SVC_TLS_KEYFILE": files["key.pem"],
        "SVC_CONTROL_PLANE": "etcd+https://10.0.0.11:2379",
    }


# -- etcd ------------------------------------------------------------------------------------


def test_etcd_over_tls_with_a_client_certificate_and_a_user(files: dict[str, str]) -> None:
    config, warnings = parse(
        {
            "SVC_CONTROL_PLANE": "etcd+https://etcd-1:2379,[::1]:2379",
            "SVC_ETCD_CACERTFILE": files["ca.pem"],
            "SVC_ETCD_CERTFILE": files["cert.pem"],
            "SVC_ETCD_KEYFILE": files["key.pem"],
            "SVC_ETCD_USER": "logbroker",
            "SVC_ETCD_PASSWORD": " a password with blanks ",
        }
    )

    assert warnings == []
    assert config.cluster.etcd_endpoints == (("etcd-1", 2379), ("::1", 2379))
    assert config.cluster.etcd == EtcdAccess(
        https=True,
        cacertfile=files["ca.pem"],
        certfile=files["cert.pem"],
        keyfile=files["key.pem"],
        user="logbroker",
        password=" a password with blanks ",
    )
    assert config.cluster.etcd.scheme == "https"
    assert "a password with blanks" not in repr(config)


def test_plain_etcd_is_http_without_credentials() -> None:
    config, _ = parse({"SVC_CONTROL_PLANE": "etcd://e1:2379"})

    assert config.cluster.etcd == EtcdAccess()
    assert config.cluster.etcd.scheme == "http"


@pytest.mark.parametrize("variable", ["SVC_ETCD_CACERTFILE", "SVC_ETCD_CERTFILE"])
def test_tls_files_with_plaintext_etcd_are_refused(files: dict[str, str], variable: str) -> None:
    env = {"SVC_CONTROL_PLANE": "etcd://e1:2379", variable: files["cert.pem"]}
    if variable == "SVC_ETCD_CERTFILE":
        env["SVC_ETCD_KEYFILE"] = files["key.pem"]

    error = refused(env)

    assert error.variable == variable
    assert "etcd+https://" in str(error)


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ("SVC_ETCD_CERTFILE", "SVC_ETCD_KEYFILE"),
        ("SVC_ETCD_KEYFILE", "SVC_ETCD_CERTFILE"),
        ("SVC_ETCD_USER", "SVC_ETCD_PASSWORD"),
        ("SVC_ETCD_PASSWORD", "SVC_ETCD_USER"),
    ],
)
def test_pairs_are_both_set_or_neither(files: dict[str, str], given: str, missing: str) -> None:
    error = refused({"SVC_CONTROL_PLANE": "etcd+https://e1:2379", given: files["cert.pem"]})

    assert (error.variable, error.value) == (missing, None)
    assert given in str(error)


def test_a_missing_etcd_file_is_refused_in_every_mode(tmp_path: Path) -> None:
    env = {"SVC_CONTROL_PLANE": "etcd+https://e1:2379", "SVC_ETCD_CACERTFILE": "nowhere.pem"}

    error = refused(env, cwd=str(tmp_path))

    assert error.variable == "SVC_ETCD_CACERTFILE"
    assert f"{tmp_path}/nowhere.pem is not one" in str(error)


def test_prod_refuses_plaintext_etcd_off_this_machine(prod: dict[str, str]) -> None:
    env = {**prod, "SVC_REQUIRE_TLS": "false", "SVC_CONTROL_PLANE": REMOTE_ETCD}

    error = refused(env)

    assert error.variable == "SVC_CONTROL_PLANE"
    assert "etcd at 10.0.0.11 is not on this machine" in str(error)
    assert "SVC_ETCD_ALLOW_PLAINTEXT=true" in str(error)


def test_prod_takes_plaintext_etcd_when_allowed_or_on_loopback(prod: dict[str, str]) -> None:
    env = {**prod, "SVC_REQUIRE_TLS": "false"}

    allowed, _ = parse({**env, "SVC_CONTROL_PLANE": REMOTE_ETCD, "SVC_ETCD_ALLOW_PLAINTEXT": "1"})
    local, _ = parse({**env, "SVC_CONTROL_PLANE": "etcd://127.0.0.2:2379,[::1]:1,localhost:2"})

    assert allowed.cluster.etcd_endpoints[0] == ("10.0.0.11", 2379)
    assert local.cluster.etcd.https is False


def test_dev_takes_plaintext_etcd_anywhere_but_warns_of_a_plaintext_password() -> None:
    _, quiet = parse({"SVC_CONTROL_PLANE": REMOTE_ETCD})
    _, warnings = parse(
        {"SVC_CONTROL_PLANE": REMOTE_ETCD, "SVC_ETCD_USER": "lb", "SVC_ETCD_PASSWORD": "pw"}
    )

    assert quiet == []
    assert warnings == [
        "SVC_ETCD_PASSWORD goes to etcd at 10.0.0.11 in plaintext (SVC_CONTROL_PLANE=etcd://);"
        " use etcd+https:// for TLS"
    ]


def test_a_bad_control_plane_scheme_names_both_etcd_schemes() -> None:
    error = refused({"SVC_CONTROL_PLANE": "https://e1:2379"})

    assert error.variable == "SVC_CONTROL_PLANE"
    assert "etcd://host:port" in str(error)
    assert "etcd+https://host:port" in str(error)


# -- the peer port ---------------------------------------------------------------------------


def test_a_cluster_node_with_tls_takes_the_peer_ca_from_the_tls_ca(
    prod: dict[str, str], files: dict[str, str]
) -> None:
    config, _ = parse({**prod, "SVC_TLS_CACERTFILE": files["ca.pem"]})

    assert config.tls.peer_cacertfile == files["ca.pem"]


def test_the_peer_ca_setting_wins_over_the_tls_ca(
    prod: dict[str, str], files: dict[str, str]
) -> None:
    config, _ = parse(
        {
            **prod,
            "SVC_TLS_CACERTFILE": files["ca.pem"],
            "SVC_PEER_TLS_CACERTFILE": files["peer-ca.pem"],
        }
    )

    assert config.tls.peer_cacertfile == files["peer-ca.pem"]
    assert config.tls.cacertfile == files["ca.pem"]


def test_prod_refuses_a_cluster_node_with_tls_but_no_peer_ca(prod: dict[str, str]) -> None:
    error = refused(prod)

    assert (error.variable, error.value) == ("SVC_PEER_TLS_CACERTFILE", None)
    assert "SVC_TLS_CACERTFILE" in str(error)


def test_prod_refuses_a_missing_peer_ca_file(prod: dict[str, str]) -> None:
    error = refused({**prod, "SVC_PEER_TLS_CACERTFILE": "/nowhere/ca.pem"})

    assert error.variable == "SVC_PEER_TLS_CACERTFILE"
    assert "/nowhere/ca.pem is not one" in str(error)


def test_dev_warns_of_a_missing_peer_ca_and_runs_without_tls_on_both_ports(
    prod: dict[str, str],
) -> None:
    config, warnings = parse({**prod, "SVC_ENV": "dev", "SVC_ENABLE_TLS": "true"})

    assert not config.tls.enabled
    assert config.tls.peer_cacertfile is None
    [warning] = warnings
    assert warning.startswith("SVC_PEER_TLS_CACERTFILE is not set")
    assert warning.endswith("TLS stays off (in dev an invalid TLS setting only warns)")


def test_a_single_node_has_no_peer_ca(prod: dict[str, str], files: dict[str, str]) -> None:
    config, _ = parse({**prod, "SVC_CONTROL_PLANE": "local", "SVC_TLS_CACERTFILE": files["ca.pem"]})

    assert config.tls.enabled
    assert config.tls.peer_cacertfile is None


def test_a_cluster_node_without_tls_has_no_peer_ca(files: dict[str, str]) -> None:
    config, _ = parse(
        {"SVC_CONTROL_PLANE": "etcd://e1:2379", "SVC_TLS_CACERTFILE": files["ca.pem"]}
    )

    assert config.tls.peer_cacertfile is None


def test_the_handshake_caps_have_defaults_and_take_settings() -> None:
    default, _ = parse({})
    set_, _ = parse({"SVC_PEER_MAX_HANDSHAKES_PER_IP": "2", "SVC_PEER_MAX_HANDSHAKES": "10"})

    assert default.cluster.peer_limits == PeerPortLimits(8, 64)
    assert set_.cluster.peer_limits == PeerPortLimits(2, 10)


@pytest.mark.parametrize("variable", ["SVC_PEER_MAX_HANDSHAKES_PER_IP", "SVC_PEER_MAX_HANDSHAKES"])
def test_a_handshake_cap_is_a_positive_integer(variable: str) -> None:
    error = refused({variable: "0"})

    assert error.variable == variable
    assert "an integer from 1 up" in str(error)
