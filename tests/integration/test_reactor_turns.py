"""What the membership relies on of Twisted's reactor (``Membership._after_pending_io``): a
call made from a timer, even at delay 0, runs only after the reactor has read the connections
that became readable meanwhile. ``TurnClock`` in ``tests/unit/cluster/test_membership_turns.py``
runs calls this way."""

from __future__ import annotations

import socket

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReadDescriptor
from zope.interface import implementer

pytestmark = pytest.mark.integration


@implementer(IReadDescriptor)
class Reader:
    def __init__(self, sock: socket.socket, order: list[str], done: Deferred[None]) -> None:
        self._sock = sock
        self._order = order
        self._done = done

    def fileno(self) -> int:
        return self._sock.fileno()

    def doRead(self) -> None:
        self._sock.recv(16)
        self._order.append("read")

    def connectionLost(self, reason: object) -> None:
        pass

    def logPrefix(self) -> str:
        return "Reader"


@pytest_twisted.ensureDeferred
async def test_a_call_a_timer_makes_runs_after_the_reads_that_came_in_meanwhile() -> None:
    ours, theirs = socket.socketpair()
    order: list[str] = []
    done: Deferred[None] = Deferred()
    reader = Reader(ours, order, done)
    reactor.addReader(reader)  # type: ignore[attr-defined]

    def timer() -> None:
        theirs.send(b"x")  # readable at once: the answer is in the connection
        reactor.callLater(0, after)  # type: ignore[attr-defined]

    def after() -> None:
        order.append("call")
        done.callback(None)

    try:
        reactor.callLater(0.01, timer)  # type: ignore[attr-defined]
        await done
    finally:
        reactor.removeReader(reader)  # type: ignore[attr-defined]
        ours.close()
        theirs.close()
    assert order == ["read", "call"]
