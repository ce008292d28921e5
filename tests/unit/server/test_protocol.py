"""The client protocol over a StringTransport: auth, dispatch, errors, long polls, subscribe."""

from __future__ import annotations

import struct

import pytest
from argon2 import PasswordHasher
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IAddress
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from logbroker import wire
from logbroker.broker.core import BrokerSettings
from logbroker.cluster.digests import DigestServer
from logbroker.cluster.membership import NodeRecord
from logbroker.cluster.verify import ClusterVerifier
from logbroker.cluster.view import ClusterView, SingleNodeView
from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.metrics import Metrics
from logbroker.peer.frames import PeerOp
from logbroker.records import ProducerStamp, Record
from logbroker.security import UserDirectory, seed_accounts
from logbroker.server.protocol import (
    CLOSE_GRACE_SECONDS,
    ClientFactory,
    ClientProtocol,
    ProtocolSettings,
)
from logbroker.testing import ImmediateExecutor, ManualExecutor
from tests.unit.broker.helpers import make_broker_and_control
from tests.unit.server.helpers import make_guards
from tests.unit.storage.helpers import MemoryLogs, result_of
from tests.unit.test_tcp import AbortableTransport, TcpTransport

CHEAP = PasswordHasher(time_cost=1, memory_cost=8, parallelism=1)


class Client:
    """One connection: sends requests, reads back the responses the server wrote."""

    def __init__(self, protocol: ClientProtocol, transport: StringTransport) -> None:
        self.protocol = protocol
        self.transport = transport
        self._decoder = wire.FrameDecoder()
        self._next = 1

    def send(self, request: wire.Request, correlation_id: int | None = None) -> int:
        if correlation_id is None:
            correlation_id = self._next
            self._next += 1
        self.protocol.dataReceived(wire.encode_request(correlation_id, request))
        return correlation_id

    def responses(self) -> list[wire.Response]:
        data = self.transport.value()
        self.transport.clear()
        return [wire.decode_response(body) for body in self._decoder.feed(data)]

    def one(self) -> wire.Response:
        [response] = self.responses()
        return response

    def login(self, user: str = "admin", password: str = "admin123") -> None:
        self.send(wire.Auth(user, password))
        assert self.one().ok


@pytest.fixture
def world() -> tuple[Clock, Server]:
    clock = Clock()
    broker, _, _, control = make_broker_and_control(clock, BrokerSettings(initial_ranges=2))
    users = UserDirectory(control, ImmediateExecutor(), CHEAP)
    result_of(seed_accounts(users, "dev", {}))
    return clock, Server(broker, users, clock)


class Server:
    def __init__(self, broker: object, users: UserDirectory, clock: Clock) -> None:
        self.broker = broker
        self.users = users
        self.clock = clock
        #: Counts what the guards refuse.
        self.metrics = Metrics(clock)
        self.guards = make_guards(clock, metrics=self.metrics)
        self.factories: list[ClientFactory] = []
        #: What ``describe_cluster`` answers (the factories' ``cluster``).
        self.cluster: ClusterView | None = None

    def connect(
        self, settings: ProtocolSettings | None = None, peer: IAddress | None = None
    ) -> Client:
        factory = ClientFactory(
            self.broker,  # type: ignore[arg-type]
            self.users,
            self.clock,
            settings or ProtocolSettings(),
            self.guards,
            cluster=self.cluster,
        )
        self.factories.append(factory)
        protocol = factory.buildProtocol(peer)
        transport = StringTransport(peerAddress=peer)
        protocol.makeConnection(transport)
        return Client(protocol, transport)  # type: ignore[arg-type]


World = tuple[Clock, Server]


# -- authentication ------------------------------------------------------------------------


def test_auth_returns_a_session_token(world: World) -> None:
    _, server = world
    client = server.connect()

    correlation_id = client.send(wire.Auth("producer", "producer123"))

    response = client.one()
    assert response.ok
    assert response.correlation_id == correlation_id
    token = wire.decode_token(response.payload)
    assert token
    assert len(token) >= 24


def test_wrong_credentials_are_refused_and_may_be_retried(world: World) -> None:
    _, server = world
    client = server.connect()

    client.send(wire.Auth("admin", "wrong"), 5)
    assert client.one() == wire.Response(5, b"", "invalid_credentials")
    client.send(wire.Auth(None, None), 6)
    assert client.one() == wire.Response(6, b"", "invalid_credentials")
    client.login()
    assert client.transport.connected


def test_a_first_frame_other_than_auth_gets_auth_required_and_a_close(world: World) -> None:
    _, server = world
    client = server.connect()

    client.send(wire.ListUsers(), 9)

    assert client.one() == wire.Response(9, b"", "auth_required")
    assert client.transport.disconnecting


def test_no_auth_within_the_timeout_closes_with_timeout(world: World) -> None:
    clock, server = world
    client = server.connect(ProtocolSettings(auth_timeout_ms=10_000))

    clock.advance(9.999)
    assert not client.transport.disconnecting
    clock.advance(0.001)

    assert client.one() == wire.Response(0, b"", "timeout")
    assert client.transport.disconnecting


def test_an_authenticated_connection_is_not_timed_out(world: World) -> None:
    clock, server = world
    client = server.connect()
    client.login()

    clock.advance(3600)

    assert not client.transport.disconnecting


# -- framing errors ------------------------------------------------------------------------


def test_a_frame_over_the_maximum_is_refused_at_its_prefix_with_correlation_id_0(
    world: World,
) -> None:
    _, server = world
    client = server.connect(ProtocolSettings(max_frame_size=1024))
    client.login()

    client.protocol.dataReceived(struct.pack(">I", 1025))

    assert client.one() == wire.Response(0, b"", "frame_too_large")
    assert client.transport.disconnecting


def test_malformed_and_unknown_requests_get_errors_with_their_correlation_id(
    world: World,
) -> None:
    _, server = world
    client = server.connect()
    client.login()

    client.protocol.dataReceived(wire.encode_frame(struct.pack(">HI", 12, 77)))
    client.protocol.dataReceived(wire.encode_frame(struct.pack(">HI", 2, 78) + b"\x07"))

    assert client.responses() == [
        wire.Response(77, b"", "unknown_api_key"),
        wire.Response(78, b"", "malformed_request"),
    ]
    assert not client.transport.disconnecting


def test_a_second_auth_is_an_unexpected_frame(world: World) -> None:
    _, server = world
    client = server.connect()
    client.login()

    client.send(wire.Auth("admin", "admin123"), 3)

    assert client.one() == wire.Response(3, b"", "unexpected_frame")


# -- operations ----------------------------------------------------------------------------


def test_produce_and_fetch_round_trip_records_byte_for_byte(world: World) -> None:
    _, server = world
    client = server.connect()
    client.login("app", "app123")
    sent = (
        Record(b"", key=None, timestamp_ms=1),
        Record(b"\x00\xff", key=b"", timestamp_ms=2**64 - 1, headers=((b"h", None), (None, b""))),
    )

    client.send(wire.CreateTopic("t", 0))
    assert client.one().ok
    client.send(wire.Produce("t", sent))
    assert wire.decode_count(client.one().payload) == 2
    client.send(wire.Fetch("t", None, None, None, 0, 0))

    fetched = wire.decode_records(client.one().payload)
    assert sorted(fetched.records, key=repr) == sorted(sent, key=repr)
    assert fetched.next_cursor


def test_produce_idempotent_stores_a_stamp_once_and_answers_every_try_its_count(
    world: World,
) -> None:
    _, server = world
    client = server.connect()
    client.login("app", "app123")
    client.send(wire.CreateTopic("t", 0))
    assert client.one().ok
    sent = (Record(b"a"), Record(b"b", key=b"k"))

    client.send(wire.ProduceIdempotent("t", ProducerStamp(7, 0), sent), 3)
    client.send(wire.ProduceIdempotent("t", ProducerStamp(7, 0), sent), 4)
    client.send(wire.ProduceIdempotent("t", ProducerStamp(7, 1), sent), 5)

    assert client.responses() == [wire.Response(i, wire.encode_count(2)) for i in (3, 4, 5)]
    client.send(wire.Fetch("t", None, None, None, 0, 0))
    fetched = wire.decode_records(client.one().payload).records
    assert sorted(record.value for record in fetched) == [b"a", b"a", b"b", b"b"]


def test_a_produce_idempotent_too_old_for_the_window_is_answered_sequence_too_old(
    world: World,
) -> None:
    _, server = world
    client = server.connect()
    client.login()
    client.send(wire.CreateTopic("t", 0))
    assert client.one().ok
    one = (Record(b"v", key=b"k"),)
    client.send(wire.ProduceIdempotent("t", ProducerStamp(7, 0), one), 3)
    client.send(wire.ProduceIdempotent("t", ProducerStamp(7, wire.PRODUCER_WINDOW), one), 4)

    client.send(wire.ProduceIdempotent("t", ProducerStamp(7, 0), one), 5)

    assert [r.reason for r in client.responses()] == [None, None, "sequence_too_old"]


def test_permissions_are_checked(world: World) -> None:
    _, server = world
    consumer = server.connect()
    consumer.login("consumer", "consumer123")

    consumer.send(wire.Produce("t", ()), 1)
    consumer.send(wire.CreateTopic("t", 0), 2)
    consumer.send(wire.ListUsers(), 3)
    consumer.send(wire.ProduceIdempotent("t", ProducerStamp(1, 0), ()), 4)

    assert [r.reason for r in consumer.responses()] == ["permission_denied"] * 4


def test_broker_errors_carry_their_reason(world: World) -> None:
    _, server = world
    client = server.connect()
    client.login()

    client.send(wire.Produce("missing", (Record(b"v"),)), 4)
    client.send(wire.CreateTopic("t", 40), 5)
    client.send(wire.CreateTopic("bad name", 0), 6)

    assert client.responses() == [
        wire.Response(4, b"", "no_such_topic"),
        wire.Response(5, b"", "invalid_keyspace_bits"),
        wire.Response(6, b"", "invalid_topic_name"),
    ]


def test_pipelined_requests_are_all_answered(world: World) -> None:
    _, server = world
    client = server.connect()
    client.login()
    frames = wire.encode_request(10, wire.CreateTopic("t", 0)) + b"".join(
        wire.encode_request(11 + i, wire.Produce("t", (Record(bytes([i])),))) for i in range(5)
    )

    client.protocol.dataReceived(frames)

    responses = client.responses()
    assert sorted(r.correlation_id for r in responses) == list(range(10, 16))
    assert all(r.ok for r in responses)


def test_a_long_poll_is_answered_when_a_record_arrives(world: World) -> None:
    clock, server = world
    consumer = server.connect()
    consumer.login()
    producer = server.connect()
    producer.login()
    producer.send(wire.CreateTopic("t", 0))
    producer.responses()

    consumer.send(wire.Fetch("t", None, None, None, 0, 30_000), 8)
    clock.advance(20)
    assert consumer.responses() == []
    producer.send(wire.Produce("t", (Record(b"wake"),)))

    response = consumer.one()
    assert response.correlation_id == 8
    assert [r.value for r in wire.decode_records(response.payload).records] == [b"wake"]


def test_user_and_acl_management(world: World) -> None:
    _, server = world
    admin = server.connect()
    admin.login()

    admin.send(wire.CreateUser("alice", "s3cret!", ("produce",)), 1)
    admin.send(wire.CreateUser("alice", "s3cret!", ("produce",)), 2)
    admin.send(wire.CreateUser("bob", "pw", ("root",)), 3)
    admin.send(wire.GrantAcl("alice", "produce", "orders.*"), 4)
    admin.send(wire.GrantAcl("alice", "delete", "orders"), 5)
    admin.send(wire.ListAcls("alice"), 6)
    admin.send(wire.DeleteUser("nobody"), 7)
    responses = {r.correlation_id: r for r in admin.responses()}

    assert responses[1].ok
    assert responses[2].reason == "user_exists"
    assert responses[3].reason == "invalid_permissions"
    assert responses[4].ok
    assert responses[5].reason == "invalid_operation"
    assert wire.decode_acls(responses[6].payload) == [("produce", "orders.*")]
    assert responses[7].reason == "user_not_found"
    alice = server.connect()
    alice.login("alice", "s3cret!")


def test_any_authenticated_user_may_list_topics(world: World) -> None:
    _, server = world
    admin = server.connect()
    admin.login()
    admin.send(wire.CreateTopic("orders", 16))
    admin.send(wire.CreateTopic("audit", 0))
    admin.responses()
    consumer = server.connect()
    consumer.login("consumer", "consumer123")

    consumer.send(wire.ListTopics(), 12)

    response = consumer.one()
    assert response.correlation_id == 12
    assert wire.decode_topics(response.payload) == [
        wire.TopicInfo("audit", 8, 2),  # keyspace_bits 0 asks for the default, 8
        wire.TopicInfo("orders", 16, 2),
    ]


def test_list_topics_needs_authentication(world: World) -> None:
    _, server = world
    client = server.connect()

    client.send(wire.ListTopics(), 4)

    assert client.one() == wire.Response(4, b"", "auth_required")


# -- describe_cluster ----------------------------------------------------------------------

NODE = NodeRecord("n1", "broker-1.internal", 4040, 4041, 4042, (("zone", "a"),), "0.1")


def with_single_node_view() -> tuple[Server, Client]:
    clock = Clock()
    broker, _, _, control = make_broker_and_control(clock, BrokerSettings(initial_ranges=2))
    users = UserDirectory(control, ImmediateExecutor(), CHEAP)
    result_of(seed_accounts(users, "dev", {}))
    server = Server(broker, users, clock)
    server.cluster = SingleNodeView("prod", NODE, control)
    admin = server.connect()
    admin.login()
    admin.send(wire.CreateTopic("orders", 0))
    for range_id in ("orders.0", "orders.1"):
        meta = SegmentMeta(range_id, 0, SegmentState.ACTIVE, None, None, ("n1",), 0)
        result_of(control.put_segment(meta))
    admin.responses()
    return server, admin


EXPECTED_CLUSTER = wire.ClusterInfo(
    cluster_id="prod",
    node_id="n1",
    control_plane="local",
    chores_holder="n1",
    domain_violations=0,
    lease_age_ms=None,
    nodes=(
        wire.ClusterNodeInfo(
            "n1", "broker-1.internal", 4040, 4041, 4042, True, 2, (("zone", "a"),), "0.1"
        ),
    ),
    under_replicated=0,
    unavailable_ranges=0,
)


@pytest.mark.parametrize("chunk", [None, 1, 7], ids=["whole", "one byte at a time", "split"])
def test_an_admin_is_told_the_cluster_as_the_view_sees_it(chunk: int | None) -> None:
    _, admin = with_single_node_view()
    frame = wire.encode_request(21, wire.DescribeCluster())

    if chunk is None:
        admin.protocol.dataReceived(frame)
    else:
        for start in range(0, len(frame), chunk):
            admin.protocol.dataReceived(frame[start : start + chunk])

    response = admin.one()
    assert (response.correlation_id, response.ok) == (21, True)
    assert wire.decode_cluster(response.payload) == EXPECTED_CLUSTER


def test_describe_cluster_is_for_admins_only() -> None:
    server, _ = with_single_node_view()
    consumer = server.connect()
    consumer.login("consumer", "consumer123")

    consumer.send(wire.DescribeCluster(), 5)

    assert consumer.one() == wire.Response(5, b"", "permission_denied")


def test_describe_cluster_needs_authentication() -> None:
    server, _ = with_single_node_view()
    client = server.connect()

    client.send(wire.DescribeCluster(), 4)

    assert client.one() == wire.Response(4, b"", "auth_required")


def test_without_a_cluster_view_describe_cluster_is_an_invalid_operation(world: World) -> None:
    _, server = world
    client = server.connect()
    client.login()

    client.send(wire.DescribeCluster(), 8)

    assert client.one() == wire.Response(8, b"", "invalid_operation")
    assert client.transport.connected, "the connection goes on"


def test_a_view_set_on_the_factory_after_it_was_built_is_the_one_answered(world: World) -> None:
    _, server = world
    client = server.connect()
    client.login()
    control = make_broker_and_control()[3]

    server.factories[-1].cluster = SingleNodeView("late", NODE, control)
    client.send(wire.DescribeCluster(), 9)

    assert wire.decode_cluster(client.one().payload).cluster_id == "late"


# -- verify_cluster ------------------------------------------------------------------------


# -- topic_leaders ------------------------------------------------------------------------


def test_a_producer_is_told_each_ranges_leader_and_where_to_reach_it() -> None:
    server, _ = with_single_node_view()
    producer = server.connect()
    producer.protocol.factory.leader_of = {"orders.0": "n1", "orders.1": "n9"}.get
    producer.login("producer", "producer123")

    producer.send(wire.TopicLeaders("orders"), 3)

    response = producer.one()
    assert (response.correlation_id, response.ok) == (3, True)
    # n9 is no node the view knows alive: that range's records may go to any node.
    assert wire.decode_leaders(response.payload) == wire.LeadersInfo(
        8,
        (
            wire.RangeLeader("orders.0", 0, 128, "n1"),
            wire.RangeLeader("orders.1", 128, 256, None),
        ),
        (wire.LeaderAddress("n1", "broker-1.internal", 4040),),
    )


def test_one_node_names_no_leaders_so_every_range_goes_to_it(world: World) -> None:
    _, server = world
    admin = server.connect()
    admin.login()
    admin.send(wire.CreateTopic("orders", 4))
    admin.responses()

    admin.send(wire.TopicLeaders("orders"), 6)

    assert wire.decode_leaders(admin.one().payload) == wire.LeadersInfo(
        4,
        (wire.RangeLeader("orders.0", 0, 8, None), wire.RangeLeader("orders.1", 8, 16, None)),
        (),
    )


@pytest.mark.parametrize(
    ("user", "topic", "reason"),
    [
        ("consumer", "orders", "permission_denied"),
        ("producer", "nowhere", "no_such_topic"),
        ("producer", None, "no_such_topic"),
    ],
)
def test_topic_leaders_is_refused_without_produce_rights_or_a_topic(
    user: str, topic: str | None, reason: str
) -> None:
    server, _ = with_single_node_view()
    client = server.connect()
    client.login(user, f"{user}123")

    client.send(wire.TopicLeaders(topic), 9)

    assert client.one() == wire.Response(9, b"", reason)
    assert client.transport.connected, "the connection goes on"


class EmptyNode:
    """A requester whose every node answers ``digests`` from ``storage``."""

    def __init__(self, storage: MemoryLogs) -> None:
        self._server = DigestServer(storage)

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        return self._server.serve(payload)


def verifier_of(segments: list[SegmentMeta]) -> ClusterVerifier:
    """n1 (alive, holding no copy) checks a cluster whose n2 is dead."""
    return ClusterVerifier(
        "n1",
        lambda: segments,
        lambda: [("n1", True), ("n2", False)],
        EmptyNode(MemoryLogs()),
        Clock(),
    )


@pytest.mark.parametrize("chunk", [None, 1, 5], ids=["whole", "one byte at a time", "split"])
def test_an_admin_is_told_what_the_verifier_found(world: World, chunk: int | None) -> None:
    _, server = world
    admin = server.connect()
    admin.login()
    meta = SegmentMeta("orders.0", 0, SegmentState.SEALED, 3, 200, ("n1", "n2"), 4)
    server.factories[-1].verifier = verifier_of([meta])
    frame = wire.encode_request(12, wire.VerifyCluster())

    for start in range(0, len(frame), chunk or len(frame)):
        admin.protocol.dataReceived(frame[start : start + (chunk or len(frame))])

    response = admin.one()
    assert (response.correlation_id, response.ok) == (12, True)
    assert wire.decode_verify(response.payload) == wire.VerifyInfo(
        node_id="n1",
        segments_checked=1,
        copies_checked=1,
        copies_unchecked=1,
        problem_count=2,
        problems=(
            wire.VerifyProblemInfo(
                "unavailable", "n2", None, None, (), "dead: its membership lease is gone"
            ),
            wire.VerifyProblemInfo("missing_copy", "n1", "orders.0", 0, (), ""),
        ),
    )


def test_verify_cluster_is_for_admins_only(world: World) -> None:
    _, server = world
    consumer = server.connect()
    consumer.login("consumer", "consumer123")
    server.factories[-1].verifier = verifier_of([])

    consumer.send(wire.VerifyCluster(), 5)

    assert consumer.one() == wire.Response(5, b"", "permission_denied")


def test_without_a_verifier_verify_cluster_is_an_invalid_operation(world: World) -> None:
    _, server = world
    client = server.connect()
    client.login()

    client.send(wire.VerifyCluster(), 8)

    assert client.one() == wire.Response(8, b"", "invalid_operation")
    assert client.transport.connected, "the connection goes on"


# -- subscribe -----------------------------------------------------------------------------


def test_a_subscription_never_has_more_than_its_window_unacknowledged(world: World) -> None:
    clock, server = world
    client = server.connect()
    client.login()
    client.send(wire.CreateTopic("t", 0))
    client.send(wire.Produce("t", tuple(Record(bytes([i])) for i in range(25))))
    client.responses()

    client.send(wire.Subscribe("t", "g", "m", 10, 4), 50)
    clock.advance(0)
    clock.advance(0)
    pushes = client.responses()

    assert [r.correlation_id for r in pushes] == [50, 50, 50]
    counts = [len(wire.decode_records(r.payload).records) for r in pushes]
    assert counts == [4, 4, 2]  # min(max, window - unacked), window 10
    last = wire.decode_records(pushes[-1].payload).next_cursor

    client.send(wire.StreamAck("t", "g", "m", last, 10), 51)
    for _ in range(5):
        clock.advance(0)
    more = client.responses()
    assert sum(len(wire.decode_records(r.payload).records) for r in more) == 10
    assert {r.correlation_id for r in more} == {50}


def test_stream_ack_commits_the_group_position(world: World) -> None:
    _, server = world
    client = server.connect()
    client.login()
    client.send(wire.CreateTopic("t", 0))
    client.send(wire.Produce("t", tuple(Record(bytes([i])) for i in range(3))))
    client.responses()
    client.send(wire.Subscribe("t", "g", "m", 100, 100), 60)
    [push] = client.responses()
    cursor = wire.decode_records(push.payload).next_cursor

    client.send(wire.StreamAck("t", "g", "m", cursor, 3), 61)
    assert client.responses() == []  # stream_ack has no reply when it succeeds

    other = server.connect()
    other.login()
    other.send(wire.Fetch("t", None, "g", None, 0, 0), 1)
    assert wire.decode_records(other.one().payload).records == ()


def test_a_stream_ack_without_a_subscription_is_an_unexpected_frame(world: World) -> None:
    _, server = world
    client = server.connect()
    client.login()

    client.send(wire.StreamAck("t", "g", "m", None, 1), 70)

    assert client.one() == wire.Response(70, b"", "unexpected_frame")


def test_losing_the_connection_cancels_its_long_polls(world: World) -> None:
    clock, server = world
    client = server.connect()
    client.login()
    client.send(wire.CreateTopic("t", 0))
    client.responses()
    client.send(wire.Fetch("t", None, None, None, 0, 30_000))
    client.send(wire.Subscribe("t", "g", "m", 10, 10))

    client.protocol.connectionLost()

    assert clock.getDelayedCalls() == []


def test_draining_answers_long_polls_at_once_and_fails_what_is_left_after_the_grace(
    world: World,
) -> None:
    clock, server = world
    client = server.connect()
    client.login()
    client.send(wire.CreateTopic("t", 0))
    client.responses()
    client.send(wire.Fetch("t", None, None, None, 0, 30_000), 90)
    stuck: Deferred[int] = Deferred()
    client.protocol._track(91, stuck, wire.encode_count)
    [factory] = server.factories

    drained = factory.drain(clock, 5.0)

    [poll] = client.responses()
    assert poll.correlation_id == 90
    assert wire.decode_records(poll.payload).records == ()
    assert not drained.called
    clock.advance(5.0)
    assert drained.called
    assert client.responses() == [wire.Response(91, b"", "unreachable")]
    assert client.transport.disconnecting
    # Once the transport reports the close, nothing of the connection is left scheduled.
    client.protocol.connectionLost()
    assert clock.getDelayedCalls() == []


def test_draining_waits_for_a_produce_to_be_acknowledged(world: World) -> None:
    clock, server = world
    client = server.connect()
    client.login()
    client.send(wire.CreateTopic("t", 0))
    client.responses()
    [factory] = server.factories
    pending: Deferred[int] = Deferred()
    client.protocol._track(91, pending, wire.encode_count)

    drained = factory.drain(clock, 5.0)
    assert not drained.called
    pending.callback(1)

    assert drained.called
    assert client.responses() == [wire.Response(91, wire.encode_count(1))]
    assert client.transport.disconnecting


def test_draining_with_nothing_in_flight_closes_at_once(world: World) -> None:
    clock, server = world
    client = server.connect()
    client.login()
    [factory] = server.factories

    drained = factory.drain(clock, 5.0)

    assert drained.called
    assert client.transport.disconnecting
    # Once the transport reports the close, nothing of the connection is left scheduled.
    client.protocol.connectionLost()
    assert clock.getDelayedCalls() == []


def test_a_close_the_client_does_not_let_finish_is_aborted_after_the_grace(world: World) -> None:
    """A client that stops reading pauses the transport, and a paused transport never finishes
    a ``loseConnection``: the connection (and its slot) would stay for ever."""
    clock, server = world
    transport = AbortableTransport()
    factory = ClientFactory(
        server.broker,  # type: ignore[arg-type]
        server.users,
        clock,
        ProtocolSettings(auth_timeout_ms=1000),
        server.guards,
    )
    protocol = factory.buildProtocol(None)
    protocol.makeConnection(transport)
    clock.advance(1)  # no auth in time: the broker closes
    assert transport.disconnecting
    assert not transport.aborted
    clock.advance(CLOSE_GRACE_SECONDS)
    assert transport.aborted
    protocol.connectionLost()
    assert clock.getDelayedCalls() == []


# -- found in review -----------------------------------------------------------------------


def test_requests_pipelined_behind_auth_wait_for_it(world: World) -> None:
    _, server = world
    executor = ManualExecutor()
    server.users = UserDirectory(server.users._control, executor, CHEAP)
    client = server.connect()

    client.protocol.dataReceived(
        wire.encode_request(1, wire.Auth("admin", "admin123"))
        + wire.encode_request(2, wire.ListUsers())
    )
    assert client.responses() == []
    executor.run_all()

    responses = client.responses()
    assert [r.correlation_id for r in responses] == [1, 2]
    assert all(r.ok for r in responses)


def test_a_malformed_auth_frame_is_malformed_request(world: World) -> None:
    _, server = world
    client = server.connect()

    client.protocol.dataReceived(wire.encode_frame(struct.pack(">HI", 0, 4) + b"\x05"))

    assert client.one() == wire.Response(4, b"", "malformed_request")
    assert client.transport.disconnecting


def test_an_oversized_frame_behind_others_before_auth_still_closes_cleanly(world: World) -> None:
    _, server = world
    client = server.connect(ProtocolSettings(max_frame_size=1024))

    client.protocol.dataReceived(
        wire.encode_request(1, wire.ListUsers())
        + wire.encode_request(2, wire.ListUsers())
        + struct.pack(">I", 5000)
    )

    assert client.responses() == [wire.Response(1, b"", "auth_required")]
    assert client.transport.disconnecting


@pytest.mark.parametrize("group", ["", "g" * 250])
def test_a_bad_group_name_is_an_error_frame_not_a_dropped_connection(
    world: World, group: str
) -> None:
    _, server = world
    client = server.connect()
    client.login()
    client.send(wire.CreateTopic("t", 0))
    client.send(wire.Fetch("t", None, None, None, 0, 0))
    cursor = wire.decode_records(client.responses()[-1].payload).next_cursor

    client.send(wire.Commit("t", group, cursor), 9)

    assert client.one() == wire.Response(9, b"", "invalid_operation")
    assert not client.transport.disconnecting


def test_a_client_that_stops_reading_is_not_read_from_either(world: World) -> None:
    _, server = world
    client = server.connect()
    client.login()

    client.protocol.pauseProducing()  # what the transport does when its buffer fills
    assert client.transport.producerState == "paused"
    client.protocol.resumeProducing()

    assert client.transport.producerState == "producing"


def test_a_connection_with_too_many_requests_in_flight_is_not_read_until_half_are_done(
    world: World,
) -> None:
    _, server = world
    client = server.connect(ProtocolSettings(max_in_flight=4))
    client.login()
    client.send(wire.CreateTopic("t", 0))
    client.responses()

    for correlation_id in range(10, 20):
        client.send(wire.Fetch("t", None, None, None, 0, 30_000), correlation_id)

    assert len(client.protocol._pending) == 4
    assert client.transport.producerState == "paused"
    producer = server.connect()
    producer.login()
    producer.send(wire.Produce("t", (Record(b"v"),)))  # wakes the four long polls

    responses = client.responses()
    assert sorted(r.correlation_id for r in responses) == list(range(10, 20))
    assert client.transport.producerState == "producing"


def test_a_subscription_with_a_large_window_pushes_everything_without_recursing(
    world: World,
) -> None:
    clock, server = world
    client = server.connect()
    client.login()
    client.send(wire.CreateTopic("t", 0))
    client.send(wire.Produce("t", tuple(Record(b"%d" % i) for i in range(1500))))
    client.responses()

    client.send(wire.Subscribe("t", "g", "m", 10_000, 1), 40)
    for _ in range(1600):
        clock.advance(0)

    pushes = client.responses()
    assert sum(len(wire.decode_records(p.payload).records) for p in pushes) == 1500


def test_a_subscribers_group_share_is_handed_over_when_its_connection_goes(world: World) -> None:
    _, server = world
    first = server.connect()
    first.login()
    first.send(wire.CreateTopic("t", 0))
    first.responses()
    first.send(wire.Subscribe("t", "g", "gone", 10, 10))
    second = server.connect()
    second.login()
    second.send(wire.Fetch("t", None, "g", "stays", 0, 0))
    second.responses()

    first.protocol.connectionLost()

    # The broker's one-node group coordinator (``LocalGroups``) keeps each group's members.
    assert server.broker._groups._groups[("t", "g")].members == ["stays"]


def test_names_and_cursors_that_are_not_utf8_get_the_reason_of_what_they_name(
    world: World,
) -> None:
    _, server = world
    client = server.connect()
    client.login()
    client.send(wire.CreateTopic("t", 0))
    client.responses()

    client.send(wire.CreateTopic("\udcff", 0), 1)
    client.send(wire.Fetch("t", "\udcff", None, None, 0, 0), 2)

    assert client.responses() == [
        wire.Response(1, b"", "invalid_topic_name"),
        wire.Response(2, b"", "invalid_cursor"),
    ]


def test_a_tcp_connection_sends_its_frames_at_once(world: World) -> None:
    _, server = world
    factory = ClientFactory(
        server.broker,  # type: ignore[arg-type]
        server.users,
        server.clock,
        ProtocolSettings(),
        server.guards,
    )
    transport = TcpTransport()

    factory.buildProtocol(None).makeConnection(transport)

    assert transport.no_delay
