"""The etcd prefix follower on a real three-member etcd: a watch whose member is killed resumes
on another without a gap, and one that falls behind a compaction meanwhile loads the whole
prefix again."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import attrs
import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.task import deferLater

from logbroker.controlplane import EtcdGatewayStore
from logbroker.controlplane._kv import EventType, RangeResult, WatchEvent
from logbroker.controlplane.follower import PrefixFollower
from tests.etcd import EtcdCluster, Member, etcd_cluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration


class Reader:
    def __init__(self) -> None:
        self.state: dict[bytes, bytes] = {}
        self.loads = 0
        self.event_revisions: list[int] = []

    def on_load(self, result: RangeResult) -> None:
        self.loads += 1
        self.state = {kv.key: kv.value for kv in result.kvs}

    def on_events(self, events: Sequence[WatchEvent]) -> None:
        for event in events:
            if event.type is EventType.PUT:
                self.state[event.kv.key] = event.kv.value
            else:
                self.state.pop(event.kv.key, None)
            self.event_revisions.append(event.kv.mod_revision)


@attrs.define
class Setup:
    cluster: EtcdCluster
    prefix: bytes
    #: The member the follower's store tries first (so the one its watch is on): not the
    #: leader, so that killing it starts no election and writes go on at once.
    watched: Member
    #: The follower's store, and one for writing that never uses ``watched``.
    following: EtcdGatewayStore
    writer: EtcdGatewayStore
    reader: Reader = attrs.Factory(Reader)

    def follower(self, **delays: float) -> PrefixFollower:
        return PrefixFollower(
            self.following,
            self.prefix,
            reactor,  # type: ignore[arg-type]
            name="Test",
            on_load=self.reader.on_load,
            on_events=self.reader.on_events,
            **delays,
        )

    def key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    async def in_store(self) -> dict[bytes, bytes]:
        return {kv.key: kv.value for kv in (await self.writer.range_prefix(self.prefix)).kvs}


@pytest_twisted.async_yield_fixture
async def setup(etcd_cluster: EtcdCluster) -> AsyncIterator[Setup]:  # noqa: F811
    leader = etcd_cluster.leader()
    watched = next(member for member in etcd_cluster.members if member is not leader)
    others = [member.endpoint for member in etcd_cluster.members if member is not watched]
    made = Setup(
        etcd_cluster,
        f"/follower-test-{uuid.uuid4().hex}/".encode(),
        watched,
        EtcdGatewayStore([watched.endpoint, *others], reactor=reactor, timeout=2),  # type: ignore[arg-type]
        EtcdGatewayStore(others, reactor=reactor, timeout=5),  # type: ignore[arg-type]
    )
    yield made
    if watched.process is None:
        etcd_cluster.restart(watched)
    await made.writer.delete_prefix(made.prefix)
    await made.following.close()
    await made.writer.close()


async def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await deferLater(reactor, 0.02)  # type: ignore[arg-type]


@pytest_twisted.ensureDeferred
async def test_a_watch_whose_member_is_killed_resumes_on_another_without_a_gap(
    setup: Setup,
) -> None:
    await setup.writer.put(setup.key("a"), b"1")
    follower = setup.follower()
    await follower.start()
    try:
        seen = await setup.writer.put(setup.key("b"), b"2")
        await eventually(lambda: setup.reader.event_revisions == [seen])

        setup.cluster.kill(setup.watched)
        changes = [
            await setup.writer.put(setup.key("c"), b"3"),
            await setup.writer.delete(setup.key("a")),
            await setup.writer.put(setup.key("b"), b"4"),
        ]
        expected = await setup.in_store()
        await eventually(lambda: setup.reader.state == expected)

        assert expected == {setup.key("b"): b"4", setup.key("c"): b"3"}
        # Every change once, in order: resumed from the revision after the last one seen.
        revisions = setup.reader.event_revisions
        assert revisions == sorted(set(revisions))
        assert revisions[0] == seen
        assert changes[0] in revisions
        assert setup.reader.loads == 1
        assert follower.watching
    finally:
        follower.stop()


@pytest_twisted.ensureDeferred
async def test_a_watch_that_falls_behind_a_compaction_loads_the_whole_prefix_again(
    setup: Setup,
) -> None:
    await setup.writer.put(setup.key("a"), b"1")
    await setup.writer.put(setup.key("b"), b"2")
    # Long pauses: the compaction is done before the watch is resumed.
    follower = setup.follower(first_delay=3.0, max_delay=3.0)
    await follower.start()
    try:
        # The watch is up once it brings a change.
        seen = await setup.writer.put(setup.key("b"), b"3")
        await eventually(lambda: setup.reader.event_revisions == [seen])
        setup.cluster.kill(setup.watched)
        await setup.writer.delete(setup.key("a"))
        last = await setup.writer.put(setup.key("c"), b"3")
        await setup.writer.compact(last)
        expected = await setup.in_store()

        await eventually(lambda: setup.reader.loads == 2)

        assert setup.reader.state == expected == {setup.key("b"): b"3", setup.key("c"): b"3"}
        assert follower.revision >= last
        await eventually(lambda: follower.watching)
        await setup.writer.put(setup.key("d"), b"4")
        await eventually(lambda: setup.key("d") in setup.reader.state)
    finally:
        follower.stop()


@pytest_twisted.ensureDeferred
async def test_a_watch_whose_member_stops_answering_resumes_on_another_once_it_fails_a_request(
    setup: Setup,
) -> None:
    """A member that stops answering (SIGSTOP; or cut off, or its gateway hung) keeps the
    watch's stream open and sends nothing: no error ever ends it. Once the store finds the
    member failing another request (a node's lease keepalive, every second), the watch is
    ended and resumed on a member that answers, without a gap."""
    await setup.writer.put(setup.key("a"), b"1")
    follower = setup.follower()
    await follower.start()
    assert setup.watched.process is not None
    paused = setup.watched.process.pid
    try:
        seen = await setup.writer.put(setup.key("b"), b"2")
        await eventually(lambda: setup.reader.event_revisions == [seen])

        os.kill(paused, signal.SIGSTOP)
        missed = await setup.writer.put(setup.key("c"), b"3")
        await deferLater(reactor, 1.0)  # type: ignore[arg-type]
        assert missed not in setup.reader.event_revisions, "the stopped member sends nothing"
        # Any request of the follower's store: it tries the stopped member first, times out,
        # and is answered by another.
        await setup.following.range_prefix(setup.key("unrelated"))

        await eventually(lambda: setup.key("c") in setup.reader.state)
        revisions = setup.reader.event_revisions
        assert revisions == [seen, missed]
        assert setup.reader.loads == 1
        assert follower.watching
    finally:
        os.kill(paused, signal.SIGCONT)
        follower.stop()
