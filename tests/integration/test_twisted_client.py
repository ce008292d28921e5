"""The Twisted client on the real reactor (pytest-twisted) against the real ``twistd
logbroker``: produce, fetch, subscribe with automatic acks, a reconnect across a restart, and a
produce retried across one."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.task import deferLater

from logbroker.client import BrokerRefused, ConnectionClosed, ReconnectingClient, connect
from logbroker.records import Record
from tests.integration.twistd import running_broker

pytestmark = pytest.mark.integration

TIMEOUT = 30


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest_twisted.ensureDeferred
async def test_produce_fetch_and_subscribe(tmp_path: Path) -> None:
    with running_broker(tmp_path) as broker:
        with pytest.raises(BrokerRefused, match="invalid_credentials"):
            await connect(reactor, "127.0.0.1", broker.port, "app", "wrong")
        client = await connect(reactor, "127.0.0.1", broker.port, "app", "app123")
        await client.create_topic("events")
        sent = [Record(f"{i}".encode(), key=b"k", timestamp_ms=i) for i in range(25)]
        # Pipelined: every produce is in flight before the first answer.
        counts = [client.produce("events", sent[i : i + 5]) for i in range(0, 25, 5)]
        assert [await count for count in counts] == [5] * 5

        fetched = await client.fetch("events", max_records=1000)
        assert list(fetched.records) == sent

        pushed: list[Record] = []
        all_pushed: Deferred[None] = Deferred()

        def on_records(records: tuple[Record, ...], cursor: str | None) -> None:
            pushed.extend(records)
            if len(pushed) == len(sent):
                all_pushed.callback(None)

        # A window of 4: only the automatic acks let all 25 through.
        subscription = client.subscribe("events", "readers", "r1", 4, 3, on_records)
        await all_pushed.addTimeout(TIMEOUT, reactor)
        assert pushed == sent
        assert not subscription.done.called

        # The last ack committed the group's position (asynchronously: poll for it).
        for _ in range(100):
            if not (await client.fetch("events", group="readers")).records:
                break
            await deferLater(reactor, 0.05)
        else:
            pytest.fail("the group's position was never committed")

        ended: list[Any] = []
        subscription.done.addErrback(ended.append)
        await client.close()
        assert ended[0].check(ConnectionClosed)


@pytest_twisted.ensureDeferred
async def test_the_reconnecting_client_comes_back_after_a_restart(tmp_path: Path) -> None:
    port = free_port()
    settings = {"SVC_TCP_PORT": str(port), "SVC_BIND_HOST": "127.0.0.1"}
    readied: list[object] = []
    service = ReconnectingClient(
        HostnameEndpoint(reactor, "127.0.0.1", port),
        "app",
        "app123",
        clock=reactor,
        retry_policy=lambda attempt: 0.1,
        on_ready=readied.append,
    )
    try:
        with running_broker(tmp_path, settings=settings) as broker:
            service.startService()
            first = await service.when_ready().addTimeout(TIMEOUT, reactor)
            await first.create_topic("kept")
            await first.produce("kept", [Record(b"before the restart")])
            broker.stop()
        with running_broker(tmp_path, settings=settings):
            # The first connection is gone; the service connects and logs in again.
            with pytest.raises(ConnectionClosed):
                await first.list_topics()
            second = await service.when_ready().addTimeout(TIMEOUT, reactor)
            while second is first:
                await deferLater(reactor, 0.05)
                second = await service.when_ready().addTimeout(TIMEOUT, reactor)
            fetched = await second.fetch("kept")
            assert [r.value for r in fetched.records] == [b"before the restart"]
            assert readied == [first, second]
    finally:
        await service.stopService()


@pytest_twisted.ensureDeferred
async def test_a_produce_made_while_the_broker_restarts_is_stored_once_it_is_back(
    tmp_path: Path,
) -> None:
    port = free_port()
    settings = {"SVC_TCP_PORT": str(port), "SVC_BIND_HOST": "127.0.0.1"}
    service = ReconnectingClient(
        HostnameEndpoint(reactor, "127.0.0.1", port),
        "app",
        "app123",
        clock=reactor,
        retry_policy=lambda attempt: 0.1,
    )
    try:
        with running_broker(tmp_path, settings=settings) as broker:
            service.startService()
            first = await service.when_ready().addTimeout(TIMEOUT, reactor)
            await first.create_topic("retried")
            await service.produce("retried", [Record(b"first")], give_up_after=TIMEOUT)
            broker.stop()
        # Made while the broker is down: its connection is gone, then none comes for a while.
        producing = service.produce("retried", [Record(b"second")], give_up_after=TIMEOUT)
        await deferLater(reactor, 0.5)
        assert not producing.called
        with running_broker(tmp_path, settings=settings):
            assert await producing == 1
            client = await service.when_ready()
            fetched = await client.fetch("retried")
            # Once each (keyless records of two produces, in whichever ranges their stamps say).
            assert sorted(r.value for r in fetched.records) == [b"first", b"second"]
    finally:
        await service.stopService()
