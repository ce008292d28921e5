"""The primary's bookkeeping: commit index, backlog and per-replica send windows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbroker.replication.core.quorum import (
    Backlog,
    Chunk,
    CommitTracker,
    ReplicaStream,
    join,
    quorum_size,
)


@pytest.mark.parametrize(("rf", "quorum"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)])
def test_quorum_is_a_majority_counting_the_primary(rf: int, quorum: int) -> None:
    assert quorum_size(rf) == quorum


def test_quorum_refuses_a_factor_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        quorum_size(0)


def test_commit_moves_once_a_quorum_is_durable() -> None:
    tracker = CommitTracker({"a": 0, "b": 0, "c": 0}, quorum=2)
    assert not tracker.advance("a", 10)
    assert tracker.commit == 0
    assert tracker.advance("c", 7)
    assert tracker.commit == 7
    assert tracker.advance("b", 12)
    assert tracker.commit == 10


def test_older_news_never_moves_a_copy_back() -> None:
    tracker = CommitTracker({"a": 5, "b": 5, "c": 0}, quorum=2)
    assert tracker.commit == 5
    assert not tracker.advance("a", 3)
    assert tracker.durable("a") == 5
    assert tracker.commit == 5


def test_a_tracker_needs_a_quorum_it_can_reach() -> None:
    with pytest.raises(ValueError, match="quorum of 3 out of 2"):
        CommitTracker({"a": 0, "b": 0}, quorum=3)


@given(
    st.lists(
        st.tuples(st.sampled_from("abcde"), st.integers(min_value=0, max_value=1000)),
        max_size=60,
    ),
    st.integers(min_value=1, max_value=5),
)
def test_commit_is_what_a_quorum_holds(news: list[tuple[str, int]], quorum: int) -> None:
    tracker = CommitTracker(dict.fromkeys("abcde", 0), quorum=quorum)
    best = dict.fromkeys("abcde", 0)
    previous = 0
    for copy, end in news:
        tracker.advance(copy, end)
        best[copy] = max(best[copy], end)
        holding = sum(1 for value in best.values() if value >= tracker.commit)
        assert holding >= quorum
        assert tracker.commit >= previous
        # No higher end is held by a quorum.
        assert sum(1 for value in best.values() if value > tracker.commit) < quorum
        previous = tracker.commit


def _chunk(offset: int, count: int, position: int, size: int = 10) -> Chunk:
    return Chunk(offset, offset + count, position, bytes(size))


def test_backlog_hands_out_chunks_from_a_boundary() -> None:
    backlog = Backlog(max_bytes=1000)
    backlog.add(_chunk(0, 5, 0))
    backlog.add(_chunk(5, 5, 10))
    backlog.add(_chunk(10, 5, 20))
    taken = backlog.take(5, max_bytes=15)
    assert taken is not None
    assert [chunk.offset for chunk in taken] == [5]
    assert [c.offset for c in backlog.take(5, max_bytes=20) or []] == [5, 10]
    assert backlog.take(15, max_bytes=100) == []
    assert backlog.take(7, max_bytes=100) is None, "not a chunk boundary"
    assert backlog.take(16, max_bytes=100) is None, "past the end"


def test_backlog_takes_at_least_one_chunk() -> None:
    backlog = Backlog(max_bytes=1000)
    backlog.add(_chunk(0, 5, 0, size=50))
    assert [c.offset for c in backlog.take(0, max_bytes=1) or []] == [0]


def test_backlog_refuses_a_gap() -> None:
    backlog = Backlog(max_bytes=1000)
    backlog.add(_chunk(0, 5, 0))
    with pytest.raises(ValueError, match="does not follow"):
        backlog.add(_chunk(6, 5, 10))


def test_backlog_forgets_what_every_replica_holds_and_what_overflows() -> None:
    backlog = Backlog(max_bytes=25)
    backlog.add(_chunk(0, 5, 0))
    backlog.add(_chunk(5, 5, 10))
    backlog.release(5)
    assert backlog.take(0, 100) is None
    assert backlog.bytes == 10
    backlog.add(_chunk(10, 5, 20))
    backlog.add(_chunk(15, 5, 30))
    assert backlog.bytes == 20
    assert backlog.take(5, 100) is None, "dropped past max_bytes: read from disk"


def test_join_makes_one_message_of_consecutive_chunks() -> None:
    joined = join([_chunk(0, 5, 0, size=3), Chunk(5, 9, 3, b"abcd")])
    assert (joined.offset, joined.next_offset, joined.position) == (0, 9, 0)
    assert joined.data == bytes(3) + b"abcd"
    assert joined.end_position == 7


def test_stream_window_bounds_bytes_in_flight() -> None:
    stream = ReplicaStream("b", 0, 0, window_bytes=25)
    assert stream.room() == 25
    generation = stream.sent(_chunk(0, 5, 0))
    stream.sent(_chunk(5, 5, 10))
    assert stream.room() == 5
    stream.sent(_chunk(10, 5, 20))
    assert stream.room() == 0
    stream.stored(generation, 10, 20)
    assert stream.room() == 15
    assert (stream.durable_offset, stream.durable_position) == (10, 20)
    assert (stream.next_offset, stream.next_position) == (15, 30)


def test_stream_sends_only_from_where_it_is() -> None:
    stream = ReplicaStream("b", 0, 0, window_bytes=25)
    with pytest.raises(ValueError, match="stream is at 0"):
        stream.sent(_chunk(5, 5, 10))


def test_a_rewind_makes_earlier_answers_stale() -> None:
    stream = ReplicaStream("b", 0, 0, window_bytes=100)
    old = stream.sent(_chunk(0, 5, 0))
    stream.sent(_chunk(5, 5, 10))
    stream.rewind(5, 10)
    assert stream.idle
    assert (stream.next_offset, stream.next_position) == (5, 10)
    new = stream.sent(_chunk(5, 5, 10))
    stream.stored(old, 5, 10)
    assert not stream.idle, "a stale answer does not free the window"
    assert stream.durable_offset == 5, "but its durable end is news"
    stream.stored(new, 10, 20)
    assert stream.idle


def test_a_failed_link_restarts_from_the_durable_end() -> None:
    stream = ReplicaStream("b", 0, 0, window_bytes=100)
    first = stream.sent(_chunk(0, 5, 0))
    stream.sent(_chunk(5, 5, 10))
    stream.stored(first, 5, 10)
    stream.restart_from_durable(0, 0)
    assert (stream.next_offset, stream.next_position) == (5, 10)
    never = ReplicaStream("c", 0, 0, window_bytes=100)
    never.sent(_chunk(0, 5, 0))
    never.restart_from_durable(3, 7)
    assert (never.next_offset, never.next_position) == (3, 7)
