"""``EtcdGatewayStore`` reports each request to its ``on_request`` hook: which op, how it ended
and how long it took on the reactor's clock. First with the HTTP exchange stubbed and the clock
in the test's hands, then against the real three-member etcd."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.defer import Deferred, TimeoutError
from twisted.internet.testing import MemoryReactorClock

from logbroker.controlplane import (
    ControlPlaneUnavailableError,
    EtcdGatewayStore,
    LeaseNotFoundError,
    OutcomeUnknownError,
    StoreError,
)
from logbroker.controlplane._etcd_gateway import _NotSent
from logbroker.controlplane._kv import Compare, Put
from tests.etcd import EtcdCluster, etcd_cluster, free_ports
from tests.unit.storage.helpers import failure_of, result_of

__all__ = ["etcd_cluster"]

Report = tuple[str, str, float]


class Reports:
    def __init__(self) -> None:
        self.seen: list[Report] = []

    def __call__(self, op: str, result: str, seconds: float) -> None:
        self.seen.append((op, result, seconds))


class StubbedStore:
    """A store on a ``MemoryReactorClock`` whose every HTTP exchange the test answers."""

    def __init__(self) -> None:
        self.reactor = MemoryReactorClock()
        self.reports = Reports()
        self.store = EtcdGatewayStore(
            ["http://a:1", "http://b:2"], reactor=self.reactor, on_request=self.reports
        )
        self.posted: list[tuple[str, str, Deferred[Any]]] = []
        self.store._post_once = self._post_once  # type: ignore[method-assign]

    async def _post_once(
        self, endpoint: str, path: str, body: Any, *, stream: bool, write: bool, token: str = ""
    ) -> Any:
        answer: Deferred[Any] = Deferred()
        self.posted.append((endpoint, path, answer))
        return await answer

    def answer(self, payload: Any, after: float = 0.0) -> None:
        self.reactor.advance(after)
        self.posted[-1][2].callback(payload)

    def fail(self, error: Exception, after: float = 0.0) -> None:
        self.reactor.advance(after)
        self.posted[-1][2].errback(error)


@pytest.fixture
def stubbed() -> StubbedStore:
    return StubbedStore()


def test_an_answered_range_is_ok_and_timed_on_the_reactor_s_clock(stubbed: StubbedStore) -> None:
    read = stubbed.store.range_prefix(b"/p/")
    stubbed.answer({"header": {"revision": "7"}, "kvs": []}, after=0.25)

    assert result_of(read).revision == 7
    assert stubbed.reports.seen == [("range", "ok", 0.25)]


def test_each_page_of_a_range_is_a_request(stubbed: StubbedStore) -> None:
    read = stubbed.store.range_prefix(b"/p/")
    page = {"key": "L3AvYQ==", "value": "", "mod_revision": "2"}
    stubbed.answer({"header": {"revision": "7"}, "kvs": [page], "more": True}, after=1)
    stubbed.answer({"header": {"revision": "7"}, "kvs": []}, after=2)

    assert len(result_of(read).kvs) == 1
    assert stubbed.reports.seen == [("range", "ok", 1), ("range", "ok", 2)]


def test_a_transaction_whose_compare_failed_is_ok(stubbed: StubbedStore) -> None:
    txn = stubbed.store.txn([Compare.absent(b"/p/a")], [Put(b"/p/a", b"1")])
    # A failed transaction has no "succeeded" at all.
    stubbed.answer({"header": {"revision": "9"}}, after=0.5)

    assert not result_of(txn).succeeded
    assert stubbed.reports.seen == [("txn", "ok", 0.5)]


def test_a_request_etcd_refuses_is_an_error(stubbed: StubbedStore) -> None:
    txn = stubbed.store.txn([], [Put(b"/p/a", b"1")])
    stubbed.fail(StoreError("etcd member refused /v3/kv/txn: too many operations"), after=0.5)

    failure_of(txn).trap(StoreError)
    revoked = stubbed.store.revoke(5)
    stubbed.fail(LeaseNotFoundError("etcd: lease not found"))
    failure_of(revoked).trap(LeaseNotFoundError)
    # An answer that says no inside a successful HTTP exchange is a refusal too.
    kept = stubbed.store.keepalive(5)
    stubbed.answer({"error": {"grpc_code": 5, "message": "lease not found"}})
    failure_of(kept).trap(StoreError)

    assert stubbed.reports.seen == [
        ("txn", "error", 0.5),
        ("revoke", "error", 0),
        ("keepalive", "error", 0),
    ]


def test_no_member_answering_is_unavailable(stubbed: StubbedStore) -> None:
    granted = stubbed.store.grant(10)
    stubbed.fail(_NotSent("connection refused"), after=1)
    stubbed.fail(_NotSent("connection refused"), after=2)

    failure_of(granted).trap(ControlPlaneUnavailableError)
    # Once for the request, however many members it was tried on.
    assert stubbed.reports.seen == [("grant", "unavailable", 3)]


def test_a_member_that_answers_after_another_failed_is_ok(stubbed: StubbedStore) -> None:
    kept = stubbed.store.keepalive(5)
    stubbed.fail(_NotSent("connection refused"), after=1)
    stubbed.answer({"result": {"TTL": "10"}}, after=1)

    assert result_of(kept) == 10
    assert stubbed.reports.seen == [("keepalive", "ok", 2)]


def test_a_write_without_an_answer_is_unavailable(stubbed: StubbedStore) -> None:
    txn = stubbed.store.txn([], [Put(b"/p/a", b"1")])
    stubbed.fail(TimeoutError(), after=5)

    failure_of(txn).trap(OutcomeUnknownError)
    assert stubbed.reports.seen == [("txn", "unavailable", 5)]


def test_a_request_its_caller_cancelled_is_unavailable(stubbed: StubbedStore) -> None:
    read = stubbed.store.range_prefix(b"/p/")
    stubbed.reactor.advance(3)
    read.cancel()

    failure_of(read)
    assert stubbed.reports.seen == [("range", "unavailable", 3)]


def test_a_member_holding_a_request_is_tried_after_the_others_until_it_answers(
    stubbed: StubbedStore,
) -> None:
    def sent_to() -> list[str]:
        return [endpoint for endpoint, _, _ in stubbed.posted]

    held = stubbed.store.keepalive(5)
    stubbed.reactor.advance(0.4)
    prompt = stubbed.store.keepalive(5)
    # Held for less than SLOW_AFTER (0.5 s): still the member to ask first.
    assert sent_to() == ["http://a:1", "http://a:1"]
    stubbed.answer({"result": {"TTL": "10"}})
    assert result_of(prompt) == 10

    stubbed.reactor.advance(0.1)
    # Now held for 0.5 s: the next request goes to the other member, and is answered.
    moved = stubbed.store.keepalive(5)
    assert sent_to()[2] == "http://b:2"
    stubbed.answer({"result": {"TTL": "10"}})
    assert result_of(moved) == 10

    # The slow member answers at last (it is asked first again: it answered last).
    stubbed.posted[0][2].callback({"result": {"TTL": "10"}})
    assert result_of(held) == 10
    stubbed.store.keepalive(5)
    assert sent_to()[3] == "http://a:1"


def test_when_every_member_holds_a_request_the_least_behind_is_asked_first(
    stubbed: StubbedStore,
) -> None:
    stubbed.store.keepalive(5)  # to a, held
    stubbed.reactor.advance(0.5)
    stubbed.store.keepalive(5)  # to b, a being slow; held too
    stubbed.reactor.advance(0.5)

    stubbed.store.keepalive(5)

    assert [endpoint for endpoint, _, _ in stubbed.posted] == [
        "http://a:1",
        "http://b:2",
        "http://b:2",
    ]


def test_a_watch_is_timed_until_it_is_set_up(stubbed: StubbedStore) -> None:
    lost: list[Exception] = []
    watch = stubbed.store.watch(b"/p/", 1, lambda events: None, lost.append)
    stubbed.fail(_NotSent("connection refused"), after=1)
    stubbed.fail(_NotSent("connection refused"), after=1)

    [error] = lost
    assert isinstance(error, ControlPlaneUnavailableError)
    assert not watch.active
    assert stubbed.reports.seen == [("watch", "unavailable", 2)]


# -- a real etcd ------------------------------------------------------------------------------


@pytest_twisted.async_yield_fixture
async def real(etcd_cluster: EtcdCluster) -> AsyncIterator[tuple[EtcdGatewayStore, Reports]]:
    from twisted.internet import reactor

    reports = Reports()
    store = EtcdGatewayStore(etcd_cluster.endpoints, reactor=reactor, on_request=reports)  # type: ignore[arg-type]
    yield store, reports
    await store.close()


def results(reports: Reports) -> list[tuple[str, str]]:
    assert all(seconds >= 0 for _, _, seconds in reports.seen), reports.seen
    return [(op, result) for op, result, _ in reports.seen]


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_real_etcd_s_answers_are_ok_and_its_refusals_errors(
    real: tuple[EtcdGatewayStore, Reports],
) -> None:
    store, reports = real
    prefix = f"/requests-test-{uuid.uuid4().hex}/".encode()
    key = prefix + b"a"

    await store.range_prefix(prefix)
    assert (await store.txn([Compare.absent(key)], [Put(key, b"1")])).succeeded
    assert not (await store.txn([Compare.absent(key)], [Put(key, b"2")])).succeeded
    lease = await store.grant(30)
    assert await store.keepalive(lease) > 0
    await store.revoke(lease)
    with pytest.raises(LeaseNotFoundError):
        await store.revoke(lease)
    await store.delete_prefix(prefix)

    assert results(reports) == [
        ("range", "ok"),
        ("txn", "ok"),
        ("txn", "ok"),
        ("grant", "ok"),
        ("keepalive", "ok"),
        ("revoke", "ok"),
        ("revoke", "error"),
    ]


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_a_real_watch_is_reported_once_set_up(
    real: tuple[EtcdGatewayStore, Reports],
) -> None:
    store, reports = real
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    watch = store.watch(b"/requests-test-watch/", 1, lambda events: None, lambda error: None)
    for _ in range(500):
        if reports.seen:
            break
        await deferLater(reactor, 0.01)  # type: ignore[arg-type]
    watch.cancel()

    assert results(reports) == [("watch", "ok")]


@pytest.mark.integration
@pytest_twisted.ensureDeferred
async def test_no_member_listening_is_unavailable() -> None:
    from twisted.internet import reactor

    reports = Reports()
    closed = [f"http://127.0.0.1:{port}" for port in free_ports(2)]
    store = EtcdGatewayStore(closed, reactor=reactor, on_request=reports)  # type: ignore[arg-type]

    with pytest.raises(ControlPlaneUnavailableError):
        await store.range_prefix(b"/p/")
    await store.close()

    assert results(reports) == [("range", "unavailable")]
