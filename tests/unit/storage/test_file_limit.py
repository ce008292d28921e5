"""The open-file limit: raised to the hard limit at start, and the segment files it leaves the
range logs room for, which a node holding more ranges than that stays within."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet.task import Clock, deferLater

from logbroker.metrics import Metrics
from logbroker.service import StorageService
from logbroker.storage import DataDirectory, LogConfig, OsFileSystem, RangeLog
from logbroker.storage.file_limit import FileLimit, raise_file_limit
from logbroker.testing import ImmediateExecutor
from tests.unit.storage.helpers import descriptors_open_under, record, result_of


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
    assert limit.max_open_files == 65536 - 4096


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
    assert FileLimit(1024).max_open_files == 768
    assert FileLimit(20000).max_open_files == 20000 - 4096


@pytest_twisted.ensureDeferred
async def test_a_node_holds_more_ranges_than_its_limit_leaves_files_for(tmp_path: Path) -> None:
    from twisted.internet import reactor

    fs = OsFileSystem()
    data_dir = DataDirectory.open(str(tmp_path / "data"), fs)
    for number in range(12):
        opened = result_of(
            RangeLog.open(
                data_dir.range_path(f"orders.{number}"),
                fs=fs,
                clock=Clock(),
                executor=ImmediateExecutor(),
            )
        )
        result_of(opened.append([record(number)]))
        result_of(opened.close())
    # A limit of 8 leaves the logs 6 files, and 2 for the rest.
    storage = StorageService(reactor, data_dir, fs, LogConfig(), Metrics(Clock()), FileLimit(8))
    storage.recover()
    storage.startService()
    try:
        for number in range(20):
            log = await storage.open_range(f"orders.{number}")
            await log.append([record(100 + number)])
            # The writer threads close what the budget released: give them a moment.
            for _ in range(200):
                if descriptors_open_under(tmp_path, ".log") <= 6:
                    break
                await deferLater(reactor, 0.01)
            assert descriptors_open_under(tmp_path, ".log") <= 6
        for number in range(12):
            values = [s.record.value for s in storage.logs[f"orders.{number}"].read(0)]
            assert values == [record(number).value, record(100 + number).value]
    finally:
        await storage.stopService()
    assert descriptors_open_under(tmp_path, ".log") == 0
