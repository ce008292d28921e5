"""A real etcd cluster for tests: three members on free loopback ports.

Data directories go under a temporary directory in /dev/shm when there is one (etcd 3.4 fsyncs
every write and has no flag to stop it). Members can be killed (SIGKILL) and restarted on their
data. Teardown kills every member: SIGTERM to the last leader can take seconds.

Used by the control plane's contract tests and by cluster tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

#: Fast elections, so a killed leader is replaced in well under a second.
HEARTBEAT_MS = 50
ELECTION_MS = 500
STARTUP_TIMEOUT = 30.0


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


@attrs.define
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


class EtcdCluster:
    """``size`` etcd members under ``directory``; ``start`` before use, ``stop`` after."""

    def __init__(self, directory: Path, size: int = 3) -> None:
        etcd = shutil.which("etcd")
        # A missing etcd is a broken test machine, not a reason to skip.
        assert etcd is not None, "etcd is missing: run scripts/install --test"
        self._etcd = etcd
        self.directory = directory
        ports = free_ports(2 * size)
        self.members = [
            Member(
                f"m{i}",
                ports[2 * i],
                ports[2 * i + 1],
                directory / f"m{i}.data",
                directory / f"m{i}.log",
            )
            for i in range(size)
        ]
        self._token = f"logbroker-test-{os.getpid()}-{ports[0]}"

    @property
    def endpoints(self) -> list[str]:
        return [member.endpoint for member in self.members]

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
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
        ]

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
            with urllib.request.urlopen(member.endpoint + "/health", timeout=1) as response:
                return bool(json.loads(response.read()).get("health") == "true")
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
                    with urllib.request.urlopen(request, timeout=1) as response:
                        status = json.loads(response.read())
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
def running_etcd(size: int = 3) -> Iterator[EtcdCluster]:
    """A started cluster, killed and its data removed on exit."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = Path(tempfile.mkdtemp(prefix="logbroker-etcd-", dir=base))
    cluster = EtcdCluster(directory, size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(directory, ignore_errors=True)


_shared: list[EtcdCluster] = []


@pytest.fixture(scope="session")
def etcd_cluster(request: pytest.FixtureRequest) -> EtcdCluster:
    """One real three-member cluster for the whole test run, started on first use.

    Shared by every module that imports this fixture; tests keep apart by key prefix, and one
    that kills a member restarts it before it ends (``EtcdCluster.restart``)."""
    if not _shared:
        running = running_etcd()
        _shared.append(running.__enter__())
        request.config.add_cleanup(lambda: running.__exit__(None, None, None))
    cluster = _shared[0]
    for member in cluster.members:
        if member.process is None:
            cluster.restart(member)
    return cluster
