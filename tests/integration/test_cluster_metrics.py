"""The control-plane and peer series of a real three-node cluster, read from a node's
``/metrics`` as Prometheus would: fed by the etcd store and the peer port as requests and bytes
go by, not sitting at 0."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from logbroker.client.blocking import BlockingClient
from logbroker.records import Record
from tests.cluster import BrokerCluster, Node, running_cluster
from tests.etcd import EtcdCluster, etcd_cluster

pytestmark = pytest.mark.integration

__all__ = ["etcd_cluster"]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, etcd_cluster: EtcdCluster
) -> Iterator[BrokerCluster]:
    yield from running_cluster(tmp_path_factory.mktemp("cluster"), etcd_cluster)


def scrape(node: Node) -> Samples:
    request = urllib.request.Request(
        f"http://127.0.0.1:{node.dashboard_port}/metrics", headers={"Accept": "text/plain"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_node_counts_its_peer_links_bytes_and_etcd_requests(cluster: BrokerCluster) -> None:
    n1 = cluster.nodes[0]
    with BlockingClient.connect("127.0.0.1", n1.port, "app", "app123") as client:
        client.create_topic("metered")
        records = [Record(b"value-%d" % i, key=b"key-%d" % i) for i in range(64)]
        # The topic's ranges are spread over the nodes: some records go over a peer link.
        assert client.produce("metered", records) == len(records)

    # Each node dials both others and accepts a link from each: 2 x (3 - 1) established.
    connections = ("svc_peer_connections", ())
    counted = [
        ("svc_peer_bytes_total", (("direction", "in"),)),
        ("svc_peer_bytes_total", (("direction", "out"),)),
        ("svc_controlplane_requests_total", (("op", "txn"), ("result", "ok"))),
        ("svc_controlplane_requests_total", (("op", "keepalive"), ("result", "ok"))),
        ("svc_controlplane_request_seconds_count", (("op", "txn"),)),
    ]
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(n1)
        wrong = {key: samples[key] for key in counted if not samples[key] > 0}
        if samples[connections] != 4:
            wrong[connections] = samples[connections]
        if not wrong or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert wrong == {}
