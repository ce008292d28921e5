"""The clients' leader map (``logbroker.client._leaders``): a ``topic_leaders`` answer checked,
and a produce's records cut into one share per leader exactly as the broker routes them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbroker import wire
from logbroker.broker.keyspace import split_keyspace
from logbroker.client._leaders import LeaderMap
from logbroker.key_routing import key_slot, stamp_range
from logbroker.records import ProducerStamp, Record

NODES = ("n1", "n2", "n3")
ADDRESSES = tuple(wire.LeaderAddress(node, f"{node}.internal", 4040) for node in NODES)


def answer(bits: int, leaders: list[str | None]) -> wire.LeadersInfo:
    cuts = split_keyspace(bits, len(leaders))
    ranges = tuple(
        wire.RangeLeader(f"t.{index}", start, end, leaders[index])
        for index, (start, end) in enumerate(cuts)
    )
    return wire.LeadersInfo(bits, ranges, ADDRESSES)


def owner(bits: int, starts: tuple[int, ...], key: bytes) -> int:
    slot = key_slot(key, bits)
    return max(index for index, start in enumerate(starts) if start <= slot)


records = st.builds(
    Record,
    value=st.binary(max_size=8),
    key=st.one_of(st.none(), st.binary(max_size=6)),
)


@given(
    st.lists(records, max_size=30),
    st.integers(2, 12),
    st.lists(st.sampled_from([*NODES, None]), min_size=1, max_size=8),
    st.one_of(st.none(), st.builds(ProducerStamp, st.integers(0, 2**64 - 1), st.integers(0, 99))),
    st.integers(0, 20),
)
def test_each_record_goes_to_its_ranges_leader_in_the_order_it_came(
    batch: list[Record],
    bits: int,
    leaders: list[str | None],
    stamp: ProducerStamp | None,
    turn: int,
) -> None:
    leader_map = LeaderMap.of(answer(bits, leaders))
    starts = leader_map.starts
    keyless = turn % len(starts) if stamp is None else stamp_range(stamp, bits, starts)

    shares = leader_map.shares(wire.encode_wire_records(batch), stamp, turn)

    assert len({leader for leader, _ in shares}) == len(shares), "one share per leader"
    sent: list[Record] = []
    for leader, share in shares:
        decoded = wire.decode_wire_records(share)
        sent += decoded
        for record in decoded:
            index = keyless if record.key is None else owner(bits, starts, record.key)
            assert leader_map.leaders[index] == leader
    assert sorted(sent, key=repr) == sorted(batch, key=repr)
    # Within a share, the records of each range keep the order they came in.
    for _, share in shares:
        decoded = list(wire.decode_wire_records(share))
        for index in range(len(starts)):
            of_range = [
                r for r in batch if r in decoded and _range_of(r, bits, starts, keyless) == index
            ]
            assert [r for r in decoded if r in of_range] == of_range


def _range_of(record: Record, bits: int, starts: tuple[int, ...], keyless: int) -> int:
    return keyless if record.key is None else owner(bits, starts, record.key)


def test_the_addresses_of_the_leaders_are_kept() -> None:
    leader_map = LeaderMap.of(answer(8, ["n1", "n2"]))

    assert leader_map.addresses["n2"] == ("n2.internal", 4040)
    assert leader_map.leaders == ("n1", "n2")
    assert leader_map.starts == (0, 128)


@pytest.mark.parametrize(
    ("ranges", "why"),
    [
        ((), "0 ranges do not cover"),
        ((wire.RangeLeader("t.0", 1, 256, "n1"),), "do not cover"),
        ((wire.RangeLeader("t.0", 0, 128, "n1"),), "do not cover"),
        (
            (wire.RangeLeader("t.0", 0, 100, "n1"), wire.RangeLeader("t.1", 128, 256, "n1")),
            "t.1 does not follow t.0",
        ),
        ((wire.RangeLeader("t.0", 0, 256, "n9"),), r"no address for \['n9'\]"),
    ],
)
def test_an_answer_that_does_not_tile_the_keyspace_is_refused(
    ranges: tuple[wire.RangeLeader, ...], why: str
) -> None:
    with pytest.raises(wire.ProtocolViolation, match=why):
        LeaderMap.of(wire.LeadersInfo(8, ranges, ADDRESSES))
