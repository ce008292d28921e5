"""A real cluster for tests: three ``twistd -n logbroker`` processes on loopback ports sharing a
real three-member etcd (``tests.etcd``), each with its own data directory and node id.

``BrokerCluster`` starts, stops, kills and restarts nodes; every node's client, dashboard and
peer ports are free ones, read back from its log. Each cluster has its own cluster id, so
clusters sharing one etcd never see each other's keys.
"""

from __future__ import annotations

import itertools
import re
import signal
import subprocess
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import attrs

from logbroker.client.blocking import BlockingClient
from tests.etcd import EtcdCluster
from tests.integration.twistd import run_twistd, wait_for_line

_LISTENING = re.compile(r"listening for clients on (.+):(\d+)")
_DASHBOARD = re.compile(r"Dashboard listening on (.+):(\d+)")
_PEER = re.compile(r"peer port (\d+)")
_CLUSTERS = itertools.count(1)


@attrs.define
class Node:
    node_id: str
    directory: Path
    settings: dict[str, str]
    process: subprocess.Popen[str] | None = None
    port: int = 0
    dashboard_port: int = 0
    peer_port: int = 0
    output: list[str] = attrs.Factory(list)
    _reader: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.process = run_twistd(self.directory, settings=self.settings)
        seen = wait_for_line(self.process, "listening for clients on", seconds=60)
        self.output.extend(seen)
        text = "".join(seen)
        listening = _LISTENING.search(text)
        dashboard = _DASHBOARD.search(text)
        peer = _PEER.search(text)
        assert listening, text
        assert dashboard, text
        assert peer, text
        self.port = int(listening.group(2))
        self.dashboard_port = int(dashboard.group(2))
        self.peer_port = int(peer.group(1))
        # Read the output as it comes: a node logs a few kilobytes a second under load, and
        # one whose pipe filled up would block in its next write, stalling its reactor.
        self._reader = threading.Thread(
            target=self._read_output,
            args=(self.process,),
            name=f"{self.node_id}-output",
            daemon=True,
        )
        self._reader.start()

    def _read_output(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.output.append(line)

    def _collect(self) -> str:
        assert self.process is not None
        self.process.wait(timeout=60)
        if self._reader is not None:
            self._reader.join(timeout=60)
            self._reader = None
        if self.process.stdout is not None:
            self.process.stdout.close()
        return "".join(self.output)

    def stop(self) -> str:
        """SIGTERM and wait for the orderly stop; the node's whole output."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self._collect()

    def kill(self) -> None:
        """SIGKILL: no goodbye, the lease runs out in etcd."""
        assert self.process is not None
        self.process.kill()
        self._collect()


class BrokerCluster:
    def __init__(
        self,
        directory: Path,
        etcd: EtcdCluster,
        size: int = 3,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.cluster_id = f"test-{next(_CLUSTERS)}-{directory.name[-8:]}"
        control_plane = "etcd://" + ",".join(
            endpoint.removeprefix("http://") for endpoint in etcd.endpoints
        )
        self.nodes = [
            Node(
                f"n{index}",
                directory / f"n{index}",
                {
                    "SVC_ENV": "test",
                    "SVC_CONTROL_PLANE": control_plane,
                    "SVC_CLUSTER_ID": self.cluster_id,
                    "SVC_NODE_ID": f"n{index}",
                    "SVC_ADVERTISE_HOST": "127.0.0.1",
                    "SVC_BIND_HOST": "127.0.0.1",
                    "SVC_PEER_PORT": "0",
                    "SVC_NODE_LEASE_MS": "3000",
                    "SVC_SCRUB_ENABLED": "false",
                    "SVC_CLUSTER_SECRET": "a cluster secret for the tests only",
                    **(settings or {}),
                },
            )
            for index in range(1, size + 1)
        ]
        for node in self.nodes:
            node.directory.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        for node in self.nodes:
            node.start()

    def node(self, node_id: str) -> Node:
        return next(node for node in self.nodes if node.node_id == node_id)

    def stop(self) -> None:
        for node in self.nodes:
            if node.running:
                node.kill()


def running_cluster(
    directory: Path, etcd: EtcdCluster, settings: Mapping[str, str] | None = None
) -> Iterator[BrokerCluster]:
    cluster = BrokerCluster(directory, etcd, settings=settings)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def read_all(
    node: Node, topic: str, user: str = "admin", password: str = "admin123"
) -> list[bytes]:
    """Every record's value of ``topic``, read through ``node`` from the start until a fetch
    finds nothing more."""
    values: list[bytes] = []
    with BlockingClient.connect("127.0.0.1", node.port, user, password, timeout=30) as client:
        cursor = None
        while True:
            batch = client.fetch(topic, cursor, None, None, 1000, 0)
            if not batch.records:
                return values
            values += [record.value for record in batch.records]
            cursor = batch.next_cursor
