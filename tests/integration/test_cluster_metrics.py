"""The control-plane and peer series of a real three-node cluster, read from a node's
``/metrics`` as Prometheus would: fed by the etcd store and the peer port as requests and bytes
go by, not sitting at 0."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from logbroker.client.blocking import BlockingClient
from logbroker.records import Record
from tests.cluster import BrokerCluster, running_cluster
from tests.etcd import EtcdCluster, etcd_cluster
from tests.integration.twistd import scrape

pytestmark = pytest.mark.integration

__all__ = ["etcd_cluster"]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, etcd_cluster: EtcdCluster
) -> Iterator[BrokerCluster]:
    yield from running_cluster(tmp_path_factory.mktemp("cluster"), etcd_cluster)


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
        samples = scrape(n1.dashboard_port)
        wrong = {key: samples[key] for key in counted if not samples[key] > 0}
        if samples[connections] != 4:
            wrong[connections] = samples[connections]
        if not wrong or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert wrong == {}
