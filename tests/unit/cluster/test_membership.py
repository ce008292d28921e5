"""Membership on the in-memory etcd double, on one clock: leases, the member list, chores."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from logbroker.cluster.membership import Membership, NodeRecord
from logbroker.testing import MemoryKeyValueStore
from tests.unit.storage.helpers import result_of

PREFIX = b"/logbroker/test/cluster/"


def record(node_id: str, zone: str = "a") -> NodeRecord:
    return NodeRecord(node_id, f"{node_id}.internal", 4040, 4041, 4042, (("zone", zone),), "0.1")


class Cluster:
    def __init__(self) -> None:
        self.clock = Clock()
        self.store = MemoryKeyValueStore(self.clock)
        self.nodes: dict[str, Membership] = {}
        self.events: list[tuple[str, str]] = []

    def join(self, node_id: str, ttl_ms: int = 3000) -> Membership:
        node = Membership(self.store, PREFIX, record(node_id), self.clock, ttl_ms)
        node.on_lease_lost.append(lambda: self.events.append((node_id, "lost")))
        node.on_lease_regained.append(lambda: self.events.append((node_id, "regained")))
        node.startService()
        self.nodes[node_id] = node
        return node

    def advance(self, seconds: float, step: float = 0.25) -> None:
        for _ in range(round(seconds / step)):
            self.clock.advance(step)

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.running:
                result_of(node.stopService())
        self.store.stop()
        assert not self.clock.getDelayedCalls()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    yield made
    made.stop()


def alive(node: Membership) -> dict[str, bool]:
    return {view.record.node_id: view.alive for view in node.nodes()}


def test_a_node_registers_under_a_lease_and_takes_the_chores(cluster: Cluster) -> None:
    node = cluster.join("n1")

    assert node.holds_lease
    assert node.holds_chores
    assert alive(node) == {"n1": True}
    assert node.nodes()[0].record == record("n1")
    assert cluster.store.get(PREFIX + b"alive/n1") is not None
    assert cluster.events == [("n1", "regained")]


def test_a_node_registers_only_once_it_may_and_not_at_its_keepalives_before(
    cluster: Cluster,
) -> None:
    loaded: Deferred[None] = Deferred()
    node = Membership(
        cluster.store, PREFIX, record("n1"), cluster.clock, 3000, registers_after=lambda: loaded
    )
    cluster.nodes["n1"] = node
    node.startService()
    # Its control plane loads meanwhile: alive to no one, and to itself not a member yet.
    cluster.advance(10)
    assert not node.holds_lease
    assert cluster.store.get(PREFIX + b"alive/n1") is None

    loaded.callback(None)
    assert node.holds_lease
    assert alive(node) == {"n1": True}


def test_nodes_see_each_other_and_exactly_one_holds_the_chores(cluster: Cluster) -> None:
    nodes = [cluster.join(f"n{i}") for i in (1, 2, 3)]

    for node in nodes:
        assert alive(node) == {"n1": True, "n2": True, "n3": True}
        assert node.chores_holder == "n1"
    assert [node.holds_chores for node in nodes] == [True, False, False]


def test_keepalives_hold_the_lease_for_as_long_as_etcd_answers(cluster: Cluster) -> None:
    node = cluster.join("n1", ttl_ms=3000)

    cluster.advance(60)

    assert node.holds_lease
    assert cluster.events == [("n1", "regained")]
    age = node.lease_age()
    assert age is not None
    assert age <= 1.0


def test_a_node_whose_keepalives_go_unanswered_for_a_ttl_gives_up_its_lease_at_once(
    cluster: Cluster,
) -> None:
    node = cluster.join("n1", ttl_ms=3000)
    other = cluster.join("n2", ttl_ms=3000)
    cluster.advance(1)
    cluster.store.unavailable = True

    # Renewed last at t=1 at the latest: by t=4 the lease may be gone, so it is given up.
    cluster.advance(3)

    assert not node.holds_lease
    assert not node.holds_chores
    assert ("n1", "lost") in cluster.events

    cluster.store.unavailable = False
    cluster.advance(2)

    assert node.holds_lease
    assert cluster.events.count(("n1", "regained")) == 2
    assert alive(other) == {"n1": True, "n2": True}


def test_a_node_resumed_after_a_stall_holds_no_lease_before_its_timers_run(
    cluster: Cluster,
) -> None:
    """A process frozen past its TTL runs its due calls in any order once resumed: the lease
    is read from the clock, so none of them acts as if it were still held."""
    node = cluster.join("n1", ttl_ms=3000)
    cluster.advance(1)
    assert node.holds_lease
    frozen_until = cluster.clock.seconds() + 4
    # The clock moves past the TTL without running anything (the process was stopped).
    cluster.clock.rightNow = frozen_until
    assert not node.holds_lease
    assert not node.holds_chores


def test_a_dead_node_shows_as_dead_and_another_takes_the_chores(cluster: Cluster) -> None:
    first = cluster.join("n1", ttl_ms=3000)
    second = cluster.join("n2", ttl_ms=3000)
    # n1 stops renewing (stalled): its lease runs out in etcd.
    first._keepalive.stopService()
    first._cancel_expiry()

    cluster.advance(4)

    assert alive(second) == {"n1": False, "n2": True}
    assert second.holds_chores
    first._lease = 0  # it would have noticed itself; keep the teardown from revoking
    result_of(first.stopService())


def test_a_node_that_stops_leaves_at_once(cluster: Cluster) -> None:
    first = cluster.join("n1")
    second = cluster.join("n2")

    result_of(first.stopService())

    assert alive(second) == {"n1": False, "n2": True}
    assert second.holds_chores


def _killed(node: Membership) -> None:
    """``node``'s process is gone: nothing renews its lease, nothing answers for it."""
    node._keepalive.stopService()
    node._cancel_expiry()
    node._lease = 0  # keeps the teardown from revoking what is already gone


def test_a_node_found_gone_has_its_lease_revoked_and_is_dead_to_all_at_once(
    cluster: Cluster,
) -> None:
    first, second, third = (cluster.join(f"n{i}", ttl_ms=5000) for i in (1, 2, 3))
    cluster.advance(1)
    _killed(third)

    # n1's link to n3 was refused just now: n3 is dead to every node long before its TTL.
    first.report_gone("n3", began=cluster.clock.seconds())

    assert alive(first) == {"n1": True, "n2": True, "n3": False}
    assert alive(second) == {"n1": True, "n2": True, "n3": False}
    # n2 finds it gone too: its lease is no longer there to revoke, which changes nothing.
    second.report_gone("n3", began=cluster.clock.seconds())
    assert alive(second)["n3"] is False
    assert first.holds_lease
    assert second.holds_lease


def test_a_refusal_from_before_a_node_registered_anew_leaves_its_new_lease_alone(
    cluster: Cluster,
) -> None:
    first = cluster.join("n1", ttl_ms=5000)
    cluster.advance(1)
    refused_at = cluster.clock.seconds()
    cluster.advance(0.25)
    # n2 registered after the attempt that was refused began (it listens before registering).
    second = cluster.join("n2", ttl_ms=5000)

    first.report_gone("n2", began=refused_at)

    assert alive(first) == {"n1": True, "n2": True}
    assert second.holds_lease
    assert cluster.events.count(("n2", "lost")) == 0


def test_a_node_reports_nothing_gone_without_its_own_lease_nor_of_itself(
    cluster: Cluster,
) -> None:
    first = cluster.join("n1", ttl_ms=3000)
    cluster.join("n2", ttl_ms=3000)
    cluster.advance(1)

    first.report_gone("n1", began=cluster.clock.seconds())
    assert first.holds_lease

    # n1 resumes after a stall past its TTL, before any of its timers ran: it may have lost
    # its lease, so what it found while stalled is not acted on.
    cluster.clock.rightNow += 4
    assert not first.holds_lease
    first.report_gone("n2", began=cluster.clock.seconds())
    assert cluster.store.get(PREFIX + b"alive/n2") is not None


def test_the_member_list_survives_a_dropped_watch_and_a_compaction(cluster: Cluster) -> None:
    first = cluster.join("n1")
    cluster.store.drop_watches()
    cluster.join("n2")
    cluster.advance(1.5)
    assert alive(first) == {"n1": True, "n2": True}

    cluster.store.drop_watches()
    cluster.join("n3")
    cluster.store.compact(cluster.store.revision)
    # Resuming from the revision after its last finds it compacted: it loads the list again.
    cluster.advance(1.5)

    assert alive(first) == {"n1": True, "n2": True, "n3": True}


def test_a_record_with_fields_a_newer_node_added_still_decodes() -> None:
    newer = json.loads(record("n9").encode())
    newer["rack_power"] = "feed-b"

    assert NodeRecord.decode(json.dumps(newer).encode()) == record("n9")
