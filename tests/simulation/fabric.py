"""The simulated machine room: one ``Clock`` for everything, per-node clocks that a crash
silences and a stall freezes, disks that take time, an etcd whose answers and watch events
arrive late (and that a node can be cut off from, that fails requests and loses answers), and a
network that drops, delays, duplicates and reorders peer messages and can be partitioned.

Every choice is drawn from one seeded ``random.Random``, so a seed replays exactly.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from twisted.internet.base import DelayedCall
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import IDelayedCall
from twisted.python.failure import Failure

from logbroker.controlplane import (
    ControlPlaneUnavailableError,
    KeyValueStore,
    OutcomeUnknownError,
)
from logbroker.controlplane._kv import OnEvents, OnLost, WatchEvent, WatchHandle
from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.window import PeerError

_T = TypeVar("_T")


class SimClock:
    """The simulation's one clock: ``twisted.internet.task.Clock``'s behaviour on a heap.

    ``Clock`` sorts every pending call whenever one is added; with the thousands a simulated
    run keeps pending (client deadlines, lease timers, disk jobs) that sort is most of the run.
    Cancelled and moved calls are dropped lazily, when their heap entry comes up.
    """

    def __init__(self) -> None:
        self._now = 0.0
        self._heap: list[tuple[float, int, DelayedCall]] = []
        self._sequence = 0

    def seconds(self) -> float:
        return self._now

    def callLater(self, delay: float, f: Callable[..., Any], *args: Any, **kw: Any) -> IDelayedCall:
        at = self._now + delay
        if delay > 0 and at <= self._now:
            # A delay below the clock's resolution still lets time pass, as a real clock does:
            # a loop that waits "almost nothing" (a ``LoopingCall`` on a stepped clock) would
            # otherwise never see time move.
            at = math.nextafter(self._now, math.inf)
        call = DelayedCall(at, f, args, kw, _ignore, self._push, seconds=self.seconds)
        self._push(call)
        return call

    def _push(self, call: DelayedCall) -> None:
        heapq.heappush(self._heap, (call.time, self._sequence, call))
        self._sequence += 1

    def getDelayedCalls(self) -> Sequence[IDelayedCall]:
        return [call for _, _, call in self._heap if call.active()]

    def advance(self, amount: float) -> None:
        """Run every call due in the next ``amount`` seconds, in time order (ties in the order
        they were made), then move to the end of it."""
        end = self._now + amount
        heap = self._heap
        while heap and heap[0][0] <= end:
            at, _, call = heapq.heappop(heap)
            if not call.active() or call.time != at:
                continue
            if call.delayed_time:
                call.activate_delay()
                self._push(call)
                continue
            self._now = max(self._now, at)
            call.called = 1
            call.func(*call.args, **call.kw)
        self._now = max(self._now, end)


def _ignore(call: DelayedCall) -> None:
    """A cancelled call stays in the heap until it comes up, and is skipped then."""


class NodeClock:
    """One node incarnation's view of the shared clock. A crash cancels every call the
    incarnation scheduled and ignores what it schedules afterwards: a dead process runs
    nothing. A stall (``freeze``) holds every call that comes due, and the peer requests and
    etcd answers that arrive, until ``resume`` runs them all at once, in the order they came
    due, as a process resumed after SIGSTOP does."""

    def __init__(self, clock: SimClock) -> None:
        self._clock = clock
        self._calls: set[IDelayedCall] = set()
        self.alive = True
        self.frozen = False
        self._held: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
        #: How far this node's clock is behind the others (``step_back``).
        self.skew = 0.0
        #: How fast this node's clock runs against the others' (``run_at``), from when.
        self._rate = 1.0
        self._origin_global = self._origin_local = clock.seconds()

    def seconds(self) -> float:
        elapsed = (self._clock.seconds() - self._origin_global) * self._rate
        return self._origin_local + elapsed - self.skew

    def run_at(self, rate: float) -> None:
        """From now on this node's clock runs at ``rate`` times the others' speed (below 1: it
        lags, as a drifting clock or a starved VM's does): its timers fire late, so it finds
        out late that etcd stopped renewing its lease. Only fencing keeps such a node from
        getting anything acknowledged once another took its ranges over."""
        self._origin_local = self.seconds() + self.skew
        self._origin_global = self._clock.seconds()
        self._rate = rate

    def step_back(self, seconds: float) -> None:
        """The node's clock is stepped back (as NTP may, or a paused VM's): it reads
        ``seconds`` less from now on, so it thinks less time passed since it last renewed its
        lease than etcd does. Only fencing keeps such a node from leading after etcd expired
        its lease."""
        self.skew += seconds

    def freeze(self) -> None:
        self.frozen = True

    def resume(self) -> None:
        self.frozen = False
        held, self._held = self._held, []
        for f, args, kw in held:
            if self.alive:
                f(*args, **kw)

    def callLater(self, delay: float, f: Callable[..., Any], *args: Any, **kw: Any) -> IDelayedCall:
        delay /= self._rate

        def run() -> None:
            self._calls.discard(call)
            if not self.alive:
                return
            if self.frozen:
                self._held.append((f, args, kw))
                return
            f(*args, **kw)

        call = self._clock.callLater(delay, run)
        if self.alive:
            self._calls.add(call)
        else:
            call.cancel()
        return call

    def getDelayedCalls(self) -> Sequence[IDelayedCall]:
        return [call for call in self._calls if call.active()]

    def kill(self) -> None:
        self.alive = False
        self._held.clear()
        for call in list(self._calls):
            if call.active():
                call.cancel()
        self._calls.clear()

    # Anything asking for the reactor's thread helpers gets the same clock.
    def callFromThread(self, f: Callable[..., Any], *args: Any, **kw: Any) -> None:
        self.callLater(0, f, *args, **kw)


class SlowDisk:
    """A storage ``Executor`` whose jobs finish after a random delay on the node's clock: the
    job itself (the write, the fsync) runs when it finishes, so a crash before then loses it."""

    def __init__(self, clock: NodeClock, rng: random.Random, slowest: float = 0.004) -> None:
        self._clock = clock
        self._rng = rng
        self._slowest = slowest
        #: Jobs finish in the order they were given (one disk queue), like a writer thread.
        self._last = 0.0

    def run(self, job: Callable[..., _T], *args: Any) -> Deferred[_T]:
        done: Deferred[_T] = Deferred()
        now = self._clock.seconds()
        at = max(now, self._last) + self._rng.uniform(0.0001, self._slowest)
        self._last = at

        def finish() -> None:
            try:
                result = job(*args)
            except Exception:
                done.errback(Failure())
            else:
                done.callback(result)

        self._clock.callLater(at - now, finish)
        return done


class EtcdFaults:
    """What goes wrong between the nodes and etcd, changed by the scenario: requests that fail
    before reaching etcd, and answers lost after it acted (a transaction's loss is an unknown
    outcome, as the gateway reports it)."""

    def __init__(self) -> None:
        self.errors = 0.0
        self.lost_answers = 0.0
        #: The slowest answer (seconds): etcd under load answers in tens of milliseconds.
        self.slowest = 0.003

    def calm(self) -> None:
        self.errors = self.lost_answers = 0.0
        self.slowest = 0.003


class EtcdLink:
    """A node incarnation's link to the shared etcd double: answers and watch events arrive
    after a small random delay; once the node dies, nothing more arrives (its watches end).
    A cut link (``cut``) fails every request after a timeout without reaching etcd and ends
    every watch, until ``mend``."""

    #: How long a request on a cut link takes to fail (the gateway's own timeout).
    TIMEOUT = 1.0

    def __init__(
        self, store: KeyValueStore, clock: NodeClock, rng: random.Random, faults: EtcdFaults
    ) -> None:
        self._store = store
        self._clock = clock
        self._rng = rng
        self._faults = faults
        self._watches: list[tuple[WatchHandle, OnLost]] = []
        self.cut = False

    def _late(self, answer: Deferred[_T]) -> Deferred[_T]:
        late: Deferred[_T] = Deferred()
        delay = self._rng.uniform(0.0002, self._faults.slowest)

        def arrive(result: object) -> None:
            self._clock.callLater(delay, _fire, late, result)

        answer.addBoth(arrive)
        return late

    def _call(self, name: str, *args: Any) -> Deferred[Any]:
        if not self._clock.alive:
            return fail(ControlPlaneUnavailableError("this node is down"))
        if self.cut or self._rng.random() < self._faults.errors:
            failed: Deferred[Any] = Deferred()
            delay = self.TIMEOUT if self.cut else self._rng.uniform(0.0002, 0.003)
            error = ControlPlaneUnavailableError(f"no etcd member answered {name}")
            self._clock.callLater(delay, _fire, failed, Failure(error))
            return failed
        answered = getattr(self._store, name)(*args)
        if self._rng.random() < self._faults.lost_answers:
            lost: Deferred[Any] = Deferred()
            error = (
                OutcomeUnknownError(f"the answer to {name} was lost")
                if name == "txn"
                else ControlPlaneUnavailableError(f"the answer to {name} was lost")
            )
            answered.addBoth(lambda _: self._clock.callLater(0.5, _fire, lost, Failure(error)))
            return lost
        return self._late(answered)

    def range_prefix(self, prefix: bytes) -> Deferred[Any]:
        return self._call("range_prefix", prefix)

    def txn(self, compares: Any, success: Any, failure: Any = ()) -> Deferred[Any]:
        return self._call("txn", compares, success, failure)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> Deferred[Any]:
        return self._call("put", key, value, lease)

    def delete(self, key: bytes) -> Deferred[Any]:
        return self._call("delete", key)

    def delete_prefix(self, prefix: bytes) -> Deferred[Any]:
        return self._call("delete_prefix", prefix)

    def grant(self, ttl_seconds: int) -> Deferred[Any]:
        return self._call("grant", ttl_seconds)

    def keepalive(self, lease: int) -> Deferred[Any]:
        return self._call("keepalive", lease)

    def revoke(self, lease: int) -> Deferred[Any]:
        return self._call("revoke", lease)

    def close(self) -> Deferred[None]:
        return self._store.close()

    def watch(
        self, prefix: bytes, start_revision: int, on_events: OnEvents, on_lost: OnLost
    ) -> WatchHandle:
        # One watch is one stream (etcd's gateway answers a watch as one chunked response):
        # its events arrive late, but in the order etcd sent them, and its end after them.
        last = 0.0

        def in_order(delay: float) -> float:
            nonlocal last
            now = self._clock.seconds()
            last = max(now + delay, last + 1e-6)
            return last - now

        def events(found: Sequence[WatchEvent]) -> None:
            delay = in_order(self._rng.uniform(0.0002, 0.005))
            self._clock.callLater(delay, on_events, list(found))

        def lost(error: Exception) -> None:
            self._clock.callLater(in_order(0.001), on_lost, error)

        if self.cut:
            self._clock.callLater(
                self.TIMEOUT, on_lost, ControlPlaneUnavailableError("no etcd member to watch")
            )
            return _NoWatch()
        handle = self._store.watch(prefix, start_revision, events, lost)
        self._watches.append((handle, lost))
        return handle

    def kill(self) -> None:
        for handle, _ in self._watches:
            handle.cancel()
        self._watches.clear()

    def sever(self) -> None:
        """Cut this node off from etcd: its watches end, its requests fail."""
        self.cut = True
        watches, self._watches = self._watches, []
        for handle, lost in watches:
            handle.cancel()
            lost(ControlPlaneUnavailableError("the link to etcd was cut"))

    def mend(self) -> None:
        self.cut = False


class _NoWatch:
    def cancel(self) -> None:
        pass


def _fire(deferred: Deferred[Any], result: object) -> None:
    if isinstance(result, Failure):
        deferred.errback(result)
    else:
        deferred.callback(result)


#: A node's handler of peer requests: ``(peer node id, op, payload) -> ok payload``.
Serve = Callable[[str, PeerOp, bytes], Deferred[bytes]]


class Network:
    """Peer links between the simulated nodes.

    A request reaches its node after a random delay, or is lost (the sender hears nothing
    until its timeout), or arrives twice; the answer comes back the same way. Partitions cut
    pairs of nodes both ways; a request to a node that is down or cut off fails at once, as a
    link without a connection does.
    """

    def __init__(self, clock: SimClock, rng: random.Random) -> None:
        self._clock = clock
        self._rng = rng
        self._serve: dict[str, tuple[NodeClock, Serve]] = {}
        self._cut: set[frozenset[str]] = set()
        #: When each node last heard from each other over their link: now, while they can
        #: (the links ping), else when they last could.
        self._heard: dict[tuple[str, str], float] = {}
        #: Fault rates, changed by the scenario; zero when faults stop.
        self.loss = 0.0
        self.duplication = 0.0
        #: The share of messages held up for a long while (retransmissions, full queues): a
        #: message sent before a node lost its lease may land after another node took over.
        self.slow = 0.0
        self.slowest = 0.003
        self.timeout = 2.0

    def attach(self, node: str, clock: NodeClock, serve: Serve) -> None:
        self._serve[node] = (clock, serve)

    def cut(self, a: str, b: str) -> None:
        self._cut.add(frozenset((a, b)))

    def heal(self) -> None:
        self._cut.clear()

    def calm(self) -> None:
        self.loss = 0.0
        self.duplication = 0.0
        self.slow = 0.0

    def reachable(self, a: str, b: str) -> bool:
        target = self._serve.get(b)
        return target is not None and target[0].alive and frozenset((a, b)) not in self._cut

    def heard_at(self, node: str, peer: str, now: float) -> float | None:
        """When (``now`` on ``node``'s clock) ``node``'s link last heard from ``peer`` (a
        frozen peer answers no pings)."""
        target = self._serve.get(peer)
        if self.reachable(node, peer) and target is not None and not target[0].frozen:
            self._heard[node, peer] = now
        return self._heard.get((node, peer))

    def requester(self, node: str, clock: NodeClock) -> _Requester:
        return _Requester(self, node, clock)

    def _delay(self) -> float:
        if self.slow and self._rng.random() < self.slow:
            return self._rng.uniform(0.5, 3.0)
        return self._rng.uniform(0.0001, self.slowest)

    def send(
        self, sender: str, clock: NodeClock, target: str, op: PeerOp, payload: bytes
    ) -> Deferred[bytes]:
        if not self.reachable(sender, target):
            return fail(PeerError(PeerReason.UNREACHABLE, f"no link from {sender} to {target}"))
        answer: Deferred[bytes] = Deferred()
        # On the sender's clock: a sender that dies hears nothing more.
        timeout = clock.callLater(self.timeout, _time_out, answer, target)
        target_clock, serve = self._serve[target]
        copies = 2 if self._rng.random() < self.duplication else 1
        for _ in range(copies):
            if self._rng.random() < self.loss:
                continue
            self._clock.callLater(
                self._delay(),
                self._deliver,
                sender,
                clock,
                target,
                target_clock,
                serve,
                op,
                payload,
                answer,
                timeout,
            )
        return answer

    def _deliver(
        self,
        sender: str,
        clock: NodeClock,
        target: str,
        target_clock: NodeClock,
        serve: Serve,
        op: PeerOp,
        payload: bytes,
        answer: Deferred[bytes],
        timeout: IDelayedCall,
    ) -> None:
        if not target_clock.alive or frozenset((sender, target)) in self._cut:
            return
        # On the target's clock: a stalled node takes it once it resumes.
        target_clock.callLater(
            0, self._serve_one, sender, clock, serve, op, payload, answer, timeout
        )

    def _serve_one(
        self,
        sender: str,
        clock: NodeClock,
        serve: Serve,
        op: PeerOp,
        payload: bytes,
        answer: Deferred[bytes],
        timeout: IDelayedCall,
    ) -> None:
        try:
            served = serve(sender, op, payload)
        except Exception:
            served = fail(Failure())

        def back(result: object) -> None:
            if self._rng.random() < self.loss:
                return
            if isinstance(result, Failure):
                error = result.value
                reason = getattr(error, "reason", PeerReason.INTERNAL_ERROR)
                result = Failure(PeerError(str(reason), str(error)))
            self._clock.callLater(self._delay(), self._answer, clock, answer, timeout, result)

        served.addBoth(back)

    def _answer(
        self, clock: NodeClock, answer: Deferred[bytes], timeout: IDelayedCall, result: object
    ) -> None:
        # On the sender's clock: a stalled sender hears it once it resumes.
        clock.callLater(0, self._heard_answer, answer, timeout, result)

    def _heard_answer(self, answer: Deferred[bytes], timeout: IDelayedCall, result: object) -> None:
        if answer.called:
            return
        if timeout.active():
            timeout.cancel()
        _fire(answer, result)


def _time_out(answer: Deferred[bytes], target: str) -> None:
    if not answer.called:
        answer.errback(PeerError(PeerReason.TIMEOUT, f"{target} did not answer in time"))


class _Requester:
    def __init__(self, network: Network, node: str, clock: NodeClock) -> None:
        self._network = network
        self._node = node
        self._clock = clock

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        return self._network.send(self._node, self._clock, node_id, op, payload)

    def heard_at(self, node_id: str) -> float | None:
        return self._network.heard_at(self._node, node_id, self._clock.seconds())
