"""The blocking client (``logbroker.client.blocking``) over one end of a socket pair: what it
sends, and how it reads what the broker answers."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from logbroker import wire
from logbroker.client.blocking import BlockingClient, BrokerRefused, ProduceRetry
from logbroker.records import ProducerStamp, Record

CLUSTER = wire.ClusterInfo(
    cluster_id="prod",
    node_id="n1",
    control_plane="local",
    chores_holder="n1",
    domain_violations=0,
    lease_age_ms=None,
    nodes=(wire.ClusterNodeInfo("n1", "::1", 4040, 4041, 4042, True, 2, (("zone", "a"),)),),
    under_replicated=3,
)


@pytest.fixture
def pair() -> Iterator[tuple[BlockingClient, socket.socket]]:
    near, far = socket.socketpair()
    near.settimeout(5)
    far.settimeout(5)
    client = BlockingClient(near)
    yield client, far
    client.close()
    far.close()


def requests_read(far: socket.socket) -> list[wire.ReceivedRequest]:
    decoder = wire.FrameDecoder()
    bodies: list[bytes] = []
    while not bodies:
        bodies = decoder.feed(far.recv(1 << 16))
    return [wire.decode_request(body) for body in bodies]


def test_describe_cluster_sends_its_request_and_decodes_the_answer(
    pair: tuple[BlockingClient, socket.socket],
) -> None:
    client, far = pair
    # Answered ahead of time: the client sends correlation id 1 first.
    far.sendall(wire.encode_ok(1, wire.encode_cluster(CLUSTER)))

    assert client.describe_cluster() == CLUSTER
    assert requests_read(far) == [wire.ReceivedRequest(1, wire.DescribeCluster())]


def test_describe_cluster_refused_raises_with_the_reason(
    pair: tuple[BlockingClient, socket.socket],
) -> None:
    client, far = pair
    far.sendall(wire.encode_error(1, "permission_denied"))

    with pytest.raises(BrokerRefused) as refused:
        client.describe_cluster()

    assert (refused.value.reason, refused.value.correlation_id) == ("permission_denied", 1)


def test_topic_leaders_sends_its_request_and_decodes_the_answer(
    pair: tuple[BlockingClient, socket.socket],
) -> None:
    client, far = pair
    leaders = wire.LeadersInfo(
        1,
        (wire.RangeLeader("t.0", 0, 1, "n2"), wire.RangeLeader("t.1", 1, 2, None)),
        (wire.LeaderAddress("n2", "broker-2", 4040),),
    )
    far.sendall(wire.encode_ok(1, wire.encode_leaders(leaders)))

    assert client.topic_leaders("t") == leaders
    assert requests_read(far) == [wire.ReceivedRequest(1, wire.TopicLeaders("t"))]


FAST = ProduceRetry(first_delay=0.001, max_delay=0.001, jitter=0)


def test_each_produce_is_stamped_with_the_clients_producer_id_and_its_own_sequence(
    pair: tuple[BlockingClient, socket.socket],
) -> None:
    client, far = pair
    far.sendall(wire.encode_ok(1, wire.encode_count(1)) + wire.encode_ok(2, wire.encode_count(2)))

    assert client.produce("t", [Record(b"a")]) == 1
    assert client.produce("t", [Record(b"b"), Record(b"c")]) == 2

    sent = [request.request for request in requests_read(far)]
    assert sent == [
        wire.ProduceIdempotent("t", ProducerStamp(client.producer_id, 0), (Record(b"a"),)),
        wire.ProduceIdempotent(
            "t", ProducerStamp(client.producer_id, 1), (Record(b"b"), Record(b"c"))
        ),
    ]


def test_a_produce_refused_try_again_is_sent_again_with_the_same_stamp() -> None:
    near, far = socket.socketpair()
    with BlockingClient(near, FAST) as client, far:
        far.sendall(
            wire.encode_error(1, "unreachable")
            + wire.encode_error(2, "no_quorum")
            + wire.encode_ok(3, wire.encode_count(1))
        )

        assert client.produce("t", [Record(b"v")]) == 1

        first, second, third = (request.request for request in requests_read(far))
        assert first == second == third
        assert isinstance(first, wire.ProduceIdempotent)


@pytest.mark.parametrize(
    ("reason", "produce_retry", "give_up_after"),
    [
        ("no_such_topic", FAST, None),
        ("unreachable", None, None),
        ("unreachable", ProduceRetry(first_delay=1.0, jitter=0), 0.5),
    ],
    ids=["not retried", "retries off", "no time left"],
)
def test_a_produce_that_is_not_retried_raises_its_refusal(
    reason: str, produce_retry: ProduceRetry | None, give_up_after: float | None
) -> None:
    near, far = socket.socketpair()
    with BlockingClient(near, produce_retry) as client, far:
        far.sendall(wire.encode_error(1, reason))

        with pytest.raises(BrokerRefused) as refused:
            client.produce("t", [Record(b"v")], give_up_after=give_up_after)

        assert refused.value.reason == reason
        assert len(requests_read(far)) == 1


def test_a_broker_without_produce_idempotent_is_sent_plain_produces(
    pair: tuple[BlockingClient, socket.socket],
) -> None:
    client, far = pair
    far.sendall(
        wire.encode_error(1, "unknown_api_key")
        + wire.encode_ok(2, wire.encode_count(1))
        + wire.encode_ok(3, wire.encode_count(1))
    )

    assert client.produce("t", [Record(b"a")]) == 1
    assert client.produce("t", [Record(b"b")]) == 1

    sent = [request.request for request in requests_read(far)]
    assert isinstance(sent[0], wire.ProduceIdempotent)
    assert sent[1:] == [wire.Produce("t", (Record(b"a"),)), wire.Produce("t", (Record(b"b"),))]


def test_verify_cluster_waits_as_long_as_asked_then_restores_the_timeout(
    pair: tuple[BlockingClient, socket.socket],
) -> None:
    client, far = pair
    report = wire.VerifyInfo("n1", 2, 6, 0, 0, ())
    far.sendall(wire.encode_ok(1, wire.encode_verify(report)))

    assert client.verify_cluster(timeout=0.5) == report
    assert requests_read(far) == [wire.ReceivedRequest(1, wire.VerifyCluster())]
    assert client._socket.gettimeout() == 5


def test_verify_cluster_gives_up_after_its_timeout(
    pair: tuple[BlockingClient, socket.socket],
) -> None:
    client, _ = pair

    with pytest.raises(TimeoutError):
        client.verify_cluster(timeout=0.05)

    assert client._socket.gettimeout() == 5
