"""How replication and forwarding send a request to a node: ``PeerRequester``.

``PeerConnections`` is the requester of a running node; the simulation has its own. A node's
requests to itself (a node taking a segment over fences its own copy like any other) go through
``Loopback`` to its own handlers, so the procedures that treat every copy alike need no special
case for the local one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from twisted.internet.defer import Deferred, fail, maybeDeferred

from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.window import PeerError


class PeerRequester(Protocol):
    """Sends one request to a peer node: the Deferred fires with the ok payload, or fails with
    ``PeerError`` (``unreachable`` at once without a link)."""

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]: ...


if TYPE_CHECKING:
    from logbroker.peer.connections import PeerConnections

    def _connections_are_a_requester(connections: PeerConnections) -> PeerRequester:
        return connections


#: A node's own handler of one op: ``(sending node id, payload) -> ok payload``.
LocalOps = dict[PeerOp, Callable[[str, bytes], Deferred[bytes]]]


class Loopback:
    """Sends requests for ``node_id`` to its own ``ops``, and the rest over ``peers``."""

    def __init__(self, node_id: str, peers: PeerRequester, ops: LocalOps) -> None:
        self._node_id = node_id
        self._peers = peers
        self._ops = ops

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        if node_id != self._node_id:
            return self._peers.request(node_id, op, payload)
        serve = self._ops.get(op)
        if serve is None:
            return fail(PeerError(PeerReason.UNKNOWN_OP, f"op {op} is not served locally"))
        return maybeDeferred(serve, self._node_id, payload)
