"""A range reached over the peer link (``logbroker.cluster.forwarding``).

The contract suite (``tests/unit/broker/test_ranges.py``, world ``forwarded``) holds
``ForwardedRange`` to what every handle does; here are what only a forwarder does: how the
peer's failures reach the client, what ``RangeServer`` answers, and two brokers, one forwarding
to the other's ranges. Requests cross a real peer link over ``iosim``; nothing sleeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import pytest
from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.internet.task import Clock

from logbroker.broker.core import Broker, BrokerSettings
from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import Bounds, LocalRanges, RangeHandle
from logbroker.cluster.forwarding import (
    FORWARDED_REASONS,
    MAX_REMOTE_WAIT_MS,
    ForwardedRange,
    RangeServer,
)
from logbroker.errors import Reason
from logbroker.metrics import Metrics
from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.range_ops import (
    AppendRequest,
    AppendResult,
    BoundsRequest,
    BoundsResult,
    ReadRequest,
    decode_append_request,
    decode_bounds_result,
    decode_read_result,
    encode_append_request,
    encode_append_result,
    encode_bounds_request,
    encode_read_request,
)
from logbroker.peer.window import PeerError
from logbroker.records import ProducerStamp, Record
from logbroker.storage import LogConfig, RangeLog
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from logbroker.wire import encode_wire_records
from tests.unit.broker.helpers import MemoryRangeLogs
from tests.unit.broker.test_ranges import RANGE, PeerLink, decoded, records
from tests.unit.controlplane.helpers import started
from tests.unit.storage.helpers import MemoryLogs, failure_of, result_of


def reason_of(deferred: Deferred[Any]) -> Reason:
    error = failure_of(deferred).value
    assert isinstance(error, BrokerError), error
    return error.reason


class CountingLogs(MemoryLogs):
    """Range logs that count how often each range was opened."""

    def __init__(self, executor: ManualExecutor, config: LogConfig) -> None:
        super().__init__(executor=executor, config=config)
        self.opened: list[str] = []

    def open_range(self, name: str) -> Deferred[RangeLog]:
        self.opened.append(name)
        return super().open_range(name)


class Nodes:
    """Node ``a`` forwarding range ``r.0`` (``forwarded``) to node ``b``, which holds it in
    ``primary`` with its storage jobs held in ``executor`` until ``settle`` runs them."""

    def __init__(self, config: LogConfig | None = None) -> None:
        self.executor = ManualExecutor()
        self.logs = CountingLogs(self.executor, config or LogConfig())
        self.primary = LocalRanges(self.logs)
        opening = self.primary.open([RANGE])
        self.executor.run_all()
        result_of(opening)
        self.link = PeerLink(RangeServer(self.primary, Clock()))
        self.forwarded = ForwardedRange(RANGE, "b", self.link.connections)

    def settle(self) -> None:
        while self.link.flush() or self.executor.pending:
            self.executor.run_all()


@pytest.fixture
def make_nodes() -> Iterator[Callable[..., Nodes]]:
    made: list[Nodes] = []

    def make(config: LogConfig | None = None) -> Nodes:
        made.append(Nodes(config))
        return made[-1]

    yield make
    for each in made:
        each.link.close()


@pytest.fixture
def nodes(make_nodes: Callable[..., Nodes]) -> Nodes:
    return make_nodes()


# -- how the peer's failures reach the client ------------------------------------------------


def test_overloaded_from_the_primarys_storage_arrives_as_overloaded(
    make_nodes: Callable[..., Nodes],
) -> None:
    nodes = make_nodes(LogConfig(max_inflight_records=2))
    first = nodes.forwarded.append(records(b"a", b"b"))
    nodes.link.flush()  # the primary writes them; their fsync is held
    assert not first.called

    second = nodes.forwarded.append(records(b"c"))
    nodes.link.flush()

    assert reason_of(second) is Reason.OVERLOADED
    nodes.settle()
    assert result_of(first) is None
    bounds = nodes.forwarded.bounds()
    nodes.settle()
    assert result_of(bounds) == Bounds(0, 2)


def test_a_peer_that_is_not_connected_is_unreachable_at_once(nodes: Nodes) -> None:
    stranger = ForwardedRange(RANGE, "c", nodes.link.connections)
    nodes.link.drop()
    assert nodes.link.connections.established("b") is None

    # Nothing is flushed or settled: each has failed already.
    for handle in (stranger, nodes.forwarded):
        assert reason_of(handle.append(records(b"a"))) is Reason.UNREACHABLE
        assert reason_of(handle.bounds()) is Reason.UNREACHABLE
        assert reason_of(handle.read(0, 10, 1000)) is Reason.UNREACHABLE


def test_the_link_dropping_while_an_append_is_in_flight_is_unreachable(nodes: Nodes) -> None:
    appending = nodes.forwarded.append(records(b"a"))
    nodes.link.flush()
    assert not appending.called

    nodes.link.drop()

    assert reason_of(appending) is Reason.UNREACHABLE
    # The primary goes on and stores the records (a produce is at-least-once); its answer has
    # no link to go back over, and nothing fails for it.
    nodes.executor.run_all()
    assert result_of(nodes.primary.handle(RANGE).bounds()) == Bounds(0, 1)


class Answering:
    """A ``PeerRequester`` that answers every request with ``outcome``."""

    def __init__(self, outcome: bytes | BaseException) -> None:
        self.outcome = outcome

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        if isinstance(self.outcome, BaseException):
            return fail(self.outcome)
        return succeed(self.outcome)


@pytest.mark.parametrize(
    ("answered", "told"),
    [
        ("overloaded", Reason.OVERLOADED),
        ("unreachable", Reason.UNREACHABLE),
        ("no_quorum", Reason.NO_QUORUM),
        ("not_primary", Reason.NOT_PRIMARY),
        ("timeout", Reason.TIMEOUT),
        ("sequence_too_old", Reason.SEQUENCE_TOO_OLD),
        # The primary's passing conditions, folded as the client port folds them (the primary
        # logs its own storage errors).
        ("storage_error", Reason.UNREACHABLE),
        ("control_plane_unavailable", Reason.UNREACHABLE),
        ("contended", Reason.UNREACHABLE),
    ],
)
def test_the_reasons_a_client_can_act_on_pass_through(answered: str, told: Reason) -> None:
    handle = ForwardedRange(RANGE, "b", Answering(PeerError(answered, "answered by the peer")))

    for deferred in (handle.append(records(b"a")), handle.bounds(), handle.read(0, 1, 1)):
        assert reason_of(deferred) is told


@pytest.mark.parametrize(
    "answered",
    [
        PeerReason.INTERNAL_ERROR,
        PeerReason.UNKNOWN_OP,
        PeerReason.FRAME_TOO_LARGE,
        Reason.MALFORMED_REQUEST,
        "a_reason_of_a_newer_version",
    ],
)
def test_any_other_reason_is_unreachable_and_logged(
    answered: str, logged_errors: list[dict[str, Any]]
) -> None:
    assert answered not in FORWARDED_REASONS
    handle = ForwardedRange(RANGE, "b", Answering(PeerError(answered, "answered by the peer")))

    assert reason_of(handle.bounds()) is Reason.UNREACHABLE

    assert len(logged_errors) == 1
    assert logged_errors[0]["error"] == f"{answered}: answered by the peer"
    logged_errors.clear()


def test_an_answer_that_does_not_decode_is_unreachable_and_logged(
    logged_errors: list[dict[str, Any]],
) -> None:
    handle = ForwardedRange(RANGE, "b", Answering(b"\x00\x01"))

    assert reason_of(handle.bounds()) is Reason.UNREACHABLE
    assert reason_of(handle.read(0, 1, 1)) is Reason.UNREACHABLE
    assert reason_of(handle.append(records(b"a"))) is Reason.UNREACHABLE

    assert len(logged_errors) == 3
    logged_errors.clear()


def test_a_short_append_answer_is_unreachable_and_logged(
    logged_errors: list[dict[str, Any]],
) -> None:
    handle = ForwardedRange(RANGE, "b", Answering(b"\x00\x00\x00\x01"))

    assert reason_of(handle.append(records(b"a", b"b"))) is Reason.UNREACHABLE
    assert "1 records appended of 2 sent" in logged_errors[0]["error"]
    logged_errors.clear()


def test_an_unexpected_failure_is_unreachable_and_logged_with_its_traceback(
    logged_errors: list[dict[str, Any]],
) -> None:
    handle = ForwardedRange(RANGE, "b", Answering(RuntimeError("a bug")))

    assert reason_of(handle.bounds()) is Reason.UNREACHABLE

    [event] = logged_errors
    assert isinstance(event["log_failure"].value, RuntimeError)
    logged_errors.clear()


class Recording:
    """A ``PeerRequester`` that keeps each request and answers the next of ``answers``."""

    def __init__(self, *answers: bytes | BaseException) -> None:
        self.sent: list[tuple[PeerOp, bytes]] = []
        self._answers = list(answers)

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        self.sent.append((op, payload))
        answer = self._answers.pop(0)
        return fail(answer) if isinstance(answer, BaseException) else succeed(answer)


def test_a_stamped_append_goes_as_a_stamped_append_and_a_plain_one_as_before() -> None:
    requester = Recording(
        encode_append_result(AppendResult(1)), encode_append_result(AppendResult(1))
    )
    handle = ForwardedRange(RANGE, "b", requester)
    stamp = ProducerStamp(7, 3)

    result_of(handle.append(records(b"a"), stamp))
    result_of(handle.append(records(b"a")))

    share = encode_wire_records(records(b"a"))
    count, data = share.count, share.data
    assert requester.sent == [
        (PeerOp.STAMPED_APPEND, encode_append_request(AppendRequest(RANGE, count, data, stamp))),
        (PeerOp.APPEND, encode_append_request(AppendRequest(RANGE, count, data))),
    ]


def test_only_the_records_the_primary_acknowledged_count_as_forwarded() -> None:
    requester = Recording(
        encode_append_result(AppendResult(2)), PeerError("no_quorum", "no quorum there")
    )
    counted: list[int] = []
    handle = ForwardedRange(RANGE, "b", requester, on_forwarded=counted.append)

    result_of(handle.append(records(b"a", b"b")))
    assert reason_of(handle.append(records(b"c"))) is Reason.NO_QUORUM

    assert counted == [2]


def test_a_primary_without_stamped_appends_is_sent_the_share_as_a_plain_append() -> None:
    requester = Recording(
        PeerError(PeerReason.UNKNOWN_OP, "op 9 is not known here"),
        encode_append_result(AppendResult(1)),
    )
    handle = ForwardedRange(RANGE, "b", requester)

    result_of(handle.append(records(b"a"), ProducerStamp(7, 3)))

    assert [op for op, _ in requester.sent] == [PeerOp.STAMPED_APPEND, PeerOp.APPEND]
    assert decode_append_request(requester.sent[1][1]).stamp is None


def test_a_caller_may_cancel_its_request(nodes: Nodes) -> None:
    appending = nodes.forwarded.append(records(b"a"))
    nodes.link.flush()

    appending.cancel()

    assert isinstance(failure_of(appending).value, CancelledError)
    nodes.settle()  # the late answer is dropped quietly


# -- what RangeServer answers ----------------------------------------------------------------


def serve(server: RangeServer, op: PeerOp, payload: bytes) -> Deferred[bytes]:
    return server("a", op, payload)


@pytest.mark.parametrize(
    ("op", "payload"),
    [
        (PeerOp.APPEND, b"\x00\x03r.0\x00\x00\x00\x01"),
        (PeerOp.APPEND, encode_append_request(AppendRequest(RANGE, 0, b""))),
        (PeerOp.APPEND, encode_append_request(AppendRequest(RANGE, 2, b""))),
        (PeerOp.READ, b"\x00\x03r.0"),
        (PeerOp.BOUNDS, b""),
        (PeerOp.BOUNDS, b"\x00\x03r.0!"),
    ],
    ids=["append-truncated", "append-nothing", "append-wrong-count", "read", "bounds", "trailing"],
)
def test_a_malformed_request_is_answered_malformed_request(
    nodes: Nodes, op: PeerOp, payload: bytes
) -> None:
    server = RangeServer(nodes.primary, Clock())

    assert reason_of(serve(server, op, payload)) is Reason.MALFORMED_REQUEST
    assert nodes.logs.logs[RANGE].end_offset == 0


def test_an_op_that_is_not_a_range_op_is_answered_unknown_op(nodes: Nodes) -> None:
    answer = serve(RangeServer(nodes.primary, Clock()), cast(PeerOp, 99), b"")

    error = failure_of(answer).value
    assert isinstance(error, PeerError)
    assert error.reason is PeerReason.UNKNOWN_OP


def test_a_range_not_open_yet_is_opened_once_by_its_first_requests() -> None:
    executor = ManualExecutor()
    logs = CountingLogs(executor, LogConfig())
    server = RangeServer(LocalRanges(logs), Clock())
    payload = encode_bounds_request(BoundsRequest("fresh.0"))

    answers = [serve(server, PeerOp.BOUNDS, payload) for _ in range(3)]
    assert not any(answer.called for answer in answers)
    executor.run_all()

    for answer in answers:
        assert decode_bounds_result(result_of(answer)) == BoundsResult(0, 0)
    assert logs.opened == ["fresh.0"]
    assert decode_bounds_result(result_of(serve(server, PeerOp.BOUNDS, payload))) == (
        BoundsResult(0, 0)
    )
    assert logs.opened == ["fresh.0"]


class Refusing:
    """A ``RangeDirectory`` that refuses every range for ``reason``, or forwards it on."""

    def __init__(self, reason: Reason | None) -> None:
        self.reason = reason
        self.opened: list[str] = []

    def handle(self, range_id: str) -> RangeHandle:
        if self.reason is None:
            return ForwardedRange(range_id, "c", Answering(b""))
        raise BrokerError(self.reason, f"range {range_id} is not served here")

    def open(self, range_ids: Sequence[str]) -> Deferred[None]:
        self.opened.extend(range_ids)
        return succeed(None)


def test_a_range_led_elsewhere_is_answered_not_primary_never_forwarded_on() -> None:
    for directory in (Refusing(Reason.NOT_PRIMARY), Refusing(None)):
        server = RangeServer(directory, Clock())
        payload = encode_bounds_request(BoundsRequest(RANGE))

        assert reason_of(serve(server, PeerOp.BOUNDS, payload)) is Reason.NOT_PRIMARY
        assert directory.opened == []


def test_a_range_that_cannot_be_opened_is_unreachable() -> None:
    directory = Refusing(Reason.UNREACHABLE)
    server = RangeServer(directory, Clock())

    answer = serve(server, PeerOp.BOUNDS, encode_bounds_request(BoundsRequest(RANGE)))

    assert reason_of(answer) is Reason.UNREACHABLE
    assert directory.opened == [RANGE]


def has_result(deferred: Deferred[Any]) -> bool:
    """Whether ``deferred`` has its result (``called`` is true already while it waits on
    another Deferred)."""
    return not isinstance(deferred.result, Deferred) if deferred.called else False


def test_a_read_with_a_wait_is_a_long_poll_on_the_primary(nodes: Nodes) -> None:
    clock = Clock()
    server = RangeServer(nodes.primary, clock)
    appending = nodes.forwarded.append(records(b"a", b"b"))
    nodes.settle()
    result_of(appending)

    # Records at the offset: answered at once.
    read = serve(server, PeerOp.READ, encode_read_request(ReadRequest(RANGE, 1, 10, 100, 30_000)))
    nodes.settle()  # the read runs in a reader thread
    found = decode_read_result(result_of(read))
    assert (found.record_count, found.next_offset, found.end_offset) == (1, 2, 2)
    assert decoded((found.records,), 1) == [b"b"]

    # None yet: answered once a produce (through any node) brings one.
    woken = serve(server, PeerOp.READ, encode_read_request(ReadRequest(RANGE, 2, 10, 100, 30_000)))
    clock.advance(4)
    assert not has_result(woken)
    appending = nodes.forwarded.append(records(b"c"))
    nodes.settle()
    result_of(appending)
    late = decode_read_result(result_of(woken))
    assert (late.record_count, late.next_offset) == (1, 3)

    # A wait longer than a primary holds one is cut to MAX_REMOTE_WAIT_MS (the asker asks again).
    capped = serve(server, PeerOp.READ, encode_read_request(ReadRequest(RANGE, 3, 10, 100, 30_000)))
    clock.advance(MAX_REMOTE_WAIT_MS / 1000)
    nodes.settle()
    assert decode_read_result(result_of(capped)).record_count == 0

    # None within the wait: answered empty when it runs out, and nothing is left waiting.
    idle = serve(server, PeerOp.READ, encode_read_request(ReadRequest(RANGE, 3, 10, 100, 2_000)))
    clock.advance(1.9)
    assert not has_result(idle)
    clock.advance(0.2)
    nodes.settle()
    empty = decode_read_result(result_of(idle))
    assert (empty.record_count, empty.next_offset, empty.end_offset) == (0, 3, 3)
    assert clock.getDelayedCalls() == []


def test_a_forwarded_read_is_the_primarys_read(nodes: Nodes) -> None:
    values = [b"x" * n for n in range(1, 8)]
    for batch in (values[:2], values[2:]):
        appending = nodes.forwarded.append(records(*batch))
        nodes.settle()
        result_of(appending)
    local = nodes.primary.handle(RANGE)

    # Whole, by record limit, by byte budget, and the edges a caller might pass: from before
    # the start, no room for a record, no budget (still one record), past the end.
    cases = [(0, 100, 1 << 20), (1, 3, 1 << 20), (0, 100, 7), (2, 100, 9), (-3, 100, 1 << 20)]
    cases += [(0, 0, 100), (0, -1, 100), (3, 100, 0), (3, 100, -5), (7, 100, 100), (9, 1, 1)]
    for offset, max_records, max_bytes in cases:
        forwarded = nodes.forwarded.read(offset, max_records, max_bytes)
        reading = local.read(offset, max_records, max_bytes)
        nodes.settle()
        there = result_of(reading)
        here = result_of(forwarded)
        assert (here.count, here.next_offset, here.size) == (
            there.count,
            there.next_offset,
            there.size,
        )
        assert b"".join(here.data) == b"".join(there.data)


# -- two brokers -----------------------------------------------------------------------------


class Forwarding:
    """The ``RangeDirectory`` of a node that leads no range: every range is on node ``b``."""

    def __init__(self, link: PeerLink) -> None:
        self._link = link

    def handle(self, range_id: str) -> RangeHandle:
        return ForwardedRange(range_id, "b", self._link.connections)

    def open(self, range_ids: Sequence[str]) -> Deferred[None]:
        return succeed(None)  # the primary opens each range at its first request


class Cluster:
    """Broker ``owner`` (node b) holds the ranges; broker ``forwarder`` (node a) reaches them
    over the peer link. Both see one control plane, as the nodes of a cluster share etcd."""

    def __init__(self) -> None:
        self.clock = Clock()
        fs = MemoryFileSystem()
        control = started(fs)
        metrics = Metrics(self.clock)
        self.storage = MemoryRangeLogs(fs, self.clock, metrics, ImmediateExecutor())
        settings = BrokerSettings(initial_ranges=4)
        # One directory serves the owner's clients and its peers, as on a node.
        ranges = LocalRanges(self.storage)
        self.owner = Broker(control, ranges, self.clock, settings)
        self.link = PeerLink(RangeServer(ranges, self.clock), self.clock)
        self.forwarder = Broker(control, Forwarding(self.link), self.clock, settings)

    def done(self, deferred: Deferred[Any]) -> Any:
        self.link.flush()
        return result_of(deferred)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    yield made
    made.link.close()


def mixed(*values: bytes) -> list[Record]:
    return [Record(value, key=value if i % 2 else None) for i, value in enumerate(values)]


def values_of(result: Any) -> list[bytes]:
    return sorted(record.value for record in result.records)


def test_records_produced_through_a_forwarding_broker_are_read_back_through_either(
    cluster: Cluster,
) -> None:
    cluster.done(cluster.owner.create_topic("t", 0))
    sent = [b"%02d" % i for i in range(20)]

    assert cluster.done(cluster.forwarder.produce("t", mixed(*sent))) == 20

    assert sum(log.end_offset for log in cluster.storage.logs.values()) == 20
    through_forwarder = cluster.done(cluster.forwarder.fetch("t", None, None, None, 100, 0))
    through_owner = cluster.done(cluster.owner.fetch("t", None, None, None, 100, 0))
    assert values_of(through_forwarder) == values_of(through_owner) == sent
    assert through_forwarder.next_cursor == through_owner.next_cursor


def test_a_stamped_produce_through_either_broker_is_stored_once(cluster: Cluster) -> None:
    cluster.done(cluster.owner.create_topic("t", 0))
    sent = mixed(*[b"%02d" % i for i in range(12)])
    stamp = ProducerStamp(7, 0)

    assert cluster.done(cluster.forwarder.produce("t", sent, stamp)) == 12
    assert cluster.done(cluster.owner.produce("t", sent, stamp)) == 12
    assert cluster.done(cluster.forwarder.produce("t", sent, stamp)) == 12

    stored = cluster.done(cluster.owner.fetch("t", None, None, None, 1000, 0))
    assert values_of(stored) == sorted(record.value for record in sent)


def test_a_fetch_through_the_forwarder_goes_on_from_its_cursor(cluster: Cluster) -> None:
    cluster.done(cluster.owner.create_topic("t", 0))
    cluster.done(cluster.owner.produce("t", mixed(b"a", b"b", b"c")))

    first = cluster.done(cluster.forwarder.fetch("t", None, None, None, 2, 0))
    cluster.done(cluster.forwarder.produce("t", mixed(b"d")))
    rest = cluster.done(cluster.forwarder.fetch("t", first.next_cursor, None, None, 100, 0))

    assert len(first.records) == 2
    assert sorted(values_of(first) + values_of(rest)) == [b"a", b"b", b"c", b"d"]


def test_a_long_poll_on_the_forwarder_is_woken_by_a_produce_through_it(cluster: Cluster) -> None:
    cluster.done(cluster.owner.create_topic("t", 0))
    polling = cluster.forwarder.fetch("t", None, None, None, 0, 30_000)
    cluster.link.flush()
    assert not polling.called

    cluster.clock.advance(5)
    cluster.done(cluster.forwarder.produce("t", [Record(b"late")]))

    assert values_of(cluster.done(polling)) == [b"late"]


def test_the_forwarder_answers_unreachable_while_the_owner_is_away(cluster: Cluster) -> None:
    cluster.done(cluster.owner.create_topic("t", 0))
    cluster.link.drop()

    assert reason_of(cluster.forwarder.produce("t", mixed(b"a"))) is Reason.UNREACHABLE
    assert reason_of(cluster.forwarder.fetch("t", None, None, None, 0, 0)) is Reason.UNREACHABLE


class _EndUnknown:
    """A ``RangeDirectory`` whose one handle cannot know where its range ends (a node whose
    leader of the range stopped, ``ReplicatedRange.bounds``)."""

    class _Handle:
        def bounds(self) -> Deferred[Bounds]:
            return succeed(Bounds(0, 3, end_known=False))

    def handle(self, range_id: str) -> RangeHandle:
        return cast(RangeHandle, self._Handle())

    def open(self, range_ids: Sequence[str]) -> Deferred[None]:
        return succeed(None)


def test_bounds_whose_end_is_not_known_here_are_answered_not_primary() -> None:
    # The asking node would take them as the range's end and refuse a consumer's cursor past
    # it; not_primary sends it to the range's copies.
    server = RangeServer(_EndUnknown(), Clock())

    answer = serve(server, PeerOp.BOUNDS, encode_bounds_request(BoundsRequest(RANGE)))

    assert reason_of(answer) is Reason.NOT_PRIMARY
