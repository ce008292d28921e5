"""Consumer groups in a cluster: each group's membership is kept by one coordinator node.

A group's members may be connected to different nodes. Every node agrees on the group's
coordinator (rendezvous hashing of ``topic`` and ``group`` over the live members, as placement
does), and a node that is not the coordinator forwards each fetch's "member is active, which
ranges does it read" to it over the peer link, so members on different nodes get disjoint
shares and the session timeout is enforced in one place. When the coordinator changes (a node
joins or leaves), the new one learns the members as they next fetch: for up to one session
timeout, shares may overlap (a member the old coordinator knew still reads what it was given)
but never leave a range unread.

A coordinator that cannot be reached makes a group fetch answer ``unreachable``: a member never
reads by a share computed from a partial view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.broker.errors import BrokerError
from logbroker.broker.groups import LocalGroups
from logbroker.errors import Reason
from logbroker.peer.frames import PeerOp
from logbroker.peer.range_ops import (
    GroupRequest,
    GroupVerb,
    decode_group_request,
    decode_group_share,
    encode_group_request,
    encode_group_share,
)
from logbroker.peer.requester import PeerRequester
from logbroker.placement import (
    PlacementError,
    PlacementNode,
    PlacementRule,
    place,
)

log = Logger()

_ONE = PlacementRule(1)


class ClusterGroups:
    """The ``GroupCoordinator`` of a cluster node."""

    def __init__(
        self,
        node_id: str,
        local: LocalGroups,
        live_nodes: Callable[[], Iterable[PlacementNode]],
        peers: PeerRequester,
    ) -> None:
        self._node_id = node_id
        self._local = local
        self._live_nodes = live_nodes
        self._peers = peers

    def coordinator(self, topic: str, group: str) -> str:
        try:
            return place(f"group:{topic}\x00{group}", self._live_nodes(), _ONE).primary
        except PlacementError:
            # No live member known (this node is not registered yet): keep the group here.
            return self._node_id

    def share(
        self, topic: str, group: str, member: str, range_ids: Sequence[str]
    ) -> Deferred[list[str]]:
        coordinator = self.coordinator(topic, group)
        if coordinator == self._node_id:
            return self._local.share(topic, group, member, range_ids)
        request = GroupRequest(GroupVerb.SHARE, topic, group, member, tuple(range_ids))

        def unreachable(failure: Failure) -> list[str]:
            raise BrokerError(
                Reason.UNREACHABLE,
                f"group {group!r} of {topic!r} is coordinated by {coordinator}, which did not"
                f" answer: {failure.getErrorMessage()}",
            )

        sent = self._peers.request(coordinator, PeerOp.GROUP, encode_group_request(request))
        return sent.addCallbacks(decode_group_share, unreachable)

    def touch(self, topic: str, group: str, member: str) -> None:
        self._tell(GroupVerb.TOUCH, topic, group, member)

    def leave(self, topic: str, group: str, member: str) -> None:
        self._tell(GroupVerb.LEAVE, topic, group, member)

    def _tell(self, verb: GroupVerb, topic: str, group: str, member: str) -> None:
        coordinator = self.coordinator(topic, group)
        if coordinator == self._node_id:
            serve_group(self._local, GroupRequest(verb, topic, group, member, ()))
            return
        request = GroupRequest(verb, topic, group, member, ())

        def failed(failure: Failure) -> None:
            # The member's next fetch or subscription tells the coordinator again.
            log.debug(
                "Could not tell {coordinator} that {member} of {group} is {verb}: {error}",
                coordinator=coordinator,
                member=member,
                group=group,
                verb=verb.name.lower(),
                error=failure.getErrorMessage(),
            )

        self._peers.request(coordinator, PeerOp.GROUP, encode_group_request(request)).addErrback(
            failed
        )


def serve_group(local: LocalGroups, request: GroupRequest) -> Deferred[list[str]]:
    """What the coordinator does with a group request from a peer (or from itself)."""
    if request.verb is GroupVerb.SHARE:
        return local.share(request.topic, request.group, request.member, request.range_ids)
    if request.verb is GroupVerb.TOUCH:
        local.touch(request.topic, request.group, request.member)
    else:
        local.leave(request.topic, request.group, request.member)
    return succeed([])


def group_handler(local: LocalGroups) -> Callable[[bytes], Deferred[bytes]]:
    """The peer handler of ``PeerOp.GROUP`` on a coordinator."""

    def handle(payload: bytes) -> Deferred[bytes]:
        return serve_group(local, decode_group_request(payload)).addCallback(encode_group_share)

    return handle
