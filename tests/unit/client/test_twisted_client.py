"""The Twisted client (``logbroker.client``) over a StringTransport, against the real server
protocol through ``iosim``, and its reconnecting service on a Clock."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from argon2 import PasswordHasher
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from twisted.test import iosim
from zope.interface import implementer

from logbroker import wire
from logbroker.broker.core import Broker, BrokerSettings
from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import LocalRanges, RangeHandle
from logbroker.client import (
    BrokerClient,
    BrokerRefused,
    ConnectionClosed,
    ProduceRetry,
    ReconnectingClient,
    Subscription,
    client_tls_options,
    connect_endpoint,
)
from logbroker.errors import Reason
from logbroker.metrics import Metrics
from logbroker.records import ProducerStamp, Record
from logbroker.security import UserDirectory, seed_accounts
from logbroker.server.protocol import ClientFactory, ProtocolSettings
from logbroker.testing import ImmediateExecutor, MemoryFileSystem
from logbroker.wire import PRODUCER_WINDOW, decode_wire_records
from tests.certificates import issue, make_ca, serving, write
from tests.unit.broker.helpers import MemoryRangeLogs, make_broker_and_control
from tests.unit.controlplane.helpers import started
from tests.unit.server.helpers import make_guards
from tests.unit.storage.helpers import failure_of, result_of


class FakeBroker:
    """The far end of one client's StringTransport: reads its requests, writes answers."""

    def __init__(
        self, client: BrokerClient, transport: StringTransport, clock: Clock | None = None
    ) -> None:
        self.client = client
        self.transport = transport
        #: The client's clock (its produces' back-offs).
        self.clock = clock
        self._decoder = wire.FrameDecoder()

    def requests(self) -> list[wire.ReceivedRequest]:
        data = self.transport.value()
        self.transport.clear()
        return [wire.decode_request(body) for body in self._decoder.feed(data)]

    def one(self) -> wire.ReceivedRequest:
        [request] = self.requests()
        return request

    def answer(self, correlation_id: int, payload: bytes = b"") -> None:
        self.client.dataReceived(wire.encode_ok(correlation_id, payload))

    def refuse(self, correlation_id: int, reason: str) -> None:
        self.client.dataReceived(wire.encode_error(correlation_id, reason))


CLUSTER = wire.ClusterInfo(
    cluster_id="prod",
    node_id="n2",
    control_plane="etcd",
    chores_holder="n1",
    domain_violations=1,
    lease_age_ms=250,
    nodes=(
        wire.ClusterNodeInfo("n1", "h1", 4040, 4041, 4042, True, 3),
        wire.ClusterNodeInfo("n2", "h2", 4040, 4041, 4042, False, 0, (("zone", "b"),), "0.1"),
    ),
    under_replicated=3,
)


#: Produce retries at exactly the nominal delays: 50 ms, 100 ms, 200 ms...
NO_JITTER = ProduceRetry(jitter=0)


def connected(
    credentials: tuple[str, str] | None = None,
    produce_retry: ProduceRetry | None = NO_JITTER,
) -> FakeBroker:
    clock = Clock()
    client = BrokerClient(credentials, clock=clock, produce_retry=produce_retry)
    transport = StringTransport()
    client.makeConnection(transport)
    return FakeBroker(client, transport, clock)


def has_result(deferred: Deferred[Any]) -> bool:
    """Whether ``deferred`` has a result now (it is left in place)."""
    seen: list[object] = []

    def keep(result: object) -> object:
        seen.append(result)
        return result

    deferred.addBoth(keep)
    return bool(seen)


# -- requests ------------------------------------------------------------------------------


def test_requests_are_pipelined_and_answered_in_any_order() -> None:
    broker = connected()
    client = broker.client

    produced = client.produce("t", [Record(b"v")])
    users = client.list_users()
    topics = client.list_topics()
    leaders = client.topic_leaders("t")
    requests = broker.requests()
    assert [type(r.request) for r in requests] == [
        wire.ProduceIdempotent,
        wire.ListUsers,
        wire.ListTopics,
        wire.TopicLeaders,
    ]
    assert len({r.correlation_id for r in requests}) == 4
    produce_id, users_id, topics_id, leaders_id = (r.correlation_id for r in requests)
    one_leader = wire.LeadersInfo(
        8, (wire.RangeLeader("t.0", 0, 256, "n1"),), (wire.LeaderAddress("n1", "h", 4040),)
    )

    frames = (
        wire.encode_ok(leaders_id, wire.encode_leaders(one_leader))
        + wire.encode_ok(topics_id, wire.encode_topics([wire.TopicInfo("t", 8, 4)]))
        + wire.encode_ok(users_id, wire.encode_users([("admin", ["admin"])]))
        + wire.encode_ok(produce_id, wire.encode_count(1))
    )
    assert not has_result(produced)
    for i in range(len(frames)):  # one byte at a time
        client.dataReceived(frames[i : i + 1])

    assert result_of(produced) == 1
    assert result_of(users) == [("admin", ("admin",))]
    assert result_of(topics) == [wire.TopicInfo("t", 8, 4)]
    assert result_of(leaders) == one_leader


def test_every_operation_sends_its_request_and_decodes_its_answer() -> None:
    broker = connected()
    client = broker.client
    batch = wire.encode_records([Record(b"r", key=b"k")], "cursor-1")
    calls: list[tuple[Callable[[], Deferred[Any]], wire.Request, bytes, object]] = [
        (lambda: client.auth("u", "p"), wire.Auth("u", "p"), wire.encode_token("tok"), "tok"),
        (lambda: client.create_topic("t", 16), wire.CreateTopic("t", 16), b"", None),
        (
            lambda: client.fetch("t", "c", "g", "m", 5, 100),
            wire.Fetch("t", "c", "g", "m", 5, 100),
            batch,
            wire.RecordsPayload((Record(b"r", key=b"k"),), "cursor-1"),
        ),
        (lambda: client.commit("t", "g", "c"), wire.Commit("t", "g", "c"), b"", None),
        (lambda: client.leave_group("t", "g", "m"), wire.LeaveGroup("t", "g", "m"), b"", None),
        (
            lambda: client.create_user("u", "p", ["produce"]),
            wire.CreateUser("u", "p", ("produce",)),
            b"",
            None,
        ),
        (lambda: client.delete_user("u"), wire.DeleteUser("u"), b"", None),
        (lambda: client.change_password("u", "p2"), wire.ChangePassword("u", "p2"), b"", None),
        (
            lambda: client.grant_acl("u", "produce", "a.*"),
            wire.GrantAcl("u", "produce", "a.*"),
            b"",
            None,
        ),
        (
            lambda: client.revoke_acl("u", "produce", "a.*"),
            wire.RevokeAcl("u", "produce", "a.*"),
            b"",
            None,
        ),
        (
            lambda: client.list_acls("u"),
            wire.ListAcls("u"),
            wire.encode_acls([("consume", "b")]),
            [("consume", "b")],
        ),
        (
            client.describe_cluster,
            wire.DescribeCluster(),
            wire.encode_cluster(CLUSTER),
            CLUSTER,
        ),
    ]
    for call, request, payload, expected in calls:
        result = call()
        sent = broker.one()
        assert sent.request == request
        broker.answer(sent.correlation_id, payload)
        assert result_of(result) == expected


def test_an_error_frame_fails_only_its_request_with_the_reason() -> None:
    broker = connected()
    missing = broker.client.fetch("missing")
    other = broker.client.create_topic("t")
    missing_id, other_id = (r.correlation_id for r in broker.requests())

    broker.refuse(missing_id, "no_such_topic")
    broker.answer(other_id)

    refused = failure_of(missing).value
    assert isinstance(refused, BrokerRefused)
    assert (refused.reason, refused.correlation_id) == ("no_such_topic", missing_id)
    assert result_of(other) is None
    assert not broker.transport.disconnecting


def test_an_error_frame_with_correlation_id_0_fails_everything_and_closes() -> None:
    broker = connected()
    first = broker.client.produce("t", [Record(b"v")])
    second = broker.client.list_topics()
    broker.requests()

    broker.refuse(0, "frame_too_large")

    for pending in (first, second):
        refused = failure_of(pending).value
        assert isinstance(refused, BrokerRefused)
        assert (refused.reason, refused.correlation_id) == ("frame_too_large", 0)
    assert broker.transport.disconnecting
    later = failure_of(broker.client.list_topics()).value
    assert isinstance(later, BrokerRefused)
    assert later.reason == "frame_too_large"


def test_losing_the_connection_fails_pending_requests_and_later_ones() -> None:
    broker = connected()
    pending = broker.client.fetch("t", wait_ms=30_000)
    subscription = broker.client.subscribe("t", "g", "m", 10, 10, lambda records, cursor: None)

    broker.client.connectionLost(Failure(ConnectionLost("gone")))

    assert failure_of(pending).check(ConnectionClosed)
    assert failure_of(subscription.done).check(ConnectionClosed)
    assert failure_of(broker.client.list_users()).check(ConnectionClosed)


def test_a_response_that_breaks_the_protocol_drops_the_connection() -> None:
    broker = connected()
    pending = broker.client.list_topics()
    broker.requests()

    broker.client.dataReceived(wire.encode_frame(b"\x00\x00"))

    assert failure_of(pending).check(wire.ProtocolViolation)
    assert broker.transport.disconnecting


def test_a_response_over_the_maximum_frame_size_drops_the_connection() -> None:
    client = BrokerClient(max_frame_size=100, clock=Clock())
    transport = StringTransport()
    client.makeConnection(transport)
    pending = client.list_topics()

    client.dataReceived(b"\x00\x00\x01\x00")

    assert failure_of(pending).check(wire.ProtocolViolation)
    assert transport.disconnecting


def test_a_cancelled_request_ignores_its_late_answer() -> None:
    broker = connected()
    pending = broker.client.fetch("t", wait_ms=30_000)
    [sent] = broker.requests()

    pending.cancel()
    broker.answer(sent.correlation_id, wire.encode_records([], "c"))

    assert failure_of(pending).check(CancelledError)
    assert not broker.transport.disconnecting


def test_correlation_ids_wrap_around_skipping_0_and_ids_in_use() -> None:
    broker = connected()
    client = broker.client
    client.list_topics()  # id 1, still in flight
    client._last_id = 0xFFFFFFFE

    for _ in range(3):
        client.list_topics()

    assert [r.correlation_id for r in broker.requests()] == [1, 0xFFFFFFFF, 2, 3]


# -- login ---------------------------------------------------------------------------------


def test_a_client_with_credentials_logs_in_when_connected() -> None:
    broker = connected(("app", "app123"))
    ready = broker.client.ready()
    [login] = broker.requests()
    assert login.request == wire.Auth("app", "app123")
    assert not has_result(ready)

    broker.answer(login.correlation_id, wire.encode_token("token"))

    assert result_of(ready) is broker.client
    assert result_of(broker.client.ready()) is broker.client


def test_a_refused_login_fails_ready_and_closes() -> None:
    broker = connected(("app", "wrong"))
    [login] = broker.requests()

    broker.refuse(login.correlation_id, "invalid_credentials")

    refused = failure_of(broker.client.ready()).value
    assert isinstance(refused, BrokerRefused)
    assert refused.reason == "invalid_credentials"
    assert broker.transport.disconnecting


def test_requests_wait_for_the_login_to_succeed() -> None:
    broker = connected(("app", "app123"))
    produced = broker.client.produce("t", [Record(b"v")])
    subscription = broker.client.subscribe("t", "g", "m", 1, 1, lambda records, cursor: None)
    [login] = broker.requests()  # the broker would refuse anything else before its answer

    broker.answer(login.correlation_id, wire.encode_token("token"))

    held = broker.requests()
    assert [type(r.request) for r in held] == [wire.ProduceIdempotent, wire.Subscribe]
    broker.answer(held[0].correlation_id, wire.encode_count(1))
    assert result_of(produced) == 1
    assert not subscription.done.called


def test_requests_held_for_a_refused_login_fail_with_its_reason() -> None:
    broker = connected(("app", "wrong"))
    produced = broker.client.produce("t", [Record(b"v")])
    subscription = broker.client.subscribe("t", "g", "m", 1, 1, lambda records, cursor: None)

    broker.refuse(broker.one().correlation_id, "invalid_credentials")

    for failed in (produced, subscription.done):
        refused = failure_of(failed).value
        assert isinstance(refused, BrokerRefused)
        assert refused.reason == "invalid_credentials"
    assert broker.requests() == []


# -- subscribe -----------------------------------------------------------------------------


def push(broker: FakeBroker, correlation_id: int, values: list[bytes], cursor: str) -> None:
    records = [Record(value) for value in values]
    broker.answer(correlation_id, wire.encode_records(records, cursor))


def test_each_push_is_acknowledged_once_the_callback_returns() -> None:
    broker = connected()
    seen: list[tuple[list[bytes], str | None]] = []
    acks: list[wire.ReceivedRequest] = []

    def on_records(records: tuple[Record, ...], cursor: str | None) -> None:
        acks.extend(broker.requests())
        assert len(acks) == len(seen)  # each earlier push acknowledged, this one not yet
        seen.append(([r.value for r in records], cursor))

    broker.client.subscribe("t", "g", "m", 10, 4, on_records)
    [subscribe] = broker.requests()
    assert subscribe.request == wire.Subscribe("t", "g", "m", 10, 4)
    sid = subscribe.correlation_id

    push(broker, sid, [b"a", b"b"], "c1")
    push(broker, sid, [b"c"], "c2")

    assert seen == [([b"a", b"b"], "c1"), ([b"c"], "c2")]
    acks.extend(broker.requests())
    assert [r.request for r in acks] == [
        wire.StreamAck("t", "g", "m", "c1", 2),
        wire.StreamAck("t", "g", "m", "c2", 1),
    ]
    assert sid not in {r.correlation_id for r in acks}


def test_a_callback_returning_a_deferred_holds_the_ack_and_the_next_push() -> None:
    broker = connected()
    working: list[Deferred[None]] = []
    seen: list[str | None] = []

    def on_records(records: tuple[Record, ...], cursor: str | None) -> Deferred[None]:
        seen.append(cursor)
        working.append(Deferred())
        return working[-1]

    broker.client.subscribe("t", None, None, 0, 0, on_records)
    sid = broker.one().correlation_id
    push(broker, sid, [b"a"], "c1")
    push(broker, sid, [b"b"], "c2")
    assert seen == ["c1"]
    assert broker.requests() == []

    working[0].callback(None)

    assert seen == ["c1", "c2"]
    assert [r.request for r in broker.requests()] == [wire.StreamAck("t", None, None, "c1", 1)]
    working[1].callback(None)
    assert [r.request for r in broker.requests()] == [wire.StreamAck("t", None, None, "c2", 1)]


def test_a_failing_callback_ends_the_subscription_without_an_ack() -> None:
    broker = connected()
    calls: list[str | None] = []

    def on_records(records: tuple[Record, ...], cursor: str | None) -> None:
        calls.append(cursor)
        raise ValueError("cannot handle this")

    subscription = broker.client.subscribe("t", "g", "m", 10, 10, on_records)
    sid = broker.one().correlation_id
    push(broker, sid, [b"a"], "c1")
    push(broker, sid, [b"b"], "c2")

    assert calls == ["c1"]
    assert failure_of(subscription.done).check(ValueError)
    assert broker.requests() == []


def test_an_error_frame_ends_the_subscription_with_its_reason() -> None:
    broker = connected()
    subscription = broker.client.subscribe("t", "g", "m", 10, 10, lambda records, cursor: None)

    broker.refuse(broker.one().correlation_id, "no_such_topic")

    refused = failure_of(subscription.done).value
    assert isinstance(refused, BrokerRefused)
    assert refused.reason == "no_such_topic"


def test_stop_ends_the_callbacks_and_the_acks() -> None:
    broker = connected()
    seen: list[str | None] = []
    subscription = broker.client.subscribe(
        "t", "g", "m", 10, 10, lambda records, cursor: seen.append(cursor)
    )
    sid = broker.one().correlation_id

    subscription.stop()
    push(broker, sid, [b"a"], "c1")

    assert result_of(subscription.done) is None
    assert seen == []
    assert broker.requests() == []


def test_a_refused_ack_is_warned_about_and_the_subscription_goes_on() -> None:
    broker = connected()
    seen: list[str | None] = []
    subscription = broker.client.subscribe(
        "t", "g", "m", 10, 10, lambda records, cursor: seen.append(cursor)
    )
    sid = broker.one().correlation_id
    push(broker, sid, [b"a"], "c1")
    [ack] = broker.requests()

    broker.refuse(ack.correlation_id, "invalid_cursor")
    push(broker, sid, [b"b"], "c2")

    assert seen == ["c1", "c2"]
    assert not subscription.done.called
    assert not broker.transport.disconnecting


# -- against the real server protocol ------------------------------------------------------


CHEAP = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)


def real_pair(credentials: tuple[str, str]) -> tuple[BrokerClient, iosim.IOPump]:
    clock = Clock()
    broker, _, _, control = make_broker_and_control(clock, BrokerSettings(initial_ranges=2))
    users = UserDirectory(control, ImmediateExecutor(), CHEAP)
    result_of(seed_accounts(users, "dev", {}))
    factory = ClientFactory(broker, users, clock, ProtocolSettings(), make_guards(clock))
    client, _, pump = iosim.connectedServerAndClient(
        lambda: factory.buildProtocol(None), lambda: BrokerClient(credentials, clock=clock)
    )
    pump.flush()
    return client, pump


def settled(pump: iosim.IOPump, deferred: Deferred[Any]) -> Any:
    pump.flush()
    return result_of(deferred)


def test_produce_fetch_and_subscribe_against_the_server_protocol() -> None:
    client, pump = real_pair(("app", "app123"))
    assert settled(pump, client.ready()) is client
    settled(pump, client.create_topic("t"))
    records = [Record(bytes([i]), key=b"k", timestamp_ms=i) for i in range(5)]
    assert settled(pump, client.produce("t", records)) == 5
    assert settled(pump, client.fetch("t")).records == tuple(records)

    pushed: list[Record] = []
    subscription: Subscription = client.subscribe(
        "t", "g", "m", 2, 2, lambda batch, cursor: pushed.extend(batch)
    )
    pump.flush()

    assert pushed == records  # a window of 2: only the automatic acks let the rest through
    assert not subscription.done.called
    committed = settled(pump, client.fetch("t", group="g"))
    assert committed.records == ()  # the last ack committed the group's position


def test_wrong_credentials_against_the_server_protocol() -> None:
    client, _ = real_pair(("app", "wrong"))

    refused = failure_of(client.ready()).value

    assert isinstance(refused, BrokerRefused)
    assert refused.reason == "invalid_credentials"


# -- over TLS, against the real server protocol --------------------------------------------


@implementer(IStreamClientEndpoint)
class PumpedEndpoint:
    """Connects each client protocol to one the server factory builds, through ``iosim``."""

    def __init__(self, server: ClientFactory, clock: Clock) -> None:
        self._server = server
        self.clock = clock
        self.pumps: list[iosim.IOPump] = []

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        client = factory.buildProtocol(None)
        server = self._server.buildProtocol(None)
        assert client is not None
        self.pumps.append(
            iosim.connect(
                server,
                iosim.makeFakeServer(server),
                client,
                iosim.makeFakeClient(client),
                greet=False,
                clock=self.clock,
            )
        )
        return succeed(client)

    def flush(self) -> None:
        self.pumps[-1].flush()


def tls_broker(tmp_path: Path) -> tuple[PumpedEndpoint, str, list[str]]:
    """An endpoint to a broker that requires TLS, the CA file its certificate verifies with
    and the outcomes of its handshakes."""
    clock = Clock()
    broker, _, _, control = make_broker_and_control(clock, BrokerSettings(initial_ranges=2))
    users = UserDirectory(control, ImmediateExecutor(), CHEAP)
    result_of(seed_accounts(users, "dev", {}))
    ca = make_ca()
    outcomes: list[str] = []
    tls = serving(issue(ca), required=True, on_handshake=outcomes.append)
    factory = ClientFactory(broker, users, clock, ProtocolSettings(), make_guards(clock), tls)
    return PumpedEndpoint(factory, clock), write(tmp_path / "ca.pem", ca.cert_pem), outcomes


def test_produce_and_fetch_over_tls_against_the_server_protocol(tmp_path: Path) -> None:
    endpoint, ca_file, outcomes = tls_broker(tmp_path)

    connecting = connect_endpoint(
        endpoint, "app", "app123", tls_hostname="localhost", cafile=ca_file, clock=endpoint.clock
    )
    endpoint.flush()
    client = result_of(connecting)
    settled(endpoint.pumps[-1], client.create_topic("t"))
    records = [Record(bytes([i]), key=b"k", timestamp_ms=i) for i in range(3)]

    assert settled(endpoint.pumps[-1], client.produce("t", records)) == 3
    assert settled(endpoint.pumps[-1], client.fetch("t")).records == tuple(records)
    assert outcomes == ["ok"]


def test_a_tls_connection_the_server_closes_is_closed(tmp_path: Path) -> None:
    # The server protocol is its connection's producer for as long as it lives, which must not
    # keep the TLS layer from closing the connection.
    endpoint, ca_file, _ = tls_broker(tmp_path)
    client = BrokerClient(clock=endpoint.clock)
    connecting = endpoint.connect(
        TLSMemoryBIOFactory(
            client_tls_options("localhost", ca_file), True, _Only(client), endpoint.clock
        )
    )
    endpoint.flush()
    assert result_of(connecting) is not None

    listing = client.list_topics()  # not a login: refused, then closed
    endpoint.flush()

    refused = failure_of(listing).value
    assert isinstance(refused, BrokerRefused)
    assert refused.reason == "auth_required"
    assert client.transport is None  # connectionLost has run


def test_the_reconnecting_service_connects_over_tls(tmp_path: Path) -> None:
    endpoint, ca_file, outcomes = tls_broker(tmp_path)
    service = ReconnectingClient(
        endpoint, "app", "app123", clock=endpoint.clock, tls_hostname="localhost", cafile=ca_file
    )
    service.startService()
    ready = service.when_ready()
    endpoint.flush()

    client = result_of(ready)

    assert settled(endpoint.pumps[-1], client.list_topics()) == []
    assert outcomes == ["ok"]
    service.stopService()
    endpoint.flush()


def test_a_ca_file_without_tls_is_refused_rather_than_ignored(tmp_path: Path) -> None:
    endpoint, ca_file, _ = tls_broker(tmp_path)

    with pytest.raises(ValueError, match="cafile is only used with TLS"):
        connect_endpoint(endpoint, "app", "app123", clock=endpoint.clock, cafile=ca_file)
    with pytest.raises(ValueError, match="cafile is only used with TLS"):
        ReconnectingClient(endpoint, "app", "app123", clock=endpoint.clock, cafile=ca_file)
    assert endpoint.pumps == []


class _Only(Factory):
    def __init__(self, protocol: BrokerClient) -> None:
        self._protocol = protocol

    def buildProtocol(self, addr: object) -> BrokerClient:
        return self._protocol


# -- the reconnecting service --------------------------------------------------------------


@implementer(IStreamClientEndpoint)
class FakeEndpoint:
    """Connects each protocol to a StringTransport at once."""

    def __init__(self) -> None:
        self.connections: list[tuple[IProtocol, FakeBroker]] = []

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        protocol = factory.buildProtocol(None)
        assert protocol is not None
        transport = StringTransport()
        protocol.makeConnection(transport)
        client = protocol._protocol  # type: ignore[attr-defined]  # ClientService's proxy
        self.connections.append((protocol, FakeBroker(client, transport)))
        return succeed(protocol)

    def drop(self, index: int) -> None:
        protocol, _ = self.connections[index]
        protocol.connectionLost(Failure(ConnectionDone()))

    def stop(self, service: ReconnectingClient) -> None:
        """Stop ``service``: its last connection closes."""
        stopped = service.stopService()
        self.drop(-1)
        result_of(stopped)


def log_in(broker: FakeBroker) -> None:
    login = broker.one()
    assert isinstance(login.request, wire.Auth)
    broker.answer(login.correlation_id, wire.encode_token("token"))


def test_the_service_logs_in_and_hands_out_the_client() -> None:
    endpoint, clock, readied = FakeEndpoint(), Clock(), []
    service = ReconnectingClient(endpoint, "app", "app123", clock=clock, on_ready=readied.append)
    service.startService()
    ready = service.when_ready()
    [(_, broker)] = endpoint.connections
    assert not has_result(ready)

    log_in(broker)

    assert result_of(ready) is broker.client
    assert readied == [broker.client]
    endpoint.stop(service)


def test_after_a_drop_requests_in_flight_fail_and_the_service_reconnects() -> None:
    endpoint, clock = FakeEndpoint(), Clock()
    service = ReconnectingClient(endpoint, "app", "app123", clock=clock, retry_policy=lambda n: 5)
    service.startService()
    log_in(endpoint.connections[0][1])
    first = result_of(service.when_ready())
    in_flight = first.produce("t", [Record(b"v")])

    endpoint.drop(0)

    assert failure_of(in_flight).check(ConnectionClosed)
    clock.advance(5)
    [_, (_, broker)] = endpoint.connections
    log_in(broker)
    assert result_of(service.when_ready()) is broker.client
    endpoint.stop(service)
    assert clock.getDelayedCalls() == []


def test_refused_logins_back_off_further_each_time() -> None:
    endpoint, clock, asked = FakeEndpoint(), Clock(), []

    def policy(attempt: int) -> float:
        asked.append(attempt)
        return 1.0

    service = ReconnectingClient(endpoint, "app", "wrong", clock=clock, retry_policy=policy)
    service.startService()
    ready = service.when_ready()
    for index in range(3):
        broker = endpoint.connections[index][1]
        broker.refuse(broker.one().correlation_id, "invalid_credentials")
        endpoint.drop(index)
        clock.advance(1.0)

    refused = failure_of(ready).value
    assert isinstance(refused, BrokerRefused)
    assert refused.reason == "invalid_credentials"
    assert service.failed_logins == 3
    assert asked == [2, 3, 4]  # ClientService's count (1 after a drop) plus failed logins
    log_in(endpoint.connections[3][1])
    assert service.failed_logins == 0
    endpoint.stop(service)


# -- idempotent produce --------------------------------------------------------------------


def stamped(request: wire.ReceivedRequest) -> wire.ProduceIdempotent:
    assert isinstance(request.request, wire.ProduceIdempotent), request
    return request.request


def test_each_produce_is_stamped_with_the_clients_producer_id_and_a_sequence_of_its_own() -> None:
    broker = connected()
    client = broker.client

    for value in (b"a", b"b", b"c"):
        client.produce("t", [Record(value)])

    sent = [stamped(request) for request in broker.requests()]
    assert [request.stamp for request in sent] == [
        ProducerStamp(client.producer_id, sequence) for sequence in range(3)
    ]
    assert [decode_wire_records(request.records) for request in sent] == [
        (Record(v),) for v in (b"a", b"b", b"c")
    ]
    assert connected().client.producer_id != client.producer_id


def test_a_produce_refused_try_again_is_sent_again_with_its_stamp_after_a_back_off() -> None:
    broker = connected(produce_retry=NO_JITTER)
    assert broker.clock is not None
    produced = broker.client.produce("t", [Record(b"v", key=b"k")])
    first = broker.one()

    broker.refuse(first.correlation_id, "unreachable")
    broker.clock.advance(0.049)
    assert broker.requests() == []
    broker.clock.advance(0.001)
    second = broker.one()
    broker.refuse(second.correlation_id, "not_primary")
    broker.clock.advance(0.1)
    third = broker.one()
    broker.answer(third.correlation_id, wire.encode_count(1))

    assert result_of(produced) == 1
    assert stamped(first) == stamped(second) == stamped(third)
    assert len({first.correlation_id, second.correlation_id, third.correlation_id}) == 3
    assert broker.clock.getDelayedCalls() == []


def test_a_produce_gives_up_with_the_last_refusal_once_a_retry_would_start_too_late() -> None:
    broker = connected(produce_retry=NO_JITTER)
    assert broker.clock is not None
    produced = broker.client.produce("t", [Record(b"v")], give_up_after=0.2)

    for reason, wait in (("unreachable", 0.05), ("no_quorum", 0.1)):
        broker.refuse(broker.one().correlation_id, reason)
        broker.clock.advance(wait)
    broker.refuse(broker.one().correlation_id, "no_quorum")  # the next would start at 0.35

    refused = failure_of(produced).value
    assert isinstance(refused, BrokerRefused)
    assert refused.reason == "no_quorum"
    assert broker.clock.seconds() == pytest.approx(0.15)
    assert broker.clock.getDelayedCalls() == []


@pytest.mark.parametrize(
    ("reason", "produce_retry"),
    [("overloaded", NO_JITTER), ("no_such_topic", NO_JITTER), ("unreachable", None)],
)
def test_other_refusals_and_a_client_told_not_to_retry_fail_at_once(
    reason: str, produce_retry: ProduceRetry | None
) -> None:
    broker = connected(produce_retry=produce_retry)
    produced = broker.client.produce("t", [Record(b"v")])

    broker.refuse(broker.one().correlation_id, reason)

    refused = failure_of(produced).value
    assert isinstance(refused, BrokerRefused)
    assert refused.reason == reason
    assert broker.clock is not None
    assert broker.clock.getDelayedCalls() == []


def test_a_producer_runs_at_most_a_window_ahead_of_its_oldest_unfinished_produce() -> None:
    broker = connected()
    produced = [broker.client.produce("t", [Record(b"%d" % i)]) for i in range(PRODUCER_WINDOW + 1)]
    sent = broker.requests()
    assert [stamped(request).stamp.sequence for request in sent] == list(range(PRODUCER_WINDOW))

    for request in sent[1:]:
        broker.answer(request.correlation_id, wire.encode_count(1))
    assert broker.requests() == []  # sequence 0 is unfinished: 32 may not go out yet
    broker.answer(sent[0].correlation_id, wire.encode_count(1))

    [last] = broker.requests()
    assert stamped(last).stamp.sequence == PRODUCER_WINDOW
    assert decode_wire_records(stamped(last).records) == (Record(b"%d" % PRODUCER_WINDOW),)
    broker.answer(last.correlation_id, wire.encode_count(1))
    assert [result_of(each) for each in produced] == [1] * (PRODUCER_WINDOW + 1)


def test_a_broker_without_produce_idempotent_is_sent_plain_produces_not_retried() -> None:
    broker = connected()
    first = broker.client.produce("t", [Record(b"a")])
    broker.refuse(broker.one().correlation_id, "unknown_api_key")

    plain = broker.one()
    assert plain.request == wire.Produce("t", (Record(b"a"),))
    broker.answer(plain.correlation_id, wire.encode_count(1))
    assert result_of(first) == 1
    assert broker.client.sends_plain_produce

    second = broker.client.produce("t", [Record(b"b")])
    again = broker.one()
    assert again.request == wire.Produce("t", (Record(b"b"),))
    broker.refuse(again.correlation_id, "unreachable")
    refused = failure_of(second).value
    assert isinstance(refused, BrokerRefused)
    assert refused.reason == "unreachable"


def test_a_produce_waiting_to_be_retried_fails_at_once_when_the_connection_goes() -> None:
    broker = connected()
    produced = broker.client.produce("t", [Record(b"v")])
    broker.refuse(broker.one().correlation_id, "unreachable")

    broker.client.connectionLost(Failure(ConnectionLost("gone")))

    assert failure_of(produced).check(ConnectionClosed)
    assert broker.clock is not None
    assert broker.clock.getDelayedCalls() == []


class _AnswerLost:
    """A range handle whose first append is stored, then answered ``unreachable``: the answer
    to a produce that was stored is lost on its way back."""

    def __init__(self, handle: RangeHandle) -> None:
        self._handle = handle
        self.lost = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def append(
        self, records: Sequence[Record], stamp: ProducerStamp | None = None
    ) -> Deferred[None]:
        appended = self._handle.append(records, stamp)
        if self.lost:
            return appended

        def lose(_: object) -> None:
            self.lost += 1
            raise BrokerError(Reason.UNREACHABLE, "the answer was lost")

        return appended.addCallback(lose)


class _LosingFirstAnswers:
    def __init__(self, local: LocalRanges) -> None:
        self._local = local
        self.handles: dict[str, _AnswerLost] = {}

    def handle(self, range_id: str) -> RangeHandle:
        if range_id not in self.handles:
            self.handles[range_id] = _AnswerLost(self._local.handle(range_id))
        return cast(RangeHandle, self.handles[range_id])

    def open(self, range_ids: Sequence[str]) -> Deferred[None]:
        return self._local.open(range_ids)


def test_a_produce_whose_answer_was_lost_is_retried_and_stored_once() -> None:
    clock = Clock()
    metrics = Metrics(clock)
    fs = MemoryFileSystem()
    control = started(fs)
    directory = _LosingFirstAnswers(LocalRanges(MemoryRangeLogs(fs, clock, metrics)))
    broker = Broker(control, directory, clock, BrokerSettings(initial_ranges=2), metrics)
    users = UserDirectory(control, ImmediateExecutor(), CHEAP)
    result_of(seed_accounts(users, "dev", {}))
    factory = ClientFactory(broker, users, clock, ProtocolSettings(), make_guards(clock))
    client, _, pump = iosim.connectedServerAndClient(
        lambda: factory.buildProtocol(None),
        lambda: BrokerClient(("app", "app123"), clock=clock, produce_retry=NO_JITTER),
    )
    settled(pump, client.create_topic("t"))

    produced = client.produce("t", [Record(b"once", key=b"k")])
    pump.flush()
    assert not has_result(produced)  # refused unreachable: waiting to be retried
    clock.advance(0.05)
    pump.flush()

    assert result_of(produced) == 1
    assert sum(handle.lost for handle in directory.handles.values()) == 1
    assert settled(pump, client.fetch("t")).records == (Record(b"once", key=b"k"),)


def test_the_reconnecting_client_sends_a_produce_again_through_its_next_connection() -> None:
    endpoint, clock = FakeEndpoint(), Clock()
    service = ReconnectingClient(
        endpoint, "app", "app123", clock=clock, retry_policy=lambda n: 5, produce_retry=NO_JITTER
    )
    service.startService()
    log_in(endpoint.connections[0][1])
    produced = service.produce("t", [Record(b"v")])
    first = endpoint.connections[0][1].one()

    endpoint.drop(0)  # before the answer
    clock.advance(0.05)  # the back-off, then a wait for the next connection
    assert not has_result(produced)
    clock.advance(5)
    [_, (_, broker)] = endpoint.connections
    log_in(broker)
    second = broker.one()
    broker.answer(second.correlation_id, wire.encode_count(1))

    assert result_of(produced) == 1
    assert stamped(first) == stamped(second)
    assert stamped(first).stamp.producer_id == service.producer_id
    endpoint.stop(service)
    assert clock.getDelayedCalls() == []


def test_the_reconnecting_client_gives_up_when_no_connection_comes_in_time() -> None:
    endpoint, clock = FakeEndpoint(), Clock()
    service = ReconnectingClient(
        endpoint, "app", "app123", clock=clock, retry_policy=lambda n: 10, produce_retry=NO_JITTER
    )
    service.startService()
    log_in(endpoint.connections[0][1])
    produced = service.produce("t", [Record(b"v")], give_up_after=3)
    endpoint.connections[0][1].one()

    endpoint.drop(0)
    clock.advance(3)

    assert failure_of(produced).check(ConnectionClosed)
    clock.advance(7)
    log_in(endpoint.connections[1][1])
    endpoint.stop(service)
    assert clock.getDelayedCalls() == []


def test_stopping_the_reconnecting_client_fails_a_produce_waiting_to_be_retried() -> None:
    endpoint, clock = FakeEndpoint(), Clock()
    service = ReconnectingClient(endpoint, "app", "app123", clock=clock)
    service.startService()
    log_in(endpoint.connections[0][1])
    produced = service.produce("t", [Record(b"v")])
    broker = endpoint.connections[0][1]
    broker.refuse(broker.one().correlation_id, "not_primary")

    endpoint.stop(service)

    assert failure_of(produced).check(ConnectionClosed)
    assert clock.getDelayedCalls() == []
