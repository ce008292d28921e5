"""What the control plane records: frozen, validated values shared by every implementation.

Names that become paths or appear in patterns are checked here, at construction, so no code
behind the control plane meets a topic called ``..`` or a range id holding a ``/``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import Enum, StrEnum

import attrs

#: Topic names and range ids become directory names (DESIGN section 5).
_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
_USER_NAME = re.compile(r"[A-Za-z0-9._@-]{1,128}")
#: Positions are a 32-bit hash of the key reduced to the topic's keyspace bits.
MAX_KEYSPACE_BITS = 32
#: The operations an ACL grant can name.
GRANT_OPERATIONS = frozenset({"produce", "consume"})
_WILDCARD = ".*"


#: Range ids are the topic's name, a dot and a number: up to 255 characters, a file name's limit.
_RANGE_ID = re.compile(r"[A-Za-z0-9._-]{1,255}")


def valid_range_id(range_id: str) -> bool:
    """Whether ``range_id`` may name a range (and its storage directory)."""
    return _RANGE_ID.fullmatch(range_id) is not None and range_id not in (".", "..")


def valid_name(name: str) -> bool:
    """Whether ``name`` is a valid topic name or range id: it may become a directory name."""
    return _NAME.fullmatch(name) is not None and name not in (".", "..")


def valid_user_name(name: str) -> bool:
    return _USER_NAME.fullmatch(name) is not None


def valid_pattern(pattern: str) -> bool:
    """An ACL pattern: a topic name, or ``prefix.*`` for every topic starting ``prefix.``."""
    if pattern.endswith(_WILDCARD):
        return _NAME.fullmatch(pattern.removesuffix(_WILDCARD)) is not None
    return valid_name(pattern)


def pattern_matches(pattern: str, topic: str) -> bool:
    if pattern.endswith(_WILDCARD):
        return topic.startswith(pattern[:-1])
    return topic == pattern


def _check_range_id(what: str) -> Callable[[object, attrs.Attribute[str], str], None]:
    def check(_: object, attribute: attrs.Attribute[str], value: str) -> None:
        if not valid_range_id(value):
            raise ValueError(
                f"invalid {what} {value!r}: use 1 to 255 of A-Z a-z 0-9 . _ -, not . or .."
            )

    return check


def _check_name(what: str) -> Callable[[object, attrs.Attribute[str], str], None]:
    def check(_: object, attribute: attrs.Attribute[str], value: str) -> None:
        if not valid_name(value):
            raise ValueError(
                f"invalid {what} {value!r}: use 1 to 249 of A-Z a-z 0-9 . _ -, not . or .."
            )

    return check


def _check_user_name(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not valid_user_name(value):
        raise ValueError(f"invalid user name {value!r}: use 1 to 128 of A-Z a-z 0-9 . _ @ -")


def _not_negative(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative, not {value}")


class RangeState(StrEnum):
    ACTIVE = "active"
    #: Split or retired: keeps its data, takes no more produces.
    SEALED = "sealed"


class SegmentState(StrEnum):
    """The control plane's view of a segment (storage has its own, per local copy)."""

    ACTIVE = "active"
    #: Immutable, with its record count and byte size recorded.
    SEALED = "sealed"


@attrs.frozen
class Topic:
    name: str = attrs.field(validator=_check_name("topic name"))
    keyspace_bits: int = attrs.field()
    created_ms: int = attrs.field(validator=_not_negative)
    #: The topic's ranges, in the order they were created.
    range_ids: tuple[str, ...] = attrs.field()

    @keyspace_bits.validator
    def _check_bits(self, attribute: attrs.Attribute[int], value: int) -> None:
        if not 0 <= value <= MAX_KEYSPACE_BITS:
            raise ValueError(f"keyspace_bits must be 0 to {MAX_KEYSPACE_BITS}, not {value}")

    @range_ids.validator
    def _check_ranges(self, attribute: attrs.Attribute[tuple[str, ...]], value: object) -> None:
        if not isinstance(value, tuple) or not value:
            raise ValueError(f"topic {self.name!r} needs a tuple of at least one range id")
        if len(set(value)) != len(value):
            raise ValueError(f"topic {self.name!r} lists a range id twice: {value!r}")
        for range_id in value:
            if not isinstance(range_id, str) or not valid_range_id(range_id):
                raise ValueError(f"topic {self.name!r} lists an invalid range id {range_id!r}")

    @property
    def keyspace_size(self) -> int:
        return 1 << self.keyspace_bits


@attrs.frozen
class Range:
    """The keyspace interval ``[start, end)`` of one topic; its id names its storage directory."""

    range_id: str = attrs.field(validator=_check_range_id("range id"))
    topic: str = attrs.field(validator=_check_name("topic name"))
    start: int = attrs.field(validator=_not_negative)
    end: int = attrs.field()
    state: RangeState = attrs.field(validator=attrs.validators.instance_of(RangeState))
    #: The range this one was split from.
    parent: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(_check_range_id("parent range id"))
    )

    @end.validator
    def _check_end(self, attribute: attrs.Attribute[int], value: int) -> None:
        if value <= self.start:
            raise ValueError(f"range {self.range_id!r} ends at {value}, not after {self.start}")


@attrs.frozen
class SegmentMeta:
    range_id: str = attrs.field(validator=_check_range_id("range id"))
    base_offset: int = attrs.field(validator=_not_negative)
    state: SegmentState = attrs.field(validator=attrs.validators.instance_of(SegmentState))
    #: Recorded at sealing; ``None`` while active.
    record_count: int | None = attrs.field()
    byte_size: int | None = attrs.field()
    #: The replica set; the first member is the primary.
    replicas: tuple[str, ...] = attrs.field()
    #: Bumped at each failover; replicas refuse writes from an older one.
    epoch: int = attrs.field(validator=_not_negative)
    #: Of a segment a claim sealed: the epoch of the primary whose records it holds, older than
    #: ``epoch`` (``records_epoch``). ``None`` otherwise.
    data_epoch: int | None = attrs.field(default=None, kw_only=True)

    @data_epoch.validator
    def _check_data_epoch(self, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is None:
            return
        if self.state is not SegmentState.SEALED or not 0 <= value < self.epoch:
            raise ValueError(
                f"segment {self.range_id}@{self.base_offset}: a data epoch is recorded only "
                f"for a sealed segment, older than its epoch {self.epoch}, not {value}"
            )

    @property
    def records_epoch(self) -> int:
        """The epoch of the primary whose records the segment holds (its copies' data epoch:
        ``logbroker.replication.core.replica``)."""
        return self.epoch if self.data_epoch is None else self.data_epoch

    @record_count.validator
    @byte_size.validator
    def _check_counts(self, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if (value is None) != (self.state is SegmentState.ACTIVE):
            raise ValueError(
                f"segment {self.range_id}@{self.base_offset}: {attribute.name} is recorded "
                "exactly when the segment is sealed"
            )
        if value is not None and value < 0:
            raise ValueError(f"{attribute.name} must not be negative, not {value}")

    @replicas.validator
    def _check_replicas(self, attribute: attrs.Attribute[tuple[str, ...]], value: object) -> None:
        if (
            not isinstance(value, tuple)
            or not value
            or len(set(value)) != len(value)
            or not all(isinstance(node, str) and node for node in value)
        ):
            raise ValueError(
                f"segment {self.range_id}@{self.base_offset} needs a tuple of distinct, "
                f"non-empty node names as its replica set, not {value!r}"
            )


class AnyRecord(Enum):
    """``put_segment``'s ``expected`` when the change holds whatever the segment's record is
    (subject to the epoch and seal rules): one node's own segments, which no other node
    writes."""

    ANY = "any"


#: See ``AnyRecord``.
ANY_RECORD = AnyRecord.ANY


@attrs.frozen
class User:
    name: str = attrs.field(validator=_check_user_name)
    #: An encoded argon2id hash (``$argon2id$...``), never the password.
    password_hash: str = attrs.field(repr=False)
    permissions: frozenset[str] = attrs.field(validator=attrs.validators.instance_of(frozenset))


@attrs.frozen
class AclGrant:
    """Lets ``user`` do ``operation`` on the topics ``pattern`` matches (with SVC_ACL_STRICT)."""

    user: str = attrs.field(validator=_check_user_name)
    operation: str = attrs.field()
    pattern: str = attrs.field()

    @operation.validator
    def _check_operation(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in GRANT_OPERATIONS:
            raise ValueError(f"ACL operation must be produce or consume, not {value!r}")

    @pattern.validator
    def _check_pattern(self, attribute: attrs.Attribute[str], value: str) -> None:
        if not valid_pattern(value):
            raise ValueError(f"ACL pattern must be a topic name or prefix.*, not {value!r}")
