"""A real etcd cluster for tests: three members on free loopback ports.

Data directories go under a temporary directory in /dev/shm when there is one (etcd 3.4 fsyncs
every write and has no flag to stop it). Members can be killed (SIGKILL) and restarted on their
data. Teardown kills every member: SIGTERM to the last leader can take seconds.

A cluster may be secured (``EtcdSecurity``), as docs/cluster.md ("Securing a cluster") says to
run it: TLS on the client URLs with client certificates required (``--client-cert-auth``,
``--trusted-ca-file``), and etcd's auth enabled with ``etcdctl`` (a ``root`` user, and a
``logbroker`` user whose role may read and write under ``/logbroker/`` only). Its tokens expire
after ``TOKEN_TTL_SECONDS`` unused, so that the tests meet expired tokens.

Used by the control plane's contract tests and by cluster tests.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from logbroker.config import EtcdAccess
from logbroker.controlplane import EtcdGatewayStore, EtcdUser
from logbroker.security.etcd_tls import load_etcd_tls
from tests.certificates import Issued, issue, make_ca, write

#: Fast elections, so a killed leader is replaced in well under a second.
HEARTBEAT_MS = 50
ELECTION_MS = 500
STARTUP_TIMEOUT = 30.0
#: A secured cluster's tokens expire after this long unused (etcd's default is 300).
TOKEN_TTL_SECONDS = 2


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@attrs.frozen
class EtcdSecurity:
    """The files and users of a secured etcd, made under ``directory`` by ``make``: a CA that
    signs the members' certificate (for 127.0.0.1 and localhost, good for TLS servers and
    clients both: etcd's gateway dials its own gRPC server with it) and the client certificate
    of logbroker's nodes (no Common Name: etcd's gateway refuses one while auth is on)."""

    directory: Path
    authority: Issued
    ca_file: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    root_password: str = "root-password-for-the-tests"
    user: str = "logbroker"
    password: str = "logbroker-password-for-the-tests"
    #: What the user's role may read and write.
    prefix: str = "/logbroker/"

    @classmethod
    def make(cls, directory: Path) -> EtcdSecurity:
        directory.mkdir(parents=True, exist_ok=True)
        authority = make_ca("etcd test CA")
        server = issue(authority, ("localhost", "127.0.0.1"), both=True)
        client = issue(authority, ("logbroker",), client=True, anonymous=True)
        return cls(
            directory=directory,
            authority=authority,
            ca_file=write(directory / "etcd-ca.pem", authority.cert_pem),
            server_cert=write(directory / "etcd-server.pem", server.cert_pem),
            server_key=write(directory / "etcd-server-key.pem", server.key_pem),
            client_cert=write(directory / "etcd-client.pem", client.cert_pem),
            client_key=write(directory / "etcd-client-key.pem", client.key_pem),
        )

    def context(self) -> ssl.SSLContext:
        """A client context trusting the members and presenting the client certificate."""
        made = ssl.create_default_context(cafile=self.ca_file)
        made.load_cert_chain(self.client_cert, self.client_key)
        return made

    def broker_settings(self) -> dict[str, str]:
        """The ``SVC_ETCD_*`` settings of a node that reaches this etcd as it should."""
        return {
            "SVC_ETCD_CACERTFILE": self.ca_file,
            "SVC_ETCD_CERTFILE": self.client_cert,
            "SVC_ETCD_KEYFILE": self.client_key,
            "SVC_ETCD_USER": self.user,
            "SVC_ETCD_PASSWORD": self.password,
        }


@attrs.define
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    scheme: str = "http"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


class EtcdCluster:
    """``size`` etcd members under ``directory``; ``start`` before use, ``stop`` after.
    With ``security``, TLS and client certificates on the client URLs, and auth once
    ``enable_auth`` has run."""

    def __init__(
        self, directory: Path, size: int = 3, security: EtcdSecurity | None = None
    ) -> None:
        etcd = shutil.which("etcd")
        # A missing etcd is a broken test machine, not a reason to skip.
        assert etcd is not None, "etcd is missing: run scripts/install --test"
        self._etcd = etcd
        self.directory = directory
        self.security = security
        ports = free_ports(2 * size)
        self.members = [
            Member(
                f"m{i}",
                ports[2 * i],
                ports[2 * i + 1],
                directory / f"m{i}.data",
                directory / f"m{i}.log",
                scheme="http" if security is None else "https",
            )
            for i in range(size)
        ]
        self._token = f"logbroker-test-{os.getpid()}-{ports[0]}"

    @property
    def endpoints(self) -> list[str]:
        return [member.endpoint for member in self.members]

    def store(self, reactor: Any, *, as_root: bool = False, **options: Any) -> EtcdGatewayStore:
        """An ``EtcdGatewayStore`` on this cluster, as a node reaches it: over TLS with the
        client certificate and as the ``logbroker`` user (``root`` with ``as_root``) when the
        cluster is secured. ``options``: the store's other arguments."""
        security = self.security
        if security is None:
            return EtcdGatewayStore(self.endpoints, reactor=reactor, **options)
        access = EtcdAccess(
            https=True,
            cacertfile=security.ca_file,
            certfile=security.client_cert,
            keyfile=security.client_key,
        )
        user = (
            EtcdUser("root", security.root_password)
            if as_root
            else EtcdUser(security.user, security.password)
        )
        tls = load_etcd_tls(access, ["127.0.0.1"], datetime.datetime.now(datetime.UTC))
        return EtcdGatewayStore(self.endpoints, reactor=reactor, tls=tls, user=user, **options)

    def _command(self, member: Member) -> list[str]:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        return [
            self._etcd,
            "--name",
            member.name,
            "--data-dir",
            str(member.data_dir),
            "--listen-client-urls",
            member.endpoint,
            "--advertise-client-urls",
            member.endpoint,
            "--listen-peer-urls",
            member.peer_url,
            "--initial-advertise-peer-urls",
            member.peer_url,
            "--initial-cluster",
            initial,
            "--initial-cluster-token",
            self._token,
            # Ignored once the data directory exists (a restart).
            "--initial-cluster-state",
            "new",
            "--heartbeat-interval",
            str(HEARTBEAT_MS),
            "--election-timeout",
            str(ELECTION_MS),
            # A member cut off and back does not unseat the leader (off by default in 3.4).
            "--pre-vote",
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            *self._security_flags(),
        ]

    def _security_flags(self) -> list[str]:
        security = self.security
        if security is None:
            return []
        return [
            "--cert-file",
            security.server_cert,
            "--key-file",
            security.server_key,
            "--client-cert-auth",
            "--trusted-ca-file",
            security.ca_file,
            "--auth-token-ttl",
            str(TOKEN_TTL_SECONDS),
        ]

    def _open(self, request: urllib.request.Request | str) -> bytes:
        context = None if self.security is None else self.security.context()
        with urllib.request.urlopen(request, timeout=1, context=context) as response:
            data: bytes = response.read()
            return data

    def etcdctl(self, *args: str, as_root: bool = True) -> str:
        """Run ``etcdctl`` against the cluster (as ``root`` once auth is on); its output."""
        security = self.security
        assert security is not None, "etcdctl is for the secured cluster"
        etcdctl = shutil.which("etcdctl")
        assert etcdctl is not None, "etcdctl is missing: run scripts/install --test"
        command = [
            etcdctl,
            f"--endpoints={','.join(self.endpoints)}",
            f"--cacert={security.ca_file}",
            f"--cert={security.client_cert}",
            f"--key={security.client_key}",
        ]
        if as_root:
            command.append(f"--user=root:{security.root_password}")
        done = subprocess.run(
            [*command, *args],
            env={**os.environ, "ETCDCTL_API": "3"},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"etcdctl {' '.join(args)}: {done.stderr}"
        return done.stdout

    def enable_auth(self) -> None:
        """etcd's users, as docs/cluster.md sets them up: ``root``, and the ``logbroker``
        user whose role reads and writes the prefix ``/logbroker/`` and nothing else."""
        security = self.security
        assert security is not None
        for args in (
            ("user", "add", "root", f"--new-user-password={security.root_password}"),
            ("user", "grant-role", "root", "root"),
            ("role", "add", "logbroker"),
            (
                "role",
                "grant-permission",
                "logbroker",
                "--prefix=true",
                "readwrite",
                security.prefix,
            ),
            ("user", "add", security.user, f"--new-user-password={security.password}"),
            ("user", "grant-role", security.user, "logbroker"),
            ("auth", "enable"),
        ):
            self.etcdctl(*args, as_root=False)

    def _spawn(self, member: Member) -> None:
        with member.log_path.open("ab") as log:
            member.process = subprocess.Popen(
                self._command(member),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    def start(self) -> None:
        for member in self.members:
            self._spawn(member)
        for member in self.members:
            self.wait_healthy(member)

    def healthy(self, member: Member) -> bool:
        try:
            return bool(json.loads(self._open(member.endpoint + "/health")).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, member: Member, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy(member):
            process = member.process
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"etcd member {member.name} exited with {process.returncode}; see "
                    f"{member.log_path}:\n{self.log_tail(member)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"etcd member {member.name} not healthy after {timeout} s; see "
                    f"{member.log_path}:\n{self.log_tail(member)}"
                )
            time.sleep(0.05)

    def leader(self) -> Member:
        """The member that leads now (asks each running member until one says it is)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            for member in self.members:
                if member.process is None:
                    continue
                request = urllib.request.Request(
                    member.endpoint + "/v3/maintenance/status", data=b"{}", method="POST"
                )
                try:
                    status = json.loads(self._open(request))
                except (OSError, ValueError):
                    continue
                if status.get("leader") and status["leader"] == status["header"]["member_id"]:
                    return member
            assert time.monotonic() < deadline, "the etcd cluster has no leader"
            time.sleep(0.05)

    def log_tail(self, member: Member, lines: int = 20) -> str:
        try:
            return "\n".join(member.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self, member: Member) -> None:
        """SIGKILL ``member`` and wait for it to be gone."""
        process = member.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
        member.process = None

    def restart(self, member: Member, *, wait: bool = True) -> None:
        """Start a killed ``member`` again on its data directory."""
        assert member.process is None, f"{member.name} is running"
        self._spawn(member)
        if wait:
            self.wait_healthy(member)

    def stop(self) -> None:
        for member in self.members:
            self.kill(member)


@contextlib.contextmanager
def running_etcd(size: int = 3, secured: bool = False) -> Iterator[EtcdCluster]:
    """A started cluster, killed and its data removed on exit; ``secured``: with TLS, client
    certificates and auth (``EtcdSecurity``)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = Path(tempfile.mkdtemp(prefix="logbroker-etcd-", dir=base))
    security = EtcdSecurity.make(directory / "tls") if secured else None
    cluster = EtcdCluster(directory, size, security)
    try:
        cluster.start()
        if security is not None:
            cluster.enable_auth()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


_shared: dict[bool, EtcdCluster] = {}


def _shared_cluster(request: pytest.FixtureRequest, secured: bool) -> EtcdCluster:
    if secured not in _shared:
        running = running_etcd(secured=secured)
        _shared[secured] = running.__enter__()
        request.config.add_cleanup(lambda: running.__exit__(None, None, None))
    cluster = _shared[secured]
    for member in cluster.members:
        if member.process is None:
            cluster.restart(member)
    return cluster


@pytest.fixture(scope="session")
def etcd_cluster(request: pytest.FixtureRequest) -> EtcdCluster:
    """One real three-member cluster for the whole test run, started on first use.

    Shared by every module that imports this fixture; tests keep apart by key prefix, and one
    that kills a member restarts it before it ends (``EtcdCluster.restart``)."""
    return _shared_cluster(request, secured=False)


@pytest.fixture(scope="session")
def secured_etcd_cluster(request: pytest.FixtureRequest) -> EtcdCluster:
    """One real three-member cluster with TLS, client certificates and auth for the whole
    test run, started on first use; tests keep under ``EtcdSecurity.prefix``, the only one
    its ``logbroker`` user may use."""
    return _shared_cluster(request, secured=True)
