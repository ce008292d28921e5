"""Retention on a real single ``twistd logbroker`` and on three real nodes at replication
factor 3 on a real three-member etcd: with ``SVC_RETENTION_MAX_BYTES=0`` every sealed segment
goes (its record in the control plane first, then every copy on disk), the active one stays,
the removal is counted on ``/metrics``, and a consumer whose cursor points into removed data
goes on from the oldest record left."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from logbroker.client.blocking import BlockingClient
from logbroker.records import Record
from tests.cluster import BrokerCluster, running_cluster
from tests.etcd import EtcdCluster, etcd_cluster
from tests.integration.test_cluster_verify import produce_load, sealed_segments
from tests.integration.test_replication_faults import segments_in_etcd
from tests.integration.twistd import running_broker, scrape

pytestmark = pytest.mark.integration

__all__ = ["etcd_cluster"]

REMOVED = ("svc_retention_segments_removed_total", ())


def wait_for(done: Callable[[], bool], seconds: float, what: Callable[[], object]) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what()}"
        time.sleep(0.2)


def test_a_budget_of_zero_removes_every_sealed_segment_of_a_single_node(tmp_path: Path) -> None:
    data = tmp_path / "data"
    settings = {"SVC_DATA_DIR": str(data), "SVC_SEGMENT_MAX_BYTES": "4096", "SVC_TOPIC_RANGES": "1"}
    with running_broker(tmp_path, settings=settings) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            client.create_topic("kept")
            for batch in range(20):
                records = [Record(b"%03d-%d" % (batch, n) + b"v" * 200, key=b"k") for n in range(5)]
                assert client.produce("kept", records) == 5
            first = client.fetch("kept", None, None, None, 3, 0)
            assert [r.value[:5] for r in first.records] == [b"000-0", b"000-1", b"000-2"]
            old_cursor = first.next_cursor
        assert scrape(broker.dashboard_port)[REMOVED] == 0
        broker.stop()
    sealed = sorted(data.rglob("*.sealed"))
    assert len(sealed) >= 4, sorted(data.rglob("*"))

    retained = {**settings, "SVC_RETENTION_MAX_BYTES": "0", "SVC_RETENTION_INTERVAL_MS": "200"}
    with running_broker(tmp_path, settings=retained) as broker:
        [directory] = {path.parent for path in data.rglob("*.log")}

        def left() -> list[str]:
            return sorted(p.name for p in directory.iterdir() if p.name != ".lock")

        # Only the active segment is left, its log alone (no sidecars: it is not sealed). The
        # records go first, the files at the end of the same pass.
        wait_for(lambda: len(left()) == 1 and left()[0].endswith(".log"), 30, left)
        [active] = list(directory.glob("*.log"))
        assert scrape(broker.dashboard_port)[REMOVED] == len(sealed)
        samples = scrape(broker.dashboard_port)
        assert samples[("svc_retention_bytes_removed_total", ())] >= 4096 * (len(sealed) - 1)
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            # The old cursor pointed at offset 3, removed: the read goes on from the oldest left.
            resumed = client.fetch("kept", old_cursor, None, None, 1000, 0)
            from_start = client.fetch("kept", None, None, None, 1000, 0)
        oldest = int(active.stem)
        assert [r.value for r in resumed.records] == [r.value for r in from_start.records]
        assert len(resumed.records) == 100 - oldest
        assert resumed.records[0].value.startswith(b"%03d-%d" % divmod(oldest, 5))
        output = broker.stop()
    assert "Retention: removed " in output


@pytest.fixture
def cluster(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[BrokerCluster]:
    settings = {
        "SVC_LOG_REPLICATION_FACTOR": "3",
        "SVC_SEGMENT_MAX_BYTES": "16384",
        "SVC_RETENTION_MAX_BYTES": "0",
        "SVC_RETENTION_INTERVAL_MS": "300",
    }
    yield from running_cluster(tmp_path, etcd_cluster, settings=settings)


def test_a_cluster_removes_every_sealed_segment_from_etcd_and_from_every_node(
    cluster: BrokerCluster, etcd_cluster: EtcdCluster
) -> None:
    produce_load(cluster.nodes[0])

    def sealed_files() -> list[Path]:
        return [p for node in cluster.nodes for p in node.directory.rglob("*.sealed")]

    wait_for(
        lambda: not sealed_segments(etcd_cluster, cluster) and not sealed_files(),
        60,
        lambda: (len(sealed_segments(etcd_cluster, cluster)), sealed_files()),
    )
    removed = [scrape(node.dashboard_port)[REMOVED] for node in cluster.nodes]
    # One node decided (the chores lease holder) and counted what it removed.
    assert sorted(removed)[:2] == [0, 0]
    assert removed.count(0) == 2
    assert max(removed) >= 6
    # Each range keeps its active segment, on each of its three replicas.
    segments = segments_in_etcd(etcd_cluster, cluster)
    assert {meta["state"] for meta in segments} == {"active"}
    for meta in segments:
        for node_id in meta["replicas"]:
            directory = cluster.node(node_id).directory / "data" / "ranges" / meta["range_id"]
            assert (directory / f"{meta['base_offset']:020d}.log").exists()
    # Reads go on from each range's oldest record left, through any node.
    with BlockingClient.connect(
        "127.0.0.1", cluster.nodes[2].port, "admin", "admin123", timeout=30
    ) as client:
        left = client.fetch("verified", None, None, None, 10_000, 0)
    assert 0 < len(left.records) < 800
