"""Stamped produces through the broker core (``produce_idempotent``): deterministic routing, and
retries that store what their first try did not, and nothing twice."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock

from logbroker.broker.core import Broker, BrokerSettings
from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import Bounds, LocalRanges, RangeHandle, RangeRead
from logbroker.errors import Reason
from logbroker.key_routing import key_slot
from logbroker.metrics import Metrics
from logbroker.records import ProducerStamp, Record
from logbroker.testing import MemoryFileSystem
from tests.unit.broker.helpers import MemoryRangeLogs, make_broker
from tests.unit.controlplane.helpers import started
from tests.unit.storage.helpers import failure_of, result_of

P = 0x1234_5678_9ABC_DEF0


def ends(storage: MemoryRangeLogs) -> dict[str, int]:
    return {name: log.end_offset for name, log in storage.logs.items() if log.end_offset}


def fetched(broker: Broker, topic: str) -> list[Record]:
    records: list[Record] = []
    cursor = None
    while True:
        result = result_of(broker.fetch(topic, cursor, None, None, 1000, 0))
        if not result.records:
            return records
        records.extend(result.records)
        cursor = result.next_cursor


def test_the_keyless_records_of_a_stamped_produce_go_where_the_stamp_says() -> None:
    stamp = ProducerStamp(P, 5)
    owner = f"t.{key_slot(struct.pack('>QQ', P, 5), 8) // 64}"
    for earlier in range(4):
        broker, storage, _ = make_broker(settings=BrokerSettings(initial_ranges=4))
        result_of(broker.create_topic("t", 0))
        for _ in range(earlier):  # move the keyless turn on
            result_of(broker.produce("t", [Record(b"turn")]))
        before = ends(storage)

        result_of(broker.produce("t", [Record(b"a"), Record(b"b")], stamp))

        grown = {name for name, end in ends(storage).items() if end != before.get(name, 0)}
        assert grown == {owner}, earlier


def test_a_producers_sequences_spread_its_keyless_records_over_the_ranges() -> None:
    broker, storage, _ = make_broker(settings=BrokerSettings(initial_ranges=4))
    result_of(broker.create_topic("t", 0))

    for sequence in range(64):
        result_of(broker.produce("t", [Record(b"v")], ProducerStamp(P, sequence)))

    assert sorted(ends(storage)) == ["t.0", "t.1", "t.2", "t.3"]


def test_a_stamped_produce_sent_again_is_answered_its_count_and_stored_once() -> None:
    broker, storage, _ = make_broker(settings=BrokerSettings(initial_ranges=4))
    result_of(broker.create_topic("t", 0))
    batch = [Record(b"k%d" % i, key=b"k%d" % i) for i in range(8)] + [Record(b"none")]

    assert result_of(broker.produce("t", batch, ProducerStamp(P, 0))) == 9
    assert result_of(broker.produce("t", batch, ProducerStamp(P, 0))) == 9
    assert sum(ends(storage).values()) == 9
    assert result_of(broker.produce("t", batch, ProducerStamp(P, 1))) == 9
    assert sum(ends(storage).values()) == 18


class _FailingFirst:
    """A handle whose first ``failures`` appends fail ``unreachable`` without storing."""

    def __init__(self, handle: RangeHandle, failures: int) -> None:
        self._handle = handle
        self._failures = failures

    @property
    def range_id(self) -> str:
        return self._handle.range_id

    def refusal(self, count: int) -> BrokerError | None:
        return self._handle.refusal(count)

    def append(
        self, records: Sequence[Record], stamp: ProducerStamp | None = None
    ) -> Deferred[None]:
        if self._failures:
            self._failures -= 1
            return fail(BrokerError(Reason.UNREACHABLE, f"{self.range_id} failed on purpose"))
        return self._handle.append(records, stamp)

    def bounds(self) -> Deferred[Bounds]:
        return self._handle.bounds()

    def read(self, offset: int, max_records: int, max_bytes: int) -> Deferred[RangeRead]:
        return self._handle.read(offset, max_records, max_bytes)

    def wait(self, offset: int, wait_ms: int) -> Deferred[None]:
        return self._handle.wait(offset, wait_ms)


class _Flaky:
    """``LocalRanges`` whose ranges fail their first appends as ``failures`` says."""

    def __init__(self, local: LocalRanges, failures: dict[str, int]) -> None:
        self._local = local
        self._handles: dict[str, _FailingFirst] = {}
        self._failures = failures

    def handle(self, range_id: str) -> RangeHandle:
        if range_id not in self._handles:
            failures = self._failures.get(range_id, 0)
            self._handles[range_id] = _FailingFirst(self._local.handle(range_id), failures)
        return self._handles[range_id]

    def open(self, range_ids: Sequence[str]) -> Deferred[None]:
        return self._local.open(range_ids)


def flaky_broker(failures: dict[str, int]) -> tuple[Broker, MemoryRangeLogs]:
    clock = Clock()
    metrics = Metrics(clock)
    fs = MemoryFileSystem()
    storage = MemoryRangeLogs(fs, clock, metrics)
    directory = _Flaky(LocalRanges(storage), failures)
    broker = Broker(started(fs), directory, clock, BrokerSettings(initial_ranges=4), metrics)
    result_of(broker.create_topic("t", 0))
    return broker, storage


def test_a_retry_after_a_partial_failure_stores_only_what_its_first_try_did_not() -> None:
    broker, storage = flaky_broker({"t.1": 1})
    batch = [Record(b"k%d" % i, key=b"k%d" % i) for i in range(16)]
    stamp = ProducerStamp(P, 0)

    error = failure_of(broker.produce("t", batch, stamp)).value
    assert isinstance(error, BrokerError)
    assert error.reason is Reason.UNREACHABLE
    assert "t.1" not in ends(storage)
    stored_first = sum(ends(storage).values())
    assert 0 < stored_first < 16

    assert result_of(broker.produce("t", batch, stamp)) == 16

    assert sorted(r.value for r in fetched(broker, "t")) == sorted(r.value for r in batch)


batches = st.lists(
    st.lists(
        st.builds(
            Record,
            value=st.binary(min_size=1, max_size=6),
            key=st.one_of(st.none(), st.binary(max_size=4)),
        ),
        min_size=1,
        max_size=12,
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60)
@given(batches, st.dictionaries(st.sampled_from(["t.0", "t.1", "t.2", "t.3"]), st.integers(0, 3)))
def test_produces_retried_until_they_succeed_are_stored_exactly_once(
    sent: list[list[Record]], failures: dict[str, int]
) -> None:
    broker, _ = flaky_broker(failures)

    for sequence, batch in enumerate(sent):
        stamp = ProducerStamp(P, sequence)
        for _ in range(sum(failures.values()) + 1):
            produced = broker.produce("t", batch, stamp)
            outcome: list[object] = []
            produced.addBoth(outcome.append)
            if outcome == [len(batch)]:
                break
        else:
            raise AssertionError(f"produce {sequence} never succeeded")

    expected = sorted(repr(record) for batch in sent for record in batch)
    assert sorted(repr(record) for record in fetched(broker, "t")) == expected
