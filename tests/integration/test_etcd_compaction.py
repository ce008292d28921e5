"""The chores holder's compaction of etcd's history, on the real three-member etcd: history
older than the run before is gone (a watch from it fails, as a node's watch cut off longer
than an interval does), and the last interval's stays. And etcd with its auth on lets the
brokers' confined user compact (``tests/integration/test_etcd_security.py``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.task import deferLater

from logbroker.controlplane import CompactedError, EtcdGatewayStore
from logbroker.controlplane.compaction import HistoryCompaction
from tests.etcd import EtcdCluster, etcd_cluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration


class Watched:
    def __init__(self) -> None:
        self.values: list[bytes] = []
        self.lost: list[Exception] = []

    def on_events(self, events: Any) -> None:
        self.values.extend(event.kv.value for event in events)

    def on_lost(self, reason: Exception) -> None:
        self.lost.append(reason)


async def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await deferLater(reactor, 0.02)  # type: ignore[arg-type]


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
