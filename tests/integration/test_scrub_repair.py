"""The scrub and repair on three real ``twistd logbroker`` nodes at replication factor 3 on a
real three-member etcd, with small segments and an aggressive scrub: a byte flipped in a
stopped follower's sealed copy (its size unchanged) is found once the node is back, repaired
from an intact replica, counted ``repaired`` in the node's ``/metrics``, logged with the
segment and the byte position, and every copy of every sealed segment is byte-identical again
(``logbroker cluster verify``). And with the scrub off, a read that meets rot in the sealed copy
of the node serving it reads on from a replica, and the damage is repaired at once."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import BrokerCluster, Node, read_all, running_cluster
from tests.etcd import EtcdCluster, etcd_cluster
from tests.integration.test_cluster_verify import (
    TOPIC,
    copy_file,
    loaded,
    produce_load,
    sealed_segments,
    verified_clean,
    wait_for,
)
from tests.integration.test_replication_faults import segments_in_etcd
from tests.integration.twistd import scrape

pytestmark = pytest.mark.integration

__all__ = ["etcd_cluster"]

SETTINGS = {
    "SVC_LOG_REPLICATION_FACTOR": "3",
    "SVC_SEGMENT_MAX_BYTES": "16384",
    "SVC_SCRUB_ENABLED": "true",
    "SVC_SCRUB_INTERVAL_MS": "300",
    "SVC_SCRUB_SEGMENTS_PER_TICK": "20",
}


@pytest.fixture
def cluster(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[BrokerCluster]:
    yield from running_cluster(tmp_path, etcd_cluster, settings=SETTINGS)


def repair_lines(node: Node) -> list[str]:
    """What a node logged of its scrub and repairs (for a failure's message)."""
    return [line for line in node.output if "repair" in line or "Scrub" in line][-20:]


def scrub_results(dashboard_port: int) -> dict[str, float]:
    samples = scrape(dashboard_port)
    return {
        result: samples.get(("svc_storage_scrub_segments_total", (("result", result),)), 0.0)
        for result in ("verified", "repaired", "unrepairable")
    }


def test_a_flipped_byte_in_a_stopped_follower_s_sealed_copy_is_repaired_from_a_replica(
    cluster: BrokerCluster, etcd_cluster: EtcdCluster
) -> None:
    first = cluster.nodes[0]
    loaded(cluster, etcd_cluster)
    damaged = sealed_segments(etcd_cluster, cluster)[0]
    follower = cluster.node(damaged["replicas"][1])
    segment = f"{damaged['range_id']}@{damaged['base_offset']}"
    follower.stop()
    log_file = copy_file(cluster, follower.node_id, damaged, ".log")
    size = log_file.stat().st_size
    flipped = size // 2
    with log_file.open("r+b") as file:
        file.seek(flipped)
        byte = file.read(1)
        file.seek(flipped)
        file.write(bytes([byte[0] ^ 0x01]))
    assert log_file.stat().st_size == size
    follower.output.clear()

    follower.start()

    wait_for(
        lambda: scrub_results(follower.dashboard_port)["repaired"] >= 1,
        60,
        lambda: scrub_results(follower.dashboard_port),
    )
    results = scrub_results(follower.dashboard_port)
    assert results["unrepairable"] == 0, results
    assert results["verified"] >= 1, results
    samples = scrape(follower.dashboard_port)
    assert samples[("svc_scrub_enabled", ())] == 1
    assert samples[("svc_storage_integrity_failures_total", (("reason", "checksum"),))] >= 1
    output = "".join(follower.output)
    repaired = re.search(
        rf"svc\.scrub\.repair: {re.escape(segment)}, damaged at byte (\d+) .*: repaired", output
    )
    assert repaired, output[-4000:]
    # The damage is where the flipped byte's frame or record starts, at most.
    assert int(repaired.group(1)) <= flipped
    assert "every copy complete and identical" in verified_clean(first).stdout
    # The other nodes' scrubs found nothing to repair.
    for node in cluster.nodes:
        if node is not follower:
            others = scrub_results(node.dashboard_port)
            assert others["verified"] >= 1, (node.node_id, others)
            assert others["repaired"] == others["unrepairable"] == 0, (node.node_id, others)
            failures = {
                labels: count
                for (name, labels), count in scrape(node.dashboard_port).items()
                if name == "svc_storage_integrity_failures_total" and count
            }
            assert failures == {}, (node.node_id, failures)


@pytest.fixture
def unscrubbed(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[BrokerCluster]:
    settings = {**SETTINGS, "SVC_SCRUB_ENABLED": "false"}
    yield from running_cluster(tmp_path, etcd_cluster, settings=settings)


def test_a_read_meeting_rot_in_its_primary_s_copy_reads_on_from_a_replica_and_repairs_it(
    unscrubbed: BrokerCluster, etcd_cluster: EtcdCluster
) -> None:
    cluster = unscrubbed
    loaded(cluster, etcd_cluster)
    expected = sorted(read_all(cluster.nodes[0], TOPIC))
    assert len(expected) == 800
    segments = segments_in_etcd(etcd_cluster, cluster)
    primaries = {
        meta["range_id"]: meta["replicas"][0]
        for meta in sorted(segments, key=lambda meta: meta["base_offset"])
    }
    # A sealed segment of a range whose primary (which serves its reads) holds a copy of it.
    damaged = next(
        meta
        for meta in sealed_segments(etcd_cluster, cluster)
        if primaries[meta["range_id"]] in meta["replicas"]
    )
    primary = cluster.node(primaries[damaged["range_id"]])
    # Rot at rest, under the running node: a byte of the first batch, so that a read from the
    # segment's start finds nothing before the damage.
    log_file = copy_file(cluster, primary.node_id, damaged, ".log")
    with log_file.open("r+b") as file:
        file.seek(40)
        byte = file.read(1)
        file.seek(40)
        file.write(bytes([byte[0] ^ 0x01]))

    assert sorted(read_all(primary, TOPIC)) == expected

    wait_for(
        lambda: scrub_results(primary.dashboard_port)["repaired"] >= 1,
        30,
        lambda: scrub_results(primary.dashboard_port),
    )
    verified_clean(primary)
    assert sorted(read_all(primary, TOPIC)) == expected


def test_sealed_copies_deleted_or_cut_short_under_a_running_follower_are_fetched_again(
    cluster: BrokerCluster, etcd_cluster: EtcdCluster
) -> None:
    first = cluster.nodes[0]
    loaded(cluster, etcd_cluster)
    follower = cluster.nodes[1]
    held = [m for m in sealed_segments(etcd_cluster, cluster) if follower.node_id in m["replicas"]]
    deleted, truncated = held[0], held[-1]
    copy_file(cluster, follower.node_id, deleted, ".log").unlink()
    with copy_file(cluster, follower.node_id, truncated, ".log").open("r+b") as file:
        file.truncate(100)

    wait_for(
        lambda: scrub_results(follower.dashboard_port)["repaired"] >= 2,
        60,
        lambda: (scrub_results(follower.dashboard_port), repair_lines(follower)),
    )
    assert scrub_results(follower.dashboard_port)["unrepairable"] == 0
    samples = scrape(follower.dashboard_port)
    assert samples[("svc_storage_integrity_failures_total", (("reason", "size"),))] == 2
    verified_clean(first)


def _rot_index(path: Path) -> None:
    with path.open("r+b") as file:
        file.seek(21)
        byte = file.read(1)
        file.seek(21)
        file.write(bytes([byte[0] ^ 0x40]))


def _tear(path: Path) -> None:
    """A torn write at the tail: the start of a frame whose rest never reached the disk."""
    with path.open("ab") as file:
        file.write(b"\x00\x00\x01\x00" + b"\xab" * 9)


@pytest.mark.parametrize("fault", ["rotted_index", "truncated_copy", "deleted_copy", "torn_tail"])
def test_a_storage_fault_in_a_stopped_follower_ends_with_every_copy_identical(
    fault: str, cluster: BrokerCluster, etcd_cluster: EtcdCluster
) -> None:
    first, follower = cluster.nodes[0], cluster.nodes[1]
    loaded(cluster, etcd_cluster)
    # Faults go into copies this node holds as a follower only (the spec's guarantee 6).
    followed = [
        meta
        for meta in segments_in_etcd(etcd_cluster, cluster)
        if follower.node_id in meta["replicas"][1:]
    ]
    sealed = next(m for m in followed if m["state"] == "sealed" and m["record_count"])
    active = next(m for m in followed if m["state"] == "active")
    follower.stop()
    if fault == "rotted_index":
        _rot_index(copy_file(cluster, follower.node_id, sealed, ".index"))
    elif fault == "truncated_copy":
        with copy_file(cluster, follower.node_id, sealed, ".log").open("r+b") as file:
            file.truncate(file.seek(0, 2) // 2)
    elif fault == "deleted_copy":
        for suffix in (".log", ".index", ".sealed", ".epoch"):
            copy_file(cluster, follower.node_id, sealed, suffix).unlink(missing_ok=True)
    else:
        _tear(copy_file(cluster, follower.node_id, active, ".log"))

    follower.start()
    # More records: the active segments the torn tails were in seal, on every copy.
    produce_load(first, label="after")

    verified_clean(first, seconds=60)
    samples = scrape(follower.dashboard_port)

    def failures(reason: str) -> float:
        return samples.get(("svc_storage_integrity_failures_total", (("reason", reason),)), 0.0)

    if fault == "rotted_index":
        assert failures("index") == 1, samples
    elif fault == "truncated_copy":
        assert failures("size") == 1, samples
        assert scrub_results(follower.dashboard_port)["repaired"] >= 1
    elif fault == "torn_tail":
        # Crash recovery, not damage: dropped, logged, not counted.
        assert failures("incomplete") == 0, samples
        assert "Torn tail in " in "".join(follower.output)
    for node in cluster.nodes:
        assert scrub_results(node.dashboard_port)["unrepairable"] == 0, node.node_id
