"""A real three-node cluster under faults: a node SIGKILLed under load, a stranger at the peer
port. Each test starts its own cluster on the shared etcd (its own cluster id)."""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from logbroker.broker.keyspace import split_keyspace
from logbroker.client.blocking import BlockingClient, BrokerRefused
from logbroker.key_routing import key_slot
from logbroker.peer import frames as codec
from logbroker.placement import PlacementNode, PlacementRule, place, segment_key
from logbroker.records import Record
from tests.cluster import BrokerCluster, Node, running_cluster
from tests.etcd import EtcdCluster, etcd_cluster

pytestmark = pytest.mark.integration

__all__ = ["etcd_cluster"]

#: The topic's ranges: 4 of the default 8 keyspace bits.
RANGES = split_keyspace(8, 4)


@pytest.fixture
def cluster(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[BrokerCluster]:
    yield from running_cluster(tmp_path, etcd_cluster)


def connect(node: Node) -> BlockingClient:
    # Produces not retried: the tests watch what the nodes answer, which retries would hide.
    return BlockingClient.connect("127.0.0.1", node.port, "app", "app123", produce_retry=None)


def spread_topic(cluster: BrokerCluster) -> str:
    """A topic name whose four ranges placement puts on more than one node, n1 not alone
    (placement is a pure function of the range ids and the live node ids)."""
    nodes = [PlacementNode(node.node_id) for node in cluster.nodes]
    for attempt in range(100):
        name = f"load{attempt}"
        leaders = {
            place(segment_key(f"{name}.{i}", 0), nodes, PlacementRule(1)).primary
            for i in range(len(RANGES))
        }
        if len(leaders) >= 2:
            return name
    raise AssertionError("no topic name spreads")


def range_of(topic: str, key: bytes) -> str:
    slot = key_slot(key, 8)
    index = next(i for i, (start, end) in enumerate(RANGES) if start <= slot < end)
    return f"{topic}.{index}"


def owner_of(cluster: BrokerCluster, range_id: str) -> Node:
    [owner] = [n for n in cluster.nodes if (n.directory / "data" / "ranges" / range_id).exists()]
    return owner


def alive_in_etcd(etcd: EtcdCluster, cluster: BrokerCluster, node_id: str) -> bool:
    key = f"/logbroker/{cluster.cluster_id}/cluster/alive/{node_id}".encode()
    body = json.dumps({"key": base64.b64encode(key).decode()}).encode()
    request = urllib.request.Request(etcd.endpoints[0] + "/v3/kv/range", data=body)
    with urllib.request.urlopen(request, timeout=5) as answer:
        return bool(json.load(answer).get("kvs"))


def test_a_killed_node_takes_only_its_ranges_and_loses_nothing_it_acknowledged(
    cluster: BrokerCluster, etcd_cluster: EtcdCluster
) -> None:
    n1 = cluster.nodes[0]
    topic = spread_topic(cluster)
    keys = [b"key-%d" % i for i in range(32)]
    with connect(n1) as client:
        client.create_topic(topic)
        for key in keys:  # every range gets records, so every owner opens its range
            client.produce(topic, [Record(b"warm", key=key)])
    owners = {key: owner_of(cluster, range_of(topic, key)) for key in keys}
    victim = next(n for n in cluster.nodes[1:] if n in owners.values())
    acknowledged: list[tuple[bytes, bytes]] = []
    # Produced from this thread while the producer thread runs: no order between the two.
    acknowledged_while_dead: list[tuple[bytes, bytes]] = []
    refused: list[str] = []
    stop = threading.Event()

    def produce_through_n1() -> None:
        with connect(n1) as client:
            sequence = 0
            while not stop.is_set():
                key = keys[sequence % len(keys)]
                value = b"v-%d" % sequence
                sequence += 1
                try:
                    client.produce(topic, [Record(value, key=key)])
                except BrokerRefused as error:
                    refused.append(error.reason)
                    continue
                acknowledged.append((key, value))

    producer = threading.Thread(target=produce_through_n1)
    producer.start()
    try:
        while len(acknowledged) < 300:
            time.sleep(0.01)
        victim.kill()  # mid-stream: some produces were in flight to it
        killed = time.monotonic()
        # The survivors find its peer port refusing and revoke its lease: it is dead to the
        # cluster well within the lease TTL (3 s, which would end 2-3 s after the kill).
        while alive_in_etcd(etcd_cluster, cluster, victim.node_id):
            assert time.monotonic() - killed < 1.5, "the killed node still looks alive"
            time.sleep(0.05)
        # Its ranges answer unreachable at once; the others keep working.
        with connect(n1) as client:
            for key in keys:
                started = time.monotonic()
                if owners[key] is victim:
                    with pytest.raises(BrokerRefused) as raised:
                        client.produce(topic, [Record(b"while-dead", key=key)])
                    assert raised.value.reason == "unreachable"
                    assert time.monotonic() - started < 1.0
                else:
                    assert client.produce(topic, [Record(b"while-dead", key=key)]) == 1
                    acknowledged_while_dead.append((key, b"while-dead"))
    finally:
        stop.set()
        producer.join(timeout=30)
    assert set(refused) == {"unreachable"}

    victim.start()
    # Back under a new lease, which the refusals from before it listened leave alone.
    deadline = time.monotonic() + 10
    while not alive_in_etcd(etcd_cluster, cluster, victim.node_id):
        assert time.monotonic() < deadline, "the restarted node never registered"
        time.sleep(0.1)
    reader = cluster.nodes[2] if victim is not cluster.nodes[2] else cluster.nodes[1]

    def read_everything() -> list[Record]:
        with connect(reader) as client:
            stored: list[Record] = []
            cursor = None
            while True:
                batch = client.fetch(topic, cursor, None, None, 1000, 0)
                if not batch.records:
                    return stored
                stored.extend(batch.records)
                cursor = batch.next_cursor

    # The reader hears that the victim is back, and links to it again, within a watch round
    # trip and a handshake: until then the victim's ranges answer unreachable.
    deadline = time.monotonic() + 10
    while True:
        try:
            stored = read_everything()
            break
        except BrokerRefused as error:
            if error.reason != "unreachable" or time.monotonic() > deadline:
                raise
            time.sleep(0.1)

    seen = [(r.key, r.value) for r in stored if r.value != b"warm"]
    # Every acknowledged record is there, exactly once (a produce refused after being sent may
    # have been stored too: it was never acknowledged, so it may be there or not).
    for record in acknowledged + acknowledged_while_dead:
        assert seen.count(record) == 1, record
    # Per key, the producer's acknowledged records in the order they were acknowledged (a
    # record produced from two clients at once may land either side of the other's).
    for key in keys:
        mine = [value for k, value in acknowledged if k == key]
        assert [value for k, value in seen if k == key and value in set(mine)] == mine
    assert alive_in_etcd(etcd_cluster, cluster, victim.node_id)
    assert "Lost the membership lease" not in victim.stop()


def test_a_peer_of_another_cluster_is_refused_at_the_handshake(cluster: BrokerCluster) -> None:
    n1 = cluster.nodes[0]
    hello = codec.Hello(codec.PROTOCOL_VERSION, "another-cluster", "intruder", os.urandom(32))
    with socket.create_connection(("127.0.0.1", n1.peer_port), timeout=10) as peer:
        peer.sendall(codec.encode(hello))
        decoder = codec.PeerFrameDecoder()
        answers: list[object] = []
        while not any(isinstance(m, codec.Refuse) for m in answers):
            data = peer.recv(65536)
            assert data, f"closed without a refusal after {answers!r}"
            answers.extend(decoder.feed(data))

    [refusal] = [m for m in answers if isinstance(m, codec.Refuse)]
    assert refusal.reason == "wrong_cluster"
    output = n1.stop()
    n1.start()
    assert "wrong_cluster" in output
