"""The dedupe of stamped appends (``logbroker.broker.producers``): pure, no I/O.

The examples pin each rule (the window, what a failed try leaves, the bound on producers, the
rebuild from the log); the property runs random sends and outcomes against a model with no
memory bound and checks that no stamp is ever stored twice and that the table answers what the
model does, within its bounds.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbroker.broker.errors import BrokerError
from logbroker.broker.producers import MAX_PRODUCERS, Admission, ProducerTable
from logbroker.errors import Reason
from logbroker.records import ProducerStamp
from logbroker.wire import PRODUCER_WINDOW

P = 0xFEED


def stamp(sequence: int, producer_id: int = P) -> ProducerStamp:
    return ProducerStamp(producer_id, sequence)


def too_old(table: ProducerTable, sent: ProducerStamp) -> bool:
    """Whether the table refuses ``sent`` as too old (any other outcome is admitted)."""
    try:
        table.admit(sent)
    except BrokerError as error:
        return error.reason is Reason.SEQUENCE_TOO_OLD
    return False


def test_the_bounds_are_the_documented_ones() -> None:
    assert PRODUCER_WINDOW == 32
    assert MAX_PRODUCERS == 10_000


def test_a_new_stamp_is_stored_and_its_retries_are_not() -> None:
    table = ProducerTable()

    assert table.admit(stamp(0)) is Admission.NEW
    assert table.admit(stamp(0)) is Admission.IN_FLIGHT
    table.stored(stamp(0))

    assert table.admit(stamp(0)) is Admission.STORED
    assert table.admit(stamp(0)) is Admission.STORED
    assert table.admit(stamp(1)) is Admission.NEW
    assert table.admit(stamp(0, producer_id=P + 1)) is Admission.NEW


def test_a_failed_try_is_forgotten_so_its_retry_is_stored() -> None:
    table = ProducerTable()
    table.admit(stamp(5))

    table.failed(stamp(5))

    assert table.admit(stamp(5)) is Admission.NEW


def test_sequences_may_arrive_out_of_order_within_the_window() -> None:
    table = ProducerTable(window=4)
    for sequence in (3, 1, 2):
        assert table.admit(stamp(sequence)) is Admission.NEW
        table.stored(stamp(sequence))

    assert table.admit(stamp(0)) is Admission.NEW  # 3 - 4 < 0: within the window
    assert [table.admit(stamp(s)) for s in (1, 2, 3)] == [Admission.STORED] * 3


def test_a_sequence_older_than_the_window_is_refused_whatever_became_of_it() -> None:
    table = ProducerTable(window=4)
    table.admit(stamp(0))
    table.stored(stamp(0))
    table.admit(stamp(10))

    with pytest.raises(BrokerError) as raised:
        table.admit(stamp(6))

    assert raised.value.reason is Reason.SEQUENCE_TOO_OLD
    assert "sequence 6 of producer 0x000000000000feed" in raised.value.detail
    assert too_old(table, stamp(0))  # stored once, but too long ago to tell
    assert table.admit(stamp(7)) is Admission.NEW  # 10 - 4 < 7
    assert table.admit(stamp(0, producer_id=P + 1)) is Admission.NEW  # another producer


def test_a_producer_keeps_at_most_its_window_of_sequences() -> None:
    table = ProducerTable(window=8)
    order = list(range(200))
    random.Random(4).shuffle(order)

    for sequence in order:
        if not too_old(table, stamp(sequence)):
            table.stored(stamp(sequence))
        assert len(table._producers[P].entries) <= 8


def test_an_entry_in_flight_that_leaves_the_window_is_too_old_to_retry() -> None:
    table = ProducerTable(window=4)
    table.admit(stamp(0))  # in flight
    table.admit(stamp(4))
    table.stored(stamp(4))

    table.stored(stamp(0))  # the window moved past it: nothing to record

    assert too_old(table, stamp(0))


def test_the_least_recently_seen_producer_is_forgotten_first() -> None:
    table = ProducerTable(max_producers=2)
    for producer_id in (1, 2):
        table.admit(stamp(0, producer_id))
        table.stored(stamp(0, producer_id))
    assert table.admit(stamp(0, 1)) is Admission.STORED  # 1 is now the most recently seen

    table.admit(stamp(0, 3))  # forgets 2

    assert len(table) == 2
    assert table.admit(stamp(0, 1)) is Admission.STORED
    # Forgotten: its retry would be stored again (the documented limit of the bound).
    assert table.admit(stamp(0, 2)) is Admission.NEW


def test_a_producer_with_an_append_in_flight_is_not_forgotten() -> None:
    table = ProducerTable(max_producers=2)
    table.admit(stamp(0, 1))  # in flight
    table.admit(stamp(0, 2))
    table.stored(stamp(0, 2))

    table.admit(stamp(0, 3))  # forgets 2, the least recent with nothing in flight
    table.admit(stamp(0, 4))  # 1 and 3 both have appends in flight: the table grows for now

    assert len(table) == 3
    assert table.admit(stamp(0, 1)) is Admission.IN_FLIGHT
    table.stored(stamp(0, 1))
    assert table.admit(stamp(0, 1)) is Admission.STORED


def test_the_table_is_rebuilt_from_the_stamped_batches_of_a_log() -> None:
    # (stamp, base_offset, record_count) as a log holds them, in no particular order.
    found = [
        (stamp(1, producer_id=1), 10, 2),
        (stamp(0, producer_id=1), 0, 5),
        (stamp(0, producer_id=2), 5, 5),
        (stamp(9, producer_id=1), 12, 1),
    ]

    table = ProducerTable.rebuild(found, window=4, max_producers=1)

    # The last in the log is the most recently seen: producer 1 stays, 2 is forgotten.
    assert len(table) == 1
    assert table.admit(stamp(9, producer_id=1)) is Admission.STORED
    assert too_old(table, stamp(1, producer_id=1))  # 9 - 4 >= 1
    assert table.admit(stamp(8, producer_id=1)) is Admission.NEW


def test_a_rebuilt_table_knows_every_stamp_of_the_log_within_its_window() -> None:
    found = [(stamp(s), 100 * s, 1) for s in range(40)]
    random.Random(2).shuffle(found)

    table = ProducerTable.rebuild(found)

    assert all(table.admit(stamp(s)) is Admission.STORED for s in range(8, 40))
    assert all(too_old(table, stamp(s)) for s in range(8))


@pytest.mark.parametrize(("window", "producers"), [(0, 1), (1, 0)])
def test_a_table_holds_something(window: int, producers: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ProducerTable(window, producers)


# -- the property ----------------------------------------------------------------------------

WINDOW = 4
sends = st.tuples(st.just("send"), st.integers(0, 2), st.integers(0, 24))
finishes = st.tuples(st.just("finish"), st.integers(0, 50), st.booleans())


@given(st.lists(st.one_of(sends, finishes), max_size=120))
def test_no_stamp_is_ever_stored_twice(operations: list[tuple[str, int, object]]) -> None:
    """Random sends and outcomes, against a model that remembers everything."""
    table = ProducerTable(window=WINDOW, max_producers=3)
    highest: dict[int, int] = {}
    state: dict[ProducerStamp, str] = {}  # the model: "in flight" or "stored"
    in_flight: list[ProducerStamp] = []
    stored_times: dict[ProducerStamp, int] = {}

    for kind, first, second in operations:
        if kind == "send":
            sent = stamp(int(second), producer_id=first)
            if sent.sequence <= highest.get(first, -1) - WINDOW:
                assert too_old(table, sent)
                continue
            expected = {"stored": Admission.STORED, "in flight": Admission.IN_FLIGHT}.get(
                state.get(sent, ""), Admission.NEW
            )
            assert table.admit(sent) is expected
            if expected is Admission.NEW:
                state[sent] = "in flight"
                in_flight.append(sent)
                highest[first] = max(highest.get(first, -1), sent.sequence)
        elif in_flight:
            done = in_flight.pop(first % len(in_flight))
            if second:
                table.stored(done)
                state[done] = "stored"
                stored_times[done] = stored_times.get(done, 0) + 1
            else:
                table.failed(done)
                del state[done]
        assert all(len(p.entries) <= WINDOW for p in table._producers.values())

    assert all(times == 1 for times in stored_times.values())
