"""The etcd control plane on a real three-member etcd: nodes racing through real transactions,
a member killed under them, the whole cluster down and back, and the chores holder's
compaction of etcd's history (history older than its run before is gone, as for a node's watch
cut off longer than an interval; the last interval's stays)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.task import deferLater
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure

from logbroker.controlplane import (
    AlreadyExistsError,
    CompactedError,
    ControlPlaneError,
    ControlPlaneUnavailableError,
    EtcdControlPlane,
    EtcdGatewayStore,
    InvalidChangeError,
    UserExistsError,
)
from logbroker.controlplane.compaction import HistoryCompaction
from tests.etcd import EtcdCluster, etcd_cluster  # noqa: F401 (a fixture)
from tests.unit.controlplane.helpers import active, make_topic, make_user

pytestmark = pytest.mark.integration


@attrs.define
class Nodes:
    """Control planes of one cluster prefix, each with a store (connections) of its own."""

    cluster: EtcdCluster
    prefix: str
    stores: list[EtcdGatewayStore] = attrs.Factory(list)
    nodes: list[EtcdControlPlane] = attrs.Factory(list)

    async def node(self, timeout: float = 2.0) -> EtcdControlPlane:
        store = EtcdGatewayStore(self.cluster.endpoints, reactor=reactor, timeout=timeout)
        control = EtcdControlPlane(store, prefix=self.prefix, clock=reactor)
        self.stores.append(store)
        self.nodes.append(control)
        await control.start()
        return control


@pytest_twisted.async_yield_fixture
async def nodes(etcd_cluster: EtcdCluster) -> AsyncIterator[Nodes]:  # noqa: F811
    made = Nodes(etcd_cluster, f"/logbroker/it-{uuid.uuid4().hex}/")
    yield made
    for member in etcd_cluster.members:
        if member.process is None:
            etcd_cluster.restart(member, wait=False)
    for member in etcd_cluster.members:
        etcd_cluster.wait_healthy(member)
    for node in made.nodes:
        await node.close()
    await made.stores[0].delete_prefix(made.prefix.encode())
    for store in made.stores:
        await store.close()


async def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await deferLater(reactor, 0.02)  # type: ignore[arg-type]


async def outcomes(*changes: Deferred[Any]) -> list[Any]:
    """Each change's result, or its error."""
    settled = await DeferredList(list(changes), consumeErrors=True)
    return [value.value if isinstance(value, Failure) else value for _, value in settled]


@pytest_twisted.ensureDeferred
async def test_a_change_on_one_node_is_seen_on_another(nodes: Nodes) -> None:
    a, b = await nodes.node(), await nodes.node()
    topic, ranges = make_topic("orders", ranges=2)

    await a.create_topic(topic, ranges)

    # Read your writes on A; B once its watch brings the change.
    assert a.topics() == [topic]
    await eventually(lambda: list(b.ranges("orders")) == ranges)
    assert b.topics() == [topic]


@pytest_twisted.ensureDeferred
async def test_changes_log_nothing_of_the_connections_they_open(nodes: Nodes) -> None:
    # Each write opens a connection of its own; Twisted would log each one's factory starting
    # and stopping, two lines per change, thousands a minute on a busy cluster.
    a = await nodes.node()
    logged: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(logged.append)
    try:
        for index in range(5):
            await a.create_user(make_user(f"user-{index}"))
    finally:
        globalLogPublisher.removeObserver(logged.append)

    factories = [event for event in logged if "factory" in str(event.get("log_format", ""))]
    assert factories == []
    assert len(a.users()) == 5


@pytest_twisted.ensureDeferred
async def test_of_nodes_racing_for_one_name_exactly_one_wins(nodes: Nodes) -> None:
    a, b, c = await nodes.node(), await nodes.node(), await nodes.node()
    topic, ranges = make_topic("orders", ranges=2)

    created = await outcomes(
        a.create_topic(topic, ranges),
        b.create_topic(attrs.evolve(topic, created_ms=1), ranges),
        c.create_topic(attrs.evolve(topic, created_ms=2), ranges),
    )
    users = await outcomes(
        a.create_user(make_user("alice", "a")),
        b.create_user(make_user("alice", "b")),
        c.create_user(make_user("alice", "c")),
    )

    assert created.count(None) == 1, created
    assert all(isinstance(e, AlreadyExistsError) for e in created if e is not None), created
    assert users.count(None) == 1, users
    assert all(isinstance(e, UserExistsError) for e in users if e is not None), users
    winner = created.index(None)
    await eventually(lambda: all(n.topic("orders") is not None for n in (a, b, c)))
    assert {n.topic("orders") for n in (a, b, c)} == {[a, b, c][winner].topic("orders")}
    assert a.topic("orders") == attrs.evolve(topic, created_ms=[topic.created_ms, 1, 2][winner])


@pytest_twisted.ensureDeferred
async def test_of_nodes_bumping_one_segment_s_epoch_exactly_one_wins(nodes: Nodes) -> None:
    a, b = await nodes.node(), await nodes.node()
    topic, ranges = make_topic("orders")
    await a.create_topic(topic, ranges)
    read = active("orders.0", 0, epoch=1)
    await a.put_segment(read)
    await eventually(lambda: b.segments("orders.0") == [read])
    mine = attrs.evolve(active("orders.0", 0, epoch=2), replicas=("node-2",))
    theirs = attrs.evolve(active("orders.0", 0, epoch=2), replicas=("node-3",))

    # Each claims from the record it read: a compare-and-swap on etcd's revision of the key.
    bumped = await outcomes(
        a.put_segment(mine, expected=read), b.put_segment(theirs, expected=read)
    )

    assert bumped.count(None) == 1, bumped
    [lost] = [e for e in bumped if e is not None]
    assert isinstance(lost, InvalidChangeError)
    winner = mine if bumped[0] is None else theirs
    await eventually(lambda: a.segments("orders.0") == b.segments("orders.0") == [winner])


@pytest_twisted.ensureDeferred
async def test_a_killed_member_does_not_stop_changes(nodes: Nodes) -> None:
    a, b = await nodes.node(), await nodes.node()
    await a.create_user(make_user("before"))
    # The member each store is using first, and which holds their watches.
    nodes.cluster.kill(nodes.cluster.members[0])

    started = time.monotonic()
    for i in range(5):
        await a.create_user(make_user(f"during-{i}"))
    took = time.monotonic() - started

    assert [u.name for u in a.users()] == ["before"] + [f"during-{i}" for i in range(5)]
    await eventually(lambda: b.users() == a.users())
    assert took < 10, took


@pytest_twisted.ensureDeferred
async def test_a_killed_leader_does_not_stop_changes(nodes: Nodes) -> None:
    a, b = await nodes.node(), await nodes.node()
    await a.create_user(make_user("before"))
    nodes.cluster.kill(nodes.cluster.leader())

    # A change sent to a follower just then is dropped by raft: its request times out, and
    # it is sent again to another member (its answer was lost, so it is resolved). None fails.
    started = time.monotonic()
    for i in range(5):
        await a.create_user(make_user(f"during-{i}"))
    took = time.monotonic() - started

    assert [u.name for u in a.users()] == ["before"] + [f"during-{i}" for i in range(5)]
    await eventually(lambda: b.users() == a.users())
    assert took < 10, took


@pytest_twisted.ensureDeferred
async def test_the_whole_cluster_down_fails_changes_then_they_recover(nodes: Nodes) -> None:
    a = await nodes.node()
    await a.create_user(make_user("before"))
    for member in nodes.cluster.members:
        nodes.cluster.kill(member)

    error = await outcomes(a.create_user(make_user("during")))
    assert isinstance(error[0], ControlPlaneUnavailableError), error
    assert error[0].reason == "unreachable"
    assert isinstance(error[0], ControlPlaneError)

    for member in nodes.cluster.members:
        nodes.cluster.restart(member, wait=False)
    for member in nodes.cluster.members:
        nodes.cluster.wait_healthy(member)
    await a.create_user(make_user("after"))
    assert [u.name for u in a.users()] == ["after", "before"]


class Watched:
    """A watch's values, and why it ended."""

    def __init__(self) -> None:
        self.values: list[bytes] = []
        self.lost: list[Exception] = []

    def on_events(self, events: Any) -> None:
        self.values.extend(event.kv.value for event in events)

    def on_lost(self, reason: Exception) -> None:
        self.lost.append(reason)


async def ran(compaction: HistoryCompaction) -> None:
    running = compaction.run()
    assert running is not None, "this node holds the chores: the run goes to etcd"
    await running


@pytest_twisted.ensureDeferred
async def test_the_holder_compacts_etcd_to_the_revision_of_its_run_before(
    etcd_cluster: EtcdCluster,  # noqa: F811
) -> None:
    store = EtcdGatewayStore(etcd_cluster.endpoints, reactor=reactor)  # type: ignore[arg-type]
    prefix = f"/logbroker/compaction-test-{uuid.uuid4().hex}/".encode()
    key = prefix + b"state/k"
    compaction = HistoryCompaction(store, prefix + b"cluster/chores", lambda: True)
    watches: list[Any] = []
    try:
        before = await store.put(key, b"before")
        await ran(compaction)  # reads the revision
        kept = await store.put(key, b"kept")
        await ran(compaction)  # compacts to the revision the first run read

        gone, interval, stays = Watched(), Watched(), Watched()
        for start, watched in [(before - 1, gone), (before, interval), (kept, stays)]:
            watches.append(store.watch(prefix, start, watched.on_events, watched.on_lost))
        await eventually(lambda: bool(gone.lost and stays.values) and len(interval.values) == 2)
        assert interval.values == [b"before", b"kept"]
        assert isinstance(gone.lost[0], CompactedError)
        assert gone.values == []
        assert stays.values == [b"kept"]
        assert interval.lost == stays.lost == []
        assert not compaction.refused
    finally:
        for watch in watches:
            watch.cancel()
        await store.delete_prefix(prefix)
        await store.close()
