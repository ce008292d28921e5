"""The ``RangeHandle`` contract, run against every implementation of the seam.

Each case builds a world that hands out the handle of range ``r.0`` and says how to settle what
is in flight (run held storage jobs, deliver peer messages...); the assertions are the same for
every handle.

* ``local``: a ``LocalRange`` over a range log on a ``MemoryFileSystem``.
* ``forwarded``: a ``ForwardedRange`` on node ``a`` whose requests cross a real peer link
  (``PeerConnections`` to a ``PeerServerFactory``, handshake included, over ``iosim``) to node
  ``b``'s ``RangeServer`` over the same kind of local range, opened by the first request.
* ``replicated``: the ``ReplicatedRange`` node ``a`` leads after claiming the range, whose
  replicas ``b`` and ``c`` (each with its own log and ``ReplicaServer``) are reached directly;
  an append is acknowledged once a quorum of the three copies holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
from twisted.internet.defer import CancelledError, Deferred, maybeDeferred, succeed
from twisted.internet.interfaces import IProtocol, IProtocolFactory, IStreamClientEndpoint
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.test.iosim import FakeTransport, IOPump, connect
from zope.interface import implementer

from logbroker import wire
from logbroker.broker.errors import BrokerError
from logbroker.broker.producers import Admission, ProducerTable
from logbroker.broker.ranges import Bounds, LocalRange, LocalRanges, RangeHandle
from logbroker.cluster.forwarding import ForwardedRange, RangeServer
from logbroker.config import SpreadPolicy
from logbroker.controlplane import (
    EtcdControlPlane,
    Range,
    RangeState,
    SegmentMeta,
    SegmentState,
    Topic,
)
from logbroker.errors import Reason
from logbroker.metrics import Metrics
from logbroker.peer.connections import PeerConnections, PeerServerFactory
from logbroker.peer.frames import PeerOp
from logbroker.peer.handshake import PeerIdentity
from logbroker.peer.link import PeerSettings, RequestHandler
from logbroker.peer.requester import LocalOps, Loopback
from logbroker.placement import PlacementNode, PlacementRule
from logbroker.records import ProducerStamp, Record
from logbroker.replication.copies import CommittedCopies
from logbroker.replication.core.actions import ReplicationSettings
from logbroker.replication.leading import LeadRanges
from logbroker.replication.replica import ReplicaServer
from logbroker.replication.takeover import ClaimContext, SegmentClaims
from logbroker.storage import LogConfig
from logbroker.testing import ManualExecutor, MemoryFileSystem, MemoryKeyValueStore
from tests.unit.storage.helpers import MemoryLogs, failure_of, result_of, run_until_idle

RANGE = "r.0"


@attrs.define
class World:
    handle: RangeHandle
    settle: Callable[[], None]
    #: Whether ``handle.refusal`` knows the range's limits. A forwarder does not: the primary
    #: refuses for itself, and the refusal comes back as the append's failure.
    refuses_up_front: bool = True
    #: Stops what the world started (and checks that it left nothing behind).
    close: Callable[[], None] = lambda: None

    def refusal(self, count: int) -> BrokerError | None:
        """Why an append of ``count`` records is refused: asked of the handle where it knows,
        else the failure of the append itself (which stores nothing when it is refused)."""
        refusal = self.handle.refusal(count)
        if refusal is not None or self.refuses_up_front:
            return refusal
        appending = self.handle.append(records(*[b"v"] * count))
        self.settle()
        outcome: list[object] = []
        appending.addCallbacks(outcome.append, lambda failure: outcome.append(failure.value))
        assert outcome, "the append has not finished"
        error = outcome[0]
        assert error is None or isinstance(error, BrokerError), error
        return error

    def done(self, deferred: Deferred[Any]) -> Any:
        self.settle()
        return result_of(deferred)

    def failed(self, deferred: Deferred[Any]) -> BaseException:
        self.settle()
        error = failure_of(deferred).value
        assert error is not None
        return error


#: The storage service counts integrity events into the metrics: so do these logs.
_counted = Metrics(Clock()).integrity_event


def local_world(config: LogConfig) -> World:
    executor = ManualExecutor()
    ranges = LocalRanges(MemoryLogs(executor=executor, config=config, on_integrity_event=_counted))
    opening = ranges.open([RANGE])
    executor.run_all()
    result_of(opening)
    return World(ranges.handle(RANGE), executor.run_all)


SECRET = b"cluster secret"


def identity(node_id: str) -> PeerIdentity:
    return PeerIdentity("c1", node_id, SECRET)


@implementer(IStreamClientEndpoint)
class PeerLink:
    """Node ``a``'s ``PeerConnections`` (``connections``, a ``PeerRequester``) with a link to node
    ``b``, whose peer listener serves requests with ``handler``; connections cross ``iosim``
    pumps, so every request and answer goes through the codec as bytes. ``flush`` delivers what
    is in flight; ``drop`` breaks the link; ``close`` stops it all and checks no timer is left."""

    def __init__(self, handler: RequestHandler, clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        settings = PeerSettings(ping_interval_s=5.0, dead_after_s=15.0)
        self.server = PeerServerFactory(identity("b"), self.clock, handler, settings)
        self.pumps: list[IOPump] = []
        self.connections = PeerConnections(
            identity("a"), self.clock, lambda _: self, settings, retry_policy=lambda _: 1.0
        )
        self.connections.add_peer("b")
        self.connections.startService()
        self.flush()
        assert self.connections.established("b") is not None

    def connect(self, factory: IProtocolFactory) -> Deferred[IProtocol]:
        client = factory.buildProtocol(None)
        server = self.server.buildProtocol(None)
        assert client is not None
        self.pumps.append(
            connect(
                server,
                FakeTransport(server, isServer=True),
                client,
                FakeTransport(client, isServer=False),
                greet=False,
                clock=self.clock,
            )
        )
        return succeed(client)

    def flush(self) -> bool:
        """Deliver everything in flight; whether anything moved."""
        return any([pump.flush() for pump in self.pumps])

    def drop(self) -> None:
        """The listener's end of the link goes away (its requests in flight are lost)."""
        self.pumps[-1].serverIO.abortConnection()
        self.flush()

    def close(self) -> None:
        stopped = self.connections.stopService()
        self.server.close_all()
        self.flush()
        result_of(stopped)
        assert self.clock.getDelayedCalls() == [], "a peer timer outlived its link"


def forwarded_world(config: LogConfig) -> World:
    executor = ManualExecutor()
    primary = LocalRanges(MemoryLogs(executor=executor, config=config, on_integrity_event=_counted))
    link = PeerLink(RangeServer(primary, Clock()))

    def settle() -> None:
        while link.flush() or executor.pending:
            executor.run_all()

    handle = ForwardedRange(RANGE, "b", link.connections)
    return World(handle, settle, refuses_up_front=False, close=link.close)


class _Replicas:
    """Replication requests between in-process nodes, answered as they are asked."""

    def __init__(self) -> None:
        self.ops: dict[str, LocalOps] = {}

    def sent_by(self, sender: str) -> _SentBy:
        return _SentBy(self, sender)


class _SentBy:
    """The requests one node sends."""

    def __init__(self, replicas: _Replicas, sender: str) -> None:
        self._replicas = replicas
        self._sender = sender

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        return maybeDeferred(self._replicas.ops[node_id][op], self._sender, payload)


def replicated_world(config: LogConfig) -> World:
    clock = Clock()
    control = EtcdControlPlane(MemoryKeyValueStore(clock), prefix="/c/", clock=clock)
    result_of(control.start())
    result_of(
        control.create_topic(
            Topic("r", 8, 0, (RANGE,)), [Range(RANGE, "r", 0, 256, RangeState.ACTIVE)]
        )
    )
    meta = SegmentMeta(RANGE, 0, SegmentState.ACTIVE, None, None, ("a", "b", "c"), 0)
    result_of(control.put_segment(meta))
    replicated = attrs.evolve(config, replicated=True, auto_roll=False)
    executors = {node: ManualExecutor() for node in "abc"}
    storages = {
        node: MemoryLogs(executor=executor, config=replicated, on_integrity_event=_counted)
        for node, executor in executors.items()
    }
    peers = _Replicas()
    for node, storage in storages.items():
        peers.ops[node] = ReplicaServer(node, storage, control).ops
    context = ClaimContext(
        node_id="a",
        control=control,
        storage=storages["a"],
        requester=Loopback("a", peers.sent_by("a"), peers.ops["a"]),
        clock=clock,
        settings=ReplicationSettings(replication_factor=3),
        rule=PlacementRule(3, None, 1, SpreadPolicy.SOFT),
        live_nodes=lambda: [PlacementNode(node, (), True) for node in "abc"],
        is_live=lambda node: True,
    )
    lead = LeadRanges(
        context.storage, SegmentClaims(context), CommittedCopies(context), replicated.roll_bytes
    )

    def settle() -> None:
        run_until_idle(clock, executors.values())

    claiming = lead.open([RANGE])
    settle()
    result_of(claiming)
    return World(lead.handle(RANGE), settle)


WORLDS = {"local": local_world, "forwarded": forwarded_world, "replicated": replicated_world}


@pytest.fixture(params=sorted(WORLDS))
def make_world(request: pytest.FixtureRequest) -> Iterator[Callable[..., World]]:
    made: list[World] = []

    def make(config: LogConfig | None = None) -> World:
        made.append(WORLDS[request.param](config or LogConfig()))
        return made[-1]

    yield make
    for world in made:
        world.close()


def records(*values: bytes) -> list[Record]:
    return [Record(value, b"k", 1_700_000_000_000 + i) for i, value in enumerate(values)]


def decoded(data: tuple[bytes, ...], count: int) -> list[bytes]:
    payload = b"".join(wire.records_payload_parts(count, data, ""))
    return [record.value for record in wire.decode_records(payload).records]


def test_an_append_is_readable_once_it_is_acknowledged(make_world: Callable[..., World]) -> None:
    world = make_world()
    assert world.done(world.handle.bounds()) == Bounds(0, 0)

    world.done(world.handle.append(records(b"a", b"b", b"c")))

    assert world.done(world.handle.bounds()) == Bounds(0, 3)
    read = world.done(world.handle.read(0, 100, 1 << 20))
    assert (read.count, read.next_offset) == (3, 3)
    assert decoded(read.data, read.count) == [b"a", b"b", b"c"]
    assert read.size == 3 * (1 + 1)


def test_a_read_stops_at_its_record_limit_and_goes_on_from_there(
    make_world: Callable[..., World],
) -> None:
    world = make_world()
    world.done(world.handle.append(records(*(b"%d" % i for i in range(10)))))

    first = world.done(world.handle.read(0, 4, 1 << 20))
    rest = world.done(world.handle.read(first.next_offset, 100, 1 << 20))

    assert (first.count, first.next_offset) == (4, 4)
    assert decoded(rest.data, rest.count) == [b"%d" % i for i in range(4, 10)]


def test_a_read_stops_once_its_byte_budget_is_taken_but_returns_a_record(
    make_world: Callable[..., World],
) -> None:
    world = make_world()
    world.done(world.handle.append(records(b"x" * 100, b"y" * 100)))

    read = world.done(world.handle.read(0, 100, 10))

    assert (read.count, read.next_offset) == (1, 1)


def test_a_read_at_the_end_returns_nothing_and_stays_there(
    make_world: Callable[..., World],
) -> None:
    world = make_world()
    world.done(world.handle.append(records(b"a")))

    read = world.done(world.handle.read(1, 100, 1 << 20))

    assert (read.count, read.next_offset, read.size) == (0, 1, 0)


def test_an_append_past_the_in_flight_limit_is_refused_as_overloaded(
    make_world: Callable[..., World],
) -> None:
    world = make_world(LogConfig(max_inflight_records=2))

    refusal = world.refusal(3)

    assert isinstance(refusal, BrokerError)
    assert refusal.reason is Reason.OVERLOADED
    assert world.done(world.handle.bounds()) == Bounds(0, 0)
    assert world.refusal(2) is None


def test_an_unknown_range_is_unreachable() -> None:
    ranges = LocalRanges(MemoryLogs(executor=ManualExecutor(), on_integrity_event=_counted))

    with pytest.raises(BrokerError) as raised:
        ranges.handle("nope.0")
    assert raised.value.reason is Reason.UNREACHABLE


def test_a_wait_fires_once_a_record_is_stored_at_its_offset(
    make_world: Callable[..., World],
) -> None:
    world = make_world()
    world.done(world.handle.append(records(b"a")))
    outcome: list[object] = []

    # A record at the offset already: at once.
    world.done(world.handle.wait(0, 30_000))
    # None yet: once one is stored, whoever stored it.
    waiting = world.handle.wait(1, 30_000)
    waiting.addBoth(outcome.append)
    world.settle()
    assert outcome == []
    world.done(world.handle.append(records(b"b")))

    assert outcome == [None]
    read = world.done(world.handle.read(1, 100, 1 << 20))
    assert decoded(read.data, read.count) == [b"b"]


def test_a_cancelled_wait_is_not_woken(make_world: Callable[..., World]) -> None:
    world = make_world()
    outcome: list[object] = []
    waiting = world.handle.wait(0, 30_000)
    waiting.addBoth(outcome.append)

    waiting.cancel()
    world.done(world.handle.append(records(b"a")))

    assert len(outcome) == 1
    assert isinstance(outcome[0], Failure)
    assert outcome[0].check(CancelledError)


# -- stamped appends (produce_idempotent) ------------------------------------------------------


def stored_values(world: World) -> list[bytes]:
    read = world.done(world.handle.read(0, 1000, 1 << 20))
    return decoded(read.data, read.count)


def test_a_stamped_append_sent_again_is_acknowledged_and_not_stored_again(
    make_world: Callable[..., World],
) -> None:
    world = make_world()
    stamp = ProducerStamp(7, 0)

    world.done(world.handle.append(records(b"a", b"b"), stamp))
    world.done(world.handle.append(records(b"a", b"b"), stamp))
    world.done(world.handle.append(records(b"c"), ProducerStamp(7, 1)))
    world.done(world.handle.append(records(b"c"), ProducerStamp(8, 1)))
    world.done(world.handle.append(records(b"d")))

    assert stored_values(world) == [b"a", b"b", b"c", b"c", b"d"]


def test_a_retry_while_its_first_try_is_in_flight_waits_for_it_and_is_not_stored(
    make_world: Callable[..., World],
) -> None:
    world = make_world()
    stamp = ProducerStamp(7, 0)
    first = world.handle.append(records(b"a"), stamp)
    retry = world.handle.append(records(b"a"), stamp)

    world.settle()

    assert (world.done(first), world.done(retry)) == (None, None)
    assert stored_values(world) == [b"a"]


def test_a_retry_after_its_first_try_was_refused_is_stored(
    make_world: Callable[..., World],
) -> None:
    world = make_world(LogConfig(max_inflight_records=2))
    # The range's first stamped append waits for its table to be read back from the log: after
    # this one, the next is taken (or refused) at once.
    world.done(world.handle.append(records(b"w"), ProducerStamp(7, 0)))
    stamp = ProducerStamp(7, 1)
    held = world.handle.append(records(b"x"))  # its fsync is held: one record in flight

    refused = world.handle.append(records(b"a", b"b"), stamp)

    error = world.failed(refused)
    assert isinstance(error, BrokerError)
    assert error.reason is Reason.OVERLOADED
    world.done(held)
    world.done(world.handle.append(records(b"a", b"b"), stamp))
    assert stored_values(world) == [b"w", b"x", b"a", b"b"]


def test_a_sequence_older_than_the_window_is_refused_sequence_too_old(
    make_world: Callable[..., World],
) -> None:
    world = make_world()
    world.done(world.handle.append(records(b"a"), ProducerStamp(7, 0)))
    world.done(world.handle.append(records(b"b"), ProducerStamp(7, wire.PRODUCER_WINDOW)))

    error = world.failed(world.handle.append(records(b"a"), ProducerStamp(7, 0)))

    assert isinstance(error, BrokerError)
    assert error.reason is Reason.SEQUENCE_TOO_OLD
    assert stored_values(world) == [b"a", b"b"]


def open_local_range(
    fs: MemoryFileSystem, executor: ManualExecutor, producers: ProducerTable | None = None
) -> LocalRange:
    logs = MemoryLogs(fs, executor=executor, on_integrity_event=_counted)
    opening = logs.open_range(RANGE)
    executor.run_all()
    return LocalRange(RANGE, result_of(opening), producers)


def test_a_retry_waiting_for_a_first_try_that_fails_fails_the_same_way(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs, executor, producers = MemoryFileSystem(), ManualExecutor(), ProducerTable()
    local = open_local_range(fs, executor, producers)
    stamp = ProducerStamp(7, 0)
    fs.failing_syncs = 1
    first = local.append(records(b"a"), stamp)
    retry = local.append(records(b"a"), stamp)

    executor.run_all()

    errors = [failure_of(first).value, failure_of(retry).value]
    # Its own reason: the disk failed, the broker is not going away.
    assert all(
        isinstance(e, BrokerError) and e.reason is Reason.STORAGE_UNAVAILABLE for e in errors
    )
    assert errors[0] is errors[1]
    # The log says once that its write failed; the refused produces add nothing to that.
    assert len(logged_errors) == 1
    logged_errors.clear()
    # Forgotten: the next retry is stored anew (this log is out of service, so it fails too).
    assert producers.admit(stamp) is Admission.NEW


def test_a_range_built_with_a_rebuilt_table_knows_what_its_log_holds() -> None:
    stamp = ProducerStamp(7, 3)
    producers = ProducerTable.rebuild([(stamp, 0, 1)])
    local = open_local_range(MemoryFileSystem(), ManualExecutor(), producers)

    assert result_of(local.append(records(b"a"), stamp)) is None

    assert result_of(local.bounds()) == Bounds(0, 0)
