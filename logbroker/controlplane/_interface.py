"""The one interface the broker uses to reach its control plane (DESIGN section 7).

Reads are synchronous and see the latest durable state: a change becomes visible once it is
durable, never before. Changes return Deferreds that fire once the change is durable, in the
order they were asked for; one that contradicts the state, as it will be once the changes
asked for before it are durable, fails at once with a typed ``ControlPlaneError``. A change
whose Deferred failed did not take effect.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

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
from logbroker.controlplane._state import MergeCursors


class ControlPlane(Protocol):
    def start(self) -> Deferred[None]:
        """Load the state; reads and changes are refused until this has fired."""

    def close(self) -> Deferred[None]:
        """Refuse further changes; fire once every change asked for is settled."""

    # -- reads ---------------------------------------------------------------------------------

    def topic(self, name: str) -> Topic | None: ...

    def topics(self) -> list[Topic]:
        """Every topic, by name."""

    def range_ids(self) -> Sequence[str]:
        """Every range of every topic: the topics by name, each one's ranges in order."""

    def range(self, range_id: str) -> Range | None: ...

    def ranges(self, topic: str) -> Sequence[Range]:
        """The topic's ranges in the order the topic lists them; none for an unknown topic."""

    def segments(self, range_id: str) -> list[SegmentMeta]:
        """The range's segments by base offset."""

    def last_segment(self, range_id: str) -> SegmentMeta | None:
        """The range's segment with the highest base offset (its active one, or the one a roll
        sealed before opening the next), ``None`` if it has none: ``segments(range_id)[-1]``
        without building the list (asked of every range, twice a second)."""

    def watch_segments(self, listener: Callable[[Collection[str]], None]) -> None:
        """Tell ``listener`` the ids of the ranges whose segment records changed, each time
        this node's view of the control plane changes (by its own changes or other nodes'):
        what follows the records needs to look again at those ranges alone."""

    def user(self, name: str) -> User | None: ...

    def users(self) -> list[User]:
        """Every user, by name."""

    def acls(self, user: str | None = None) -> list[AclGrant]:
        """The grants of ``user``, or of every user, sorted."""

    def group_position(self, topic: str, group: str) -> str | None:
        """The cursor ``group`` last committed on ``topic``."""

    # -- changes -------------------------------------------------------------------------------

    def create_topic(self, topic: Topic, ranges: Sequence[Range]) -> Deferred[None]:
        """Create ``topic`` with ``ranges`` (listed in ``topic.range_ids``, tiling its
        keyspace); ``AlreadyExistsError`` if the topic or a range id exists."""

    def put_segment(
        self, meta: SegmentMeta, *, expected: SegmentMeta | AnyRecord | None = ANY_RECORD
    ) -> Deferred[None]:
        """Record a segment or a change to it. ``NotFoundError`` for an unknown range;
        ``InvalidChangeError`` for a lower epoch, a change to a sealed segment's counts, or a
        record that is not ``expected`` when the change takes effect (``None``: the segment
        must not be recorded yet), compared where the record is kept (in etcd, on etcd's own
        revision in the transaction that writes it), never against a cached copy."""

    def put_segments(
        self, changes: Sequence[tuple[SegmentMeta, SegmentMeta | AnyRecord | None]]
    ) -> Deferred[None]:
        """Record several segments or changes to them, ``(meta, expected)`` each as
        ``put_segment`` would, in that order, all together or none (the first refusal fails
        the whole): a seal and the opening of the next segment in one change."""

    def delete_segment(self, range_id: str, base_offset: int) -> Deferred[None]:
        """Forget a segment (retention); ``NotFoundError`` if it is not recorded."""

    def create_user(self, user: User) -> Deferred[None]:
        """``UserExistsError`` if the name is taken."""

    def update_user(
        self,
        name: str,
        *,
        password_hash: str | None = None,
        permissions: frozenset[str] | None = None,
    ) -> Deferred[User]:
        """Change what is given, keep the rest; fire with the user as updated.
        ``UserNotFoundError`` for an unknown user."""

    def delete_user(self, name: str) -> Deferred[None]:
        """Remove the user and its ACL grants; ``UserNotFoundError`` for an unknown user."""

    def grant_acl(self, grant: AclGrant) -> Deferred[None]:
        """Add a grant (a no-op if present); ``UserNotFoundError`` for an unknown user."""

    def revoke_acl(self, grant: AclGrant) -> Deferred[None]:
        """Remove a grant; ``NotFoundError`` if it is not present."""

    def commit_group_position(
        self, topic: str, group: str, cursor: str, merge: MergeCursors | None = None
    ) -> Deferred[None]:
        """Record ``group``'s cursor on ``topic``; ``NotFoundError`` for an unknown topic.
        With ``merge``, record ``merge(stored cursor or None, cursor)``, computed against the
        state as it is when the change takes effect (not when it was asked for)."""
