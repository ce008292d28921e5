"""The blocking client (``logbroker.client.blocking``) over one end of a socket pair: what it
sends, and how it reads what the broker answers."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from logbroker import wire
from logbroker.client.blocking import BlockingClient, BrokerRefused

CLUSTER = wire.ClusterInfo(
    cluster_id="prod",
    node_id="n1",
    control_plane="local",
    chores_holder="n1",
    domain_violations=0,
    lease_age_ms=None,
    nodes=(wire.ClusterNodeInfo("n1", "::1", 4040, 4041, 4042, True, 2, (("zone", "a"),)),),
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
