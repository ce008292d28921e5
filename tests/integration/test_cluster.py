"""Three real ``twistd logbroker`` nodes on one real three-member etcd: any node serves any
client, security state is shared, and a killed node loses nothing it acknowledged.

The cluster is shared by the module's tests (starting it takes a few seconds); a test that kills
a node brings it back before it ends, and each test uses topics of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet.defer import gatherResults

from logbroker import wire
from logbroker.client import ClusterClient
from logbroker.client.blocking import BlockingClient, BrokerRefused
from logbroker.client.cluster import BlockingClusterClient
from logbroker.records import ProducerStamp, Record
from tests.cluster import BrokerCluster, Node, running_cluster
from tests.etcd import EtcdCluster, etcd_cluster
from tests.integration.twistd import broker_env, scrape

pytestmark = pytest.mark.integration

__all__ = ["etcd_cluster"]


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, etcd_cluster: EtcdCluster
) -> Iterator[BrokerCluster]:
    yield from running_cluster(tmp_path_factory.mktemp("cluster"), etcd_cluster)


def connect(node: Node, user: str = "app", password: str = "app123") -> BlockingClient:
    return BlockingClient.connect("127.0.0.1", node.port, user, password)


def drain(client: BlockingClient, topic: str, group: str | None = None) -> list[Record]:
    records: list[Record] = []
    cursor = None
    while True:
        batch = client.fetch(topic, cursor, group, None, 1000, 0)
        if not batch.records:
            return records
        records.extend(batch.records)
        cursor = batch.next_cursor


def eventually(check: object, seconds: float = 10.0) -> None:
    """Retry ``check`` (a callable raising AssertionError or BrokerRefused) until it passes."""
    assert callable(check)
    deadline = time.monotonic() + seconds
    while True:
        try:
            check()
            return
        except (AssertionError, BrokerRefused):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def known_everywhere(cluster: BrokerCluster, topic: str) -> None:
    """Wait until every node knows ``topic``: a node hears of a topic created through another
    within one watch round trip of its control plane (until then it answers no_such_topic)."""
    for node in cluster.nodes:

        def knows(node: Node = node) -> None:
            with connect(node) as client:
                client.fetch(topic, None, None, None, 1, 0)

        eventually(knows)


def test_records_produced_through_one_node_are_consumed_through_another(
    cluster: BrokerCluster,
) -> None:
    n1, n2, n3 = cluster.nodes
    records = [Record(b"value-%d" % i, key=b"key-%d" % (i % 16)) for i in range(400)]
    with connect(n2) as admin:
        admin.create_topic("orders")
    known_everywhere(cluster, "orders")
    with connect(n1) as producer:
        for start in range(0, len(records), 50):
            assert producer.produce("orders", records[start : start + 50]) == 50

    with connect(n3) as consumer:
        consumed = drain(consumer, "orders")

    assert sorted(r.value for r in consumed) == sorted(r.value for r in records)
    # Per key, in the order produced.
    for key in {r.key for r in records}:
        assert [r.value for r in consumed if r.key == key] == [
            r.value for r in records if r.key == key
        ]


def test_group_positions_committed_through_one_node_hold_on_another(
    cluster: BrokerCluster,
) -> None:
    n1, n2, n3 = cluster.nodes
    with connect(n1) as client:
        client.create_topic("positions")
    known_everywhere(cluster, "positions")
    with connect(n1) as client:
        client.produce("positions", [Record(b"%d" % i, key=b"k") for i in range(10)])
        first = client.fetch("positions", None, "billing", None, 4, 0)
    assert len(first.records) == 4
    with connect(n2) as client:
        client.commit("positions", "billing", first.next_cursor)

    # Node 3 hears of the commit within one watch round trip.
    def resumes_there() -> None:
        with connect(n3) as client:
            resumed = drain(client, "positions", "billing")
        assert [r.value for r in resumed] == [b"%d" % i for i in range(4, 10)]

    eventually(resumes_there)


def test_a_user_created_through_one_node_logs_in_on_the_others(cluster: BrokerCluster) -> None:
    n1, n2, n3 = cluster.nodes
    with connect(n2, "admin", "admin123") as admin:
        admin.create_user("carol", "carol-secret-1", ["produce", "consume"])

    def logs_in(node: Node) -> None:
        with connect(node, "carol", "carol-secret-1") as client:
            assert client.produce("carols", [Record(b"hi")]) == 1

    with connect(n2) as client:
        client.create_topic("carols")
    for node in (n1, n3):
        eventually(lambda node=node: logs_in(node))


def test_a_topic_s_ranges_are_spread_over_the_nodes(cluster: BrokerCluster) -> None:
    n1, _, _ = cluster.nodes
    with connect(n1) as client:
        client.create_topic("spread")
        client.produce("spread", [Record(b"v", key=b"k%d" % i) for i in range(64)])

    held = {
        node.node_id: {path.name for path in (node.directory / "data" / "ranges").iterdir()}
        for node in cluster.nodes
    }
    spread = {
        node_id: {r for r in ranges if r.startswith("spread.")} for node_id, ranges in held.items()
    }
    # Each range lives on exactly one node (replication factor 1), and more than one node leads.
    all_ranges = [r for ranges in spread.values() for r in ranges]
    assert sorted(all_ranges) == sorted(set(all_ranges))
    assert sum(1 for ranges in spread.values() if ranges) >= 2


def test_group_members_on_different_nodes_read_disjoint_shares(cluster: BrokerCluster) -> None:
    with connect(cluster.nodes[0]) as client:
        client.create_topic("shared")
    known_everywhere(cluster, "shared")
    with connect(cluster.nodes[0]) as client:
        client.produce("shared", [Record(b"%d" % i, key=b"k%d" % i) for i in range(200)])
    clients = [connect(node) for node in cluster.nodes]
    try:
        # Every member joins first, then each reads its share.
        for index, client in enumerate(clients):
            client.fetch("shared", None, "readers", f"m{index}", 1, 0)
        read: dict[str, set[bytes]] = {}
        for index, client in enumerate(clients):
            member = f"m{index}"
            cursor = None
            values: set[bytes] = set()
            while True:
                batch = client.fetch("shared", cursor, "readers", member, 1000, 0)
                if not batch.records:
                    break
                values |= {r.value for r in batch.records}
                cursor = batch.next_cursor
            read[member] = values
    finally:
        for client in clients:
            client.close()

    everything = [v for values in read.values() for v in values]
    assert sorted(everything) == sorted(b"%d" % i for i in range(200))
    assert len(everything) == len(set(everything))
    assert sum(1 for values in read.values() if values) >= 2


def http(
    node: Node, method: str, path: str, body: object = None, token: str | None = None
) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{node.dashboard_port}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={
            **({"Content-Type": "application/json"} if body is not None else {}),
            **({"Authorization": f"Bearer {token}"} if token else {}),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def login(node: Node, user: str, password: str) -> str:
    status, body = http(node, "POST", "/login", {"username": user, "password": password})
    assert status == 200, body
    token = body["token"]
    assert isinstance(token, str)
    return token


def test_a_dashboard_session_is_valid_on_every_node_and_ends_with_its_user(
    cluster: BrokerCluster,
) -> None:
    n1, n2, n3 = cluster.nodes
    admin_on_n2 = login(n2, "admin", "admin123")
    status, _ = http(
        n2,
        "POST",
        "/users",
        {"username": "dave", "password": "dave-secret-1", "permissions": ["admin"]},
        admin_on_n2,
    )
    assert status == 201

    # A user created through node 2 logs in on node 1's dashboard (once node 1 has heard of
    # it, within one watch round trip).
    tokens: list[str] = []
    eventually(lambda: tokens.append(login(n1, "dave", "dave-secret-1")))
    dave_on_n1 = tokens[-1]

    # Its session is valid on node 3 within a watch round trip (the login answered once the
    # session was in etcd; node 3 hears of it through its watch).
    def valid_on_n3() -> None:
        status, body = http(n3, "GET", "/users", token=dave_on_n1)
        assert status == 200, body

    started = time.monotonic()
    eventually(valid_on_n3)
    assert time.monotonic() - started < 2

    # Deleting the user through node 3 ends its sessions everywhere.
    status, _ = http(n3, "DELETE", "/users/dave", token=admin_on_n2)
    assert status == 200

    def ended() -> None:
        for node in (n1, n2):
            status, body = http(node, "GET", "/users", token=dave_on_n1)
            assert status == 401, body

    eventually(ended)


def test_a_long_poll_on_one_node_is_woken_by_a_produce_through_another(
    cluster: BrokerCluster,
) -> None:
    n1, n2, n3 = cluster.nodes
    with connect(n1) as client:
        client.create_topic("polled")
    known_everywhere(cluster, "polled")
    with connect(n1) as client:
        client.produce("polled", [Record(b"old", key=b"k%d" % i) for i in range(16)])
    with connect(n3) as consumer:
        drained = consumer.fetch("polled", None, None, None, 1000, 0)
        assert len(drained.records) == 16
        started = time.monotonic()
        answered: list[object] = []

        def poll() -> None:
            answered.append(consumer.fetch("polled", drained.next_cursor, None, None, 100, 20_000))

        poller = threading.Thread(target=poll)
        poller.start()
        time.sleep(0.5)
        with connect(n2) as producer:
            producer.produce("polled", [Record(b"new", key=b"k%d" % i) for i in range(16)])
        poller.join(timeout=25)

    [result] = answered
    assert [r.value for r in result.records][:1] == [b"new"]  # type: ignore[attr-defined]
    # Woken by the produce, well before the 20 s poll would have run out.
    assert time.monotonic() - started < 5


LOGBROKER = str(Path(sys.executable).with_name("logbroker"))


def cli(node: Node, *args: str, stdin: str = "", user: str = "app") -> str:
    password = {"app": "app123", "admin": "admin123"}[user]
    done = subprocess.run(
        [
            LOGBROKER,
            "--server",
            f"127.0.0.1:{node.port}",
            "--user",
            user,
            "--password",
            password,
            *args,
        ],
        input=stdin,
        capture_output=True,
        text=True,
        env=broker_env({}),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_cli_works_through_any_node_and_sees_three_live_nodes(
    cluster: BrokerCluster,
) -> None:
    n1, n2, n3 = cluster.nodes
    status = json.loads(cli(n2, "cluster", "status", "--json", user="admin"))
    cli(n1, "topic", "create", "cli-orders")
    known_everywhere(cluster, "cli-orders")
    cli(n1, "produce", "cli-orders", "--key", "k", stdin="one\ntwo\nthree\n")
    consumed = cli(n3, "consume", "cli-orders")

    assert sorted((n["node_id"], n["state"]) for n in status["nodes"]) == [
        ("n1", "alive"),
        ("n2", "alive"),
        ("n3", "alive"),
    ]
    assert status["node_id"] == "n2"
    assert status["control_plane"] == "etcd"
    assert consumed.split() == ["one", "two", "three"]


def test_one_stamp_produced_through_two_nodes_is_stored_once(cluster: BrokerCluster) -> None:
    n1, n2, n3 = cluster.nodes
    with connect(n1) as client:
        client.create_topic("stamped-twice")
    known_everywhere(cluster, "stamped-twice")
    sent = tuple(Record(b"%02d" % i, key=b"k%d" % i if i % 3 else None) for i in range(24))
    stamp = ProducerStamp(0xC1A5_7E55_0000_0001, 0)
    # The ranges are led by all three nodes: each node forwards the shares of the ranges led
    # by the others, and each range's primary knows the stamp again whichever node sent it.
    produce = wire.ProduceIdempotent("stamped-twice", stamp, sent)

    answers = []
    for node in (n1, n2):
        with connect(node) as client:
            answers.append(wire.decode_count(client.call(produce)))

    assert answers == [24, 24]
    with connect(n3) as client:
        assert sorted(drain(client, "stamped-twice"), key=repr) == sorted(sent, key=repr)


def forwarded(cluster: BrokerCluster) -> float:
    """Records every node forwarded to another node's primary so far, in all."""
    key = ("svc_forwarded_records_total", ())
    return sum(scrape(node.dashboard_port)[key] for node in cluster.nodes)


def test_a_cluster_client_sends_each_ranges_records_to_its_leader(
    cluster: BrokerCluster,
) -> None:
    with connect(cluster.nodes[0]) as client:
        client.create_topic("to-leaders")
    known_everywhere(cluster, "to-leaders")
    servers = [("127.0.0.1", node.port) for node in cluster.nodes]
    sent = [Record(b"%03d" % i, key=b"k%d" % (i % 40) if i % 5 else None) for i in range(400)]
    before = forwarded(cluster)

    with BlockingClusterClient.connect(servers, "app", "app123") as routed:
        for start in range(0, len(sent), 50):
            assert routed.produce("to-leaders", sent[start : start + 50]) == 50
        leaders = routed.node.topic_leaders("to-leaders")

    # The ranges are led by all three nodes, and not one record went through another node.
    assert {entry.leader for entry in leaders.ranges} == {"n1", "n2", "n3"}
    assert forwarded(cluster) == before
    # Through one node only, two thirds of them would have been forwarded: the count is fed.
    with connect(cluster.nodes[0]) as client:
        assert client.produce("to-leaders", sent[:50]) == 50
    assert forwarded(cluster) > before
    with connect(cluster.nodes[2]) as client:
        stored = drain(client, "to-leaders")
    produced = [*sent, *sent[:50]]
    assert sorted(stored, key=repr) == sorted(produced, key=repr)
    for key in {record.key for record in sent if record.key is not None}:
        assert [r for r in stored if r.key == key] == [r for r in produced if r.key == key]


@pytest_twisted.ensureDeferred
async def test_the_twisted_cluster_client_sends_pipelined_produces_to_the_leaders(
    cluster: BrokerCluster,
) -> None:
    from twisted.internet import reactor

    with connect(cluster.nodes[1]) as client:
        client.create_topic("to-leaders-twisted")
    known_everywhere(cluster, "to-leaders-twisted")
    servers = [("127.0.0.1", node.port) for node in cluster.nodes]
    sent = [Record(b"%03d" % i, key=b"k%d" % (i % 40) if i % 5 else None) for i in range(400)]
    before = forwarded(cluster)

    routed = await ClusterClient.connect(reactor, servers, "app", "app123")
    try:
        counts = await gatherResults(
            [routed.produce("to-leaders-twisted", sent[i : i + 50]) for i in range(0, 400, 50)]
        )
        node = await routed.node()
        leaders = await node.topic_leaders("to-leaders-twisted")
    finally:
        routed.close()

    assert counts == [50] * 8
    # More than one node leads the topic's ranges, and not one record was forwarded.
    assert len({entry.leader for entry in leaders.ranges}) >= 2
    assert forwarded(cluster) == before
    with connect(cluster.nodes[0]) as client:
        stored = drain(client, "to-leaders-twisted")
    assert sorted(stored, key=repr) == sorted(sent, key=repr)
    # Produces in flight together keep each key's order only within one produce (as Kafka's
    # pipelined producers): each produce's records of a key are stored in the order sent.
    for start in range(0, 400, 50):
        chunk = sent[start : start + 50]
        for key in {record.key for record in chunk if record.key is not None}:
            mine = [r for r in stored if r.key == key and r in chunk]
            assert mine == [r for r in chunk if r.key == key]
