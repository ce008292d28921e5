"""The history checker of the fault tests (``tests.history``) finds what it promises to find."""

from __future__ import annotations

from tests.history import History


def produced(
    history: History, key: bytes, started: float, finished: float, failure: str | None = None
) -> bytes:
    sequence, value = history.next_value(key)
    history.record(key, value, sequence, started, finished, failure)
    return value


def test_values_are_unique_and_carry_their_key_and_sequence() -> None:
    history = History()
    first = history.next_value(b"k-1")
    second = history.next_value(b"k-1")
    other = history.next_value(b"k-2")

    assert [first[0], second[0], other[0]] == [0, 1, 0]
    assert [first[1], second[1], other[1]] == [b"k-1#0", b"k-1#1", b"k-2#0"]


def test_everything_acknowledged_read_back_once_in_order_passes() -> None:
    history = History()
    a0 = produced(history, b"a", 0.0, 1.0)
    b0 = produced(history, b"b", 0.5, 1.5)
    a1 = produced(history, b"a", 1.0, 4.0)
    history.mark("a fault")

    verdict = history.check([(b"b", b0), (b"a", a0), (b"a", a1)])

    assert verdict.problems == []
    assert verdict.acknowledged == 3
    assert verdict.longest_latency == 3.0
    assert "3 acknowledged, 0 failed" in verdict.summary()
    assert "a fault" in verdict.summary()


def test_an_acknowledged_value_missing_is_lost() -> None:
    history = History()
    a0 = produced(history, b"a", 0.0, 1.0)
    a1 = produced(history, b"a", 1.0, 2.0)

    verdict = history.check([(b"a", a0)])

    assert verdict.lost == (a1,)
    assert len(verdict.problems) == 1


def test_a_value_read_twice_is_a_duplicate_even_if_its_produce_failed() -> None:
    history = History()
    a0 = produced(history, b"a", 0.0, 1.0, failure="unreachable")

    verdict = history.check([(b"a", a0), (b"a", a0)])

    assert verdict.duplicated == (a0,)
    assert verdict.lost == ()


def test_a_failed_produce_may_be_stored_once_or_not_at_all() -> None:
    history = History()
    stored = produced(history, b"a", 0.0, 1.0, failure="ConnectionClosed")
    produced(history, b"a", 1.0, 2.0, failure="no_quorum")

    verdict = history.check([(b"a", stored)])

    assert verdict.problems == []
    assert (verdict.failed, verdict.failed_but_stored) == (2, 1)
    assert verdict.failures == {"ConnectionClosed": 1, "no_quorum": 1}


def test_a_record_acknowledged_before_another_was_sent_must_read_back_before_it() -> None:
    history = History()
    a0 = produced(history, b"a", 0.0, 1.0)
    a1 = produced(history, b"a", 2.0, 3.0)

    verdict = history.check([(b"a", a1), (b"a", a0)])

    [problem] = verdict.problems
    assert "sequence 0 reads back after sequence 1" in problem


def test_produces_of_one_key_in_flight_together_may_read_back_either_way() -> None:
    history = History()
    a0 = produced(history, b"a", 0.0, 2.0)
    a1 = produced(history, b"a", 1.0, 3.0)

    assert history.check([(b"a", a1), (b"a", a0)]).problems == []


def test_failed_produces_do_not_order_the_acknowledged_ones() -> None:
    history = History()
    a0 = produced(history, b"a", 0.0, 1.0)
    failed = produced(history, b"a", 1.0, 20.0, failure="no_quorum")
    a2 = produced(history, b"a", 20.0, 21.0)

    # The failed one was committed after all, late: no acknowledged pair is out of order.
    assert history.check([(b"a", a0), (b"a", a2), (b"a", failed)]).problems == []


def test_a_value_nobody_produced_or_read_under_another_key_is_unknown() -> None:
    history = History()
    a0 = produced(history, b"a", 0.0, 1.0)

    verdict = history.check([(b"b", a0), (b"a", b"a#7"), (b"a", b"a#7")])

    assert verdict.unknown == (a0, b"a#7")
