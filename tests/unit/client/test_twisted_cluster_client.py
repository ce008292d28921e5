"""The Twisted cluster client (``logbroker.client.ClusterClient``) against scripted nodes on a
Clock: which node each share goes to, with which stamp, that shares and produces are in flight
together, and what it does when a node refuses or goes away. Its run against three real nodes
is in ``tests/integration/test_cluster.py``."""

from __future__ import annotations

from typing import Any, cast

import pytest
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.task import Clock

from logbroker import wire
from logbroker.client import BrokerClient, BrokerRefused, ClusterClient, ConnectionClosed
from logbroker.client._retry import ProduceRetry
from logbroker.records import Record
from logbroker.wire import PRODUCER_WINDOW
from tests.unit.client.test_cluster_client import RECORDS, TWO_RANGES, keyed_for, leaders
from tests.unit.storage.helpers import failure_of, result_of

FAST = ProduceRetry(first_delay=0.001, max_delay=0.001, jitter=0)


class ScriptedNode:
    """A node that answers each produce with the next of ``answers`` ("ok" gives the
    request's count; "hold" keeps it waiting in ``held``) and ``topic_leaders`` with
    ``leaders``; it keeps what it was sent."""

    def __init__(
        self,
        name: str,
        answers: list[str | Exception] | None = None,
        leaders: wire.LeadersInfo | Exception | None = None,
    ) -> None:
        self.name = name
        self.answers = answers or []
        self.leaders = leaders
        self.produced: list[wire.ProduceIdempotent] = []
        self.held: list[Deferred[bytes]] = []
        self.asked = 0
        self.closed = False

    def request(self, request: wire.Request) -> Deferred[bytes]:
        if self.closed:
            return fail(ConnectionClosed(f"{self.name} is closed"))
        assert isinstance(request, wire.ProduceIdempotent)
        self.produced.append(request)
        answer: str | Exception = self.answers.pop(0) if self.answers else "ok"
        if isinstance(answer, Exception):
            return fail(answer)
        if answer == "hold":
            held: Deferred[bytes] = Deferred()
            self.held.append(held)
            return held
        if answer != "ok":
            return fail(BrokerRefused(answer, 1))
        return succeed(wire.encode_count(request.records.count))

    def topic_leaders(self, topic: str) -> Deferred[wire.LeadersInfo]:
        self.asked += 1
        if isinstance(self.leaders, Exception):
            return fail(self.leaders)
        assert self.leaders is not None, f"{self.name} was not asked to know the leaders"
        return succeed(self.leaders)

    def close(self) -> Deferred[None]:
        self.closed = True
        return succeed(None)

    def release(self) -> None:
        """Answer the held produces: acknowledged."""
        held, self.held = self.held, []
        for waiting in held:
            waiting.callback(wire.encode_count(1))


def cluster_of(*nodes: ScriptedNode) -> tuple[ClusterClient, list[str], Clock]:
    """A cluster client whose server is the first of ``nodes`` (leaders n1 and n2 are found by
    name), the names it connected to, in order, and its clock."""
    by_address = {("h1", 1): "n1", ("h2", 2): "n2", ("seed", 0): nodes[0].name}
    named = {node.name: node for node in nodes}
    connected: list[str] = []

    def connect(host: str, port: int) -> Deferred[BrokerClient]:
        name = by_address[(host, port)]
        node = named.get(name)
        if node is None or node.closed:
            return fail(ConnectionRefusedError(f"{name} is down"))
        connected.append(name)
        return succeed(cast(Any, node))

    clock = Clock()
    return ClusterClient([("seed", 0)], connect, clock=clock, produce_retry=FAST), connected, clock


def records_of(node: ScriptedNode) -> list[tuple[Record, ...]]:
    return [wire.decode_wire_records(p.records) for p in node.produced]


def test_each_share_goes_to_its_leader_with_the_produces_stamp() -> None:
    seed = ScriptedNode("seed", leaders=leaders())
    n1, n2 = ScriptedNode("n1"), ScriptedNode("n2")
    client, connected, _ = cluster_of(seed, n1, n2)

    assert result_of(client.produce("t", RECORDS)) == 2

    assert records_of(n1) == [(RECORDS[0],)]
    assert records_of(n2) == [(RECORDS[1],)]
    assert seed.produced == []
    assert n1.produced[0].stamp == n2.produced[0].stamp
    assert n1.produced[0].stamp.producer_id == client.producer_id
    assert connected == ["seed", "n1", "n2"]


def test_shares_and_produces_are_in_flight_together_up_to_the_window() -> None:
    seed = ScriptedNode("seed", leaders=leaders())
    n1 = ScriptedNode("n1", answers=["hold"] * (PRODUCER_WINDOW + 1))
    n2 = ScriptedNode("n2")
    client, connected, _ = cluster_of(seed, n1, n2)

    produces = [client.produce("t", RECORDS) for _ in range(PRODUCER_WINDOW + 1)]

    # Every produce in the window sent both shares; the one past it waits for the oldest.
    assert len(n1.produced) == len(n2.produced) == PRODUCER_WINDOW
    assert [p.stamp.sequence for p in n1.produced] == list(range(PRODUCER_WINDOW))
    assert not any(produce.called for produce in produces)
    assert seed.asked == 1
    assert connected == ["seed", "n1", "n2"]
    n1.release()
    n1.release()
    assert [result_of(produce) for produce in produces] == [2] * (PRODUCER_WINDOW + 1)


def test_a_share_refused_not_primary_goes_again_to_the_new_leader_with_the_same_stamp() -> None:
    moved = leaders(wire.RangeLeader("t.0", 0, 1, "n1"), wire.RangeLeader("t.1", 1, 2, "n1"))
    seed = ScriptedNode("seed", leaders=leaders())
    n1, n2 = ScriptedNode("n1"), ScriptedNode("n2", answers=["not_primary"])
    client, _, clock = cluster_of(seed, n1, n2)

    produced = client.produce("t", RECORDS)
    seed.leaders = moved
    clock.advance(0.001)

    assert result_of(produced) == 2
    assert seed.asked == 2
    assert records_of(n1) == [(RECORDS[0],), (RECORDS[1],)]
    assert len({p.stamp for p in [*n1.produced, *n2.produced]}) == 1


def test_a_leader_it_cannot_reach_gets_its_share_through_the_node() -> None:
    seed = ScriptedNode("seed", leaders=leaders())
    n1 = ScriptedNode("n1")
    client, connected, _ = cluster_of(seed, n1)  # n2 is down

    assert result_of(client.produce("t", RECORDS)) == 2

    assert records_of(seed) == [(RECORDS[1],)]
    assert connected == ["seed", "n1"]


def test_a_leader_that_stops_answering_is_let_go_and_its_share_retried_elsewhere() -> None:
    seed = ScriptedNode("seed", leaders=leaders())
    n1, n2 = ScriptedNode("n1"), ScriptedNode("n2", answers=[ConnectionClosed("n2 went away")])
    client, connected, clock = cluster_of(seed, n1, n2)

    produced = client.produce("t", RECORDS)
    n2.closed = True  # down for good: the retry cannot reconnect to it
    clock.advance(0.001)

    assert result_of(produced) == 2
    assert records_of(seed) == [(RECORDS[1],)]
    assert seed.asked == 2
    assert connected == ["seed", "n1", "n2"]


def test_a_broker_without_topic_leaders_takes_every_produce_whole() -> None:
    seed = ScriptedNode("seed", leaders=BrokerRefused("unknown_api_key", 1))
    client, _, _ = cluster_of(seed)

    assert result_of(client.produce("t", RECORDS)) == 2
    assert result_of(client.produce("t", RECORDS[:1])) == 1

    assert [p.records.count for p in seed.produced] == [2, 1]
    assert seed.asked == 1


@pytest.mark.parametrize("reason", ["permission_denied", "no_such_topic"])
def test_a_refusal_no_retry_cures_fails_the_produce_at_once(reason: str) -> None:
    seed = ScriptedNode("seed", leaders=leaders())
    n1, n2 = ScriptedNode("n1"), ScriptedNode("n2", answers=[reason])
    client, _, _ = cluster_of(seed, n1, n2)

    refused = failure_of(client.produce("t", RECORDS)).value

    assert isinstance(refused, BrokerRefused)
    assert refused.reason == reason
    assert len(n2.produced) == 1


def test_a_produce_still_refused_when_its_retries_run_out_fails_with_the_refusal() -> None:
    seed = ScriptedNode("seed", leaders=leaders())
    n1 = ScriptedNode("n1", answers=["no_quorum"] * 100)
    client, _, clock = cluster_of(seed, n1, ScriptedNode("n2"))

    produced = client.produce("t", RECORDS[:1], give_up_after=0.01)
    clock.pump([0.001] * 20)

    refused = failure_of(produced).value
    assert isinstance(refused, BrokerRefused)
    assert refused.reason == "no_quorum"
    assert 5 <= len(n1.produced) <= 11


def test_no_server_answering_fails_with_a_connection_error() -> None:
    def refuse(host: str, port: int) -> Deferred[BrokerClient]:
        return fail(ConnectionRefusedError(f"{host}:{port} refused"))

    client = ClusterClient([("a", 1), ("b", 2)], refuse, clock=Clock())

    error = failure_of(client.node()).value
    assert isinstance(error, ConnectionClosed)
    assert "no server of the cluster answered" in str(error)
    assert "b:2" in str(error)


def test_the_node_connection_moves_to_the_next_server_once_closed() -> None:
    a, b = ScriptedNode("a"), ScriptedNode("b")
    nodes = {("a", 1): a, ("b", 2): b}
    client = ClusterClient(
        [("a", 1), ("b", 2)],
        lambda host, port: succeed(cast(Any, nodes[(host, port)])),
        clock=Clock(),
    )

    assert result_of(client.node()) is a
    a.closed = True
    assert result_of(client.node()) is b


def test_close_closes_every_connection() -> None:
    seed = ScriptedNode("seed", leaders=leaders())
    n1, n2 = ScriptedNode("n1"), ScriptedNode("n2")
    client, _, _ = cluster_of(seed, n1, n2)
    assert result_of(client.produce("t", RECORDS)) == 2

    client.close()

    assert seed.closed
    assert n1.closed
    assert n2.closed


def test_a_cluster_client_needs_a_server() -> None:
    with pytest.raises(ValueError, match="at least one server"):
        ClusterClient([], lambda host, port: fail(ConnectionRefusedError()), clock=Clock())


def test_keyless_records_turn_between_ranges_from_produce_to_produce_by_stamp() -> None:
    seed = ScriptedNode("seed", leaders=leaders(*TWO_RANGES))
    n1, n2 = ScriptedNode("n1"), ScriptedNode("n2")
    client, _, _ = cluster_of(seed, n1, n2)

    for _ in range(8):
        assert result_of(client.produce("t", [Record(b"x"), Record(b"y", key=keyed_for(0))])) == 2

    # Each produce's keyless record went whole to one range, and not always the same one.
    assert len(n1.produced) + len(n2.produced) >= 8
    assert n2.produced, "keyless records never went to the second range"
