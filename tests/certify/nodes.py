"""The certification's processes: in each node's namespace one etcd member and one broker
(``twistd -n logbroker``), each started and stopped by the harness.

A broker runs under a ``Supervisor`` that restarts it whenever it exits without being asked
to, after a backoff that doubles from half a second to five seconds and never gives up, as the
Debian unit's ``Restart=always`` does: a node given a config that fails at boot crash-loops,
and comes back by itself once the config is rolled back. A drill that wants a node down
(a power-kill's outage, a storage fault on a stopped follower) holds it first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from tests.certify.network import Network

CLIENT_PORT = 4040
DASHBOARD_PORT = 4041
PEER_PORT = 4042
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
TWISTD = str(Path(sys.executable).with_name("twistd"))

#: The supervisor's first delay before a restart, doubled after each quick exit up to the
#: longest; a run this long resets it.
FIRST_BACKOFF = 0.5
LONGEST_BACKOFF = 5.0
STEADY_RUN = 10.0


def _environment(settings: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without broker settings, plus ``settings``."""
    inherited = {k: v for k, v in os.environ.items() if not k.upper().startswith("SVC_")}
    return {**inherited, **settings}


class EtcdMember:
    """Member ``e<i>`` of the control plane's etcd, in node ``i``'s namespace."""

    def __init__(self, network: Network, node: int, data: Path, log: Path) -> None:
        self.network = network
        self.node = node
        self.data = data
        self.log_path = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        address = self.network.address(self.node)
        initial = ",".join(
            f"e{n}=http://{self.network.address(n)}:{ETCD_PEER_PORT}"
            for n in range(1, self.network.size + 1)
        )
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    *self.network.exec_prefix(self.node),
                    "etcd", "--name", f"e{self.node}", "--data-dir", str(self.data),
                    "--listen-client-urls",
                    f"http://{address}:{ETCD_CLIENT_PORT},http://127.0.0.1:{ETCD_CLIENT_PORT}",
                    "--advertise-client-urls", f"http://{address}:{ETCD_CLIENT_PORT}",
                    "--listen-peer-urls", f"http://{address}:{ETCD_PEER_PORT}",
                    "--initial-advertise-peer-urls", f"http://{address}:{ETCD_PEER_PORT}",
                    "--initial-cluster", initial, "--initial-cluster-token", "logbroker-certify",
                    "--initial-cluster-state", "new",
                    "--heartbeat-interval", "100", "--election-timeout", "1000",
                    # A member cut off and back does not unseat the leader (etcd 3.4: off).
                    "--pre-vote",
                    "--logger", "zap", "--log-outputs", "stderr",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    @property
    def endpoint(self) -> str:
        return f"{self.network.address(self.node)}:{ETCD_CLIENT_PORT}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as answer:
                return b'"health":"true"' in answer.read()
        except (OSError, urllib.error.URLError):
            return False

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


class Broker:
    """Broker ``n<i>``: its settings, data directory and log, and its process under a
    supervisor. ``events`` receives what the supervisor does, for the timeline."""

    def __init__(
        self,
        network: Network,
        node: int,
        directory: Path,
        settings: Mapping[str, str],
        events: Callable[[str], object],
    ) -> None:
        self.network = network
        self.node = node
        self.node_id = f"n{node}"
        self.directory = directory
        self.data = directory / "data"
        self.log_path = directory / "broker.log"
        self.settings = dict(settings)
        self._events = events
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._wanted = False
        #: Processes the harness itself stopped or killed: their exit is no crash.
        self._stopped_on_purpose: set[int] = set()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        #: How many times the supervisor found the broker exited when it was wanted running.
        self.unexpected_exits = 0
        self.starts = 0

    @property
    def address(self) -> str:
        return self.network.address(self.node)

    @property
    def server(self) -> str:
        return f"{self.address}:{CLIENT_PORT}"

    @property
    def pid(self) -> int | None:
        with self._lock:
            process = self._process
        return None if process is None or process.poll() is not None else process.pid

    def supervise(self) -> None:
        """Start the broker and keep it running until ``shutdown``."""
        self._wanted = True
        self._thread = threading.Thread(target=self._watch, name=f"supervisor-{self.node_id}")
        self._thread.daemon = True
        self._thread.start()

    def _spawn(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        log: IO[bytes]
        with self.log_path.open("ab") as log:
            process = subprocess.Popen(
                [
                    *self.network.exec_prefix(self.node),
                    TWISTD, "-n", "--pidfile=", "--logfile=-", "logbroker",
                ],
                cwd=self.directory,
                env=_environment(self.settings),
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        with self._lock:
            self._process = process
        self.starts += 1

    def _watch(self) -> None:
        backoff = FIRST_BACKOFF
        while not self._stopping.is_set():
            if not self._wanted:
                self._stopping.wait(0.1)
                continue
            started = time.monotonic()
            self._spawn()
            with self._lock:
                process = self._process
            assert process is not None
            while process.poll() is None and not self._stopping.is_set():
                self._stopping.wait(0.1)
            if self._stopping.is_set():
                return
            if process.pid in self._stopped_on_purpose:
                # A new start, not a crash loop: the next crash waits the shortest time.
                backoff = FIRST_BACKOFF
                continue
            self.unexpected_exits += 1
            self._events(f"{self.node_id} exited ({_status(process.returncode)}); restart")
            if time.monotonic() - started > STEADY_RUN:
                backoff = FIRST_BACKOFF
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, LONGEST_BACKOFF)

    def hold(self) -> None:
        """From now on, leave the broker down when it exits."""
        self._wanted = False

    def release(self) -> None:
        """Start the broker again (at once) and keep it running."""
        self._wanted = True

    def signal(self, number: int) -> None:
        pid = self.pid
        if pid is not None:
            os.kill(pid, number)

    def _end(self, number: int) -> None:
        """Hold the broker down and send ``number`` to end it (its exit is no crash)."""
        self.hold()
        pid = self.pid
        if pid is not None:
            self._stopped_on_purpose.add(pid)
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, number)

    def wait_exit(self, seconds: float = 60) -> int | None:
        with self._lock:
            process = self._process
        if process is None:
            return None
        return process.wait(timeout=seconds)

    def stop(self, seconds: float = 60) -> None:
        """Hold it down, SIGTERM, and wait for the orderly stop (SIGKILL after ``seconds``)."""
        self._end(signal.SIGTERM)
        try:
            self.wait_exit(seconds)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.wait_exit(30)

    def kill(self) -> None:
        """Hold it down and SIGKILL it: a power cut, as far as a process can have one."""
        self._end(signal.SIGKILL)
        self.wait_exit(30)

    def shutdown(self) -> None:
        self._stopping.set()
        self._end(signal.SIGKILL)
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                self._process.wait(timeout=30)

    def ready(self) -> bool:
        """Whether ``/ready`` answers 200."""
        url = f"http://{self.address}:{DASHBOARD_PORT}/ready"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                return bool(answer.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def log_since(self, offset: int) -> str:
        """What the broker logged past ``offset`` (a ``log_size`` taken before)."""
        with self.log_path.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _status(returncode: int) -> str:
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"
