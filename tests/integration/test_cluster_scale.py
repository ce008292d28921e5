"""A real three-node cluster at replication factor 3 with 1,000 topics of four ranges (4,000
ranges, 400 of the topics written): one node SIGKILLed, every topic must be writable through
the two others soon after, and signing in must never stall meanwhile.

The issue's targets on such a cluster are every topic writable within 10 s of the kill and no
sign-in slower than 1 s. On this project's two-core machines, with the three brokers, the three
etcd members and this test sharing the cores, ``bench/cluster_scale.py`` measures 4-6 s and
0.1-0.3 s on a fast day, up to about twice that on a slow one (``bench/RESULTS.md``, with what
limits them). The bounds here are the targets with half as much again for a loaded CI runner;
what they catch is the kind of failover this cluster had before (minutes with nothing writable,
sign-ins timing out). On a machine running at a third of its usual speed (2026-12-07,
``bench/replicated_produce.py``'s single node at 237 k keyed records/s against 600-760 k on its
usual days) this test's failover took 15.0-15.8 s, and a CI runner as slow missed the 15 s
with 607 topics left. So the failover's bound grows with the machine's slowness, measured in
the same run: the probe's pass over every topic of the healthy cluster just before the kill
(its floor). The failover took about four floors there (15.0 s over 3.7 s, 15.8 s over 4.4 s);
six are allowed, and never less than the fixed bound. That still fails the failover this
cluster had before by a wide margin. The probe, the sign-ins and the pipelined set-up are the
benchmark's own (``bench/cluster_scale.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from logbroker import wire
from logbroker.records import Record
from tests.bench_scripts import load_bench_script
from tests.cluster import BrokerCluster, running_cluster
from tests.etcd import EtcdCluster, etcd_cluster

pytestmark = pytest.mark.integration

__all__ = ["etcd_cluster"]

scale = load_bench_script("cluster_scale")

TOPICS = 1000
WRITTEN = 400
#: The longest the test lets the failover take, and any sign-in meanwhile (see above).
WRITABLE_WITHIN_SECONDS = 15.0
SIGN_IN_WITHIN_SECONDS = 1.5
#: On a slower machine, the failover may take this many of the healthy cluster's passes over
#: every topic, timed just before the kill (see above).
WRITABLE_WITHIN_FLOORS = 6
#: The probe's requests in flight through each survivor (the benchmark's default).
PROBE_IN_FLIGHT = 8


@pytest.fixture
def cluster(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[BrokerCluster]:
    settings = {
        "SVC_LOG_REPLICATION_FACTOR": "3",
        "SVC_TOPIC_RANGES": "4",
        "SVC_AUTH_RATE_LIMIT": "1000000",
    }
    yield from running_cluster(tmp_path, etcd_cluster, settings)


def test_every_one_of_a_thousand_topics_is_writable_soon_after_a_node_is_killed(
    cluster: BrokerCluster,
) -> None:
    keys = scale.range_keys(4)
    ports = [node.port for node in cluster.nodes]
    creates = [wire.CreateTopic(scale.topic_name(index), 0) for index in range(TOPICS)]
    scale.split_over(ports, creates, scale.ADMIN)
    produces = [
        wire.Produce(scale.topic_name(index), tuple(Record(b"first", key=key) for key in keys))
        for index in range(WRITTEN)
    ]
    scale.split_over(ports, produces, scale.APP)
    victim = cluster.node("n3")
    survivors = [node for node in cluster.nodes if node is not victim]
    survivor_ports = [node.port for node in survivors]
    # Every topic taken once before the kill: each range is led (the nodes claim a new topic's
    # ranges after its creation is acknowledged), so the kill meets a settled cluster.
    scale.Probe(TOPICS, survivor_ports, keys, PROBE_IN_FLIGHT).run(time.monotonic() + 300)
    # The same probe on the healthy cluster: how fast this machine is now (see above).
    started = time.monotonic()
    scale.Probe(TOPICS, survivor_ports, keys, PROBE_IN_FLIGHT).run(started + 300)
    floor = time.monotonic() - started
    writable_within = max(WRITABLE_WITHIN_SECONDS, WRITABLE_WITHIN_FLOORS * floor)

    with scale.SignIns({node.node_id: node.port for node in cluster.nodes}) as sign_ins:
        time.sleep(1)
        sign_ins.drop(victim.node_id)
        killed = time.monotonic()
        victim.kill()
        probe = scale.Probe(TOPICS, survivor_ports, keys, PROBE_IN_FLIGHT)
        probe.run(killed + writable_within)
        writable = time.monotonic() - killed
        during = sign_ins.between(killed, time.monotonic())

    assert len(probe.writable_at) == TOPICS
    assert writable < writable_within
    assert during["sign_ins"] > 10, during
    assert during["sign_in_failed"] == 0, during
    assert during["sign_in_longest_s"] < SIGN_IN_WITHIN_SECONDS, during
    print(
        f"every topic writable {writable:.1f} s after the kill (probe floor {floor:.2f} s,"
        f" bound {writable_within:.1f} s); sign-ins {during}"
    )
