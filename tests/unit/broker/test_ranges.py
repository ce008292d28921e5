"""The ``RangeHandle`` contract, run against every implementation of the seam.

Each case builds a world that hands out the handle of range ``r.0`` and says how to settle what
is in flight (run held storage jobs, deliver peer messages...); the assertions are the same for
every handle. The forwarded and replicated handles join the parameter list as they land.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from logbroker import wire
from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import Bounds, LocalRanges, RangeHandle
from logbroker.errors import Reason
from logbroker.metrics import Metrics
from logbroker.records import Record
from logbroker.storage import LogConfig, RangeLog
from logbroker.testing import ManualExecutor, MemoryFileSystem
from tests.unit.storage.helpers import failure_of, result_of

RANGE = "r.0"


@attrs.define
class World:
    handle: RangeHandle
    settle: Callable[[], None]

    def done(self, deferred: Deferred[Any]) -> Any:
        self.settle()
        return result_of(deferred)

    def failed(self, deferred: Deferred[Any]) -> BaseException:
        self.settle()
        error = failure_of(deferred).value
        assert error is not None
        return error


class _Logs:
    def __init__(self, fs: MemoryFileSystem, executor: ManualExecutor, config: LogConfig) -> None:
        self._fs = fs
        self._executor = executor
        self._config = config
        self.logs: dict[str, RangeLog] = {}

    def open_range(self, name: str) -> Deferred[RangeLog]:
        def opened(range_log: RangeLog) -> RangeLog:
            self.logs[name] = range_log
            return range_log

        return RangeLog.open(
            f"/data/ranges/{name}",
            fs=self._fs,
            clock=Clock(),
            executor=self._executor,
            config=self._config,
            on_integrity_event=Metrics(Clock()).integrity_event,
        ).addCallback(opened)


def local_world(config: LogConfig) -> World:
    executor = ManualExecutor()
    ranges = LocalRanges(_Logs(MemoryFileSystem(), executor, config))
    opening = ranges.open([RANGE])
    executor.run_all()
    result_of(opening)
    return World(ranges.handle(RANGE), executor.run_all)


WORLDS = {"local": local_world}


@pytest.fixture(params=sorted(WORLDS))
def make_world(request: pytest.FixtureRequest) -> Callable[..., World]:
    return lambda config=None: WORLDS[request.param](config or LogConfig())


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

    refusal = world.handle.refusal(3)

    assert isinstance(refusal, BrokerError)
    assert refusal.reason is Reason.OVERLOADED
    assert world.handle.refusal(2) is None


def test_an_unknown_range_is_unreachable() -> None:
    ranges = LocalRanges(_Logs(MemoryFileSystem(), ManualExecutor(), LogConfig()))

    with pytest.raises(BrokerError) as raised:
        ranges.handle("nope.0")
    assert raised.value.reason is Reason.UNREACHABLE
