"""Quorum replication (factor 3) under faults, on three real nodes and a real etcd.

Each test starts its own cluster, runs a steady keyed load (several producers, each in its own
thread with its own client, on different nodes), injects one fault (a primary SIGKILLed, a
primary SIGSTOPped past its lease, a follower SIGKILLed and restarted, a rolling restart, two
nodes of three lost), stops the load, reads everything back through a node and checks the history
(``tests.history``): nothing acknowledged lost, nothing stored twice, each key's records in the
order acknowledged. The follower's test also checks that it catches up: every sealed segment
is held whole and byte-identical by every member of its replica set.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from logbroker.broker.keyspace import split_keyspace
from logbroker.client.blocking import BlockingClient, BrokerRefused, ConnectionClosed
from logbroker.key_routing import key_slot
from logbroker.records import Record
from tests.cluster import BrokerCluster, Node, running_cluster
from tests.etcd import EtcdCluster, etcd_cluster
from tests.history import History
from tests.integration.test_cluster import known_everywhere

pytestmark = pytest.mark.integration

__all__ = ["etcd_cluster"]

#: The fixture's membership lease (``SVC_NODE_LEASE_MS``), in seconds.
LEASE = 3.0
REPLICATED = {"SVC_LOG_REPLICATION_FACTOR": "3"}
TOPIC = "load"
#: A new topic's ranges (``SVC_TOPIC_RANGES`` 4 of the default 8 keyspace bits).
RANGES = split_keyspace(8, 4)
PRODUCERS = 4
#: Seconds between one producer's produces: a steady load that leaves the two cores room for
#: the nodes' leases and failovers.
PACE = 0.01
#: A produce still refused this long after its first try fails (the client retries meanwhile).
GIVE_UP_AFTER = 15.0
#: How long a fault lasts at least, load running.
FAULT_SECONDS = 10.0


@pytest.fixture
def cluster(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[BrokerCluster]:
    yield from running_cluster(tmp_path, etcd_cluster, settings=REPLICATED)


@pytest.fixture
def small_segments(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[BrokerCluster]:
    """Segments that seal every few seconds: the load writes a few kilobytes a second to each
    range."""
    settings = {**REPLICATED, "SVC_SEGMENT_MAX_BYTES": "16384"}
    yield from running_cluster(tmp_path, etcd_cluster, settings=settings)


def connect(node: Node, user: str = "app", password: str = "app123") -> BlockingClient:
    return BlockingClient.connect("127.0.0.1", node.port, user, password, timeout=20)


def range_index(key: bytes) -> int:
    slot = key_slot(key, 8)
    return next(i for i, (start, end) in enumerate(RANGES) if start <= slot < end)


def keys_of(producer: int) -> list[bytes]:
    """One key in each of the topic's ranges, owned by ``producer`` alone."""
    found: dict[int, bytes] = {}
    for attempt in range(1000):
        key = b"p%d-k%d" % (producer, attempt)
        found.setdefault(range_index(key), key)
        if len(found) == len(RANGES):
            return [found[i] for i in sorted(found)]
    raise AssertionError("no keys cover every range")


def wait_for(
    condition: Callable[[], bool],
    seconds: float,
    what: str,
    explain: Callable[[], object] = lambda: "",
) -> None:
    """Poll ``condition`` every 0.1 s until it holds; fail saying ``what`` (and what
    ``explain`` says then) after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what} {explain()}"
        time.sleep(0.1)


class KeyedLoad:
    """``PRODUCERS`` threads producing one keyed record at a time, each through its own client
    on its own node (the next node, round the cluster, when its node stops answering), each
    with keys of its own that cover every range. Every produce goes into ``history``."""

    def __init__(self, cluster: BrokerCluster, history: History) -> None:
        self._cluster = cluster
        self.history = history
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self.keys = [keys_of(index) for index in range(PRODUCERS)]
        self._threads = [
            threading.Thread(target=self._run, args=(index,), name=f"producer-{index}")
            for index in range(PRODUCERS)
        ]

    @property
    def every_key(self) -> set[bytes]:
        return {key for keys in self.keys for key in keys}

    def __enter__(self) -> KeyedLoad:
        """Start producing; return once every key has a record acknowledged."""
        for thread in self._threads:
            thread.start()
        try:
            wait_for_every_key(self, self.history.origin, 20, "every key acknowledged once")
        except BaseException:
            self.stop()
            raise
        self.history.mark("every key acknowledged")
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop producing, wait for the produces in flight, and raise what a producer did not
        expect."""
        if not self._stop.is_set():
            self.history.mark("load stopped")
        self._stop.set()
        for thread in self._threads:
            # A produce in flight gives up after GIVE_UP_AFTER, a silent node after the
            # client's socket timeout.
            thread.join(timeout=GIVE_UP_AFTER + 30)
            assert not thread.is_alive(), f"{thread.name} did not stop"
        if self._errors:
            raise self._errors[0]

    def _run(self, index: int) -> None:
        try:
            self._produce(index)
        except BaseException as error:
            self._errors.append(error)

    def _connect(self, index: int) -> BlockingClient | None:
        """A client on the first node, from the producer's own round the cluster, that
        answers; None once stopped."""
        nodes = self._cluster.nodes
        while not self._stop.is_set():
            node = nodes[index % len(nodes)]
            try:
                return connect(node)
            except (OSError, ConnectionClosed, BrokerRefused):
                index += 1
                time.sleep(0.05)
        return None

    def _produce(self, index: int) -> None:
        keys = self.keys[index]
        client = self._connect(index)
        count = 0
        while client is not None and not self._stop.is_set():
            key = keys[count % len(keys)]
            count += 1
            sequence, value = self.history.next_value(key)
            started = time.monotonic()
            failure = None
            try:
                client.produce(TOPIC, [Record(value, key=key)], give_up_after=GIVE_UP_AFTER)
            except BrokerRefused as refused:
                failure = refused.reason
            except (OSError, ConnectionClosed) as error:
                # The node went (or stopped answering): its answer is lost, so the record
                # may or may not be stored. Carry on through the next node.
                failure = type(error).__name__
                client.close()
                index += 1
                client = self._connect(index)
            self.history.record(key, value, sequence, started, time.monotonic(), failure)
            time.sleep(PACE)
        if client is not None:
            client.close()


def read_back(node: Node, seconds: float = 30) -> list[tuple[bytes | None, bytes]]:
    """Every record of the topic, ``(key, value)`` in the order read through ``node`` from the
    start; read again from the start while the cluster settles (a range whose primary has
    just changed may answer a refusal for a moment)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with connect(node) as client:
                read: list[tuple[bytes | None, bytes]] = []
                cursor = None
                while True:
                    batch = client.fetch(TOPIC, cursor, None, None, 1000, 0)
                    if not batch.records:
                        return read
                    read.extend((record.key, record.value) for record in batch.records)
                    cursor = batch.next_cursor
        except (BrokerRefused, ConnectionClosed, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def check(history: History, reader: Node) -> None:
    """Read everything back through ``reader`` and check it against ``history``."""
    verdict = history.check(read_back(reader))
    # What the fault cost (failed produces, the longest latency), shown with -s or -rP.
    print(f"\n{verdict.summary()}")
    if verdict.problems:
        pytest.fail("\n".join([verdict.summary(), *verdict.problems]), pytrace=False)
    assert verdict.acknowledged > 0


def describe(node: Node) -> dict[str, tuple[bool, int]]:
    """Each node's (alive, segments led), as ``node`` sees the cluster."""
    with connect(node, "admin", "admin123") as admin:
        cluster = admin.describe_cluster()
    return {n.node_id: (n.alive, n.segments_led) for n in cluster.nodes}


def alive_everywhere(cluster: BrokerCluster) -> bool:
    """Whether every node answers and sees every node alive."""
    try:
        seen = [describe(node) for node in cluster.nodes]
    except (BrokerRefused, ConnectionClosed, OSError):
        return False
    return all(
        sorted(node_id for node_id, (alive, _) in nodes.items() if alive)
        == sorted(node.node_id for node in cluster.nodes)
        for nodes in seen
    )


def wait_until_alive(cluster: BrokerCluster, seconds: float = 20) -> None:
    wait_for(lambda: alive_everywhere(cluster), seconds, "every node sees 3 of 3 alive")


def leader(cluster: BrokerCluster) -> Node:
    """The node that leads the most active segments."""
    led = describe(cluster.nodes[0])
    node_id = max(led, key=lambda n: led[n][1])
    assert led[node_id][1] > 0, led
    return cluster.node(node_id)


def follower(cluster: BrokerCluster) -> Node:
    """The node that leads the fewest active segments."""
    led = describe(cluster.nodes[0])
    return cluster.node(min(led, key=lambda n: led[n][1]))


def ranges_progressed(history: History, since: float) -> set[int]:
    """The ranges with a produce acknowledged after ``since``."""
    return {range_index(p.key) for p in history.produces if p.acknowledged and p.finished > since}


def wait_for_every_key(
    load: KeyedLoad, since: float, seconds: float, what: str, not_before: float = 0.0
) -> None:
    """Wait until every key has a produce acknowledged after ``since`` (and the clock is past
    ``not_before``): every producer made progress, in every range."""

    def missing() -> list[bytes]:
        return sorted(load.every_key - load.history.acknowledged_keys(since))

    wait_for(
        lambda: time.monotonic() > not_before and not missing(),
        seconds,
        what,
        lambda: f"(keys without: {missing()})",
    )


def loaded(cluster: BrokerCluster, history: History) -> KeyedLoad:
    """The load on a new topic (once every node knows it)."""
    with connect(cluster.nodes[0]) as client:
        client.create_topic(TOPIC)
    known_everywhere(cluster, TOPIC)
    return KeyedLoad(cluster, history)


def pid(node: Node) -> int:
    assert node.process is not None
    return node.process.pid


def test_a_primary_killed_under_load_loses_nothing_acknowledged(
    cluster: BrokerCluster,
) -> None:
    history = History()
    with loaded(cluster, history) as load:
        victim = leader(cluster)
        killed_at = history.mark(f"SIGKILL {victim.node_id}")
        victim.kill()
        # Every range, the victim's included, takes produces again within a lease and a
        # failover: every key, so every producer, gets records acknowledged after that.
        wait_for_every_key(
            load,
            since=killed_at + LEASE + 3,
            seconds=FAULT_SECONDS + 15,
            what="every key acknowledged after the failover",
            not_before=killed_at + FAULT_SECONDS,
        )
        victim.start()
        history.mark(f"restarted {victim.node_id}")
        wait_until_alive(cluster)
        history.mark("3 of 3 alive")
    reader = next(node for node in cluster.nodes if node is not victim)
    check(history, reader)


def test_a_primary_stalled_past_its_lease_gets_nothing_acknowledged_and_comes_back(
    cluster: BrokerCluster,
) -> None:
    history = History()
    with loaded(cluster, history) as load:
        victim = leader(cluster)
        others = [node for node in cluster.nodes if node is not victim]
        stopped_at = history.mark(f"SIGSTOP {victim.node_id}")
        os.kill(pid(victim), signal.SIGSTOP)
        try:
            wait_for(
                lambda: not describe(others[0])[victim.node_id][0],
                LEASE + 3,
                "the stalled node is dead to the others",
            )
            history.mark(f"{victim.node_id} dead")
            # The producers on the other nodes go on: every range is taken over, the stalled
            # node's too.
            wait_for(
                lambda: (
                    time.monotonic() > stopped_at + 2 * LEASE
                    and ranges_progressed(history, stopped_at + LEASE) == set(range(len(RANGES)))
                ),
                2 * LEASE + 10,
                "every range acknowledged during the stall",
                lambda: ranges_progressed(history, stopped_at + LEASE),
            )
        finally:
            continued_at = history.mark(f"SIGCONT {victim.node_id}")
            os.kill(pid(victim), signal.SIGCONT)
        wait_until_alive(cluster)
        history.mark("3 of 3 alive")
        # The producers that were stuck on the stalled node get their answers (not_primary,
        # retried elsewhere) and go on.
        wait_for_every_key(load, continued_at, 10, "every key acknowledged after SIGCONT")
    # Read through the node that was stalled: it serves what the quorum holds, nothing stale.
    check(history, victim)


def test_a_follower_killed_and_restarted_catches_up_byte_identical(
    small_segments: BrokerCluster, etcd_cluster: EtcdCluster
) -> None:
    cluster = small_segments
    history = History()
    with loaded(cluster, history) as load:
        victim = follower(cluster)
        killed_at = history.mark(f"SIGKILL {victim.node_id}")
        victim.kill()
        wait_for_every_key(
            load,
            since=killed_at + LEASE + 3,
            seconds=FAULT_SECONDS + 15,
            what="every key acknowledged with the node away",
            not_before=killed_at + FAULT_SECONDS,
        )
    # The segments it was in sealed while it was away: it holds them short or not at all, and
    # must fetch them by itself (no produce comes to bring it along).
    behind = sealed_copy_problems(etcd_cluster, cluster)
    assert any(victim.node_id in problem for problem in behind), behind
    victim.start()
    history.mark(f"restarted {victim.node_id}")
    wait_until_alive(cluster)
    history.mark("3 of 3 alive")
    wait_for(
        lambda: not sealed_copy_problems(etcd_cluster, cluster),
        20,
        "every sealed segment held whole and identical by its replicas",
        lambda: sealed_copy_problems(etcd_cluster, cluster),
    )
    history.mark("every sealed copy whole")
    check(history, victim)


def test_with_two_nodes_of_three_lost_every_acknowledged_record_is_read_through_the_third(
    cluster: BrokerCluster,
) -> None:
    history = History()
    with loaded(cluster, history) as load:
        wait_for_every_key(
            load, history.origin, 20, "a few records of every key", time.monotonic() + 3
        )
    survivor = follower(cluster)
    lost = [node for node in cluster.nodes if node is not survivor]
    led_by_lost = sum(describe(survivor)[node.node_id][1] for node in lost)
    assert led_by_lost > 0, "the lost nodes lead ranges whose reads must go to the copies"
    history.mark(f"SIGKILL {', '.join(node.node_id for node in lost)}")
    for node in lost:
        node.kill()
    wait_for(
        lambda: [alive for alive, _ in describe(survivor).values()].count(True) == 1,
        LEASE + 10,
        f"{survivor.node_id} sees the two others dead",
    )
    history.mark("2 of 3 dead")

    # No quorum: a produce is refused at once, never left waiting.
    with connect(survivor) as client:
        started = time.monotonic()
        with pytest.raises(BrokerRefused) as refused:
            client.produce(TOPIC, [Record(b"no quorum", key=b"k")], give_up_after=0)
        assert refused.value.reason in {"no_quorum", "unreachable"}
        assert time.monotonic() - started < 2
    # Every record acknowledged before the loss is read back through the survivor, the ranges
    # the lost nodes led included.
    check(history, survivor)


def test_a_rolling_restart_under_load_loses_nothing_acknowledged(
    cluster: BrokerCluster,
) -> None:
    history = History()
    with loaded(cluster, history) as load:
        for node in cluster.nodes:
            history.mark(f"SIGTERM {node.node_id}")
            node.stop()
            restarted_at = history.mark(f"restarted {node.node_id}")
            node.start()
            wait_until_alive(cluster)
            history.mark("3 of 3 alive")
            wait_for_every_key(load, restarted_at, 15, "every key acknowledged after the restart")
    check(history, cluster.nodes[0])


def segments_in_etcd(etcd: EtcdCluster, cluster: BrokerCluster) -> list[dict[str, Any]]:
    """Every segment's record in the control plane (``logbroker.controlplane._format``)."""
    prefix = f"/logbroker/{cluster.cluster_id}/state/segments/".encode()
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    body = json.dumps(
        {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()}
    ).encode()
    request = urllib.request.Request(etcd.endpoints[0] + "/v3/kv/range", data=body)
    with urllib.request.urlopen(request, timeout=5) as answer:
        found = json.load(answer).get("kvs", [])
    return [json.loads(base64.b64decode(kv["value"])) for kv in found]


def sealed_copy_problems(etcd: EtcdCluster, cluster: BrokerCluster) -> list[str]:
    """Sealed segments (with records) that a member of their replica set does not hold whole
    (its ``.log`` with a ``.sealed`` marker beside it, of the size sealed), or whose copies are
    not byte-identical."""
    problems = []
    for meta in segments_in_etcd(etcd, cluster):
        if meta["state"] != "sealed" or not meta["record_count"]:
            continue
        range_id, base = meta["range_id"], meta["base_offset"]
        copies: dict[str, bytes] = {}
        for node_id in meta["replicas"]:
            stem = cluster.node(node_id).directory / "data" / "ranges" / range_id / f"{base:020d}"
            try:
                if stem.with_suffix(".sealed").exists():
                    copies[node_id] = stem.with_suffix(".log").read_bytes()
            except OSError:
                pass
            if node_id not in copies:
                problems.append(f"{node_id} lacks a sealed copy of {range_id}@{base}")
        sizes = {node_id: len(data) for node_id, data in copies.items()}
        if any(size != meta["byte_size"] for size in sizes.values()):
            problems.append(f"{range_id}@{base}: sizes {sizes}, sealed at {meta['byte_size']}")
        if len(set(copies.values())) > 1:
            problems.append(f"{range_id}@{base}: copies differ on {sorted(copies)}")
    return problems
