"""Consumer group membership: who is in a group, and which ranges each member reads.

Pure: the caller passes ``now`` (milliseconds). A member joins by fetching or subscribing with
its name and stays while it keeps coming back within the session timeout; ``leave_group`` removes
it at once. Ranges are shared out by rendezvous hashing: each range goes to the member with the
highest CRC32C of ``member NUL range_id``. Every member computes the same shares from the same
membership, shares are disjoint and cover every range, and a member joining or leaving moves
only the ranges it takes or gives up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs
from crc32c import crc32c
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime


def _weight(member: str, range_id: str) -> int:
    return int(crc32c(member.encode("utf-8") + b"\x00" + range_id.encode("utf-8")))


def assign(members: Iterable[str], range_ids: Iterable[str]) -> dict[str, list[str]]:
    """Each member's share of ``range_ids`` (members with no range get an empty list)."""
    shares: dict[str, list[str]] = {member: [] for member in sorted(set(members))}
    if not shares:
        return shares
    for range_id in range_ids:
        owner = max(shares, key=lambda member: (_weight(member, range_id), member))
        shares[owner].append(range_id)
    return shares


@attrs.define
class Group:
    """The live members of one consumer group of one topic, with when each was last seen."""

    session_timeout_ms: int
    _last_seen: dict[str, int] = attrs.field(factory=dict)

    def touch(self, member: str, now: int) -> None:
        """``member`` is active at ``now`` (it joins if it was not a member)."""
        self._last_seen[member] = now

    def leave(self, member: str) -> bool:
        """Remove ``member``; whether it was a member."""
        return self._last_seen.pop(member, None) is not None

    def expire(self, now: int) -> list[str]:
        """Drop the members not seen for longer than the session timeout; return them."""
        expired = [
            member
            for member, seen in self._last_seen.items()
            if now - seen > self.session_timeout_ms
        ]
        for member in expired:
            del self._last_seen[member]
        return expired

    @property
    def members(self) -> list[str]:
        return sorted(self._last_seen)

    def share(self, member: str, range_ids: Iterable[str]) -> list[str]:
        """The ranges ``member`` reads under the current membership."""
        return assign(self._last_seen, range_ids).get(member, [])


class GroupCoordinator(Protocol):
    """Who keeps each consumer group's membership: this node (``LocalGroups``), or in a cluster
    the group's coordinator node, wherever its members are connected."""

    def share(
        self, topic: str, group: str, member: str, range_ids: Sequence[str]
    ) -> Deferred[list[str]]:
        """``member`` is active now: the ranges of ``range_ids`` it reads."""

    def touch(self, topic: str, group: str, member: str) -> None:
        """``member`` is active now (it holds a subscription), whether or not it fetches."""

    def leave(self, topic: str, group: str, member: str) -> None:
        """``member`` leaves at once; its ranges go to the others."""


class LocalGroups:
    """Every consumer group's members, kept in this process, each expiring
    ``session_timeout_ms`` after it was last seen."""

    def __init__(self, clock: IReactorTime, session_timeout_ms: int) -> None:
        self._clock = clock
        self._session_timeout_ms = session_timeout_ms
        self._groups: dict[tuple[str, str], Group] = {}

    def _now(self) -> int:
        return round(self._clock.seconds() * 1000)

    def _group(self, topic: str, group: str) -> Group:
        key = (topic, group)
        state = self._groups.get(key)
        if state is None:
            state = self._groups[key] = Group(self._session_timeout_ms)
        state.expire(self._now())
        return state

    def share(
        self, topic: str, group: str, member: str, range_ids: Sequence[str]
    ) -> Deferred[list[str]]:
        state = self._group(topic, group)
        state.touch(member, self._now())
        return succeed(state.share(member, range_ids))

    def touch(self, topic: str, group: str, member: str) -> None:
        self._group(topic, group).touch(member, self._now())

    def leave(self, topic: str, group: str, member: str) -> None:
        key = (topic, group)
        state = self._groups.get(key)
        if state is not None:
            state.leave(member)
            if not state.members:
                # Forget empty groups: names clients made up must not accumulate.
                del self._groups[key]
