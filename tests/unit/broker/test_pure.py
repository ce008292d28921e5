"""The broker's pure parts: topic names and keyspaces, cursors, group shares."""

from __future__ import annotations

import base64
import itertools

import pytest
from crc32c import crc32c
from hypothesis import given
from hypothesis import strategies as st

from logbroker.broker.cursor import Cursor, InvalidCursorError
from logbroker.broker.groups import Group, assign
from logbroker.broker.keyspace import keyspace_bits, split_keyspace, valid_topic_name
from logbroker.key_routing import key_hash, key_slot

# -- topics and keyspaces ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["orders", "a", "A.b-c_9", "x" * 249, ".hidden", "..."])
def test_valid_topic_names(name: str) -> None:
    assert valid_topic_name(name)


@pytest.mark.parametrize(
    "name", [None, "", ".", "..", "x" * 250, "a/b", "a b", "é", "a\x00", "orders\n"]
)
def test_invalid_topic_names(name: str | None) -> None:
    assert not valid_topic_name(name)


@pytest.mark.parametrize(
    ("requested", "taken"), [(0, 8), (1, 1), (16, 16), (32, 32), (33, None), (255, None)]
)
def test_keyspace_bits_0_means_8_and_1_to_32_are_taken(requested: int, taken: int | None) -> None:
    assert keyspace_bits(requested) == taken


def test_the_key_hash_is_crc32c_and_the_slot_its_top_bits() -> None:
    assert key_hash(b"123456789") == 0xE3069283
    assert key_slot(b"123456789", 8) == 0xE3
    assert key_slot(b"123456789", 32) == 0xE3069283
    assert key_slot(b"123456789", 1) == 1


@given(st.integers(1, 32), st.integers(1, 64))
def test_a_keyspace_splits_into_contiguous_ranges_covering_every_slot(
    bits: int, count: int
) -> None:
    ranges = split_keyspace(bits, count)

    assert len(ranges) == min(count, 2**bits)
    assert ranges[0][0] == 0
    assert ranges[-1][1] == 2**bits
    assert all(end == start for (_, end), (start, _) in itertools.pairwise(ranges))
    sizes = {end - start for start, end in ranges}
    assert max(sizes) - min(sizes) <= 1


# -- cursors -------------------------------------------------------------------------------

range_ids = st.from_regex(r"[A-Za-z0-9._-]{1,40}", fullmatch=True)
positions = st.dictionaries(range_ids, st.integers(0, 2**64 - 1), max_size=20)


@given(positions)
def test_cursors_round_trip(mapping: dict[str, int]) -> None:
    cursor = Cursor(mapping)

    text = cursor.encode()

    assert Cursor.decode(text) == cursor
    assert set(text) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "!!!!",
        "AQ",
        _b64(b"\x02\x00\x00"),
        _b64(b"\x01\x00\x01"),
        _b64(b"\x01\x00\x01\x00\x01a" + bytes(7)),
        _b64(b"\x01\x00\x00\x00"),
        _b64(b"\x01\x00\x02\x00\x01b" + bytes(8) + b"\x00\x01a" + bytes(8)),
        _b64(b"\x01\x00\x02\x00\x01a" + bytes(8) + b"\x00\x01a" + bytes(8)),
        _b64(b"\x01\x00\x01\x00\x00" + bytes(8)),
        _b64(b"\x01\x00\x01\x00\x01\xff" + bytes(8)),
        _b64(b"\x01\x00\x00") + "=",
        "A" * 20000,
    ],
    ids=[
        "empty",
        "not base64url",
        "too short",
        "version 2",
        "entry missing",
        "offset cut short",
        "bytes left over",
        "ranges out of order",
        "range repeated",
        "empty range id",
        "range id not ascii",
        "padding",
        "too long",
    ],
)
def test_anything_but_a_cursor_is_refused(text: str) -> None:
    with pytest.raises(InvalidCursorError):
        Cursor.decode(text)


def test_a_cursor_has_one_spelling() -> None:
    text = Cursor({"t.0": 5}).encode()
    last = text[-1]
    # The final character's unused low bits do not change the decoded bytes.
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    index = alphabet.index(last)
    twin = text[:-1] + alphabet[index ^ 1]
    assert base64.urlsafe_b64decode(twin + "=" * (-len(twin) % 4)) == base64.urlsafe_b64decode(
        text + "=" * (-len(text) % 4)
    )

    with pytest.raises(InvalidCursorError, match="canonical"):
        Cursor.decode(twin)


# -- groups --------------------------------------------------------------------------------

members = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=6, unique=True)
ranges = st.lists(range_ids, max_size=30, unique=True)


@given(members, ranges)
def test_shares_are_disjoint_and_cover_every_range(names: list[str], ids: list[str]) -> None:
    shares = assign(names, ids)

    assert set(shares) == set(names)
    assigned = [range_id for share in shares.values() for range_id in share]
    assert sorted(assigned) == sorted(ids)


@given(members, ranges, st.text(min_size=1, max_size=8))
def test_a_member_joining_takes_ranges_only_for_itself(
    names: list[str], ids: list[str], newcomer: str
) -> None:
    before = assign(names, ids)
    after = assign([*names, newcomer], ids)

    for name in names:
        if name != newcomer:
            assert set(after[name]) <= set(before[name])


def test_the_share_is_rendezvous_hashing_over_crc32c() -> None:
    weight = {m: crc32c(m.encode() + b"\x00t.0") for m in ("a", "b", "c")}

    assert assign(["a", "b", "c"], ["t.0"])[max(weight, key=lambda m: weight[m])] == ["t.0"]


def test_members_expire_after_the_session_timeout_and_can_leave() -> None:
    group = Group(session_timeout_ms=1000)
    group.touch("a", now=0)
    group.touch("b", now=500)

    assert group.expire(now=1000) == []
    assert group.expire(now=1001) == ["a"]
    assert group.members == ["b"]
    assert group.share("b", ["t.0", "t.1"]) == ["t.0", "t.1"]
    assert group.leave("b")
    assert not group.leave("b")
    assert group.members == []
    assert group.share("b", ["t.0"]) == []
