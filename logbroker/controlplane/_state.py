"""The control plane's state as one immutable value, and the changes that make a new one.

Pure: no files, no reactor. ``change.apply(state)`` checks the change against ``state`` (raising
a typed ``ControlPlaneError``) and returns the new state; ``state`` itself is never touched, so
a snapshot can be serialized on a writer thread while the reactor goes on applying changes.
The mappings are persistent maps (``immutables.Map``, a hash array mapped trie): a change
makes a new map sharing all but a path of the old one, so changing one range of 40,000 costs
what changing one of 40 does, where copying a dict of every range cost a quarter of a
millisecond and made each change at that scale as slow as its size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
from immutables import Map

from logbroker.controlplane._model import (
    ANY_RECORD,
    AclGrant,
    AnyRecord,
    Range,
    RangeState,
    SegmentMeta,
    SegmentState,
    Topic,
    User,
)
from logbroker.controlplane.errors import (
    AlreadyExistsError,
    InvalidChangeError,
    NotFoundError,
    UserExistsError,
    UserNotFoundError,
)

MAX_GROUP_NAME = 249

_V = TypeVar("_V")


def _persistent(mapping: Mapping[Any, Any]) -> Map[Any, Any]:
    return mapping if isinstance(mapping, Map) else Map(mapping)


@attrs.frozen
class ControlState:
    """Everything the control plane records, in persistent maps (plain mappings given are
    made into them)."""

    topics: Map[str, Topic] = attrs.field(factory=Map, converter=_persistent)
    ranges: Map[str, Range] = attrs.field(factory=Map, converter=_persistent)
    #: range id -> base offset -> segment (the inner mappings are small, never modified)
    segments: Map[str, Mapping[int, SegmentMeta]] = attrs.field(factory=Map, converter=_persistent)
    users: Map[str, User] = attrs.field(factory=Map, converter=_persistent)
    #: user name -> that user's grants (no entry for a user without any)
    acls: Map[str, frozenset[AclGrant]] = attrs.field(factory=Map, converter=_persistent)
    #: (topic, group) -> the group's committed cursor
    positions: Map[tuple[str, str], str] = attrs.field(factory=Map, converter=_persistent)


def _without(mapping: Map[str, _V], key: str) -> Map[str, _V]:
    return mapping.delete(key) if key in mapping else mapping


@attrs.frozen
class CreateTopic:
    topic: Topic
    ranges: tuple[Range, ...]

    def apply(self, state: ControlState) -> ControlState:
        topic = self.topic
        if topic.name in state.topics:
            raise AlreadyExistsError(f"topic {topic.name!r} exists already")
        if tuple(r.range_id for r in self.ranges) != topic.range_ids:
            raise InvalidChangeError(
                f"topic {topic.name!r} lists ranges {topic.range_ids!r} but was given "
                f"{tuple(r.range_id for r in self.ranges)!r}"
            )
        for range_ in self.ranges:
            if range_.range_id in state.ranges:
                # Range ids name storage directories, so they are unique across topics.
                raise AlreadyExistsError(f"range {range_.range_id!r} exists already")
            if range_.topic != topic.name or range_.state is not RangeState.ACTIVE:
                raise InvalidChangeError(
                    f"range {range_.range_id!r} of a new topic {topic.name!r} must belong to "
                    "it and be active"
                )
            if range_.parent is not None:
                raise InvalidChangeError(
                    f"range {range_.range_id!r} of a new topic cannot have a parent"
                )
        # A new topic's ranges tile its keyspace: every key lands in exactly one range.
        edge = 0
        for range_ in sorted(self.ranges, key=lambda r: r.start):
            if range_.start != edge:
                break
            edge = range_.end
        if edge != topic.keyspace_size or sum(r.end - r.start for r in self.ranges) != edge:
            raise InvalidChangeError(
                f"the ranges of topic {topic.name!r} must cover its keyspace "
                f"[0, {topic.keyspace_size}) without gaps or overlaps"
            )
        return attrs.evolve(
            state,
            topics=state.topics.set(topic.name, topic),
            ranges=state.ranges.update({r.range_id: r for r in self.ranges}),
        )


def swap_refusal(
    old: SegmentMeta | None, meta: SegmentMeta, expected: SegmentMeta | AnyRecord | None
) -> str | None:
    """Why a change of a segment's record from ``old`` to ``meta`` is refused when it expects
    the record to be ``expected`` (``None``: absent), if it is: a compare-and-swap, so that of
    two nodes that read the same record and change it (two claims of the same epoch, two
    openings of the same next segment), one wins and the other is told it lost."""
    if expected is ANY_RECORD or old == expected:
        return None
    where = f"segment {meta.range_id}@{meta.base_offset}"
    if expected is None:
        return f"{where} exists already ({old!r}); another node recorded it first"
    if old is None:
        return f"{where} is not recorded; this change expected {expected!r}"
    return (
        f"{where} is now {old!r}, not {expected!r} as this change expected: another node "
        "changed it first; read it again and decide anew"
    )


@attrs.frozen
class PutSegment:
    """Record a new segment or a change to one (sealing, a new epoch, a new replica set), if
    its record is still ``expected`` (see ``swap_refusal``)."""

    meta: SegmentMeta
    expected: SegmentMeta | AnyRecord | None = ANY_RECORD

    def apply(self, state: ControlState) -> ControlState:
        touched: dict[str, dict[int, SegmentMeta]] = {}
        self.put_into(state, touched)
        return _with_segments(state, touched)

    def put_into(self, state: ControlState, touched: dict[str, dict[int, SegmentMeta]]) -> None:
        """Put the record into ``touched`` (copies of ``state``'s ranges' records, made here
        as needed), checked against ``state`` as ``touched`` leaves it."""
        meta = self.meta
        if meta.range_id not in state.ranges:
            raise NotFoundError(f"range {meta.range_id!r} does not exist")
        segments = touched.get(meta.range_id)
        if segments is None:
            segments = touched[meta.range_id] = dict(state.segments.get(meta.range_id, {}))
        old = segments.get(meta.base_offset)
        where = f"segment {meta.range_id}@{meta.base_offset}"
        refused = swap_refusal(old, meta, self.expected)
        if refused is not None:
            raise InvalidChangeError(refused)
        if old is not None:
            # These would let a stale primary back in or change what replicas trim to.
            if meta.epoch < old.epoch:
                raise InvalidChangeError(
                    f"{where} is at epoch {old.epoch}; it cannot go back to {meta.epoch}"
                )
            if old.state is SegmentState.SEALED and (
                meta.record_count,
                meta.byte_size,
            ) != (old.record_count, old.byte_size):
                raise InvalidChangeError(
                    f"{where} is sealed at {old.record_count} records, {old.byte_size} bytes; "
                    "a sealed segment cannot be unsealed or resized"
                )
        segments[meta.base_offset] = meta


def _with_segments(state: ControlState, touched: dict[str, dict[int, SegmentMeta]]) -> ControlState:
    """``state`` with the records of the ranges in ``touched`` replaced: the segments mapping
    is copied once, however many records were put."""
    return attrs.evolve(state, segments=state.segments.update(touched))


def _some_puts(_: object, attribute: attrs.Attribute[Any], value: tuple[PutSegment, ...]) -> None:
    if not value or not all(isinstance(put, PutSegment) for put in value):
        raise ValueError(f"{attribute.name} must be one PutSegment or more, not {value!r}")


@attrs.frozen
class PutSegments:
    """Several ``PutSegment`` changes made together, each on the state the ones before it leave,
    or none of them if one is refused: a seal and the opening of the next segment are one
    change, not two."""

    puts: tuple[PutSegment, ...] = attrs.field(validator=_some_puts)

    def apply(self, state: ControlState) -> ControlState:
        touched: dict[str, dict[int, SegmentMeta]] = {}
        for put in self.puts:
            put.put_into(state, touched)
        return _with_segments(state, touched)


@attrs.frozen
class DeleteSegment:
    range_id: str
    base_offset: int

    def apply(self, state: ControlState) -> ControlState:
        segments = state.segments.get(self.range_id, {})
        if self.base_offset not in segments:
            raise NotFoundError(f"segment {self.range_id}@{self.base_offset} does not exist")
        rest = {base: meta for base, meta in segments.items() if base != self.base_offset}
        # No empty entries: the state file has none, and a reloaded state must compare equal.
        others = _without(state.segments, self.range_id)
        return attrs.evolve(state, segments=others.set(self.range_id, rest) if rest else others)


@attrs.frozen
class CreateUser:
    user: User

    def apply(self, state: ControlState) -> ControlState:
        if self.user.name in state.users:
            raise UserExistsError(f"user {self.user.name!r} exists already")
        return attrs.evolve(state, users=state.users.set(self.user.name, self.user))


def _existing_user(state: ControlState, name: str) -> User:
    try:
        return state.users[name]
    except KeyError:
        raise UserNotFoundError(f"user {name!r} does not exist") from None


@attrs.frozen
class UpdateUser:
    """Change a user's password hash, permissions or both; what is ``None`` stays as it is.

    Applied to the state as it will be once earlier changes are durable, so two updates of
    different fields never undo each other.
    """

    name: str
    password_hash: str | None = None
    permissions: frozenset[str] | None = None

    def apply(self, state: ControlState) -> ControlState:
        user = _existing_user(state, self.name)
        if self.password_hash is not None:
            user = attrs.evolve(user, password_hash=self.password_hash)
        if self.permissions is not None:
            user = attrs.evolve(user, permissions=self.permissions)
        return attrs.evolve(state, users=state.users.set(self.name, user))


@attrs.frozen
class DeleteUser:
    """Remove a user and every ACL grant naming it."""

    name: str

    def apply(self, state: ControlState) -> ControlState:
        _existing_user(state, self.name)
        return attrs.evolve(
            state,
            users=_without(state.users, self.name),
            acls=_without(state.acls, self.name),
        )


@attrs.frozen
class GrantAcl:
    """Add a grant; granting one that exists changes nothing."""

    grant: AclGrant

    def apply(self, state: ControlState) -> ControlState:
        user = self.grant.user
        _existing_user(state, user)
        grants = state.acls.get(user, frozenset()) | {self.grant}
        return attrs.evolve(state, acls=state.acls.set(user, grants))


@attrs.frozen
class RevokeAcl:
    grant: AclGrant

    def apply(self, state: ControlState) -> ControlState:
        user = self.grant.user
        grants = state.acls.get(user, frozenset())
        if self.grant not in grants:
            raise NotFoundError(f"no such ACL grant: {self.grant!r}")
        rest = grants - {self.grant}
        acls = state.acls.set(user, rest) if rest else _without(state.acls, user)
        return attrs.evolve(state, acls=acls)


#: ``(the stored cursor or None, the committed one) -> the cursor to store``.
MergeCursors = Callable[[str | None, str], str]


@attrs.frozen
class CommitGroupPosition:
    """Record ``group``'s cursor on ``topic``; with ``merge``, the cursor ``merge`` makes of the
    stored one and this one, computed against the state the change is applied to, so that
    commits of different ranges made through different nodes at once never undo each other
    (in etcd a commit that lost a race is applied again to the winner's position)."""

    topic: str
    group: str = attrs.field()
    cursor: str
    merge: MergeCursors | None = attrs.field(default=None, eq=False, repr=False)

    @group.validator
    def _check_group(self, attribute: attrs.Attribute[str], value: str) -> None:
        if not 1 <= len(value) <= MAX_GROUP_NAME:
            raise ValueError(f"a group name has 1 to {MAX_GROUP_NAME} characters, not {value!r}")

    def apply(self, state: ControlState) -> ControlState:
        if self.topic not in state.topics:
            raise NotFoundError(f"topic {self.topic!r} does not exist")
        key = (self.topic, self.group)
        cursor = (
            self.cursor if self.merge is None else self.merge(state.positions.get(key), self.cursor)
        )
        return attrs.evolve(state, positions=state.positions.set(key, cursor))


Change = (
    CreateTopic
    | PutSegment
    | PutSegments
    | DeleteSegment
    | CreateUser
    | UpdateUser
    | DeleteUser
    | GrantAcl
    | RevokeAcl
    | CommitGroupPosition
)
