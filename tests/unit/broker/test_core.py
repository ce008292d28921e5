"""The broker core over in-memory storage and control plane: topics, produce, fetch, groups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import Clock

from logbroker.broker.core import Broker, BrokerSettings, FetchResult, _Wakeup
from logbroker.broker.cursor import Cursor
from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import Bounds, LocalRanges, RangeHandle
from logbroker.key_routing import key_slot
from logbroker.metrics import Metrics
from logbroker.records import Record
from logbroker.testing import MemoryFileSystem
from logbroker.wire import Reason
from tests.unit.broker.helpers import MemoryRangeLogs, make_broker
from tests.unit.controlplane.helpers import started
from tests.unit.storage.helpers import failure_of, result_of


def reason_of(deferred: Deferred[object]) -> Reason:
    failure = failure_of(deferred)
    assert isinstance(failure.value, BrokerError), failure
    return failure.value.reason


def fetch_all(broker, topic: str, cursor: str | None = None) -> FetchResult:  # type: ignore[no-untyped-def]
    return result_of(broker.fetch(topic, cursor, None, None, 1000, 0))


# -- topics --------------------------------------------------------------------------------


def test_a_topic_is_created_with_its_keyspace_cut_into_ranges() -> None:
    broker, storage, _ = make_broker(settings=BrokerSettings(initial_ranges=4))

    result_of(broker.create_topic("orders", 0))

    assert sorted(storage.logs) == ["orders.0", "orders.1", "orders.2", "orders.3"]


@pytest.mark.parametrize(
    ("name", "bits", "reason"),
    [
        ("bad/name", 0, Reason.INVALID_TOPIC_NAME),
        (None, 0, Reason.INVALID_TOPIC_NAME),
        ("..", 0, Reason.INVALID_TOPIC_NAME),
        ("ok", 33, Reason.INVALID_KEYSPACE_BITS),
        ("ok", 255, Reason.INVALID_KEYSPACE_BITS),
    ],
)
def test_bad_topics_are_refused(name: str | None, bits: int, reason: Reason) -> None:
    broker, _, _ = make_broker()

    assert reason_of(broker.create_topic(name, bits)) is reason


def test_a_topic_exists_once() -> None:
    broker, _, _ = make_broker()
    result_of(broker.create_topic("orders", 16))

    assert reason_of(broker.create_topic("orders", 16)) is Reason.ALREADY_EXISTS


def test_a_one_bit_keyspace_has_two_ranges_at_most() -> None:
    broker, storage, _ = make_broker(settings=BrokerSettings(initial_ranges=4))

    result_of(broker.create_topic("tiny", 1))

    assert sorted(storage.logs) == ["tiny.0", "tiny.1"]


# -- produce and fetch ---------------------------------------------------------------------


def test_produce_to_an_unknown_topic_is_refused() -> None:
    broker, _, _ = make_broker()

    assert reason_of(broker.produce("nope", [Record(b"v")])) is Reason.NO_SUCH_TOPIC
    assert reason_of(broker.fetch("nope", None, None, None, 0, 0)) is Reason.NO_SUCH_TOPIC


records = st.lists(
    st.builds(
        Record,
        value=st.binary(max_size=20),
        key=st.one_of(st.none(), st.binary(max_size=8)),
        timestamp_ms=st.integers(0, 2**64 - 1),
        headers=st.lists(
            st.tuples(st.one_of(st.none(), st.binary(max_size=4)), st.none()), max_size=2
        ).map(tuple),
    ),
    max_size=30,
)


@settings(max_examples=50)
@given(st.lists(records, min_size=1, max_size=4))
def test_everything_produced_is_fetched_once_with_per_key_order(
    batches: list[list[Record]],
) -> None:
    broker, _, _ = make_broker()
    result_of(broker.create_topic("t", 0))

    for batch in batches:
        assert result_of(broker.produce("t", batch)) == len(batch)
    fetched: list[Record] = []
    cursor = None
    while True:
        result = result_of(broker.fetch("t", cursor, None, None, 7, 0))
        if not result.records:
            break
        fetched.extend(result.records)
        cursor = result.next_cursor

    produced = [record for batch in batches for record in batch]
    assert sorted(fetched, key=repr) == sorted(produced, key=repr)
    for key in {record.key for record in produced if record.key is not None}:
        assert [r for r in fetched if r.key == key] == [r for r in produced if r.key == key]


def test_keyed_records_land_in_the_range_owning_their_slot() -> None:
    broker, storage, _ = make_broker(settings=BrokerSettings(initial_ranges=4))
    result_of(broker.create_topic("t", 8))
    key = b"customer-42"

    result_of(broker.produce("t", [Record(b"v", key=key)]))

    owner = f"t.{key_slot(key, 8) // 64}"
    assert {name: log.end_offset for name, log in storage.logs.items() if log.end_offset} == {
        owner: 1
    }


def test_the_keyless_records_of_a_produce_go_to_one_range_in_turn() -> None:
    broker, storage, _ = make_broker(settings=BrokerSettings(initial_ranges=2))
    result_of(broker.create_topic("t", 0))

    for _ in range(4):
        result_of(broker.produce("t", [Record(b"a"), Record(b"b")]))

    assert {name: log.end_offset for name, log in storage.logs.items()} == {"t.0": 4, "t.1": 4}


def test_max_0_means_100_and_max_is_capped_at_1000() -> None:
    broker, _, _ = make_broker(settings=BrokerSettings(initial_ranges=1))
    result_of(broker.create_topic("t", 0))
    result_of(broker.produce("t", [Record(b"v")] * 1500))

    assert len(result_of(broker.fetch("t", None, None, None, 0, 0)).records) == 100
    assert len(result_of(broker.fetch("t", None, None, None, 5000, 0)).records) == 1000


def test_a_cursor_resumes_where_the_last_fetch_ended() -> None:
    broker, _, _ = make_broker(settings=BrokerSettings(initial_ranges=1))
    result_of(broker.create_topic("t", 0))
    result_of(broker.produce("t", [Record(bytes([i])) for i in range(10)]))

    first = result_of(broker.fetch("t", None, None, None, 4, 0))
    second = result_of(broker.fetch("t", first.next_cursor, None, None, 100, 0))

    assert [r.value for r in first.records + second.records] == [bytes([i]) for i in range(10)]
    assert result_of(broker.fetch("t", second.next_cursor, None, None, 100, 0)).records == ()


@pytest.mark.parametrize(
    "cursor",
    ["garbage!", Cursor({"other.0": 0}).encode(), Cursor({"t.0": 99}).encode()],
    ids=["not a cursor", "another topic's range", "past the end"],
)
def test_a_bad_cursor_is_invalid_cursor(cursor: str) -> None:
    broker, _, _ = make_broker(settings=BrokerSettings(initial_ranges=1))
    result_of(broker.create_topic("t", 0))

    assert reason_of(broker.fetch("t", cursor, None, None, 0, 0)) is Reason.INVALID_CURSOR
    assert reason_of(broker.commit("t", "g", cursor)) is Reason.INVALID_CURSOR


class _EndUnknown:
    """A directory whose ranges say their end is only the least they hold, as a range read
    from its copies does while its primary cannot answer."""

    def __init__(self, ranges: LocalRanges) -> None:
        self._ranges = ranges

    def handle(self, range_id: str) -> RangeHandle:
        handle = self._ranges.handle(range_id)

        class Handle:
            def __getattr__(self, name: str) -> Any:
                return getattr(handle, name)

            def bounds(self) -> Deferred[Bounds]:
                return handle.bounds().addCallback(
                    lambda found: Bounds(found.start, found.end, end_known=False)
                )

        return Handle()  # type: ignore[return-value]

    def open(self, range_ids: Sequence[str]) -> Deferred[None]:
        return self._ranges.open(range_ids)


def test_a_cursor_past_an_end_that_is_not_known_is_taken() -> None:
    clock = Clock()
    fs = MemoryFileSystem()
    storage = MemoryRangeLogs(fs, clock, Metrics(clock))
    ranges = _EndUnknown(LocalRanges(storage))
    broker = Broker(started(fs), ranges, clock, BrokerSettings(initial_ranges=1), Metrics(clock))
    result_of(broker.create_topic("t", 0))
    result_of(broker.produce("t", [Record(b"v")]))
    ahead = Cursor({"t.0": 3}).encode()

    fetched = result_of(broker.fetch("t", ahead, None, None, 0, 0))

    assert fetched.records == ()
    assert result_of(broker.commit("t", "g", ahead)) is None


# -- long poll -----------------------------------------------------------------------------


def test_a_long_poll_is_woken_by_a_produce() -> None:
    broker, _, clock = make_broker(settings=BrokerSettings(initial_ranges=1))
    result_of(broker.create_topic("t", 0))
    polling = broker.fetch("t", None, None, None, 0, 30_000)
    assert not polling.called

    clock.advance(5)
    result_of(broker.produce("t", [Record(b"late")]))

    assert [r.value for r in result_of(polling).records] == [b"late"]
    assert clock.getDelayedCalls() == []


def test_a_long_poll_ends_empty_at_its_wait_capped_at_30_s() -> None:
    broker, _, clock = make_broker(settings=BrokerSettings(initial_ranges=1))
    result_of(broker.create_topic("t", 0))
    polling = broker.fetch("t", None, None, None, 0, 120_000)

    clock.advance(29.999)
    assert not polling.called
    clock.advance(0.001)

    assert result_of(polling).records == ()


def test_a_cancelled_long_poll_stops_waiting() -> None:
    broker, _, clock = make_broker(settings=BrokerSettings(initial_ranges=1))
    result_of(broker.create_topic("t", 0))
    polling = broker.fetch("t", None, None, None, 0, 10_000)

    polling.cancel()
    failure_of(polling)

    assert clock.getDelayedCalls() == []
    result_of(broker.produce("t", [Record(b"v")]))


def test_waits_that_come_after_the_poll_ended_are_cancelled_and_leave_no_unhandled_error() -> None:
    """A long poll over several ranges: one range's wait fires at once (a range read from its
    copies, say), so the waits of the ranges after it are cancelled as they come. A cancelled
    wait fails with CancelledError; left unhandled, every such poll logged a critical
    'Unhandled error in Deferred' once collected."""
    broker, _, clock = make_broker(settings=BrokerSettings(initial_ranges=1))
    wakeup = _Wakeup(broker)
    wakeup.watch(succeed(None))
    assert wakeup.deferred.called

    late: Deferred[None] = Deferred()
    wakeup.watch(late)

    assert late.called
    assert result_of(late) is None, "its cancellation is handled"
    assert clock.getDelayedCalls() == []


# -- groups --------------------------------------------------------------------------------


def test_a_group_resumes_from_its_committed_cursor() -> None:
    broker, _, _ = make_broker(settings=BrokerSettings(initial_ranges=1))
    result_of(broker.create_topic("t", 0))
    result_of(broker.produce("t", [Record(bytes([i])) for i in range(6)]))
    first = result_of(broker.fetch("t", None, "g", None, 4, 0))

    result_of(broker.commit("t", "g", first.next_cursor))

    resumed = result_of(broker.fetch("t", None, "g", None, 100, 0))
    assert [r.value for r in resumed.records] == [bytes([4]), bytes([5])]


def test_members_of_a_group_read_disjoint_shares_and_a_leaver_gives_its_share_up() -> None:
    broker, _, _ = make_broker(settings=BrokerSettings(initial_ranges=4))
    result_of(broker.create_topic("t", 0))
    for i in range(40):
        result_of(broker.produce("t", [Record(bytes([i]))]))
    broker.fetch("t", None, "g", "a", 0, 0)  # both join before either reads
    broker.fetch("t", None, "g", "b", 0, 0)

    a = result_of(broker.fetch("t", None, "g", "a", 1000, 0)).records
    b = result_of(broker.fetch("t", None, "g", "b", 1000, 0)).records

    assert sorted(r.value for r in a + b) == [bytes([i]) for i in range(40)]
    assert not {r.value for r in a} & {r.value for r in b}
    broker.leave_group("t", "g", "b")
    assert len(result_of(broker.fetch("t", None, "g", "a", 1000, 0)).records) == 40


def test_a_silent_member_loses_its_share_after_the_session_timeout() -> None:
    broker, _, clock = make_broker(
        settings=BrokerSettings(initial_ranges=4, group_session_timeout_ms=1000)
    )
    result_of(broker.create_topic("t", 0))
    for i in range(8):
        result_of(broker.produce("t", [Record(bytes([i]))]))
    broker.fetch("t", None, "g", "a", 0, 0)
    broker.fetch("t", None, "g", "b", 0, 0)
    clock.advance(1.001)

    assert len(result_of(broker.fetch("t", None, "g", "a", 1000, 0)).records) == 8


def test_commit_needs_a_group_and_a_cursor() -> None:
    broker, _, _ = make_broker()
    result_of(broker.create_topic("t", 0))

    assert reason_of(broker.commit("t", None, Cursor({}).encode())) is Reason.INVALID_OPERATION
    assert reason_of(broker.commit("t", "g", None)) is Reason.INVALID_CURSOR


# -- found in review -----------------------------------------------------------------------


def test_members_committing_their_own_shares_never_undo_each_other() -> None:
    broker, _, _ = make_broker(settings=BrokerSettings(initial_ranges=4))
    result_of(broker.create_topic("t", 0))
    for i in range(40):
        result_of(broker.produce("t", [Record(bytes([i]))]))
    broker.fetch("t", None, "g", "a", 0, 0)
    broker.fetch("t", None, "g", "b", 0, 0)
    a = result_of(broker.fetch("t", None, "g", "a", 1000, 0))
    b = result_of(broker.fetch("t", None, "g", "b", 1000, 0))

    result_of(broker.commit("t", "g", a.next_cursor))
    result_of(broker.commit("t", "g", b.next_cursor))

    broker.leave_group("t", "g", "a")
    broker.leave_group("t", "g", "b")
    assert result_of(broker.fetch("t", None, "g", None, 1000, 0)).records == ()


def test_a_group_members_cursor_names_only_its_share() -> None:
    broker, _, _ = make_broker(settings=BrokerSettings(initial_ranges=4))
    result_of(broker.create_topic("t", 0))
    broker.fetch("t", None, "g", "a", 0, 0)
    broker.fetch("t", None, "g", "b", 0, 0)

    a = result_of(broker.fetch("t", None, "g", "a", 1000, 0))
    b = result_of(broker.fetch("t", None, "g", "b", 1000, 0))

    shares = [set(Cursor.decode(r.next_cursor).positions) for r in (a, b)]
    assert not shares[0] & shares[1]
    assert shares[0] | shares[1] == {"t.0", "t.1", "t.2", "t.3"}


def test_a_refused_range_stores_nothing_of_the_produce() -> None:
    broker, storage, _ = make_broker(settings=BrokerSettings(initial_ranges=4))
    result_of(broker.create_topic("t", 8))
    keys = [b"k%d" % i for i in range(40)]  # spread over every range
    result_of(storage.logs["t.3"].close())

    failure = failure_of(broker.produce("t", [Record(b"v", key=key) for key in keys]))

    assert isinstance(failure.value, BrokerError)
    assert failure.value.reason is Reason.UNREACHABLE
    assert [storage.logs[f"t.{i}"].end_offset for i in range(3)] == [0, 0, 0]


def test_a_busy_range_does_not_starve_the_others() -> None:
    broker, storage, _ = make_broker(settings=BrokerSettings(initial_ranges=2))
    result_of(broker.create_topic("t", 1))
    result_of(storage.logs["t.0"].append([Record(b"busy")] * 50))
    result_of(storage.logs["t.1"].append([Record(b"quiet")]))

    seen = [
        result_of(broker.fetch("t", None, None, None, 10, 0)).records[0].value for _ in range(4)
    ]

    assert b"quiet" in seen


def test_the_largest_cursor_a_topic_can_have_is_accepted_back() -> None:
    broker, _, _ = make_broker(settings=BrokerSettings(initial_ranges=64))
    name = "t" * 249
    result_of(broker.create_topic(name, 16))
    result_of(broker.produce(name, [Record(b"v")]))

    cursor = result_of(broker.fetch(name, None, None, None, 0, 0)).next_cursor

    assert len(Cursor.decode(cursor).positions) == 64
    assert result_of(broker.fetch(name, cursor, None, None, 0, 0)).records == ()


@pytest.mark.parametrize("group", ["", "g" * 250])
def test_bad_group_names_are_refused(group: str) -> None:
    broker, _, _ = make_broker()
    result_of(broker.create_topic("t", 0))
    cursor = result_of(broker.fetch("t", None, None, None, 0, 0)).next_cursor

    assert reason_of(broker.commit("t", group, cursor)) is Reason.INVALID_OPERATION
    assert reason_of(broker.fetch("t", None, group, "m", 0, 0)) is Reason.INVALID_OPERATION


def test_a_produce_whose_caller_went_away_still_wakes_long_polls() -> None:
    broker, _, _ = make_broker(settings=BrokerSettings(initial_ranges=1))
    result_of(broker.create_topic("t", 0))
    polling = broker.fetch("t", None, None, None, 0, 30_000)

    producing = broker.produce("t", [Record(b"v")])
    producing.cancel()

    assert [r.value for r in result_of(polling).records] == [b"v"]


def test_a_member_whose_share_is_empty_waits_instead_of_spinning() -> None:
    broker, _, clock = make_broker(settings=BrokerSettings(initial_ranges=1))
    result_of(broker.create_topic("t", 0))
    members = [f"m{i}" for i in range(5)]
    for member in members:
        broker.fetch("t", None, "g", member, 0, 0)
    idle = next(m for m in members if not result_of(broker._groups.share("t", "g", m, ["t.0"])))

    polling = broker.fetch("t", None, "g", idle, 0, 1000)

    assert not polling.called
    clock.advance(1)
    assert result_of(polling).records == ()


def test_wake_all_answers_every_long_poll_at_once() -> None:
    broker, _, clock = make_broker(settings=BrokerSettings(initial_ranges=1))
    result_of(broker.create_topic("t", 0))
    polls = [broker.fetch("t", None, None, None, 0, 30_000) for _ in range(3)]

    broker.wake_all()

    assert [result_of(p).records for p in polls] == [(), (), ()]
    assert clock.getDelayedCalls() == []
