"""The clients' idempotent produce, pure part (``logbroker.client._retry``): the back-off
schedule, when a produce gives up, and the window of sequences a producer keeps in flight."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbroker.client import ProduceRetry
from logbroker.client._retry import (
    RETRIED_REASONS,
    Retries,
    SequenceWindow,
    new_producer_id,
)
from logbroker.wire import PRODUCER_WINDOW


def test_the_default_back_off_starts_at_50_ms_doubles_and_stops_at_1_s() -> None:
    policy = ProduceRetry(jitter=0)

    assert [policy.delay(retry, 0.5) for retry in range(1, 9)] == [
        0.05,
        0.1,
        0.2,
        0.4,
        0.8,
        1.0,
        1.0,
        1.0,
    ]
    assert policy.give_up_after == 30.0
    assert policy.delay(100_000, 0.0) == 1.0  # no overflow however long it runs


@given(st.integers(1, 2000), st.floats(0, 1, exclude_max=True), st.floats(0, 1))
def test_jitter_shortens_a_delay_by_at_most_its_share(
    retry: int, draw: float, jitter: float
) -> None:
    nominal = ProduceRetry(jitter=0).delay(retry, draw)

    delay = ProduceRetry(jitter=jitter).delay(retry, draw)

    assert nominal * (1 - jitter) - 1e-12 <= delay <= nominal


def test_only_the_refusals_that_mean_try_again_are_retried() -> None:
    assert {"not_primary", "unreachable", "no_quorum", "storage_unavailable"} == RETRIED_REASONS


def test_no_retry_starts_after_the_give_up_time() -> None:
    retries = Retries(ProduceRetry(jitter=0), started=100.0)
    now, waits = 100.0, []

    while (delay := retries.next_delay(now)) is not None:
        waits.append(delay)
        now += delay

    assert now <= 130.0
    assert now + 1.0 > 130.0  # the next (of 1 s) would have started too late
    assert waits[:3] == [0.05, 0.1, 0.2]


def test_a_produce_may_give_up_sooner_or_later_than_the_policy_says() -> None:
    assert Retries(ProduceRetry(jitter=0), 0.0, give_up_after=0.12).next_delay(0.0) == 0.05
    assert Retries(ProduceRetry(jitter=0), 0.0, give_up_after=0.01).next_delay(0.0) is None
    later = Retries(ProduceRetry(jitter=0), 0.0, give_up_after=100.0)
    assert later.remaining(60.0) == 40.0
    assert later.remaining(160.0) == 0.0


@pytest.mark.parametrize(
    "settings",
    [
        {"first_delay": -1},
        {"multiplier": 0.5},
        {"max_delay": -0.1},
        {"give_up_after": -1},
        {"jitter": 1.5},
    ],
)
def test_a_policy_that_makes_no_sense_is_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(settings))):
        ProduceRetry(**settings)


def test_the_window_lets_a_producer_run_at_most_its_size_ahead_of_its_oldest() -> None:
    window = SequenceWindow(3)
    assert [window.take() for _ in range(4)] == [0, 1, 2, None]

    window.finish(1)
    window.finish(2)
    assert window.take() is None  # 0 is unfinished: 3 would be 3 ahead of it

    window.finish(0)
    assert [window.take(), window.take(), window.take(), window.take()] == [3, 4, 5, None]


@given(st.lists(st.one_of(st.none(), st.integers(0, 40)), max_size=200))
def test_no_sequence_goes_out_while_one_size_behind_it_is_unfinished(
    operations: list[int | None],
) -> None:
    size = 4
    window, unfinished, taken = SequenceWindow(size), set(), []
    for operation in operations:
        if operation is None:
            sequence = window.take()
            if sequence is None:
                assert unfinished
                assert len(taken) - min(unfinished) >= size
                continue
            assert sequence == len(taken)  # each once, in order
            assert all(sequence - old < size for old in unfinished)
            taken.append(sequence)
            unfinished.add(sequence)
        elif unfinished:
            done = sorted(unfinished)[operation % len(unfinished)]
            window.finish(done)
            unfinished.discard(done)


def test_the_clients_window_is_the_brokers() -> None:
    window = SequenceWindow()

    assert [window.take() for _ in range(PRODUCER_WINDOW)] == list(range(PRODUCER_WINDOW))
    assert window.take() is None


def test_producer_ids_are_random_64_bit_numbers() -> None:
    ids = {new_producer_id() for _ in range(100)}

    assert len(ids) == 100
    assert all(0 <= producer_id < 2**64 for producer_id in ids)
