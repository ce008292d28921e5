"""The etcd prefix follower on the etcd double, one transition of ``Following`` at a time: what
the reader is handed, and when the store is asked (loads, watches and the pauses between)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.logger import LogLevel, globalLogPublisher

from logbroker.controlplane._kv import EventType, OnEvents, OnLost, RangeResult, WatchEvent
from logbroker.controlplane._memory_kv import _Watch
from logbroker.controlplane.errors import ControlPlaneUnavailableError, StateFileError
from logbroker.controlplane.follower import MAX_RESUME_DELAY, RESUME_DELAY, PrefixFollower
from logbroker.controlplane.following import (
    CancelWatch,
    Following,
    FollowState,
    GiveUp,
    Load,
    LoadReason,
    Trouble,
    Watch,
)
from logbroker.testing import MemoryKeyValueStore
from tests.unit.storage.helpers import failure_of, result_of

PREFIX = b"/logbroker/test/things/"


def key(name: str) -> bytes:
    return PREFIX + name.encode()


def pauses(times: Sequence[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(times)]


class RecordingStore(MemoryKeyValueStore):
    """The double, noting when each load and watch was asked for."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.loads: list[float] = []
        self.watches: list[tuple[float, int]] = []

    def range_prefix(self, prefix: bytes) -> Any:
        self.loads.append(self._clock.seconds())
        return super().range_prefix(prefix)

    def watch(
        self, prefix: bytes, start_revision: int, on_events: OnEvents, on_lost: OnLost
    ) -> _Watch:
        self.watches.append((self._clock.seconds(), start_revision))
        return super().watch(prefix, start_revision, on_events, on_lost)


class Reader:
    """A cache of the prefix, as the follower's users keep one."""

    def __init__(self) -> None:
        self.state: dict[bytes, bytes] = {}
        self.loaded_at: list[int] = []
        #: The revision of every event handed over, in order.
        self.event_revisions: list[int] = []
        #: How many of the next loads, and of the next event batches, to refuse.
        self.refuse_loads = 0
        self.refuse_events = 0

    def on_load(self, result: RangeResult) -> None:
        if self.refuse_loads:
            self.refuse_loads -= 1
            raise StateFileError("an entry this reader cannot read")
        self.state = {kv.key: kv.value for kv in result.kvs}
        self.loaded_at.append(result.revision)

    def on_events(self, events: Sequence[WatchEvent]) -> None:
        if self.refuse_events:
            self.refuse_events -= 1
            raise ValueError("a change this reader cannot apply")
        for event in events:
            if event.type is EventType.PUT:
                self.state[event.kv.key] = event.kv.value
            else:
                self.state.pop(event.kv.key, None)
            self.event_revisions.append(event.kv.mod_revision)


class Bench:
    def __init__(self) -> None:
        self.clock = Clock()
        self.store = RecordingStore(self.clock)
        self.reader = Reader()
        self.followers: list[PrefixFollower] = []

    def follower(self, **delays: float) -> PrefixFollower:
        made = PrefixFollower(
            self.store,
            PREFIX,
            self.clock,
            name="Things",
            on_load=self.reader.on_load,
            on_events=self.reader.on_events,
            **delays,
        )
        self.followers.append(made)
        return made

    def started(self, **delays: float) -> PrefixFollower:
        made = self.follower(**delays)
        result_of(made.start())
        return made

    def put(self, name: str, value: bytes = b"v") -> int:
        revision: int = result_of(self.store.put(key(name), value))
        return revision

    def delete(self, name: str) -> None:
        result_of(self.store.delete(key(name)))

    def in_store(self) -> dict[bytes, bytes]:
        read = MemoryKeyValueStore.range_prefix(self.store, PREFIX)  # not counted as a load
        return {kv.key: kv.value for kv in result_of(read).kvs}

    def advance(self, seconds: float, step: float = 0.05) -> None:
        for _ in range(round(seconds / step)):
            self.clock.advance(step)


@pytest.fixture
def bench() -> Iterator[Bench]:
    made = Bench()
    yield made
    made.store.unavailable = False
    made.store.release()
    for follower in made.followers:
        follower.stop()
    assert made.store.watch_count == 0
    assert made.clock.getDelayedCalls() == []


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    """The text of every warning logged meanwhile."""
    seen: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_level") is LogLevel.warn:
            seen.append(str(event.get("log_format")))

    globalLogPublisher.addObserver(observe)
    yield seen
    globalLogPublisher.removeObserver(observe)


# -- STOPPED -> LOADING -> WATCHING, and events ---------------------------------------------------


def test_start_hands_over_the_whole_prefix_then_every_change_after_it(bench: Bench) -> None:
    bench.put("a", b"1")
    result_of(bench.store.put(b"/logbroker/test/other", b"not under the prefix"))
    at = bench.put("b", b"2")

    follower = bench.started()

    assert bench.reader.loaded_at == [at]
    assert bench.reader.state == {key("a"): b"1", key("b"): b"2"}
    assert follower.watching
    assert bench.store.watches == [(0.0, at + 1)]
    changed = bench.put("a", b"3")
    bench.delete("b")
    assert bench.reader.state == {key("a"): b"3"}
    assert bench.reader.event_revisions == [changed, changed + 1]
    assert follower.revision == changed + 1


def test_start_fires_once_the_first_load_is_handed_over(bench: Bench) -> None:
    bench.store.hold()
    follower = bench.follower()

    started = follower.start()

    assert not started.called
    assert bench.reader.loaded_at == []
    bench.store.release()
    result_of(started)
    assert bench.reader.loaded_at == [bench.store.revision]


# -- LOADING -> WAITING_TO_LOAD -> LOADING --------------------------------------------------------


def test_a_failed_load_is_retried_after_pauses_that_double_up_to_the_cap(bench: Bench) -> None:
    bench.put("a")
    bench.store.unavailable = True
    follower = bench.follower()

    started = follower.start()
    bench.advance(20)

    assert not started.called
    assert not follower.watching
    waited = pauses(bench.store.loads)
    assert waited[:6] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2], abs=0.051)
    assert waited[6:] == pytest.approx([MAX_RESUME_DELAY] * len(waited[6:]), abs=0.051)
    bench.store.unavailable = False
    bench.advance(MAX_RESUME_DELAY)
    result_of(started)
    assert bench.reader.state == {key("a"): b"v"}
    assert follower.watching


def test_a_first_load_that_is_not_to_be_retried_fails_start_and_stops(bench: Bench) -> None:
    bench.store.unavailable = True
    follower = bench.follower()

    failure_of(follower.start(retry_first_load=False)).trap(ControlPlaneUnavailableError)

    bench.store.unavailable = False
    bench.advance(10)
    assert bench.store.loads == [0.0]
    assert bench.reader.loaded_at == []
    assert bench.clock.getDelayedCalls() == []


def test_a_load_the_reader_refuses_counts_as_a_failed_load(bench: Bench) -> None:
    bench.put("a")
    bench.reader.refuse_loads = 1

    refused = bench.follower()
    failure_of(refused.start(retry_first_load=False)).trap(StateFileError)
    bench.reader.refuse_loads = 2
    follower = bench.follower()
    started = follower.start()
    bench.advance(1)

    result_of(started)
    assert bench.store.loads == pytest.approx([0.0, 0.0, 0.1, 0.3], abs=0.051)
    assert bench.reader.state == {key("a"): b"v"}


# -- WATCHING -> WAITING_TO_WATCH -> WATCHING -----------------------------------------------------


def test_a_lost_watch_resumes_after_the_pause_from_the_revision_after_the_last(
    bench: Bench,
) -> None:
    follower = bench.started()
    seen = bench.put("a", b"1")
    bench.store.drop_watches()

    first = bench.put("b", b"2")
    bench.delete("a")
    bench.clock.advance(RESUME_DELAY / 2)
    assert not follower.watching
    assert bench.reader.state == {key("a"): b"1"}
    bench.clock.advance(RESUME_DELAY / 2)

    assert follower.watching
    assert bench.store.watches[-1] == (pytest.approx(RESUME_DELAY), seen + 1)
    # Every change exactly once, in order, none missed.
    assert bench.reader.event_revisions == [seen, first, first + 1]
    assert bench.reader.state == bench.in_store() == {key("b"): b"2"}
    assert len(bench.store.loads) == 1


def test_a_watch_lost_again_and_again_backs_off_then_recovers(bench: Bench) -> None:
    follower = bench.started()
    bench.store.drop_watches()
    bench.store.unavailable = True
    bench.advance(20)
    bench.store.unavailable = False
    changed = bench.put("a")

    # Lost at 0: the first attempt to resume after the first pause.
    waited = pauses([at for at, _ in bench.store.watches])
    assert waited[:6] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2], abs=0.051)
    assert waited[6:] == pytest.approx([MAX_RESUME_DELAY] * len(waited[6:]), abs=0.051)
    bench.advance(MAX_RESUME_DELAY)
    assert follower.watching
    assert bench.reader.event_revisions == [changed]
    # Working again: the next loss waits the first pause only.
    bench.store.drop_watches()
    lost_at = bench.clock.seconds()
    bench.advance(RESUME_DELAY)
    assert bench.store.watches[-1][0] == pytest.approx(lost_at + RESUME_DELAY)


def test_a_watch_that_stayed_up_counts_as_working_even_without_changes(bench: Bench) -> None:
    follower = bench.started()
    bench.store.drop_watches()
    bench.store.unavailable = True
    bench.advance(3)
    bench.store.unavailable = False
    bench.advance(MAX_RESUME_DELAY)
    assert follower.watching
    bench.advance(MAX_RESUME_DELAY)

    bench.store.drop_watches()
    lost_at = bench.clock.seconds()
    bench.advance(RESUME_DELAY)

    assert follower.watching
    assert bench.store.watches[-1][0] == pytest.approx(lost_at + RESUME_DELAY)


def test_trouble_is_warned_once_until_following_works_again(
    bench: Bench, warnings: list[str]
) -> None:
    bench.started()
    bench.store.drop_watches()
    bench.store.unavailable = True
    bench.advance(10)
    assert len(warnings) == 1
    assert "lost the watch on {prefix}" in warnings[0]

    bench.store.unavailable = False
    bench.put("a")
    bench.advance(MAX_RESUME_DELAY)
    bench.store.drop_watches()
    assert len(warnings) == 2


# -- WATCHING -> LOADING (compacted, silent, rejected) --------------------------------------------


def test_a_watch_behind_a_compaction_loads_the_whole_prefix_again(
    bench: Bench, warnings: list[str]
) -> None:
    follower = bench.started()
    bench.put("a")
    bench.put("b")
    bench.store.drop_watches()
    bench.delete("a")
    bench.put("c")
    bench.store.compact(bench.store.revision)

    bench.clock.advance(RESUME_DELAY)

    assert follower.watching
    assert len(bench.store.loads) == 2
    assert bench.reader.loaded_at[-1] == bench.store.revision
    assert bench.reader.state == bench.in_store() == {key("b"): b"v", key("c"): b"v"}
    assert bench.store.watch_count == 1
    assert any("fell behind a compaction" in warning for warning in warnings)
    bench.put("d")
    assert key("d") in bench.reader.state


def test_an_expected_revision_that_does_not_come_reloads(bench: Bench, warnings: list[str]) -> None:
    follower = bench.started()
    bench.store.silence_watches()
    expected = bench.put("a")

    follower.expect(expected, within=2.0)
    bench.clock.advance(1.5)
    assert bench.reader.state == {}

    bench.clock.advance(0.5)
    assert len(bench.store.loads) == 2
    assert bench.reader.state == {key("a"): b"v"}
    # The silent watch is given up; one watch from the reloaded revision replaces it.
    assert bench.store.watch_count == 1
    assert bench.store.watches[-1] == (pytest.approx(2.0), expected + 1)
    assert any("in case the watch went silent" in warning for warning in warnings)
    bench.put("b")
    assert key("b") in bench.reader.state


def test_an_expected_revision_that_comes_in_time_reloads_nothing(bench: Bench) -> None:
    follower = bench.started()
    expected = bench.put("a")
    follower.expect(expected, within=2.0)
    follower.expect(expected + 1, within=2.0)
    bench.put("b")

    assert bench.clock.getDelayedCalls() == []
    bench.advance(5)
    assert len(bench.store.loads) == 1


def test_a_cancelled_expectation_reloads_nothing(bench: Bench) -> None:
    follower = bench.started()
    bench.store.silence_watches()

    follower.expect(bench.put("a"), within=2.0).cancel()

    assert bench.clock.getDelayedCalls() == []
    bench.advance(5)
    assert len(bench.store.loads) == 1


def test_an_expected_revision_due_while_the_watch_waits_to_resume_reloads(bench: Bench) -> None:
    follower = bench.started(first_delay=10.0, max_delay=10.0)
    bench.store.drop_watches()

    follower.expect(bench.put("a"), within=1.0)
    bench.clock.advance(1.0)

    assert follower.watching
    assert len(bench.store.loads) == 2
    assert bench.reader.state == {key("a"): b"v"}
    bench.advance(10)
    assert len(bench.store.watches) == 2


def test_a_change_the_reader_cannot_apply_loads_the_whole_prefix_again(
    bench: Bench, logged_errors: list[dict[str, Any]]
) -> None:
    follower = bench.started()
    bench.reader.refuse_events = 1

    bench.put("a")

    assert [event["log_format"] for event in logged_errors] == [
        "{name}: applying a change under {prefix} failed; loading it all again"
    ]
    logged_errors.clear()
    assert follower.watching
    assert len(bench.store.loads) == 2
    assert bench.reader.state == {key("a"): b"v"}
    assert bench.store.watch_count == 1


# -- any -> STOPPED -------------------------------------------------------------------------------


def test_stop_ends_the_watch_and_nothing_more_is_handed_over(bench: Bench) -> None:
    follower = bench.started()
    follower.expect(bench.store.revision + 10, within=1.0)

    follower.stop()

    assert bench.store.watch_count == 0
    assert bench.clock.getDelayedCalls() == []
    bench.put("a")
    assert bench.reader.state == {}


def test_stop_while_waiting_to_retry_retries_nothing(bench: Bench) -> None:
    follower = bench.started()
    bench.store.drop_watches()

    follower.stop()

    assert bench.clock.getDelayedCalls() == []
    bench.advance(1)
    assert bench.store.watches == [(0.0, 2)]


def test_stop_while_loading_ignores_the_answer(bench: Bench) -> None:
    bench.put("a")
    bench.store.hold()
    follower = bench.follower()
    started = follower.start()

    follower.stop()
    bench.store.release()

    assert not started.called
    assert bench.reader.loaded_at == []
    assert bench.store.watch_count == 0


# -- the state machine alone ----------------------------------------------------------------------


def test_the_state_machine_ignores_what_its_state_does_not_expect() -> None:
    following = Following(first_delay=1.0, max_delay=4.0)
    assert following.loaded(5, now=0.0) == []
    assert following.events(5, now=0.0) == []
    assert following.watch_lost(compacted=False, now=0.0) == []
    assert following.timer(now=100.0) == []

    assert following.start() == [Load(LoadReason.START)]
    assert following.start() == []
    assert following.loaded(5, now=0.0) == [Watch(6)]
    assert following.load_failed(now=0.0) == []
    assert following.watch_lost(compacted=False, now=1.0) == [Trouble(True, 1.0)]
    assert following.state is FollowState.WAITING_TO_WATCH
    assert following.timer(now=1.5) == []
    assert following.timer(now=2.0) == [Watch(6)]
    assert following.rejected(now=2.0) == [CancelWatch(), Load(LoadReason.REJECTED)]
    assert following.load_failed(now=3.0) == [Trouble(False, 2.0)]
    assert following.stop() == []
    assert following.wakeup is None


def test_a_first_load_not_to_be_retried_gives_up_once_and_only_the_first() -> None:
    following = Following(first_delay=1.0, max_delay=4.0)
    following.start(retry_first_load=False)
    assert following.load_failed(now=0.0) == [GiveUp()]
    assert following.state is FollowState.STOPPED

    following.start(retry_first_load=False)
    following.loaded(3, now=0.0)
    following.watch_lost(compacted=True, now=0.0)
    assert following.load_failed(now=0.0) == [Trouble(True, 1.0)]


def test_delays_must_be_positive_and_ordered() -> None:
    with pytest.raises(ValueError, match="need 0 < first <= max"):
        Following(first_delay=0.0, max_delay=1.0)
    with pytest.raises(ValueError, match="need 0 < first <= max"):
        Following(first_delay=2.0, max_delay=1.0)
