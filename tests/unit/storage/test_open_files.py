"""The node's budget of open segment files: past it, the least recently used idle handles are
closed, never one a write is using, and a log whose file was closed opens it again at its next
append or read, with nothing lost."""

from __future__ import annotations

from pathlib import Path

import pytest
from twisted.internet.task import Clock

from logbroker.storage import (
    DataDirectory,
    LogConfig,
    OpenFiles,
    OsFileSystem,
    RangeLog,
    close_each,
)
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from tests.unit.storage.helpers import descriptors_open_under, record, result_of


class _Handle:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Budget:
    """An ``OpenFiles`` whose released handles are noted, not closed by an executor."""

    def __init__(self, budget: int) -> None:
        self.released: list[str] = []
        self.files = OpenFiles(
            budget, lambda handles: self.released.extend(h.name for h in handles)
        )
        self.in_use: set[str] = set()

    def _release(self, handles: list[_Handle]) -> None:
        self.released.extend(handle.name for handle in handles)

    def open(self, name: str) -> None:
        handle = _Handle(name)
        self.files.opened(
            (name, "writer"),  # type: ignore[arg-type]  # any hashable key does here
            lambda: None if name in self.in_use else handle,
        )


def test_past_the_budget_the_least_recently_used_handle_is_released() -> None:
    budget = _Budget(2)
    budget.open("a")
    budget.open("b")
    budget.files.used(("a", "writer"))  # type: ignore[arg-type]
    budget.open("c")
    assert budget.released == ["b"]
    assert len(budget.files) == 2
    assert budget.files.closed_for_budget == 1


def test_a_handle_in_use_is_passed_over_and_released_once_idle() -> None:
    budget = _Budget(1)
    budget.in_use.add("a")
    budget.open("a")
    budget.open("b")
    # "a" is writing and "b" was just opened (for use at once): the count stays over.
    assert budget.released == []
    assert len(budget.files) == 2
    budget.in_use.clear()
    budget.open("c")
    assert budget.released == ["a", "b"]
    assert len(budget.files) == 1


def test_a_handle_its_log_closed_no_longer_counts() -> None:
    budget = _Budget(1)
    budget.open("a")
    budget.files.forget(("a", "writer"))  # type: ignore[arg-type]
    budget.open("b")
    assert budget.released == []


def test_a_budget_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1, not 0"):
        OpenFiles(0, close_each)


def _logs(
    fs: MemoryFileSystem, files: OpenFiles, count: int, executor: ManualExecutor | None = None
) -> list[RangeLog]:
    opening = [
        RangeLog.open(
            f"/data/ranges/topic/{number}",
            fs=fs,
            clock=Clock(),
            executor=executor or ImmediateExecutor(),
            open_files=files,
        )
        for number in range(count)
    ]
    if executor is not None:
        executor.run_all()
    return [result_of(opened) for opened in opening]


def test_many_logs_keep_no_more_files_open_than_the_budget_and_lose_nothing() -> None:
    fs = MemoryFileSystem()
    files = OpenFiles(3, close_each)
    logs = _logs(fs, files, 20)
    for round_number in range(3):
        for number, log in enumerate(logs):
            result_of(log.append([record(round_number * 100 + number)]))
            assert len(fs.open_handles) <= 3
    # Reads in the reactor thread count too, and reopen what the budget closed.
    for number, log in enumerate(logs):
        values = [stored.record.value for stored in log.read(0)]
        assert values == [record(r * 100 + number).value for r in range(3)]
        assert len(fs.open_handles) <= 3
    assert files.closed_for_budget > 50
    for log in logs:
        result_of(log.close())
    assert fs.open_handles == set()


def test_a_writer_whose_write_is_under_way_is_not_closed() -> None:
    fs = MemoryFileSystem()
    executor = ManualExecutor()
    files = OpenFiles(1, close_each)
    first, second = _logs(fs, files, 2, executor)
    written = [second.append([record(3)]), first.append([record(1)])]
    executor.run_all()
    assert [result_of(each).base_offset for each in written] == [0, 0]
    # The first log's next write is queued with its writer when a read of the second log
    # opens a file past the budget: the first log's writer stays open, and the reader the
    # read just opened is not the one closed in its place either.
    held = first.append([record(2)])
    assert [s.record.value for s in second.read(0)] == [record(3).value]
    assert files.closed_for_budget == 1  # the second log's writer, when the first's opened
    assert len(files) == 2
    executor.run_all()
    assert result_of(held).base_offset == 1
    # Once idle, the first log's writer goes with the second's reader, past the budget.
    assert [s.record.value for s in first.read(0)] == [record(1).value, record(2).value]
    assert files.closed_for_budget == 3
    assert len(fs.open_handles) == 1


def test_on_disk_a_node_writes_to_more_ranges_than_its_budget_of_descriptors(
    tmp_path: Path,
) -> None:
    fs = OsFileSystem()
    data_dir = DataDirectory.open(str(tmp_path / "data"), fs)
    files = OpenFiles(4, close_each)
    logs = [
        result_of(
            RangeLog.open(
                data_dir.range_path(f"orders.{number}"),
                fs=fs,
                clock=Clock(),
                executor=ImmediateExecutor(),
                config=LogConfig(),
                open_files=files,
            )
        )
        for number in range(40)
    ]
    for number, log in enumerate(logs):
        result_of(log.append([record(number)]))
    # The data directory's lock is one more descriptor under it.
    assert descriptors_open_under(tmp_path) <= 4 + 1
    for number, log in enumerate(logs):
        result_of(log.append([record(100 + number)]))
        assert [s.record.value for s in log.read(0)] == [
            record(number).value,
            record(100 + number).value,
        ]
    assert descriptors_open_under(tmp_path) <= 4 + 1
    for log in logs:
        result_of(log.close())
    reopened = RangeLog.recover(
        data_dir.range_path("orders.7"), fs=fs, clock=Clock(), executor=ImmediateExecutor()
    )
    assert [s.record.value for s in reopened.read(0)] == [record(7).value, record(107).value]
    result_of(reopened.close())
