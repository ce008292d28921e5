"""The pure helpers of ``bench/replicated_produce.py`` and ``bench/_cluster.py``: the order of the
setups, what a node's data directory holds of a topic, the copies, and the forwarded fraction.
The benchmark's sanity check that replication happened is only as right as these counts."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from logbroker.records import Record
from logbroker.storage._format import encode_batch
from logbroker.storage._segment import segment_stem
from tests.bench_scripts import load_bench_script

replicated = load_bench_script("replicated_produce")
cluster = load_bench_script("_cluster")
Stored = replicated.Stored


def _batch(base_offset: int, count: int) -> bytes:
    return encode_batch(base_offset, [Record(b"v" * 100) for _ in range(count)])


def _segment(data: Path, range_id: str, base_offset: int, content: bytes) -> None:
    directory = data / "ranges" / range_id
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{segment_stem(base_offset)}.log").write_bytes(content)


# -- round order --------------------------------------------------------------------------


def test_the_order_rotates_by_one_each_round() -> None:
    setups = ["single", "off", "on"]

    assert [replicated.round_order(setups, number) for number in range(1, 5)] == [
        ["single", "off", "on"],
        ["off", "on", "single"],
        ["on", "single", "off"],
        ["single", "off", "on"],
    ]


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_over_as_many_rounds_as_setups_each_runs_once_in_each_position(count: int) -> None:
    setups = list(range(count))
    orders = [replicated.round_order(setups, number) for number in range(1, count + 1)]

    for position in range(count):
        assert sorted(order[position] for order in orders) == setups


# -- what a node stores -------------------------------------------------------------------


def test_stored_counts_the_records_of_whole_batches_in_every_segment_of_each_range(
    tmp_path: Path,
) -> None:
    first = _batch(0, 100) + _batch(100, 25)
    second = _batch(125, 10)
    _segment(tmp_path, "round1-rf3.0", 0, first)
    _segment(tmp_path, "round1-rf3.0", 125, second)
    _segment(tmp_path, "round1-rf3.1", 0, _batch(0, 7))

    assert replicated.stored(str(tmp_path), "round1-rf3") == {
        "round1-rf3.0": Stored(135, len(first) + len(second)),
        "round1-rf3.1": Stored(7, len(_batch(0, 7))),
    }


def test_a_torn_batch_at_the_end_counts_its_bytes_but_not_its_records(tmp_path: Path) -> None:
    whole = _batch(0, 10)
    torn = _batch(10, 10)[:-5]
    _segment(tmp_path, "t.0", 0, whole + torn)

    assert replicated.stored(str(tmp_path), "t") == {"t.0": Stored(10, len(whole) + len(torn))}


def test_only_the_topics_own_ranges_and_segment_logs_count(tmp_path: Path) -> None:
    _segment(tmp_path, "round1-rf3.0", 0, _batch(0, 3))
    _segment(tmp_path, "round10-rf3.0", 0, _batch(0, 5))
    _segment(tmp_path, "round1-rf3x.0", 0, _batch(0, 5))
    directory = tmp_path / "ranges" / "round1-rf3.0"
    (directory / f"{segment_stem(0)}.index").write_bytes(b"\0" * 64)
    (directory / "notes.log").write_bytes(_batch(0, 5))

    assert replicated.topic_ranges(str(tmp_path), "round1-rf3") == ["round1-rf3.0"]
    assert replicated.stored(str(tmp_path), "round1-rf3") == {
        "round1-rf3.0": Stored(3, len(_batch(0, 3)))
    }
    assert replicated.log_sizes(str(tmp_path), "round1-rf3") == {"round1-rf3.0": len(_batch(0, 3))}


def test_a_data_directory_without_the_topic_holds_nothing_of_it(tmp_path: Path) -> None:
    assert replicated.stored(str(tmp_path / "missing"), "t") == {}
    os.makedirs(tmp_path / "ranges")
    assert replicated.log_sizes(str(tmp_path), "t") == {}


# -- copies -------------------------------------------------------------------------------


def test_every_node_holding_every_record_is_as_many_copies_as_nodes() -> None:
    held = {"a": Stored(10, 1400), "b": Stored(30, 4200)}
    by_node = {node: dict(held) for node in ("n1", "n2", "n3")}

    assert replicated.copies(by_node) == 3.0


def test_copies_count_each_range_against_the_most_any_node_holds_of_it() -> None:
    by_node = {
        "n1": {"a": Stored(10, 0), "b": Stored(30, 0)},
        "n2": {"a": Stored(10, 0), "b": Stored(20, 0)},
        "n3": {"b": Stored(30, 0)},
    }

    # 100 records stored, 40 distinct (10 of a, 30 of b).
    assert replicated.copies(by_node) == 100 / 40


def test_one_copy_of_each_range_where_each_node_holds_its_own() -> None:
    by_node = {"n1": {"a": Stored(10, 0)}, "n2": {"b": Stored(5, 0)}, "n3": {}}

    assert replicated.copies(by_node) == 1.0


def test_copies_of_nothing_are_not_a_number() -> None:
    assert math.isnan(replicated.copies({"n1": {}, "n2": {}}))
    assert math.isnan(replicated.copies({"n1": {}, "n2": {}}, by_range=False))


def test_independent_nodes_copies_count_against_the_most_records_any_node_holds() -> None:
    # Each node spread the same 40 keyless records over its ranges its own way; n3 is short.
    by_node = {
        "n1": {"a": Stored(10, 0), "b": Stored(30, 0)},
        "n2": {"a": Stored(20, 0), "b": Stored(20, 0)},
        "n3": {"a": Stored(30, 0)},
    }

    assert replicated.copies(by_node, by_range=False) == 110 / 40
    # By range, n2's 20 of a and n1's 30 of b would count as 50 distinct records.
    assert replicated.copies(by_node) == 110 / 60


# -- forwarded fraction -------------------------------------------------------------------


def test_the_forwarded_fraction_counts_each_nodes_records_led_elsewhere() -> None:
    placement = cluster.Placement(
        leaders={"t.0": "n1", "t.1": "n2", "t.2": "n3", "t.3": "n1"},
        per_request={"n1": 50, "n2": 22, "n3": 28},
    )
    # Each node acknowledged 10 requests of 100 records.
    acknowledged = {"n1": 1000, "n2": 1000, "n3": 1000}

    fraction = cluster.forwarded_fraction(placement, acknowledged, batch=100, keys=100)

    assert fraction == pytest.approx((500 + 780 + 720) / 3000)


def test_a_node_leading_everything_forwards_nothing_from_its_producers() -> None:
    placement = cluster.Placement(leaders={"t.0": "n1"}, per_request={"n1": 100, "n2": 0})

    assert cluster.forwarded_fraction(placement, {"n1": 500, "n2": 0}, 100, 100) == 0.0
    assert cluster.forwarded_fraction(placement, {"n1": 0, "n2": 500}, 100, 100) == 1.0


def _shares(by_leader: dict[str, list[bytes]]) -> object:
    return cluster.LeaderShares(
        addresses={leader: ("127.0.0.1", 1) for leader in by_leader},
        frames={leader: b"frame-" + leader.encode() for leader in by_leader},
        records={
            leader: tuple(Record(b"v", key=key) for key in keys)
            for leader, keys in by_leader.items()
        },
    )


def test_shares_cut_by_leaders_that_agree_with_etcd_forward_nothing() -> None:
    placement = cluster.Placement(
        leaders={"t.0": "n1", "t.1": "n2"},
        per_request={"n1": 2, "n2": 1},
        key_leaders={b"a": "n1", b"b": "n1", b"c": "n2"},
    )

    agreeing = _shares({"n1": [b"a", b"b"], "n2": [b"c"]})
    astray = _shares({"n1": [b"a"], "n2": [b"b", b"c"]})

    assert cluster.shares_forwarded(placement, agreeing) == 0.0
    assert cluster.shares_forwarded(placement, astray) == pytest.approx(1 / 3)


class _HeldConnection:
    """A load connection whose answers the test gives."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    def send(self, frame: bytes, due: float, answered: object) -> None:
        self.sent.append((frame, answered))


def test_a_request_cut_by_leaders_is_answered_once_every_share_is_with_the_first_error() -> None:
    from logbroker import wire

    n1, n2 = _HeldConnection(), _HeldConnection()
    producer = cluster._SharesConnection({"n1": n1, "n2": n2}, {"n1": b"one", "n2": b"two"})
    answers: list[tuple[wire.Response, float]] = []

    producer.send(b"ignored", 7.0, lambda response, due: answers.append((response, due)))

    assert [frame for frame, _ in n1.sent] == [b"one"]
    assert [frame for frame, _ in n2.sent] == [b"two"]
    refused = wire.Response(1, b"", "no_quorum")
    n2.sent[0][1](refused, 7.0)  # type: ignore[operator]
    assert answers == []
    n1.sent[0][1](wire.Response(2, b""), 7.0)  # type: ignore[operator]
    assert answers == [(refused, 7.0)]


# -- keyless records ----------------------------------------------------------------------


def _keyless_placement() -> object:
    return cluster.Placement(
        leaders={"t.0": "n1", "t.1": "n2", "t.2": "n2", "t.3": "n1"},
        per_request={"n1": 0, "n2": 0, "n3": 0},
        range_leaders=("n1", "n2", "n2", "n1"),
    )


def test_keyless_requests_are_led_by_each_node_as_the_share_of_ranges_it_leads() -> None:
    led = cluster.keyless_led(_keyless_placement(), ["n1", "n2", "n3"])

    assert led == {"n1": 0.5, "n2": 0.5, "n3": 0.0}


def test_keyless_records_a_node_takes_are_forwarded_for_the_ranges_it_does_not_lead() -> None:
    placement = _keyless_placement()

    # n1 and n2 lead half the ranges each, n3 none: all of n3's requests go on.
    fraction = cluster.keyless_forwarded_fraction(placement, {"n1": 1000, "n2": 1000, "n3": 2000})

    assert fraction == pytest.approx((500 + 500 + 2000) / 4000)
    assert math.isnan(cluster.keyless_forwarded_fraction(placement, {"n1": 0}))


def _leader_map(leaders: tuple[str, ...]) -> object:
    from logbroker.client._leaders import LeaderMap

    return LeaderMap(
        keyspace_bits=16,
        starts=tuple(i * (1 << 16) // len(leaders) for i in range(len(leaders))),
        leaders=leaders,
        addresses={leader: ("127.0.0.1", 1) for leader in leaders},
    )


def test_keyless_requests_sent_by_leaders_that_agree_with_etcd_forward_nothing() -> None:
    from logbroker import wire

    records = wire.encode_wire_records((Record(b"v"),))
    agreeing = cluster.KeylessToLeaders("t", records, _leader_map(("n1", "n2", "n2", "n1")))
    astray = cluster.KeylessToLeaders("t", records, _leader_map(("n1", "n2", "n1", "n1")))

    assert agreeing.forwarded(_keyless_placement()) == 0.0
    assert astray.forwarded(_keyless_placement()) == 0.25


def test_each_keyless_request_is_stamped_anew_and_sent_whole_to_its_stamps_leader() -> None:
    from logbroker import wire
    from logbroker.key_routing import stamp_range
    from logbroker.records import ProducerStamp

    leader_map = _leader_map(("n1", "n2", "n3", "n1"))
    records = wire.encode_wire_records(tuple(Record(b"v%d" % i) for i in range(5)))
    to = cluster.KeylessToLeaders("t", records, leader_map)
    held = {"n1": _HeldConnection(), "n2": _HeldConnection(), "n3": _HeldConnection()}
    producer = to.producer(held)
    answered = object()

    for _ in range(40):
        producer.send(b"ignored", 1.0, answered)

    sent = [
        (leader, wire.decode_request(frame[4:]).request, callback)
        for leader, connection in held.items()
        for frame, callback in connection.sent
    ]
    assert len(sent) == 40
    assert {callback for _, _, callback in sent} == {answered}
    stamps = sorted((request.stamp for _, request, _ in sent), key=lambda s: s.sequence)
    (producer_id,) = {stamp.producer_id for stamp in stamps}
    assert stamps == [ProducerStamp(producer_id, sequence) for sequence in range(40)]
    for leader, request, _ in sent:
        assert isinstance(request, wire.ProduceIdempotent)
        assert request.topic == "t"
        assert wire.decode_wire_records(request.records) == wire.decode_wire_records(records)
        index = stamp_range(request.stamp, leader_map.keyspace_bits, leader_map.starts)
        assert leader == leader_map.leaders[index]
    # The stamps spread the requests over every leader.
    assert all(connection.sent for connection in held.values())


def test_independent_nodes_have_settled_once_they_hold_as_many_bytes_in_all(
    tmp_path: Path,
) -> None:
    class _Node:
        def __init__(self, data: Path) -> None:
            self.data = str(data)

    first, second = tmp_path / "m1", tmp_path / "m2"
    _segment(first, "t.0", 0, _batch(0, 2))
    _segment(first, "t.1", 0, _batch(0, 1))
    _segment(second, "t.0", 0, _batch(0, 1))
    _segment(second, "t.1", 0, _batch(0, 2))
    nodes = [_Node(first), _Node(second)]

    assert replicated.settle(nodes, "t", seconds=0, by_range=False)
    assert not replicated.settle(nodes, "t", seconds=0)
