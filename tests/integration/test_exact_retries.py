"""Retries are exact: stamped produces retried through other nodes, on three real nodes at
replication factor 3, during kills, stalls and a lost quorum, are each stored once.

Each producer thread sends one record at a time as ``produce_idempotent`` with its own producer
id and the next sequence, and on any failure (a refusal such as ``no_quorum``, ``unreachable``
or ``not_primary``, or a connection lost or silent) sends the very same stamp through the next
node, until it is acknowledged or the producer gives up. Meanwhile a node is SIGKILLed and
restarted, a node is SIGSTOPped past its lease and resumed, and two nodes are stopped at once
so the third cannot reach a quorum (its appends are refused ``no_quorum`` in doubt, and their
retries wait for the first try's fate). Read back afterwards, every acknowledged value is there
and no value, acknowledged or not, is there twice.
"""

from __future__ import annotations

import collections
import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from logbroker import wire
from logbroker.client.blocking import BlockingClient, BrokerRefused, ConnectionClosed
from logbroker.records import ProducerStamp, Record
from tests.cluster import BrokerCluster, Node, running_cluster
from tests.etcd import EtcdCluster, etcd_cluster
from tests.history import History
from tests.integration.test_replication_faults import (
    LEASE,
    REPLICATED,
    TOPIC,
    check,
    keys_of,
    leader,
    pid,
    wait_until_alive,
)

pytestmark = pytest.mark.integration

__all__ = ["etcd_cluster"]

PRODUCERS = 4
#: How long one try may wait for its answer before it counts as lost.
TRY_SECONDS = 8.0
#: A produce not acknowledged this long after its first try is given up (its value may or may
#: not be stored: at most once).
GIVE_UP_AFTER = 40.0


@pytest.fixture
def cluster(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[BrokerCluster]:
    settings = {**REPLICATED, "SVC_SEGMENT_MAX_BYTES": "16384"}
    yield from running_cluster(tmp_path, etcd_cluster, settings=settings)


class StampedLoad:
    """Producer threads whose every produce is stamped, and retried with the same stamp
    through the next node after any failure."""

    def __init__(self, cluster: BrokerCluster, history: History) -> None:
        self._nodes = cluster.nodes
        self.history = history
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        #: Retries, by what made the try before them fail.
        self.retried_after: collections.Counter[str] = collections.Counter()
        #: While set, the index of the node every new produce is first tried through.
        self.home: int | None = None
        self._threads = [
            threading.Thread(target=self._run, args=(index,), name=f"stamped-{index}")
            for index in range(PRODUCERS)
        ]

    def __enter__(self) -> StampedLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=GIVE_UP_AFTER + 2 * TRY_SECONDS)
            assert not thread.is_alive(), f"{thread.name} did not stop"
        if self._errors:
            raise self._errors[0]

    def _run(self, index: int) -> None:
        try:
            self._produce(index)
        except BaseException as error:
            self._errors.append(error)

    def _produce(self, index: int) -> None:
        keys = keys_of(index)
        producer_id = 0x5EED_0000_0000_0000 + index
        clients: dict[int, BlockingClient] = {}
        node = index
        try:
            for sequence in itertools.count():
                if self._stop.is_set():
                    return
                key = keys[sequence % len(keys)]
                if self.home is not None:
                    node = self.home
                number, value = self.history.next_value(key)
                stamp = ProducerStamp(producer_id, sequence)
                request = wire.ProduceIdempotent(TOPIC, stamp, (Record(value, key=key),))
                started = time.monotonic()
                failure: str | None = "gave up"
                while time.monotonic() - started < GIVE_UP_AFTER:
                    why = self._try(clients, node, request)
                    if why is None:
                        failure = None
                        break
                    with self._lock:
                        self.retried_after[why] += 1
                    node += 1
                    time.sleep(0.05)
                self.history.record(key, value, number, started, time.monotonic(), failure)
        finally:
            for client in clients.values():
                client.close()

    def _try(
        self, clients: dict[int, BlockingClient], node: int, request: wire.Request
    ) -> str | None:
        """One try through node ``node`` (round the cluster): ``None`` when acknowledged,
        else what made it fail."""
        slot = node % len(self._nodes)
        try:
            client = clients.get(slot)
            if client is None:
                target: Node = self._nodes[slot]
                client = clients[slot] = BlockingClient.connect(
                    "127.0.0.1", target.port, "app", "app123", timeout=TRY_SECONDS
                )
            wire.decode_count(client.call(request))
            return None
        except BrokerRefused as refused:
            return refused.reason
        except (OSError, ConnectionClosed):
            # Lost, or silent past the try's timeout: its outcome is unknown.
            dropped = clients.pop(slot, None)
            if dropped is not None:
                dropped.close()
            return "connection lost"


def test_stamped_retries_through_other_nodes_store_every_value_once(
    cluster: BrokerCluster,
) -> None:
    history = History()
    with BlockingClient.connect("127.0.0.1", cluster.nodes[0].port, "app", "app123") as admin:
        admin.create_topic(TOPIC)
    with StampedLoad(cluster, history) as load:
        time.sleep(3)
        first, second, third = cluster.nodes

        history.mark(f"SIGKILL {first.node_id}")
        first.kill()
        time.sleep(LEASE + 3)
        first.start()
        history.mark(f"restarted {first.node_id}")
        wait_until_alive(cluster)

        history.mark(f"SIGSTOP {second.node_id}")
        os.kill(pid(second), signal.SIGSTOP)
        time.sleep(LEASE + 3)
        os.kill(pid(second), signal.SIGCONT)
        history.mark(f"SIGCONT {second.node_id}")
        wait_until_alive(cluster)

        # The node left alone cannot reach a quorum: what it took for the segments it leads is
        # refused no_quorum in doubt, and committed once the others are back. It is the node
        # leading the most segments: one leading none would only forward, refused unreachable.
        alone = leader(cluster)
        stopped = [node for node in cluster.nodes if node is not alone]
        # Every producer's next produce goes through it (a producer waiting on a stopped node
        # would wait there past the fault, and take no part in it).
        load.home = cluster.nodes.index(alone)
        time.sleep(1)
        history.mark(f"SIGSTOP {stopped[0].node_id} and {stopped[1].node_id}")
        for node in stopped:
            os.kill(pid(node), signal.SIGSTOP)
        time.sleep(LEASE + 3)
        for node in stopped:
            os.kill(pid(node), signal.SIGCONT)
        history.mark(f"SIGCONT {stopped[0].node_id} and {stopped[1].node_id}")
        load.home = None
        wait_until_alive(cluster)
        time.sleep(3)
    print(f"\nretries by what failed the try before: {dict(load.retried_after)}")
    check(history, third)
    # Every fault ends within LEASE + 3 s of its start: a produce retried for GIVE_UP_AFTER
    # in vain waited on a fate that never came (its records stored, but never committed).
    gave_up = [p for p in history.produces if p.failure == "gave up"]
    assert not gave_up, f"{len(gave_up)} produces retried for {GIVE_UP_AFTER:g} s in vain"
    for cause in ("no_quorum", "connection lost"):
        assert load.retried_after[cause] > 0, f"no retry after {cause}: {dict(load.retried_after)}"
    assert load.retried_after["unreachable"] + load.retried_after["not_primary"] > 0
