"""etcd reached as docs/cluster.md ("Securing a cluster") says: a real three-member etcd with TLS,
client certificates required and auth on (``tests.etcd.EtcdSecurity``). The store renews its
expired tokens and stays inside its role's prefix; what etcd refuses (a wrong password, no client
certificate, a certificate of another CA, an etcd certificate this node does not trust) fails
with ``ControlPlaneAccessError`` saying which; and the real ``twistd logbroker`` boots with the
right material and stops at boot with status 2 and a line naming what was wrong otherwise. The
contract suites of tests/unit/controlplane also run against this cluster (``secured-etcd``)."""

from __future__ import annotations

import datetime
import subprocess
import uuid
from pathlib import Path
from typing import Any

import attrs
import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.task import deferLater

from logbroker.config import EtcdAccess
from logbroker.controlplane import ControlPlaneAccessError, EtcdGatewayStore, EtcdUser
from logbroker.controlplane._kv import Put
from logbroker.controlplane.compaction import AUTO_COMPACTION, HistoryCompaction
from logbroker.security.etcd_tls import load_etcd_tls
from tests.certificates import issue, make_ca, write
from tests.etcd import TOKEN_TTL_SECONDS, EtcdCluster, secured_etcd_cluster
from tests.integration.twistd import TWISTD, broker_env, running_broker

pytestmark = pytest.mark.integration

__all__ = ["secured_etcd_cluster"]


def store_with(
    cluster: EtcdCluster,
    *,
    user: EtcdUser | None = None,
    reports: list[tuple[str, str]] | None = None,
    **files: str | None,
) -> EtcdGatewayStore:
    """A store on the secured cluster with the right material but for what is given."""
    security = cluster.security
    assert security is not None
    heard = reports if reports is not None else []
    access = attrs.evolve(
        EtcdAccess(
            https=True,
            cacertfile=security.ca_file,
            certfile=security.client_cert,
            keyfile=security.client_key,
        ),
        **files,
    )
    return EtcdGatewayStore(
        cluster.endpoints,
        reactor=reactor,  # type: ignore[arg-type]
        tls=load_etcd_tls(access, ["127.0.0.1"], datetime.datetime.now(datetime.UTC)),
        user=user or EtcdUser(security.user, security.password),
        on_request=lambda op, result, seconds: heard.append((op, result)),
    )


def prefix() -> bytes:
    return f"/logbroker/security-test-{uuid.uuid4().hex}/".encode()


@pytest_twisted.ensureDeferred
async def test_an_expired_token_is_renewed_on_its_own(secured_etcd_cluster: EtcdCluster) -> None:
    reports: list[tuple[str, str]] = []
    store = store_with(secured_etcd_cluster, reports=reports)
    key = prefix() + b"k"
    try:
        await store.put(key, b"1")
        await deferLater(reactor, TOKEN_TTL_SECONDS + 1.5)  # type: ignore[arg-type]
        await store.put(key, b"2")
        found = await store.range_prefix(key)
    finally:
        await store.delete_prefix(key)
        await store.close()

    assert [kv.value for kv in found.kvs] == [b"2"]
    assert reports.count(("authenticate", "ok")) >= 2
    assert ("txn", "error") not in reports


@pytest_twisted.ensureDeferred
async def test_the_user_s_role_confines_it_to_its_prefix(
    secured_etcd_cluster: EtcdCluster,
) -> None:
    store = store_with(secured_etcd_cluster)
    try:
        with pytest.raises(ControlPlaneAccessError, match="permission denied"):
            await store.txn([], [Put(b"/elsewhere/key", b"x")])
    finally:
        await store.close()


@pytest_twisted.ensureDeferred
async def test_the_brokers_user_may_compact_etcd_s_history(
    secured_etcd_cluster: EtcdCluster, logged: list[dict[str, Any]]
) -> None:
    """etcd 3.4 lets a user confined to ``/logbroker/`` compact (some versions give compaction
    to root alone while auth is on: the node then says how to have etcd compact itself, which
    ``tests/unit/controlplane/test_compaction.py`` holds it to)."""
    security = secured_etcd_cluster.security
    assert security is not None
    store = store_with(secured_etcd_cluster)
    key = f"{security.prefix}compaction-test".encode()
    compaction = HistoryCompaction(store, f"{security.prefix}cluster/chores".encode(), lambda: True)
    try:
        for value in [b"1", b"2", b"3"]:
            await store.put(key, value)
            running = compaction.run()
            assert running is not None, "asked again: it was not refused"
            await running
    finally:
        await store.delete_prefix(key)
        await store.close()

    assert not compaction.refused
    assert [e["revision"] for e in logged if "Compacted etcd" in e.get("log_format", "")]
    assert not [e for e in logged if e.get("flags") == AUTO_COMPACTION]


async def refusal(store: EtcdGatewayStore) -> str:
    try:
        with pytest.raises(ControlPlaneAccessError) as raised:
            await store.range_prefix(prefix())
    finally:
        await store.close()
    return str(raised.value)


@pytest_twisted.ensureDeferred
async def test_a_wrong_password_is_refused_naming_the_settings(
    secured_etcd_cluster: EtcdCluster,
) -> None:
    error = await refusal(
        store_with(secured_etcd_cluster, user=EtcdUser("logbroker", "not the password"))
    )

    assert "SVC_ETCD_USER" in error
    assert "invalid user ID or password" in error
    assert "not the password" not in error


@pytest_twisted.ensureDeferred
async def test_no_client_certificate_is_refused_at_tls(secured_etcd_cluster: EtcdCluster) -> None:
    error = await refusal(store_with(secured_etcd_cluster, certfile=None, keyfile=None))

    assert "every etcd member refused this node at TLS" in error
    assert "SVC_ETCD_CERTFILE" in error


@pytest_twisted.ensureDeferred
async def test_a_client_certificate_of_another_ca_is_refused_at_tls(
    secured_etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    other = issue(make_ca("another CA"), ("logbroker",), client=True, anonymous=True)
    error = await refusal(
        store_with(
            secured_etcd_cluster,
            certfile=write(tmp_path / "other.pem", other.cert_pem),
            keyfile=write(tmp_path / "other-key.pem", other.key_pem),
        )
    )

    assert "every etcd member refused this node at TLS" in error
    assert "alert" in error


@pytest_twisted.ensureDeferred
async def test_an_etcd_this_node_does_not_trust_is_refused(
    secured_etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    other_ca = write(tmp_path / "other-ca.pem", make_ca("another CA").cert_pem)
    error = await refusal(store_with(secured_etcd_cluster, cacertfile=other_ca))

    assert "certificate verify failed" in error
    assert "SVC_ETCD_CACERTFILE" in error


@pytest_twisted.ensureDeferred
async def test_without_a_user_a_secured_etcd_asks_for_one(
    secured_etcd_cluster: EtcdCluster,
) -> None:
    security = secured_etcd_cluster.security
    assert security is not None
    access = EtcdAccess(
        https=True,
        cacertfile=security.ca_file,
        certfile=security.client_cert,
        keyfile=security.client_key,
    )
    store = EtcdGatewayStore(
        secured_etcd_cluster.endpoints,
        reactor=reactor,  # type: ignore[arg-type]
        tls=load_etcd_tls(access, ["127.0.0.1"], datetime.datetime.now(datetime.UTC)),
    )

    assert "SVC_ETCD_USER" in await refusal(store)


# -- the real twistd logbroker ---------------------------------------------------------------


def node_settings(cluster: EtcdCluster, **changes: str | None) -> dict[str, str]:
    security = cluster.security
    assert security is not None
    endpoints = ",".join(member.endpoint.removeprefix("https://") for member in cluster.members)
    settings: dict[str, str | None] = {
        "SVC_CONTROL_PLANE": f"etcd+https://{endpoints}",
        "SVC_CLUSTER_ID": f"security-{uuid.uuid4().hex[:8]}",
        "SVC_NODE_ID": "n1",
        "SVC_ADVERTISE_HOST": "127.0.0.1",
        "SVC_BIND_HOST": "127.0.0.1",
        "SVC_PEER_PORT": "0",
        "SVC_SCRUB_ENABLED": "false",
        "SVC_CLUSTER_SECRET": "a cluster secret for the tests only",
        **security.broker_settings(),
        **changes,
    }
    return {name: value for name, value in settings.items() if value is not None}


def test_a_node_with_the_right_material_boots_and_serves(
    secured_etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    from logbroker.client.blocking import BlockingClient

    with running_broker(tmp_path, settings=node_settings(secured_etcd_cluster)) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "admin", "admin123") as client:
            client.create_topic(f"secured-{uuid.uuid4().hex[:8]}")
        output = broker.stop()

    assert "control plane etcd at" in output
    assert "(https)" in output


@pytest.fixture
def boot(tmp_path: Path) -> Any:
    def run(settings: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [TWISTD, "-n", "--pidfile=", "--logfile=-", "logbroker"],
            cwd=tmp_path,
            env=broker_env(
                {"SVC_ENV": "test", "SVC_TCP_PORT": "0", "SVC_DASHBOARD_PORT": "0", **settings}
            ),
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )

    return run


def test_a_wrong_password_stops_the_boot_with_status_2(
    secured_etcd_cluster: EtcdCluster, boot: Any
) -> None:
    done = boot(node_settings(secured_etcd_cluster, SVC_ETCD_PASSWORD="not the password"))

    assert done.returncode == 2, done.stdout
    assert "The broker could not get ready: etcd refused user 'logbroker'" in done.stdout
    assert "(SVC_ETCD_USER) with its password (SVC_ETCD_PASSWORD)" in done.stdout
    assert "not the password" not in done.stdout


def test_a_missing_client_certificate_stops_the_boot_with_status_2(
    secured_etcd_cluster: EtcdCluster, boot: Any
) -> None:
    done = boot(node_settings(secured_etcd_cluster, SVC_ETCD_CERTFILE=None, SVC_ETCD_KEYFILE=None))

    assert done.returncode == 2, done.stdout
    assert "every etcd member refused this node at TLS" in done.stdout
    assert "set SVC_ETCD_CERTFILE and SVC_ETCD_KEYFILE" in done.stdout


def test_a_client_certificate_of_another_ca_stops_the_boot_with_status_2(
    secured_etcd_cluster: EtcdCluster, boot: Any, tmp_path: Path
) -> None:
    other = issue(make_ca("another CA"), ("logbroker",), client=True, anonymous=True)
    done = boot(
        node_settings(
            secured_etcd_cluster,
            SVC_ETCD_CERTFILE=write(tmp_path / "other.pem", other.cert_pem),
            SVC_ETCD_KEYFILE=write(tmp_path / "other-key.pem", other.key_pem),
        )
    )

    assert done.returncode == 2, done.stdout
    assert "every etcd member refused this node at TLS" in done.stdout


def test_a_client_certificate_with_a_common_name_stops_the_boot_before_any_request(
    secured_etcd_cluster: EtcdCluster, boot: Any, tmp_path: Path
) -> None:
    security = secured_etcd_cluster.security
    assert security is not None
    named = issue(security.authority, ("logbroker",), client=True)
    done = boot(
        node_settings(
            secured_etcd_cluster,
            SVC_ETCD_CERTFILE=write(tmp_path / "named.pem", named.cert_pem),
            SVC_ETCD_KEYFILE=write(tmp_path / "named-key.pem", named.key_pem),
        )
    )

    assert done.returncode == 2, done.stderr
    assert "expected a client certificate without a Common Name" in done.stderr


def test_prod_refuses_plaintext_etcd_off_this_machine_with_status_2(boot: Any) -> None:
    done = boot(
        {
            "SVC_ENV": "prod",
            "SVC_DATA_DIR": "/var/lib/logbroker-test-never-made",
            "SVC_ADMIN_PASS": "an admin password",
            "SVC_REQUIRE_TLS": "false",
            "SVC_CONTROL_PLANE": "etcd://10.0.0.11:2379",
        }
    )

    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "logbroker: SVC_CONTROL_PLANE='etcd://10.0.0.11:2379' is invalid: expected"
        " etcd+https://... in prod: etcd at 10.0.0.11 is not on this machine, and it holds"
        " every password hash, ACL grant and session (SVC_ETCD_ALLOW_PLAINTEXT=true allows"
        " plaintext etcd, on a private network only)"
    ]
