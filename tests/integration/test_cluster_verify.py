"""``logbroker cluster verify`` on three real ``twistd logbroker`` nodes at replication factor 3
on a real three-member etcd: after a load that seals several segments, every copy of every
sealed segment is complete and byte-identical on its three nodes (the spec's guarantee 4); a
byte changed in one follower's ``.index``, a ``.sealed`` deleted from another, and a node
killed are each reported, naming the segment, the node and the file, with exit status 1; a
node killed under load and restarted gets back its copies of every segment sealed while it was
away, with the under-replicated count (``cluster status``, ``/metrics``) back at 0."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from logbroker.client.blocking import BlockingClient
from logbroker.records import Record
from tests.cluster import BrokerCluster, Node, running_cluster
from tests.etcd import EtcdCluster, etcd_cluster
from tests.integration.test_replication_faults import segments_in_etcd
from tests.integration.twistd import broker_env, flip_byte

pytestmark = pytest.mark.integration

__all__ = ["etcd_cluster"]

LOGBROKER = str(Path(sys.executable).with_name("logbroker"))
#: Segments seal every 16 KiB: the load below seals several in each range.
#: The scrub is off (the cluster fixture's default): the damage below must stay for verify to find.
SETTINGS = {"SVC_LOG_REPLICATION_FACTOR": "3", "SVC_SEGMENT_MAX_BYTES": "16384"}
TOPIC = "verified"


@pytest.fixture
def cluster(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[BrokerCluster]:
    yield from running_cluster(tmp_path, etcd_cluster, settings=SETTINGS)


def verify(node: Node, *args: str) -> subprocess.CompletedProcess[str]:
    return cli(node, "cluster", "verify", "--timeout", "60", *args)


def cli(node: Node, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            LOGBROKER,
            "--server",
            f"127.0.0.1:{node.port}",
            "--user",
            "admin",
            "--password",
            "admin123",
            *args,
        ],
        capture_output=True,
        text=True,
        env=broker_env({}),
        timeout=90,
        check=False,
    )


def wait_for(condition: Callable[[], bool], seconds: float, what: Callable[[], object]) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what()}"
        time.sleep(0.5)


def produce_load(node: Node, label: str = "") -> None:
    """About 40 KiB into each of the topic's ranges, keyed across them, through one node."""
    with BlockingClient.connect("127.0.0.1", node.port, "admin", "admin123", timeout=30) as client:
        if TOPIC not in {topic.name for topic in client.list_topics()}:
            client.create_topic(TOPIC)
        for start in range(0, 800, 20):
            records = [
                Record(b"%s%d-" % (label.encode(), n) + b"x" * 200, key=b"key-%d" % (n % 97))
                for n in range(start, start + 20)
            ]
            assert client.produce(TOPIC, records, give_up_after=30) == len(records)


def sealed_segments(etcd: EtcdCluster, cluster: BrokerCluster) -> list[dict[str, Any]]:
    return [
        meta
        for meta in segments_in_etcd(etcd, cluster)
        if meta["state"] == "sealed" and meta["record_count"]
    ]


def copy_file(cluster: BrokerCluster, node_id: str, meta: dict[str, Any], suffix: str) -> Path:
    directory = cluster.node(node_id).directory / "data" / "ranges" / meta["range_id"]
    return directory / f"{meta['base_offset']:020d}{suffix}"


def verified_clean(node: Node, seconds: float = 30) -> subprocess.CompletedProcess[str]:
    """``cluster verify`` through ``node`` once it finds every copy complete and identical."""
    last: list[subprocess.CompletedProcess[str]] = []
    wait_for(
        lambda: not last.append(verify(node)) and last[-1].returncode == 0,
        seconds,
        lambda: last[-1].stdout + last[-1].stderr,
    )
    return last[-1]


def loaded(cluster: BrokerCluster, etcd: EtcdCluster) -> None:
    """``produce_load`` through the first node, once several segments are sealed and every
    copy of them verifies identical."""
    produce_load(cluster.nodes[0])
    wait_for(
        lambda: len(sealed_segments(etcd, cluster)) >= 6,
        30,
        lambda: f"{len(sealed_segments(etcd, cluster))} sealed segments",
    )
    # Each replica seals its copy when its primary tells it to, right after the seal.
    verified_clean(cluster.nodes[0])


def test_every_sealed_copy_verifies_identical_until_one_is_damaged(
    cluster: BrokerCluster, etcd_cluster: EtcdCluster
) -> None:
    first = cluster.nodes[0]
    loaded(cluster, etcd_cluster)

    clean = verify(cluster.nodes[1])

    assert clean.returncode == 0, clean.stdout + clean.stderr
    sealed = sealed_segments(etcd_cluster, cluster)
    assert f"checked {len(sealed)} sealed segments, {3 * len(sealed)} copies" in clean.stdout
    assert "every copy complete and identical" in clean.stdout

    damaged, deleted = sealed[0], sealed[-1]
    index_follower, seal_follower = damaged["replicas"][1], deleted["replicas"][2]
    index = copy_file(cluster, index_follower, damaged, ".index")
    flip_byte(index, 21)
    copy_file(cluster, seal_follower, deleted, ".sealed").unlink()

    found = verify(first)
    as_json = verify(first, "--json")

    assert found.returncode == 1, found.stdout + found.stderr
    where = f"{damaged['range_id']}@{damaged['base_offset']} on {index_follower}"
    assert f"{where}: differs: .index (from the copies on " in found.stdout
    where = f"{deleted['range_id']}@{deleted['base_offset']} on {seal_follower}"
    assert f"{where}: missing_files: .sealed (not on disk)" in found.stdout
    assert found.stdout.splitlines()[-1].endswith(": 2 problems")
    assert as_json.returncode == 1
    report = json.loads(as_json.stdout)
    assert report["ok"] is False
    assert sorted(
        (p["kind"], p["node_id"], p["range_id"], p["base_offset"], p["files"])
        for p in report["problems"]
    ) == sorted(
        [
            ("differs", index_follower, damaged["range_id"], damaged["base_offset"], ["index"]),
            (
                "missing_files",
                seal_follower,
                deleted["range_id"],
                deleted["base_offset"],
                ["sealed"],
            ),
        ]
    )

    # A node that does not answer is reported too, and its copies are not checked.
    gone = cluster.node(seal_follower)
    asking = next(node for node in cluster.nodes if node is not gone)
    gone.kill()
    without: list[subprocess.CompletedProcess[str]] = []
    wait_for(
        lambda: (
            not without.append(verify(asking))
            and f"{seal_follower}: unavailable" in without[-1].stdout
        ),
        30,
        lambda: without[-1],
    )
    assert without[-1].returncode == 1
    assert "more on nodes not checked" in without[-1].stdout.splitlines()[-1]


def status(node: Node) -> dict[str, Any]:
    answer = cli(node, "cluster", "status", "--json")
    assert answer.returncode == 0, answer.stdout + answer.stderr
    result: dict[str, Any] = json.loads(answer.stdout)
    return result


def under_replicated_gauge(node: Node) -> float | None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{node.dashboard_port}/metrics", headers={"Accept": "text/plain"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    return next(
        (
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "svc_under_replicated_segments"
        ),
        None,
    )


def test_a_follower_killed_under_load_gets_back_three_identical_copies(
    cluster: BrokerCluster, etcd_cluster: EtcdCluster
) -> None:
    # While n3 is away, segments seal without it (its ranges are taken over, at a new epoch):
    # the cluster counts them under-replicated. Back, n3 is added to their replica sets, seals
    # what it holds to the recorded length and fetches whole what it lacks, and the count
    # returns to 0. Then every file of every copy must be the same on the three nodes: the
    # .index however the bytes arrived, the .sealed wherever and whenever it was sealed, the
    # .epoch however the copy came to be.
    first, away = cluster.nodes[0], cluster.nodes[2]
    produce_load(first, "before")
    away.kill()
    produce_load(first, "during")
    wait_for(
        lambda: (
            (status(first)["under_replicated_segments"] or 0) > 0
            and (under_replicated_gauge(first) or 0) > 0
        ),
        30,
        lambda: (status(first), under_replicated_gauge(first)),
    )
    away.start()
    produce_load(first, "after")

    live = cluster.nodes
    wait_for(
        lambda: (
            all(status(node)["under_replicated_segments"] == 0 for node in live)
            and all(under_replicated_gauge(node) == 0 for node in live)
        ),
        60,
        lambda: [status(node)["under_replicated_segments"] for node in live],
    )
    last: list[subprocess.CompletedProcess[str]] = []
    wait_for(
        lambda: not last.append(verify(away)) and last[-1].returncode == 0, 30, lambda: last[-1]
    )

    sealed = sealed_segments(etcd_cluster, cluster)
    assert len(sealed) >= 12
    assert any(meta["epoch"] > 0 for meta in sealed), "some were taken over"
    assert [meta for meta in sealed if len(meta["replicas"]) != 3] == []
    assert f"checked {len(sealed)} sealed segments, {3 * len(sealed)} copies" in last[-1].stdout
    assert "every copy complete and identical" in last[-1].stdout
