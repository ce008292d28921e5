"""What every control plane does the same way: reads of a ``ControlState``, and each change of
the interface as one ``Change`` (``_state``) handed to the implementation's writer.

An implementation provides ``_read()`` (the state reads see, or ``ControlPlaneClosedError``) and
``_submit(change)`` (queue the change; fire, once it is durable and readable, with the state as
it left it), and calls ``_view_replaced`` whenever the state reads see is replaced.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence

from twisted.internet.defer import Deferred

from logbroker.controlplane._model import (
    ANY_RECORD,
    AclGrant,
    AnyRecord,
    Range,
    SegmentMeta,
    Topic,
    User,
)
from logbroker.controlplane._state import (
    Change,
    CommitGroupPosition,
    ControlState,
    CreateTopic,
    CreateUser,
    DeleteSegment,
    DeleteUser,
    GrantAcl,
    MergeCursors,
    PutSegment,
    PutSegments,
    RevokeAcl,
    UpdateUser,
)


def _nothing(_: object) -> None:
    return None


class StateControlPlane(ABC):
    """The reads and changes of ``ControlPlane`` over a ``ControlState``."""

    def __init__(self) -> None:
        #: Each range's segments in order, with the dict of the state they were sorted from.
        self._ordered_segments: dict[str, tuple[Mapping[int, SegmentMeta], list[SegmentMeta]]] = {}
        self._segment_listeners: list[Callable[[Collection[str]], None]] = []
        #: Each topic's ranges (``ranges()``), with the topic record and the ranges mapping they
        #: were read from.
        self._topic_ranges: dict[str, tuple[Topic, Mapping[str, Range], tuple[Range, ...]]] = {}
        #: ``range_ids()``, with the topics mapping it was made from.
        self._range_ids: tuple[Mapping[str, Topic] | None, tuple[str, ...]] = (None, ())

    @abstractmethod
    def _read(self) -> ControlState:
        """The state reads see; ``ControlPlaneClosedError`` before the start."""

    @abstractmethod
    def _submit(self, change: Change) -> Deferred[ControlState]:
        """Queue ``change``; fire, once it is durable and readable, with the state as it left
        it (a typed ``ControlPlaneError`` at once if it contradicts the state)."""

    # -- reads ---------------------------------------------------------------------------------

    def topic(self, name: str) -> Topic | None:
        return self._read().topics.get(name)

    def watch_segments(self, listener: Callable[[Collection[str]], None]) -> None:
        self._segment_listeners.append(listener)

    def _view_replaced(
        self,
        old: ControlState | None,
        new: ControlState,
        touched: Collection[str] | None = None,
    ) -> None:
        """Tell the segment listeners which ranges' records differ between ``old`` (``None``:
        nothing was loaded) and ``new``. A change copies the segments of the ranges it touches
        and keeps the others' (``Change.apply``, and the watch's updates alike): identity
        tells, without comparing records. ``touched``: the only ranges whose records may
        differ, when the caller knows (a watch event names its ranges): only those are looked
        at, not every range of the cluster."""
        if not self._segment_listeners:
            return
        before, after = old.segments if old is not None else None, new.segments
        changed: Collection[str]
        if before is None:
            changed = frozenset(after)
        elif touched is not None:
            # A range dropped is among those named too: its records are gone from ``after``.
            changed = {r for r in touched if before.get(r) is not after.get(r)}
        else:
            changed = {r for r in after if before.get(r) is not after.get(r)}
            changed.update(r for r in before if r not in after)
        if changed:
            for listener in list(self._segment_listeners):
                listener(changed)

    def topics(self) -> list[Topic]:
        return [topic for _, topic in sorted(self._read().topics.items())]

    def range_ids(self) -> Sequence[str]:
        # Made again only when the topics change: the takeover sweep and healing read it
        # twice a second, thousands of ranges long.
        topics = self._read().topics
        made_from, range_ids = self._range_ids
        if made_from is not topics:
            range_ids = tuple(r for _, topic in sorted(topics.items()) for r in topic.range_ids)
            self._range_ids = (topics, range_ids)
        return range_ids

    def range(self, range_id: str) -> Range | None:
        return self._read().ranges.get(range_id)

    def ranges(self, topic: str) -> Sequence[Range]:
        state = self._read()
        found = state.topics.get(topic)
        if found is None:
            self._topic_ranges.pop(topic, None)
            return ()
        # Asked for at every produce: made once per change of the topic or of any range (a
        # change makes a new record and a new ranges mapping, so identity tells).
        cached = self._topic_ranges.get(topic)
        if cached is not None and cached[0] is found and cached[1] is state.ranges:
            return cached[2]
        # A topic another node is creating may be seen before all of its ranges.
        ranges = tuple(state.ranges[r] for r in found.range_ids if r in state.ranges)
        self._topic_ranges[topic] = (found, state.ranges, ranges)
        return ranges

    def segments(self, range_id: str) -> list[SegmentMeta]:
        return list(self._ordered(range_id))

    def last_segment(self, range_id: str) -> SegmentMeta | None:
        ordered = self._ordered(range_id)
        return ordered[-1] if ordered else None

    def _ordered(self, range_id: str) -> Sequence[SegmentMeta]:
        segments = self._read().segments.get(range_id)
        if not segments:
            self._ordered_segments.pop(range_id, None)
            return ()
        # Asked for thousands of times a second (every sweep asks for every range's active
        # segment), while a range's records change seldom: sorted once per change of them. A
        # change makes a new dict for the range and keeps the others', so identity tells.
        found = self._ordered_segments.get(range_id)
        if found is not None and found[0] is segments:
            return found[1]
        ordered = [meta for _, meta in sorted(segments.items())]
        self._ordered_segments[range_id] = (segments, ordered)
        return ordered

    def user(self, name: str) -> User | None:
        return self._read().users.get(name)

    def users(self) -> list[User]:
        return [user for _, user in sorted(self._read().users.items())]

    def acls(self, user: str | None = None) -> list[AclGrant]:
        acls = self._read().acls
        grants = (
            acls.get(user, frozenset()) if user is not None else frozenset().union(*acls.values())
        )
        return sorted(grants, key=lambda g: (g.user, g.operation, g.pattern))

    def group_position(self, topic: str, group: str) -> str | None:
        return self._read().positions.get((topic, group))

    # -- changes -------------------------------------------------------------------------------

    def create_topic(self, topic: Topic, ranges: Sequence[Range]) -> Deferred[None]:
        return self._change(CreateTopic(topic, tuple(ranges)))

    def put_segment(
        self, meta: SegmentMeta, *, expected: SegmentMeta | AnyRecord | None = ANY_RECORD
    ) -> Deferred[None]:
        return self._change(PutSegment(meta, expected))

    def put_segments(
        self, changes: Sequence[tuple[SegmentMeta, SegmentMeta | AnyRecord | None]]
    ) -> Deferred[None]:
        return self._change(PutSegments(tuple(PutSegment(m, e) for m, e in changes)))

    def delete_segment(self, range_id: str, base_offset: int) -> Deferred[None]:
        return self._change(DeleteSegment(range_id, base_offset))

    def create_user(self, user: User) -> Deferred[None]:
        return self._change(CreateUser(user))

    def update_user(
        self,
        name: str,
        *,
        password_hash: str | None = None,
        permissions: frozenset[str] | None = None,
    ) -> Deferred[User]:
        updated = self._submit(UpdateUser(name, password_hash, permissions))
        return updated.addCallback(lambda state: state.users[name])

    def delete_user(self, name: str) -> Deferred[None]:
        return self._change(DeleteUser(name))

    def grant_acl(self, grant: AclGrant) -> Deferred[None]:
        return self._change(GrantAcl(grant))

    def revoke_acl(self, grant: AclGrant) -> Deferred[None]:
        return self._change(RevokeAcl(grant))

    def commit_group_position(
        self, topic: str, group: str, cursor: str, merge: MergeCursors | None = None
    ) -> Deferred[None]:
        return self._change(CommitGroupPosition(topic, group, cursor, merge))

    def _change(self, change: Change) -> Deferred[None]:
        return self._submit(change).addCallback(_nothing)
