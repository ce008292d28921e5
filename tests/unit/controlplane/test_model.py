"""The recorded values refuse what would become a bad path, pattern or segment record."""

from __future__ import annotations

from typing import Any

import pytest

from logbroker.controlplane import (
    AclGrant,
    Range,
    RangeState,
    SegmentMeta,
    SegmentState,
    Topic,
    User,
    pattern_matches,
    valid_name,
    valid_pattern,
)


@pytest.mark.parametrize("name", ["orders", "a", "orders.eu-1_x", "x" * 249, "..."])
def test_valid_names(name: str) -> None:
    assert valid_name(name)
    Topic(name, 8, 0, ("r.0",))
    Range(name, "t", 0, 1, RangeState.ACTIVE)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "x" * 256, "ordérs", "a b", "a*"])
def test_invalid_names_are_refused_as_topic_and_range_ids(name: str) -> None:
    assert not valid_name(name)
    with pytest.raises(ValueError, match="invalid topic name"):
        Topic(name, 8, 0, ("r.0",))
    with pytest.raises(ValueError, match="invalid range id"):
        Range(name, "t", 0, 1, RangeState.ACTIVE)
    with pytest.raises(ValueError, match="invalid range id"):
        Topic("t", 8, 0, (name,))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keyspace_bits": -1}, "keyspace_bits must be 0 to 32, not -1"),
        ({"keyspace_bits": 33}, "keyspace_bits must be 0 to 32, not 33"),
        ({"created_ms": -1}, "created_ms must not be negative"),
        ({"range_ids": ()}, "needs a tuple of at least one range id"),
        ({"range_ids": ["t.0"]}, "needs a tuple of at least one range id"),
        ({"range_ids": ("t.0", "t.0")}, "lists a range id twice"),
    ],
)
def test_topic_fields_are_checked(kwargs: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {
        "name": "t",
        "keyspace_bits": 8,
        "created_ms": 0,
        "range_ids": ("t.0",),
    }
    with pytest.raises(ValueError, match=message):
        Topic(**{**fields, **kwargs})


def test_a_range_is_a_non_empty_interval() -> None:
    with pytest.raises(ValueError, match="ends at 5, not after 5"):
        Range("t.0", "t", 5, 5, RangeState.ACTIVE)
    with pytest.raises(ValueError, match="start must not be negative"):
        Range("t.0", "t", -1, 5, RangeState.ACTIVE)
    with pytest.raises(ValueError, match="invalid parent range id"):
        Range("t.0", "t", 0, 5, RangeState.ACTIVE, parent="../x")


def test_counts_are_recorded_exactly_when_a_segment_is_sealed() -> None:
    SegmentMeta("t.0", 0, SegmentState.ACTIVE, None, None, ("n1",), 0)
    SegmentMeta("t.0", 0, SegmentState.SEALED, 0, 0, ("n1",), 0)
    with pytest.raises(ValueError, match="record_count is recorded exactly when"):
        SegmentMeta("t.0", 0, SegmentState.SEALED, None, 10, ("n1",), 0)
    with pytest.raises(ValueError, match="byte_size is recorded exactly when"):
        SegmentMeta("t.0", 0, SegmentState.ACTIVE, None, 10, ("n1",), 0)
    with pytest.raises(ValueError, match="byte_size must not be negative"):
        SegmentMeta("t.0", 0, SegmentState.SEALED, 1, -1, ("n1",), 0)


@pytest.mark.parametrize("replicas", [(), ("n1", "n1"), ("",), ["n1"]])
def test_a_replica_set_is_distinct_named_nodes(replicas: Any) -> None:
    with pytest.raises(ValueError, match="replica set"):
        SegmentMeta("t.0", 0, SegmentState.ACTIVE, None, None, replicas, 0)


def test_user_names_and_the_hash_stays_out_of_repr() -> None:
    user = User("app@eu-1.example", "$argon2id$secret", frozenset({"produce"}))
    assert "secret" not in repr(user)
    for bad in ["", "a b", "x" * 129, "a/b"]:
        with pytest.raises(ValueError, match="invalid user name"):
            User(bad, "h", frozenset())
    with pytest.raises(TypeError):
        User("a", "h", {"produce"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "topic", "matches"),
    [
        ("orders", "orders", True),
        ("orders", "orders.eu", False),
        ("orders.*", "orders.eu", True),
        ("orders.*", "orders.eu.west", True),
        ("orders.*", "orders", False),
        ("orders.*", "ordersx", False),
        ("a.b.*", "a.b.c", True),
    ],
)
def test_patterns_match_a_topic_or_a_dotted_prefix(pattern: str, topic: str, matches: bool) -> None:
    assert valid_pattern(pattern)
    assert pattern_matches(pattern, topic) is matches


@pytest.mark.parametrize("pattern", ["", "*", ".*", "orders*", "or*ders", "a/b.*", "..", "a.**"])
def test_invalid_patterns(pattern: str) -> None:
    assert not valid_pattern(pattern)
    with pytest.raises(ValueError, match="ACL pattern"):
        AclGrant("alice", "produce", pattern)


def test_a_grant_names_produce_or_consume() -> None:
    AclGrant("alice", "consume", "orders")
    for operation in ["admin", "create_topic", "PRODUCE", ""]:
        with pytest.raises(ValueError, match="ACL operation"):
            AclGrant("alice", operation, "orders")


def test_a_range_id_may_be_a_longest_topic_name_with_its_range_number() -> None:
    # A directory name may take 255 characters: the topic name (249), a dot and the number.
    longest = "t" * 249 + ".63"

    assert not valid_name("x" * 250)
    Range(longest, "t" * 249, 0, 1, RangeState.ACTIVE)
    with pytest.raises(ValueError, match="invalid range id"):
        Range("x" * 256, "t", 0, 1, RangeState.ACTIVE)
