"""The blocking cluster client (``logbroker.client.cluster``) against scripted nodes: which node
each share goes to, with which stamp, and what it does when a node refuses or goes away. Its
run against three real nodes is in ``tests/integration/test_cluster.py``."""

from __future__ import annotations

import socket

import pytest

from logbroker import wire
from logbroker.client._errors import BrokerRefused, ConnectionClosed
from logbroker.client._retry import ProduceRetry
from logbroker.client.blocking import BlockingClient
from logbroker.client.cluster import BlockingClusterClient
from logbroker.key_routing import key_slot
from logbroker.records import Record

FAST = ProduceRetry(first_delay=0.001, max_delay=0.001, jitter=0)
#: Keyspace of one bit, two ranges: slot 0 led by n1, slot 1 by n2.
TWO_RANGES = (wire.RangeLeader("t.0", 0, 1, "n1"), wire.RangeLeader("t.1", 1, 2, "n2"))
ADDRESSES = (wire.LeaderAddress("n1", "h1", 1), wire.LeaderAddress("n2", "h2", 2))


def leaders(*ranges: wire.RangeLeader) -> wire.LeadersInfo:
    return wire.LeadersInfo(1, ranges or TWO_RANGES, ADDRESSES)


class ScriptedNode(BlockingClient):
    """A node that answers each produce with the next of ``answers`` (a count is taken from
    the request) and ``topic_leaders`` with ``leaders``; it keeps what it was sent."""

    def __init__(
        self,
        name: str,
        answers: list[str | Exception] | None = None,
        leaders: wire.LeadersInfo | Exception | None = None,
    ) -> None:
        super().__init__(socket.socket())
        self.name = name
        self.answers = answers or []
        self.leaders = leaders
        self.produced: list[wire.ProduceIdempotent] = []
        self._requests: dict[int, wire.Request] = {}
        self.closed = False

    def send(self, request: wire.Request) -> int:
        if self.closed:
            raise ConnectionClosed(f"{self.name} is closed")
        correlation_id = len(self._requests) + 1
        self._requests[correlation_id] = request
        if isinstance(request, wire.ProduceIdempotent):
            self.produced.append(request)
        return correlation_id

    def answer(self, correlation_id: int) -> bytes:
        request = self._requests[correlation_id]
        answer: str | Exception = self.answers.pop(0) if self.answers else "ok"
        if isinstance(answer, Exception):
            raise answer
        if answer != "ok":
            raise BrokerRefused(answer, correlation_id)
        assert isinstance(request, wire.ProduceIdempotent)
        return wire.encode_count(request.records.count)

    def topic_leaders(self, topic: str) -> wire.LeadersInfo:
        if isinstance(self.leaders, Exception):
            raise self.leaders
        assert self.leaders is not None, f"{self.name} was not asked to know the leaders"
        return self.leaders

    def close(self) -> None:
        self.closed = True
        super().close()


def cluster_of(*nodes: ScriptedNode) -> tuple[BlockingClusterClient, list[str]]:
    """A cluster client whose servers are ``nodes`` (the first is the node for everything
    else; leaders n1 and n2 are found by name), and the names it connected to, in order."""
    by_address = {("h1", 1): "n1", ("h2", 2): "n2", ("seed", 0): nodes[0].name}
    named = {node.name: node for node in nodes}
    connected: list[str] = []

    def connect(host: str, port: int) -> BlockingClient:
        name = by_address[(host, port)]
        node = named.get(name)
        if node is None or node.closed:
            raise ConnectionRefusedError(f"{name} is down")
        connected.append(name)
        return node

    return BlockingClusterClient([("seed", 0)], connect, FAST), connected


def keyed_for(slot: int) -> bytes:
    """A key whose slot, in a keyspace of one bit, is ``slot``."""
    return next(b"k%d" % n for n in range(100) if key_slot(b"k%d" % n, 1) == slot)


RECORDS = [Record(b"a", key=keyed_for(0)), Record(b"b", key=keyed_for(1))]


def test_each_share_goes_to_its_leader_with_the_produces_stamp() -> None:
    seed = ScriptedNode("seed", leaders=leaders())
    n1, n2 = ScriptedNode("n1"), ScriptedNode("n2")
    client, _ = cluster_of(seed, n1, n2)

    assert client.produce("t", RECORDS) == 2

    assert [wire.decode_wire_records(p.records) for p in n1.produced] == [(RECORDS[0],)]
    assert [wire.decode_wire_records(p.records) for p in n2.produced] == [(RECORDS[1],)]
    assert seed.produced == []
    assert n1.produced[0].stamp == n2.produced[0].stamp
    assert n1.produced[0].stamp.producer_id == client.producer_id


def test_a_share_refused_not_primary_goes_again_to_the_new_leader_with_the_same_stamp() -> None:
    moved = leaders(wire.RangeLeader("t.0", 0, 1, "n1"), wire.RangeLeader("t.1", 1, 2, "n1"))
    seed = ScriptedNode("seed", leaders=leaders())
    n1, n2 = ScriptedNode("n1"), ScriptedNode("n2", answers=["not_primary"])
    client, _ = cluster_of(seed, n1, n2)
    # Asked again after the refusal, the seed names n1 for both ranges.
    original = seed.topic_leaders
    asked = []

    def topic_leaders(topic: str) -> wire.LeadersInfo:
        asked.append(topic)
        return original(topic) if len(asked) == 1 else moved

    seed.topic_leaders = topic_leaders  # type: ignore[method-assign]

    assert client.produce("t", RECORDS) == 2

    assert asked == ["t", "t"]
    assert [wire.decode_wire_records(p.records) for p in n1.produced] == [
        (RECORDS[0],),
        (RECORDS[1],),
    ]
    assert len({p.stamp for p in [*n1.produced, *n2.produced]}) == 1


def test_a_leader_it_cannot_reach_gets_its_share_through_the_node() -> None:
    seed = ScriptedNode("seed", leaders=leaders())
    n1 = ScriptedNode("n1")
    client, connected = cluster_of(seed, n1)  # n2 is down

    assert client.produce("t", RECORDS) == 2

    assert [wire.decode_wire_records(p.records) for p in seed.produced] == [(RECORDS[1],)]
    assert connected == ["seed", "n1"]


def test_a_broker_without_topic_leaders_takes_every_produce_whole() -> None:
    seed = ScriptedNode("seed", leaders=BrokerRefused("unknown_api_key", 1))
    client, _ = cluster_of(seed)

    assert client.produce("t", RECORDS) == 2
    assert client.produce("t", RECORDS[:1]) == 1

    assert [p.records.count for p in seed.produced] == [2, 1]


@pytest.mark.parametrize("reason", ["permission_denied", "no_such_topic"])
def test_a_refusal_no_retry_cures_is_raised_at_once(reason: str) -> None:
    seed = ScriptedNode("seed", leaders=leaders())
    n1, n2 = ScriptedNode("n1"), ScriptedNode("n2", answers=[reason])
    client, _ = cluster_of(seed, n1, n2)

    with pytest.raises(BrokerRefused) as refused:
        client.produce("t", RECORDS)

    assert refused.value.reason == reason
    assert len(n2.produced) == 1


def test_a_leader_that_stops_answering_is_asked_again_through_new_leaders() -> None:
    seed = ScriptedNode("seed", leaders=leaders())
    n1, n2 = ScriptedNode("n1"), ScriptedNode("n2", answers=[ConnectionClosed("n2 went away")])
    client, connected = cluster_of(seed, n1, n2)

    assert client.produce("t", RECORDS) == 2

    # n2's connection was closed; the retry reconnected to it (the scripted n2 is closed now,
    # so the retry went through the node, which forwards it).
    assert n2.closed
    assert [wire.decode_wire_records(p.records) for p in seed.produced] == [(RECORDS[1],)]
    assert connected == ["seed", "n1", "n2"]


def test_no_server_answering_is_a_connection_error() -> None:
    def refuse(host: str, port: int) -> BlockingClient:
        raise ConnectionRefusedError(f"{host}:{port} refused")

    with pytest.raises(ConnectionClosed, match="no server of the cluster answered"):
        BlockingClusterClient([("a", 1), ("b", 2)], refuse).node  # noqa: B018


def test_a_cluster_client_needs_a_server() -> None:
    with pytest.raises(ValueError, match="at least one server"):
        BlockingClusterClient([], lambda host, port: ScriptedNode("x"))
