"""What ``EtcdControlPlane`` relies on from etcd, checked against the in-memory double and a
real three-member etcd alike: this suite is why the double can be trusted in other tests.

Revisions are compared relative to one another: the real cluster is shared by every test.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.task import Clock, deferLater

from logbroker.controlplane import (
    CompactedError,
    EtcdGatewayStore,
    KeyValueStore,
    LeaseNotFoundError,
    StoreError,
)
from logbroker.controlplane._kv import (
    Compare,
    Delete,
    DeletePrefix,
    EventType,
    Get,
    Put,
    Result,
    Target,
    WatchEvent,
    prefix_end,
)
from logbroker.testing import MemoryKeyValueStore


class Store:
    """A store under test, a prefix of the test's own, and a way to let time pass; ``admin``
    compacts, as etcd's ``root`` (etcd 3.4 lets any user compact, but some versions give
    compaction to ``root`` alone while etcd's auth is on)."""

    def __init__(
        self, kv: Any, prefix: bytes, clock: Clock | None, admin: EtcdGatewayStore | None = None
    ) -> None:
        self.kv: KeyValueStore = kv
        self.prefix = prefix
        self.clock = clock
        self.admin = admin

    def key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    async def sleep(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            from twisted.internet import reactor

            await deferLater(reactor, seconds)  # type: ignore[arg-type]

    async def eventually(self, check: Callable[[], bool], timeout: float = 10.0) -> None:
        """The double is synchronous: ``check`` holds at once. Real etcd gets ``timeout``."""
        if self.clock is not None:
            assert check()
            return
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, "timed out"
            await self.sleep(0.02)

    async def compact(self, revision: int) -> None:
        if isinstance(self.kv, MemoryKeyValueStore):
            await self.kv.compact(revision)
        else:
            assert isinstance(self.kv, EtcdGatewayStore)
            await (self.admin or self.kv).compact(revision)


@pytest_twisted.async_yield_fixture(
    params=[
        "memory",
        pytest.param("etcd", marks=pytest.mark.integration),
        # TLS with a client certificate, as an etcd user whose role reaches /logbroker/ only.
        pytest.param("secured-etcd", marks=pytest.mark.integration),
    ]
)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    prefix = f"/logbroker/store-test-{uuid.uuid4().hex}/".encode()
    if request.param == "memory":
        clock = Clock()
        kv = MemoryKeyValueStore(clock)
        yield Store(kv, prefix, clock)
        kv.stop()
        assert clock.getDelayedCalls() == []
    else:
        from twisted.internet import reactor

        secured = request.param == "secured-etcd"
        cluster = request.getfixturevalue("secured_etcd_cluster" if secured else "etcd_cluster")
        real = cluster.store(reactor, timeout=5)
        admin = cluster.store(reactor, as_root=True) if secured else None
        yield Store(real, prefix, None, admin)
        await real.delete_prefix(prefix)
        await real.close()
        if admin is not None:
            await admin.close()


class Watched:
    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self.lost: list[Exception] = []

    def on_events(self, events: Any) -> None:
        self.events.extend(events)

    def on_lost(self, reason: Exception) -> None:
        self.lost.append(reason)

    def seen(self) -> list[tuple[EventType, bytes, bytes]]:
        return [(e.type, e.kv.key, e.kv.value) for e in self.events]


def test_prefix_end_is_etcd_s_range_end() -> None:
    assert prefix_end(b"/lb/") == b"/lb0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


@pytest_twisted.ensureDeferred
async def test_revisions_count_changes(store: Store) -> None:
    a = store.key("a")
    first = await store.kv.put(a, b"1")
    second = await store.kv.put(a, b"2")
    other = await store.kv.put(store.key("b"), b"x")

    assert second == first + 1
    assert other == second + 1
    found = await store.kv.range_prefix(store.prefix)
    assert found.revision >= other
    assert [(kv.key, kv.value, kv.create_revision, kv.mod_revision) for kv in found.kvs] == [
        (a, b"2", first, second),
        (store.key("b"), b"x", other, other),
    ]


@pytest_twisted.ensureDeferred
async def test_a_missing_key_compares_as_revision_zero(store: Store) -> None:
    missing = store.key("missing")

    for compare, holds in [
        (Compare.absent(missing), True),
        (Compare.unchanged(missing, 0), True),
        (Compare.present(missing), False),
        (Compare(missing, Target.MOD, Result.LESS, 1), True),
        # A value compare on a missing key is false, whatever it asks.
        (Compare(missing, Target.VALUE, Result.EQUAL, b""), False),
        (Compare(missing, Target.VALUE, Result.NOT_EQUAL, b"x"), False),
    ]:
        result = await store.kv.txn([compare], [Get(missing)], [Get(missing)])
        assert result.succeeded is holds, compare
        assert result.gets == (None,)


@pytest_twisted.ensureDeferred
async def test_a_transaction_compares_then_writes_as_one_revision(store: Store) -> None:
    a, b = store.key("a"), store.key("b")
    created = await store.kv.txn([Compare.absent(a)], [Put(a, b"1"), Put(b, b"2")])
    assert created.succeeded

    again = await store.kv.txn([Compare.absent(a)], [Put(a, b"x")], [Get(a), Get(b)])
    assert not again.succeeded
    assert again.revision == created.revision
    assert [kv.mod_revision if kv else None for kv in again.gets] == [created.revision] * 2
    assert [kv.value if kv else None for kv in again.gets] == [b"1", b"2"]

    stale = await store.kv.txn([Compare.unchanged(a, created.revision - 1)], [Delete(a)])
    assert not stale.succeeded
    swapped = await store.kv.txn(
        [Compare.unchanged(a, created.revision), Compare(b, Target.VALUE, Result.EQUAL, b"2")],
        [Put(a, b"3"), Delete(b)],
        [Get(a)],
    )
    assert swapped.succeeded
    assert swapped.revision == created.revision + 1
    assert swapped.gets == ()
    found = await store.kv.range_prefix(store.prefix)
    assert [(kv.key, kv.value, kv.create_revision) for kv in found.kvs] == [
        (a, b"3", created.revision)
    ]


@pytest_twisted.ensureDeferred
async def test_prefix_ranges_and_deletes_stay_inside_the_prefix(store: Store) -> None:
    inside = [store.key("x/1"), store.key("x/2"), store.key("x/\xff")]
    outside = [store.key("x"), store.key("x0"), store.key("y/1")]
    for key in outside + inside:
        await store.kv.put(key, b"v")

    found = await store.kv.range_prefix(store.key("x/"))
    assert [kv.key for kv in found.kvs] == sorted(inside)

    assert await store.kv.delete_prefix(store.key("x/")) == 3
    assert await store.kv.delete(store.key("x")) == 1
    assert await store.kv.delete(store.key("x")) == 0
    left = await store.kv.range_prefix(store.prefix)
    assert [kv.key for kv in left.kvs] == sorted(outside[1:])

    deleted = await store.kv.txn([], [DeletePrefix(store.prefix)])
    assert deleted.succeeded
    assert (await store.kv.range_prefix(store.prefix)).kvs == ()


@pytest_twisted.ensureDeferred
async def test_a_watch_reports_changes_from_its_start_revision(store: Store) -> None:
    a, b = store.key("w/a"), store.key("w/b")
    first = await store.kv.put(a, b"1")
    await store.kv.put(store.key("elsewhere"), b"-")
    await store.kv.put(b, b"2")

    watched = Watched()
    watch = store.kv.watch(store.key("w/"), first, watched.on_events, watched.on_lost)
    # Changes made before the watch was created come first, in revision order.
    await store.eventually(lambda: len(watched.events) == 2)
    await store.kv.put(a, b"3")
    await store.kv.delete(b)
    await store.eventually(lambda: len(watched.events) == 4)

    assert watched.seen() == [
        (EventType.PUT, a, b"1"),
        (EventType.PUT, b, b"2"),
        (EventType.PUT, a, b"3"),
        (EventType.DELETE, b, b""),
    ]
    revisions = [event.kv.mod_revision for event in watched.events]
    assert revisions == sorted(revisions)
    assert revisions[0] == first
    assert watched.lost == []

    watch.cancel()
    await store.kv.put(a, b"4")
    await store.sleep(0.2)
    assert len(watched.events) == 4
    assert watched.lost == []


@pytest_twisted.ensureDeferred
async def test_compacting_to_a_compacted_revision_again_fails(store: Store) -> None:
    last = await store.kv.put(store.key("c/a"), b"1")
    await store.compact(last)

    with pytest.raises(StoreError, match="compacted"):
        await store.compact(last)


@pytest_twisted.ensureDeferred
async def test_a_watch_from_a_compacted_revision_fails(store: Store) -> None:
    a = store.key("c/a")
    first = await store.kv.put(a, b"1")
    await store.kv.put(a, b"2")
    last = await store.kv.put(a, b"3")
    await store.compact(last)

    compacted = Watched()
    store.kv.watch(store.key("c/"), first, compacted.on_events, compacted.on_lost)
    await store.eventually(lambda: bool(compacted.lost))
    assert compacted.events == []
    [error] = compacted.lost
    assert isinstance(error, CompactedError)
    assert error.compact_revision >= last

    # From after the compaction, it works.
    fresh = Watched()
    watch = store.kv.watch(store.key("c/"), last + 1, fresh.on_events, fresh.on_lost)
    await store.kv.put(a, b"4")
    await store.eventually(lambda: len(fresh.events) == 1)
    assert fresh.seen() == [(EventType.PUT, a, b"4")]
    watch.cancel()


@pytest_twisted.ensureDeferred
async def test_an_expired_lease_deletes_its_keys_and_watchers_hear_of_it(store: Store) -> None:
    lease = await store.kv.grant(1)
    kept = await store.kv.grant(1)
    assert lease != kept
    gone, stays = store.key("l/gone"), store.key("l/stays")
    await store.kv.put(gone, b"up", lease)
    await store.kv.put(stays, b"up", kept)
    found = await store.kv.range_prefix(store.key("l/"))
    assert [(kv.key, kv.lease) for kv in found.kvs] == [(gone, lease), (stays, kept)]
    watched = Watched()
    watch = store.kv.watch(store.key("l/"), found.revision + 1, watched.on_events, watched.on_lost)

    assert await store.kv.keepalive(kept) == 1

    # Keep one alive while the other expires.
    async def expired() -> bool:
        for _ in range(40):
            await store.sleep(0.25)
            assert await store.kv.keepalive(kept) == 1
            if watched.events:
                return True
        return False

    assert await expired()
    assert watched.seen() == [(EventType.DELETE, gone, b"")]
    assert [kv.key for kv in (await store.kv.range_prefix(store.key("l/"))).kvs] == [stays]
    assert await store.kv.keepalive(lease) == 0
    with pytest.raises(LeaseNotFoundError):
        await store.kv.put(store.key("l/late"), b"x", lease)

    await store.kv.revoke(kept)
    await store.eventually(lambda: len(watched.events) == 2)
    assert watched.seen()[1] == (EventType.DELETE, stays, b"")
    with pytest.raises(LeaseNotFoundError):
        await store.kv.revoke(kept)
    watch.cancel()


@pytest_twisted.ensureDeferred
async def test_a_transaction_takes_at_most_128_compares_or_operations(store: Store) -> None:
    keys = [store.key(f"many/{i:03d}") for i in range(129)]

    fits = await store.kv.txn([Compare.absent(k) for k in keys[:128]], [Put(keys[0], b"v")])
    assert fits.succeeded
    with pytest.raises(StoreError, match="too many operations"):
        await store.kv.txn([Compare.absent(k) for k in keys], [Put(keys[0], b"v")])
    with pytest.raises(StoreError, match="too many operations"):
        await store.kv.txn([], [Put(k, b"v") for k in keys])
