"""TLS on the real ``twistd logbroker``: TLS and plaintext on one port, ``SVC_REQUIRE_TLS``,
the versions a client may speak, hostname checks, certificates refused at boot in prod and only
warned about in dev, and the clients' ``tls`` options (blocking, Twisted, the CLI)."""

from __future__ import annotations

import datetime
import http.client
import json
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import pytest_twisted
from twisted.internet import reactor

from logbroker import wire
from logbroker.client import connect
from logbroker.client.blocking import BlockingClient, BrokerRefused
from logbroker.records import Record
from tests.certificates import DAY, Issued, issue, make_ca, write
from tests.integration.twistd import TWISTD, RunningBroker, broker_env, running_broker

pytestmark = pytest.mark.integration

LOGBROKER = str(Path(sys.executable).with_name("logbroker"))


@attrs.frozen
class Files:
    ca: str
    cert: str
    key: str
    authority: Issued


@pytest.fixture
def files(tmp_path: Path) -> Files:
    """A CA and a certificate it signs for ``localhost`` and ``127.0.0.1``, in PEM files."""
    directory = tmp_path / "tls"
    directory.mkdir()
    authority = make_ca()
    server = issue(authority)
    return Files(
        ca=write(directory / "ca.pem", authority.cert_pem),
        cert=write(directory / "cert.pem", server.cert_pem),
        key=write(directory / "key.pem", server.key_pem),
        authority=authority,
    )


def tls_settings(files: Files, **more: str) -> dict[str, str]:
    return {"SVC_TLS_CERTFILE": files.cert, "SVC_TLS_KEYFILE": files.key, **more}


@pytest.fixture
def tls_required(tmp_path: Path, files: Files) -> Iterator[RunningBroker]:
    with running_broker(tmp_path, settings=tls_settings(files, SVC_REQUIRE_TLS="true")) as broker:
        yield broker


def context(
    files: Files,
    version: ssl.TLSVersion | None = None,
    security_level_0: bool = False,
) -> ssl.SSLContext:
    """A client context trusting the test CA, limited to ``version`` when given."""
    made = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    made.load_verify_locations(files.ca)
    if security_level_0:
        # OpenSSL 3 will not even offer TLS 1.1 at its default level: lowered here, a refusal
        # is the server's doing.
        made.set_ciphers("DEFAULT:@SECLEVEL=0")
    if version is not None:
        made.minimum_version = made.maximum_version = version
    return made


def tls_socket(port: int, made: ssl.SSLContext, hostname: str = "localhost") -> ssl.SSLSocket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        return made.wrap_socket(sock, server_hostname=hostname)
    except BaseException:
        sock.close()
        raise


def test_tls_and_plaintext_clients_share_the_port_when_tls_is_offered(
    tmp_path: Path, files: Files
) -> None:
    with running_broker(tmp_path, settings=tls_settings(files, SVC_ENABLE_TLS="true")) as broker:
        with BlockingClient.connect(
            "localhost", broker.port, "app", "app123", tls=True, cafile=files.ca
        ) as secure:
            secure.create_topic("t")
            assert secure.produce("t", [Record(b"over tls")]) == 1
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as plain:
            assert plain.produce("t", [Record(b"in plaintext")]) == 1
            fetched = plain.fetch("t", max_records=10)
        output = broker.stop()

    assert sorted(record.value for record in fetched.records) == [b"in plaintext", b"over tls"]
    assert "Client port TLS: offered beside plaintext" in output


def test_plaintext_is_answered_tls_required_when_tls_is_required(
    tls_required: RunningBroker,
) -> None:
    with pytest.raises(BrokerRefused) as refused:
        BlockingClient.connect("127.0.0.1", tls_required.port, "app", "app123")
    assert refused.value.reason == "tls_required"
    assert refused.value.correlation_id == 0

    with socket.create_connection(("127.0.0.1", tls_required.port), timeout=30) as sock:
        sock.sendall(wire.encode_request(9, wire.ListTopics()))
        answer = b""
        while chunk := sock.recv(4096):  # then the broker closes the connection
            answer += chunk
    assert answer == wire.encode_error(0, "tls_required")


@pytest.mark.parametrize(
    ("version", "name"),
    [(ssl.TLSVersion.TLSv1_2, "TLSv1.2"), (ssl.TLSVersion.TLSv1_3, "TLSv1.3")],
)
def test_tls_1_2_and_1_3_clients_are_served(
    tls_required: RunningBroker, files: Files, version: ssl.TLSVersion, name: str
) -> None:
    sock = tls_socket(tls_required.port, context(files, version))
    with BlockingClient(sock) as client:
        assert sock.version() == name
        client.auth("app", "app123")
        assert client.list_topics() == []


def _handshake_in_memory(client: ssl.SSLContext, server: ssl.SSLContext) -> str:
    """A handshake between two contexts without sockets: the version agreed on."""
    client_in, client_out, server_in, server_out = (ssl.MemoryBIO() for _ in range(4))
    client_side = client.wrap_bio(client_in, client_out, server_hostname="localhost")
    server_side = server.wrap_bio(server_in, server_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, side in (("client", client_side), ("server", server_side)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        server_in.write(client_out.read())
        client_in.write(server_out.read())
        if all(done.values()):
            return str(client_side.version())
    raise AssertionError("the handshake did not finish")


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
def test_a_tls_1_1_client_is_refused_by_the_broker(
    tls_required: RunningBroker, files: Files
) -> None:
    old = context(files, ssl.TLSVersion.TLSv1_1, security_level_0=True)
    # The same client agrees on TLS 1.1 with a server that allows it: it does offer it.
    permissive = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    permissive.minimum_version = ssl.TLSVersion.TLSv1_1
    permissive.set_ciphers("DEFAULT:@SECLEVEL=0")
    permissive.load_cert_chain(files.cert, files.key)
    assert _handshake_in_memory(old, permissive) == "TLSv1.1"

    # The broker's alert: it will not speak TLS 1.1.
    with pytest.raises(ssl.SSLError, match="alert protocol version"):
        tls_socket(tls_required.port, old)

    output = tls_required.stop()
    assert "TLS handshake with 127.0.0.1 failed: unsupported protocol" in output


def test_a_client_checking_another_name_refuses_the_certificate(
    tmp_path: Path, files: Files
) -> None:
    elsewhere = issue(files.authority, ["broker.example"])
    settings = {
        "SVC_REQUIRE_TLS": "true",
        "SVC_TLS_CERTFILE": write(tmp_path / "elsewhere.pem", elsewhere.cert_pem),
        "SVC_TLS_KEYFILE": write(tmp_path / "elsewhere-key.pem", elsewhere.key_pem),
    }
    with running_broker(tmp_path, settings=settings) as broker:
        with pytest.raises(ssl.SSLCertVerificationError, match="localhost"):
            BlockingClient.connect(
                "localhost", broker.port, "app", "app123", tls=True, cafile=files.ca
            )
        # The certificate is good for the name it carries.
        sock = tls_socket(broker.port, context(files), hostname="broker.example")
        with BlockingClient(sock) as client:
            client.auth("app", "app123")


def test_the_ip_address_in_the_certificate_verifies_too(
    tls_required: RunningBroker, files: Files
) -> None:
    with BlockingClient.connect(
        "127.0.0.1", tls_required.port, "app", "app123", tls=True, cafile=files.ca
    ) as client:
        assert client.list_topics() == []


@pytest_twisted.ensureDeferred
async def test_the_twisted_client_connects_over_tls(
    tls_required: RunningBroker, files: Files
) -> None:
    client = await connect(
        reactor, "localhost", tls_required.port, "app", "app123", tls=True, cafile=files.ca
    )
    await client.create_topic("twisted")
    assert await client.produce("twisted", [Record(b"v")]) == 1
    assert [record.value for record in (await client.fetch("twisted")).records] == [b"v"]
    await client.close()


# -- boot --------------------------------------------------------------------------------


def prod_settings(tmp_path: Path, **tls: str) -> dict[str, str]:
    return {
        "SVC_ENV": "prod",
        "SVC_DATA_DIR": str(tmp_path / "data"),
        "SVC_ADMIN_PASS": "a prod password",
        **tls,
    }


def boot_failure(tmp_path: Path, settings: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TWISTD, "-n", "--pidfile=", "logbroker"],
        cwd=tmp_path,
        env=broker_env({"SVC_TCP_PORT": "0", **settings}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_prod_stops_at_boot_on_a_missing_certificate(tmp_path: Path, files: Files) -> None:
    missing = str(tmp_path / "missing.pem")
    settings = prod_settings(tmp_path, SVC_TLS_CERTFILE=missing, SVC_TLS_KEYFILE=files.key)

    broker = boot_failure(tmp_path, settings)

    assert broker.returncode == 2, broker.stderr
    assert broker.stderr.splitlines() == [
        f"logbroker: SVC_TLS_CERTFILE={missing!r} is invalid: expected an existing file"
        f" ({missing} is not one)"
    ]


def test_prod_stops_at_boot_on_a_key_that_does_not_match(tmp_path: Path, files: Files) -> None:
    other_key = write(tmp_path / "other-key.pem", issue(files.authority).key_pem)
    settings = prod_settings(tmp_path, SVC_TLS_CERTFILE=files.cert, SVC_TLS_KEYFILE=other_key)

    broker = boot_failure(tmp_path, settings)

    assert broker.returncode == 2, broker.stderr
    assert broker.stderr.splitlines() == [
        f"logbroker: SVC_TLS_KEYFILE={other_key!r} is invalid: expected the private key of the"
        " certificate in SVC_TLS_CERTFILE (this key belongs to another certificate)"
    ]


def test_prod_stops_at_boot_on_an_expired_certificate(tmp_path: Path, files: Files) -> None:
    now = datetime.datetime.now(datetime.UTC)
    expired = issue(files.authority, not_before=now - 30 * DAY, not_after=now - DAY)
    cert = write(tmp_path / "expired.pem", expired.cert_pem)
    key = write(tmp_path / "expired-key.pem", expired.key_pem)

    broker = boot_failure(
        tmp_path, prod_settings(tmp_path, SVC_TLS_CERTFILE=cert, SVC_TLS_KEYFILE=key)
    )

    assert broker.returncode == 2, broker.stderr
    [line] = broker.stderr.splitlines()
    assert line.startswith(
        f"logbroker: SVC_TLS_CERTFILE={cert!r} is invalid: expected certificates valid now"
        " (CN=localhost expired on "
    )


def test_prod_with_good_files_requires_tls(tmp_path: Path, files: Files) -> None:
    settings = prod_settings(tmp_path, SVC_TLS_CERTFILE=files.cert, SVC_TLS_KEYFILE=files.key)
    with running_broker(tmp_path, settings=settings) as broker:
        with pytest.raises(BrokerRefused, match="tls_required"):
            BlockingClient.connect("127.0.0.1", broker.port, "admin", "a prod password")
        with BlockingClient.connect(
            "localhost", broker.port, "admin", "a prod password", tls=True, cafile=files.ca
        ) as client:
            assert client.list_topics() == []
        output = broker.stop()

    assert broker.process.returncode == 0, output
    assert "Client port TLS: required" in output


def test_dev_warns_about_a_broken_certificate_and_serves_plaintext(
    tmp_path: Path, files: Files
) -> None:
    broken = write(tmp_path / "broken.pem", b"-----BEGIN CERTIFICATE-----\nnot base64\n")
    settings = {
        "SVC_ENV": "dev",
        "SVC_ENABLE_TLS": "true",
        "SVC_TLS_CERTFILE": broken,
        "SVC_TLS_KEYFILE": files.key,
    }
    with running_broker(tmp_path, settings=settings) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            assert client.list_topics() == []
        output = broker.stop()

    assert (
        f"logbroker: warning: SVC_TLS_CERTFILE={broken!r} is invalid: expected PEM certificates"
        " (-----BEGIN CERTIFICATE----- blocks); none parse; TLS stays off (in dev an invalid TLS"
        " setting only warns)\n"
    ) in output
    assert "Client port TLS" not in output


# -- the CLI -------------------------------------------------------------------------------


def cli(
    broker: RunningBroker, *args: str, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [
            LOGBROKER,
            "--server",
            f"localhost:{broker.port}",
            "--user",
            "app",
            "--password",
            "app123",
            *args,
        ],
        input=stdin,
        capture_output=True,
        env=broker_env({}),
        timeout=60,
        check=False,
    )


def test_the_cli_produces_and_consumes_over_tls(tls_required: RunningBroker, files: Files) -> None:
    created = cli(tls_required, "topic", "create", "cli", "--tls", "--cafile", files.ca)
    assert created.returncode == 0, created.stderr
    produced = cli(
        tls_required, "--tls", "--cafile", files.ca, "produce", "cli", stdin=b"one\ntwo\n"
    )
    assert produced.returncode == 0, produced.stderr

    consumed = cli(tls_required, "consume", "cli", "--tls", "--cafile", files.ca)
    # The benchmarks' own connections use the same TLS.
    drained = cli(tls_required, "bench", "consume", "cli", "--tls", "--cafile", files.ca)

    assert consumed.returncode == 0, consumed.stderr
    assert consumed.stdout.splitlines() == [b"one", b"two"]
    assert drained.returncode == 0, drained.stderr
    assert drained.stdout.startswith(b"consume cli: 2 records in ")


def test_the_cli_says_what_to_do_about_tls(tls_required: RunningBroker, files: Files) -> None:
    plaintext = cli(tls_required, "topic", "list")
    untrusted = cli(tls_required, "topic", "list", "--tls")  # the test CA is not the system's
    without_tls = cli(tls_required, "topic", "list", "--cafile", files.ca)
    unreadable = cli(
        tls_required,
        "topic",
        "list",
        "--tls",
        "--cafile",
        str(Path(files.ca).with_name("none.pem")),
    )

    assert plaintext.returncode == 1
    assert b"tls_required" in plaintext.stderr
    assert b"pass --tls" in plaintext.stderr
    assert untrusted.returncode == 1
    assert b"TLS with localhost:" in untrusted.stderr
    assert b"certificate did not verify: unable to get local issuer" in untrusted.stderr
    assert without_tls.returncode == 2
    assert b"--cafile is only used with --tls" in without_tls.stderr
    assert unreadable.returncode == 2
    assert b"cannot load CA certificates from" in unreadable.stderr


def test_the_dashboard_is_served_over_https_with_the_same_certificate(
    tls_required: RunningBroker, files: Files
) -> None:
    base = f"https://localhost:{tls_required.dashboard_port}"
    trusted = context(files)
    with urllib.request.urlopen(f"{base}/health", context=trusted, timeout=30) as response:
        assert json.load(response) == {"status": "ok"}
        assert response.headers["Strict-Transport-Security"].startswith("max-age=")
    login = urllib.request.Request(
        f"{base}/login",
        data=json.dumps({"username": "admin", "password": "admin123"}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(login, context=trusted, timeout=30) as response:
        cookie = response.headers["Set-Cookie"]
    assert "Secure" in cookie
    assert "HttpOnly" in cookie
    # Plain HTTP on the dashboard port is not served.
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://127.0.0.1:{tls_required.dashboard_port}/health", timeout=30)


def test_a_tls_client_over_the_connection_limit_is_told_so_inside_tls(
    tmp_path: Path, files: Files
) -> None:
    settings = tls_settings(
        files,
        SVC_REQUIRE_TLS="true",
        SVC_CONNECTION_LIMIT_ENABLED="true",
        SVC_MAX_CONN_PER_IP="1",
    )
    with running_broker(tmp_path, settings=settings) as broker:

        def login() -> BlockingClient:
            return BlockingClient.connect(
                "localhost", broker.port, "app", "app123", tls=True, cafile=files.ca
            )

        with login(), pytest.raises(BrokerRefused) as refused:
            login()
        assert (refused.value.reason, refused.value.correlation_id) == (
            "connection_limit_exceeded",
            0,
        )


def test_a_tls_client_that_never_answers_the_close_gives_its_slot_back(
    tmp_path: Path, files: Files
) -> None:
    """The broker closes a silent client (auth timeout) with a close_notify; a client that never
    answers it must not keep the connection, nor its slot under the per-IP cap."""
    settings = tls_settings(
        files,
        SVC_ENABLE_TLS="true",
        SVC_AUTH_TIMEOUT_MS="500",
        SVC_CONNECTION_LIMIT_ENABLED="true",
        SVC_MAX_CONN_PER_IP="1",
    )
    with running_broker(tmp_path, settings=settings) as broker:
        silent = tls_socket(broker.port, context(files))  # handshakes, then never reads
        try:
            reasons = set()
            for _ in range(100):
                try:
                    with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123"):
                        break
                except BrokerRefused as error:
                    reasons.add(error.reason)
                time.sleep(0.1)
            else:
                raise AssertionError("the silent TLS client kept its slot")
            assert reasons <= {"connection_limit_exceeded"}
        finally:
            silent.close()
