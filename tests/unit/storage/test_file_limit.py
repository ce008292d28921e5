"""The open-file limit: raised to the hard limit at start, and the open ranges it leaves room
for, past which a range is refused with why, and recovery refuses to start."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock

from logbroker.errors import Reason
from logbroker.metrics import Metrics
from logbroker.service import StorageService
from logbroker.storage import (
    DataDirectory,
    LogConfig,
    OpenOnce,
    OsFileSystem,
    RangeLog,
    TooManyRangesError,
)
from logbroker.storage.file_limit import FileLimit, raise_file_limit
from logbroker.testing import ImmediateExecutor
from tests.unit.storage.helpers import MemoryLogs, failure_of, result_of


class _Limits:
    def __init__(self, soft: int, hard: int, refuse: bool = False) -> None:
        self.limits = (soft, hard)
        self.refuse = refuse

    def get(self, which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return self.limits

    def set(self, which: int, limits: tuple[int, int]) -> None:
        assert which == resource.RLIMIT_NOFILE
        if self.refuse:
            raise ValueError("not allowed")
        self.limits = limits


def test_the_soft_limit_is_raised_to_the_hard_one() -> None:
    limits = _Limits(1024, 65536)
    limit = raise_file_limit(limits.get, limits.set)
    assert limits.limits == (65536, 65536)
    assert limit == FileLimit(65536, raised_from=1024)
    assert limit.max_open_ranges == 65536 - 4096


@pytest.mark.parametrize(
    ("soft", "hard", "refuse", "expected"),
    [
        (20000, 20000, False, FileLimit(20000)),
        (1024, resource.RLIM_INFINITY, False, FileLimit(1024)),
        (1024, 4096, True, FileLimit(1024)),
    ],
    ids=["already at the hard limit", "unlimited hard limit", "raise refused"],
)
def test_a_limit_that_cannot_be_raised_is_kept(
    soft: int, hard: int, refuse: bool, expected: FileLimit
) -> None:
    limits = _Limits(soft, hard, refuse)
    assert raise_file_limit(limits.get, limits.set) == expected


def test_a_small_limit_keeps_a_quarter_for_connections() -> None:
    assert FileLimit(1024).max_open_ranges == 768
    assert FileLimit(20000).max_open_ranges == 20000 - 4096


def test_past_the_room_left_a_range_is_refused_with_why() -> None:
    logs: dict[str, RangeLog] = {}
    opened = MemoryLogs()
    why = FileLimit(8).why()
    opener = OpenOnce(logs, opened.open_range, max_open=2, max_open_why=why)
    result_of(opener.open_range("a"))
    result_of(opener.open_range("b"))

    error = failure_of(opener.open_range("c")).value
    assert isinstance(error, TooManyRangesError)
    assert error.reason is Reason.OVERLOADED
    assert "holds 2 open ranges already" in str(error)
    assert "open-file limit of 8" in str(error)
    assert "LimitNOFILE" in str(error)
    # Those open are still handed out.
    assert result_of(opener.open_range("a")) is logs["a"]


def test_opens_under_way_count_against_the_room() -> None:
    logs: dict[str, RangeLog] = {}
    pending: list[Deferred[RangeLog]] = []

    def slow_open(name: str) -> Deferred[RangeLog]:
        pending.append(Deferred())
        return pending[-1]

    opener = OpenOnce(logs, slow_open, max_open=1)
    opener.open_range("a")
    failure_of(opener.open_range("b")).trap(TooManyRangesError)


def test_recovery_refuses_more_ranges_than_the_limit_leaves_room_for(tmp_path: Path) -> None:
    fs = OsFileSystem()
    data_dir = DataDirectory.open(str(tmp_path / "data"), fs)
    for name in ("orders.0", "orders.1", "orders.2"):
        opened = RangeLog.open(
            data_dir.range_path(name), fs=fs, clock=Clock(), executor=ImmediateExecutor()
        )
        result_of(result_of(opened).close())
    storage = StorageService(
        MemoryReactorClock(), data_dir, fs, LogConfig(), Metrics(Clock()), FileLimit(2)
    )

    with pytest.raises(TooManyRangesError) as refused:
        storage.recover()
    assert "holds 3 ranges, more than this node can keep open: 2" in str(refused.value)
    assert storage.logs == {}
