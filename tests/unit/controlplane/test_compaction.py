"""The chores holder compacts etcd's history to the revision it read one run before, on the
in-memory etcd double (the store contract suite holds its compaction to real etcd's)."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock

from logbroker.controlplane._kv import RangeResult
from logbroker.controlplane.compaction import (
    AUTO_COMPACTION,
    COMPACT_EVERY_SECONDS,
    HistoryCompaction,
)
from logbroker.controlplane.errors import ControlPlaneAccessError
from logbroker.maintenance.periodic import PeriodicTask
from logbroker.testing import MemoryKeyValueStore
from tests.unit.storage.helpers import result_of

PROBE = b"/logbroker/test/cluster/chores"


class Holder:
    def __init__(self) -> None:
        self.holds = True

    def __call__(self) -> bool:
        return self.holds


def compaction_on(store: Any, holder: Holder | None = None) -> HistoryCompaction:
    return HistoryCompaction(store, PROBE, holder or Holder())


def ran(compaction: HistoryCompaction) -> None:
    """A run that went to the store (this node holds the chores), to its end."""
    running = compaction.run()
    assert running is not None
    result_of(running)


def writes(store: MemoryKeyValueStore, count: int) -> int:
    for n in range(count):
        result_of(store.put(b"/logbroker/test/state/k", str(n).encode()))
    return store.revision


def test_the_chores_holder_compacts_to_the_revision_it_read_one_run_before() -> None:
    clock = Clock()
    store = MemoryKeyValueStore(clock)
    compaction = compaction_on(store)
    task = PeriodicTask("etcd_compaction", COMPACT_EVERY_SECONDS, compaction.run, clock)
    task.start(now=False)
    read_first = writes(store, 5)

    clock.advance(COMPACT_EVERY_SECONDS)  # the first run only reads the revision
    assert store.compact_revision == 0
    read_second = writes(store, 5)
    clock.advance(COMPACT_EVERY_SECONDS)
    assert store.compact_revision == read_first
    writes(store, 5)
    clock.advance(COMPACT_EVERY_SECONDS)
    # The last interval's history stays: a watch from then is served.
    assert store.compact_revision == read_second
    result_of(task.stop())


def test_a_node_without_the_chores_compacts_nothing_and_starts_over_once_it_has_them() -> None:
    store = MemoryKeyValueStore(Clock())
    holder = Holder()
    compaction = compaction_on(store, holder)
    ran(compaction)
    writes(store, 3)

    holder.holds = False
    assert compaction.run() is None
    writes(store, 3)
    holder.holds = True
    read_again = store.revision
    ran(compaction)
    assert store.compact_revision == 0, "the revision read before the chores moved is forgotten"
    writes(store, 3)
    ran(compaction)
    assert store.compact_revision == read_again


def test_history_compacted_already_by_another_node_is_no_failure(logged: list[Any]) -> None:
    store = MemoryKeyValueStore(Clock())
    compaction = compaction_on(store)
    writes(store, 3)
    ran(compaction)
    result_of(store.compact(writes(store, 3)))  # the chores' last holder, a moment ago

    ran(compaction)
    assert not [event for event in logged if event.get("log_level").name == "warn"]


class RefusingStore:
    """An etcd that gives compaction to its root user alone while its auth is on."""

    def __init__(self) -> None:
        self.revision = 10
        self.compactions = 0

    def range_prefix(self, prefix: bytes) -> Deferred[RangeResult]:
        self.revision += 1
        return succeed(RangeResult((), self.revision))

    def compact(self, revision: int) -> Deferred[None]:
        self.compactions += 1
        return fail(ControlPlaneAccessError("etcd member e1 refused /v3/kv/compaction"))


def test_a_refused_compaction_says_once_how_to_have_etcd_compact_itself(
    logged: list[Any],
) -> None:
    store = RefusingStore()
    compaction = compaction_on(store)
    ran(compaction)
    ran(compaction)
    for _ in range(3):
        assert compaction.run() is None

    assert compaction.refused
    assert store.compactions == 1, "not asked again"
    warnings = [event for event in logged if event.get("log_level").name == "warn"]
    assert len(warnings) == 1
    assert warnings[0]["flags"] == AUTO_COMPACTION
    assert "root user alone" in warnings[0]["log_format"]
