"""A real three-node cluster on an etcd of its own, which loses members: one of three changes
nothing; all three make the nodes not ready (nothing acknowledged lost), and they recover by
themselves when etcd returns."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from logbroker.client.blocking import BlockingClient, BrokerRefused
from logbroker.records import Record
from tests.cluster import BrokerCluster, Node, read_all, running_cluster
from tests.etcd import EtcdCluster, running_etcd
from tests.integration.twistd import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def etcd() -> Iterator[EtcdCluster]:
    with running_etcd() as cluster:
        yield cluster


@pytest.fixture
def cluster(tmp_path: Path, etcd: EtcdCluster) -> Iterator[BrokerCluster]:
    yield from running_cluster(tmp_path, etcd)


def connect(node: Node, user: str = "app", password: str = "app123") -> BlockingClient:
    return BlockingClient.connect("127.0.0.1", node.port, user, password)


def ready(node: Node) -> tuple[int, dict[str, str]]:
    url = f"http://127.0.0.1:{node.dashboard_port}/ready"
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_losing_one_etcd_member_of_three_changes_nothing(
    cluster: BrokerCluster, etcd: EtcdCluster
) -> None:
    etcd.kill(etcd.leader())
    n1, n2, n3 = cluster.nodes

    with connect(n1) as client:
        client.create_topic("one-lost")
        assert client.produce("one-lost", [Record(b"%d" % i, key=b"k") for i in range(20)]) == 20
    with connect(n2, "admin", "admin123") as client:
        client.create_user("erin", "erin-secret-1", ["produce"])

    def read_back() -> bool:
        # Node 3 hears of the topic within one watch round trip.
        try:
            return sorted(read_all(n3, "one-lost", "app", "app123")) == sorted(
                b"%d" % i for i in range(20)
            )
        except BrokerRefused:
            return False

    wait_until(read_back, 10)
    assert [ready(node) for node in cluster.nodes] == [(200, {"status": "ready"})] * 3


def test_losing_all_of_etcd_loses_nothing_and_the_cluster_recovers_by_itself(
    cluster: BrokerCluster, etcd: EtcdCluster
) -> None:
    n1, n2, n3 = cluster.nodes
    with connect(n1) as client:
        client.create_topic("all-lost")
        assert client.produce("all-lost", [Record(b"before", key=b"k")]) == 1

    for member in etcd.members:
        etcd.kill(member)

    # Changes to the control plane answer unreachable.
    with connect(n2) as client:
        with pytest.raises(BrokerRefused) as raised:
            client.create_topic("while-etcd-is-down")
        assert raised.value.reason == "unreachable"
    # Within a lease TTL (3 s here, plus the request timeout) every node says it is not ready,
    # and why; it stays up (/health is not affected).
    for node in cluster.nodes:
        wait_until(lambda node=node: ready(node)[0] == 503, 15)
        assert "etcd" in ready(node)[1]["reason"]
    assert all(node.running for node in cluster.nodes)

    for member in etcd.members:
        etcd.restart(member, wait=False)
    for member in etcd.members:
        etcd.wait_healthy(member)

    for node in cluster.nodes:
        wait_until(lambda node=node: ready(node)[0] == 200, 30)
    with connect(n3) as client:
        client.create_topic("after-etcd-returned")
        assert client.produce("all-lost", [Record(b"after", key=b"k")]) == 1
    assert read_all(n2, "all-lost", "app", "app123") == [b"before", b"after"]
