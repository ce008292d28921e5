"""One flush makes many range logs' writes durable: what it covers, what it does not yet, and
what a failed one fails (``logbroker.storage._flush``), on a crashable file system."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.logger import formatEvent

from logbroker.storage import (
    Appended,
    CopyState,
    LogConfig,
    LogFailedError,
    OsFileSystem,
    RangeLog,
    Record,
    SegmentStateError,
    SharedFlush,
    shared_sync_refusal,
)
from logbroker.storage import _fs as fs_module
from logbroker.storage._format import encode_batch, scan_batches
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from tests.unit.storage.helpers import result_of

DIRECTORIES = ("/data/ranges/t/0", "/data/ranges/t/1", "/data/ranges/t/2")
REPLICA = LogConfig(replicated=True, auto_roll=False)


class Node:
    """Three range logs on one ``MemoryFileSystem``, sharing one flush; jobs run when told."""

    def __init__(self, config: LogConfig | None = None) -> None:
        self.fs = MemoryFileSystem()
        self.executor = ManualExecutor()
        self.flush = SharedFlush(self.fs, self.executor, Clock())
        opening = [
            RangeLog.open(
                directory,
                fs=self.fs,
                clock=Clock(),
                executor=self.executor,
                config=config,
                shared_flush=self.flush,
            )
            for directory in DIRECTORIES
        ]
        self.executor.run_all()
        self.logs = [result_of(deferred) for deferred in opening]

    def job_names(self) -> list[str]:
        return [getattr(job, "__name__", repr(job)) for job, _, _ in self.executor.pending]

    def durable_records(self, fs: MemoryFileSystem, index: int) -> int:
        path = f"{DIRECTORIES[index]}/{0:020d}.log"
        if not fs.exists(path):
            return 0
        batches = scan_batches(fs.read_file(path), 0, 0).batches
        return batches[-1].next_offset if batches else 0


def fired(deferred: object) -> list[object]:
    results: list[object] = []
    deferred.addBoth(results.append)  # type: ignore[attr-defined]
    return results


def test_writes_asked_for_while_a_flush_runs_go_out_together_in_the_next_one() -> None:
    node = Node()
    acks = [fired(log.append([Record(b"v", key=b"k")])) for log in node.logs]
    assert node.job_names() == ["_write_job"] * 3

    node.executor.run_next()  # log 0 writes, without an fsync, and a flush starts for it
    node.executor.run_next()  # logs 1 and 2 write after it started: it does not cover them
    node.executor.run_next()

    assert [entry.operation for entry in node.fs.journal if entry.operation == "sync"] == []
    assert node.job_names() == ["_round"]
    assert acks == [[], [], []]
    assert [node.durable_records(node.fs.crash(), index) for index in range(3)] == [0, 0, 0]

    node.executor.run_next()

    assert [len(ack) for ack in acks] == [1, 0, 0]
    assert [node.durable_records(node.fs.crash(), index) for index in range(3)] == [1, 0, 0]
    assert node.job_names() == ["_round"]

    node.executor.run_next()  # one flush for both

    assert [len(ack) for ack in acks] == [1, 1, 1]
    assert node.flush.rounds == 2
    assert [node.durable_records(node.fs.crash(), index) for index in range(3)] == [1, 1, 1]


def test_the_fences_of_many_logs_share_flush_rounds() -> None:
    # At a failover every surviving copy of every range the dead node led is fenced at once:
    # each fence is an atomic replace of an epoch marker, whose two syncs (the marker, then its
    # name) ride the flush rounds instead of costing two fsyncs per range.
    node = Node(REPLICA)
    for log in node.logs:
        run_all(node, log.start_segment(0, 1))
    rounds = node.flush.rounds
    fences = [fired(log.fence(0, 7)) for log in node.logs]

    node.executor.run_all()

    assert [[fenced.epoch for fenced in fence] for fence in fences] == [[7], [7], [7]]  # type: ignore[attr-defined]
    # The first marker's round starts at once, alone; the other two markers wait for it and
    # share the next; the same for the three names: four rounds for six syncs, and the more
    # logs fence at once, the more share each round.
    assert node.flush.rounds - rounds == 4
    assert [entry.operation for entry in node.fs.journal[-3:]] == ["write-atomic"] * 3
    image = node.fs.crash()
    assert [epoch_after_recovery(image, d) for d in DIRECTORIES] == [7] * 3


def test_a_fence_is_not_done_before_its_marker_and_its_name_are_durable() -> None:
    node = Node(REPLICA)
    log = node.logs[0]
    run_all(node, log.start_segment(0, 1))
    fence = fired(log.fence(0, 7))
    steps: list[str] = []
    while node.executor.pending:
        steps.append(node.job_names()[0])
        image = node.fs.crash()
        node.executor.run_next()
        if not fence:
            # Not done yet: a crash now may leave either epoch, and nothing else.
            assert epoch_after_recovery(image, DIRECTORIES[0]) in (1, 7)

    assert steps == ["_stage_each", "_round", "_publish", "_round"]
    assert [fenced.epoch for fenced in fence] == [7]  # type: ignore[attr-defined]
    assert epoch_after_recovery(node.fs.crash(), DIRECTORIES[0]) == 7


def test_a_seals_sidecars_take_three_rounds_and_a_crash_at_any_step_recovers_whole() -> None:
    # The index and the seal marker are written and synced together, then named in order: a
    # seal marker is never durable without its index beside it.
    node = Node(REPLICA)
    log = node.logs[0]
    run_all(node, log.start_segment(0, 1))
    run_all(node, log.append_raw(0, encode_batch(0, [Record(b"v", key=b"k")]), epoch=1))
    size = log.active_bytes
    rounds = node.flush.rounds
    sealing = fired(log.seal_copy(0, 1, size, epoch=1))
    states: set[tuple[str, int]] = set()
    while node.executor.pending:
        image = node.fs.crash()
        node.executor.run_next()
        recovered = RangeLog.recover(
            DIRECTORIES[0], fs=image, clock=Clock(), executor=ImmediateExecutor(), config=REPLICA
        )
        info = recovered.segment(0)
        assert info is not None
        assert info.damage is None
        assert (info.record_count, info.byte_size) == (1, size)
        states.add((info.state.name, info.record_count))

    assert [info.state.name for info in sealing] == ["SEALED"]  # type: ignore[attr-defined]
    assert node.flush.rounds - rounds == 3
    assert states == {("ACTIVE", 1), ("SEALED", 1)}


def epoch_after_recovery(fs: MemoryFileSystem, directory: str) -> int | None:
    """The epoch of segment 0 as recovery of ``directory`` on ``fs`` finds it."""
    recovered = RangeLog.recover(
        directory, fs=fs, clock=Clock(), executor=ImmediateExecutor(), config=REPLICA
    )
    return recovered.segment_epoch(0)


def run_all(node: Node, deferred: Any) -> Any:
    """The result of ``deferred`` once every job it waits for ran."""
    node.executor.run_all()
    return result_of(deferred)


def test_a_failed_flush_fails_only_the_writes_whose_sync_failed_and_takes_that_log_out(
    logged_errors: list[dict[str, Any]],
) -> None:
    node = Node()
    node.logs[2].append([Record(b"first")])
    acks = [fired(log.append([Record(b"v")])) for log in node.logs[:2]]
    # Log 2 writes, and its flush starts; then logs 0 and 1 write, and wait for the next.
    for _ in range(4):
        node.executor.run_next()
    assert node.job_names() == ["_round"]
    node.fs.failing_syncs = 1  # the flush syncs log 0's file first: that one fails

    node.executor.run_next()

    assert isinstance(acks[0][0].value, LogFailedError)  # type: ignore[attr-defined]
    assert acks[1] == [Appended(0, 1)]
    assert [formatEvent(event).split(";")[0] for event in logged_errors] == [
        f"A write, fsync or seal failed in {DIRECTORIES[0]}"
    ]
    logged_errors.clear()
    with pytest.raises(LogFailedError):
        result_of(node.logs[0].append([Record(b"again")]))
    node.logs[1].append([Record(b"again")])
    node.executor.run_all()
    assert node.logs[1].end_offset == 2


def test_on_the_real_file_system_one_syncfs_covers_the_files_and_a_failed_one_stops_sharing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logged_errors: list[dict[str, Any]]
) -> None:
    fs = OsFileSystem(shared_sync=True)
    # The real syncfs where this machine has one (as the broker would use it), counted; where
    # it has none, the count alone: what is checked is how the files are synced.
    real_syncfs = fs._syncfs
    syncfs_calls: list[int] = []

    def counting_syncfs(fd: int) -> None:
        syncfs_calls.append(fd)
        if real_syncfs is not None:
            real_syncfs(fd)

    monkeypatch.setattr(fs, "_syncfs", counting_syncfs)
    files = [fs.create_append(str(tmp_path / f"{index}.log")) for index in range(3)]
    for file in files:
        file.write(b"x" * 100)
    synced: list[int] = []
    real_fdatasync = os.fdatasync

    def counting_fdatasync(fd: int) -> None:
        synced.append(fd)
        real_fdatasync(fd)

    monkeypatch.setattr(fs_module.os, "fdatasync", counting_fdatasync)

    assert fs.sync_files(files) == [None, None, None]
    assert (len(syncfs_calls), synced) == (1, [])  # one syncfs, no fdatasync

    def failing_syncfs(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fs, "_syncfs", failing_syncfs)
    assert fs.sync_files(files) == [None, None, None]
    assert len(synced) == 3  # each file on its own, after the syncfs failed
    assert [formatEvent(event) for event in logged_errors] == [
        f"syncfs failed on the file system of {tmp_path}/0.log ([Errno 5] Input/output error):"
        " each file is fsynced on its own from now on"
    ]
    logged_errors.clear()
    assert fs.sync_files(files[:1]) == [None]
    assert len(synced) == 4  # and from then on
    for file in files:
        file.close()


def test_without_a_shared_sync_each_file_is_fsynced(tmp_path: Path) -> None:
    fs = OsFileSystem()
    file = fs.create_append(str(tmp_path / "0.log"))
    file.close()
    # A closed descriptor: its fdatasync fails, and says so for that file alone.
    outcomes = fs.sync_files([file])
    assert isinstance(outcomes[0], OSError)
    assert outcomes[0].errno == errno.EBADF


@pytest.mark.parametrize(
    ("release", "refused"),
    [
        ("5.4.0-182-generic", "older than 5.8"),
        ("4.19.0", "older than 5.8"),
        ("not-a-version", "does not say its version"),
    ],
)
def test_a_kernel_whose_syncfs_hides_write_errors_is_refused(release: str, refused: str) -> None:
    refusal = shared_sync_refusal(release)
    assert refusal is not None
    assert refused in refusal


def test_a_kernel_whose_syncfs_reports_write_errors_is_taken() -> None:
    assert shared_sync_refusal("6.1.0-18-amd64") is None
    assert shared_sync_refusal("5.8.0") is None


class _Handle:
    def __init__(self, name: str, events: list[str]) -> None:
        self.name = name
        self.events = events
        self.device = 0

    def fileno(self) -> int:
        return 0

    def sync(self) -> None:
        raise AssertionError("synced by sync_files only")

    def close(self) -> None:
        self.events.append(f"close {self.name}")


class _SyncRecorder:
    """Just ``sync_files``, recorded, failing with ``failure`` when set."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.failure: OSError | None = None

    def sync_files(self, files: list[_Handle]) -> list[OSError | None]:
        self.events.append("sync " + " ".join(file.name for file in files))
        if self.failure is not None:
            raise self.failure
        return [None] * len(files)


@pytest.mark.parametrize("failure", [None, OSError(errno.EIO, "Input/output error")])
def test_a_flush_asked_to_close_closes_its_file_after_the_sync_in_the_rounds_job(
    failure: OSError | None,
) -> None:
    events: list[str] = []
    fs = _SyncRecorder(events)
    fs.failure = failure
    executor = ManualExecutor()
    flush = SharedFlush(fs, executor, Clock())  # type: ignore[arg-type]
    closed_by_round = fired(flush.flush(_Handle("marker", events), close=True))  # type: ignore[arg-type]
    kept_open = fired(flush.flush(_Handle("log", events)))  # type: ignore[arg-type]
    assert events == []

    executor.run_next()

    # In the same job as the sync, after it, whatever its outcome.
    assert events == ["sync marker", "close marker"]
    executor.run_next()
    assert events == ["sync marker", "close marker", "sync log"]  # the log's file stays open
    assert executor.pending == []
    if failure is None:
        assert closed_by_round == kept_open == [0.0]
    else:
        assert [result.value for result in closed_by_round + kept_open] == [failure] * 2  # type: ignore[attr-defined]


def _flush_of_one_file(
    path: str,
) -> tuple[MemoryFileSystem, ManualExecutor, SharedFlush, Any]:
    """A shared flush whose rounds run when told, and a file at ``path`` to write to."""
    fs = MemoryFileSystem()
    fs.make_dirs(path.rsplit("/", 1)[0])
    executor = ManualExecutor()
    return fs, executor, SharedFlush(fs, executor, Clock()), fs.create_append(path)


def test_a_notice_of_a_taken_write_that_raises_is_logged_and_the_round_runs(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs, executor, flush, file = _flush_of_one_file("/d/log")

    def broken() -> None:
        raise RuntimeError("broken notice")

    written = fired(flush.write(file, b"abc", taken=broken))
    executor.run_all()

    assert len(written) == 1
    assert isinstance(written[0], float), "the write is durable"
    assert fs.read_file("/d/log") == b"abc"
    assert [event["log_failure"].value.args[0] for event in logged_errors] == ["broken notice"]
    logged_errors.clear()


def test_a_join_waits_for_the_next_round_and_what_it_writes_goes_in_that_round() -> None:
    fs, executor, flush, second = _flush_of_one_file("/d/second")
    written: list[list[object]] = []

    def join() -> None:
        # Built when the round starts: the bytes that came until then.
        written.append(fired(flush.write(second, b"late")))

    flush.join_next_round(join)  # no round runs: at once, and its write starts one
    assert len(written) == 1
    assert flush.running
    assert flush.rounds == 1
    flush.join_next_round(join)  # a round runs: waits for the next
    assert len(written) == 1
    executor.run_next()

    assert flush.rounds == 2, "the join started the next round and wrote in it"
    assert len(written) == 2
    assert isinstance(written[0][0], float)
    assert written[1] == []
    executor.run_next()
    assert isinstance(written[1][0], float)
    assert fs.read_file("/d/second") == b"latelate"
    assert not flush.running
    flush.join_next_round(lambda: None)  # asks for nothing: no round runs
    assert not flush.running
    assert flush.rounds == 2


def test_the_next_round_starts_before_the_acknowledgements_of_the_last_one_run() -> None:
    fs, executor, flush, first_file = _flush_of_one_file("/d/first")
    second_file = fs.create_append("/d/second")
    seen_when_acknowledged: list[tuple[bool, int, bytes]] = []

    def acknowledged(_: object) -> None:
        # The next round is under way already, with the bytes asked for meanwhile.
        _, (_, writes, _, _), _ = executor.pending[0]
        parts = b"".join(b"".join(data) for _, data in writes)
        seen_when_acknowledged.append((flush.running, flush.rounds, parts))

    flush.write(first_file, b"a").addCallback(acknowledged)
    later = fired(flush.write(second_file, b"b"))  # asked for while the first round runs
    executor.run_next()

    assert seen_when_acknowledged == [(True, 2, b"b")]
    assert later == []
    executor.run_next()
    assert isinstance(later[0], float)
    assert fs.read_file("/d/second") == b"b"
    assert not flush.running


def test_a_join_that_raises_is_logged_and_the_round_runs(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs, executor, flush, file = _flush_of_one_file("/d/log")
    first = fired(flush.write(file, b"a"))
    second = fired(flush.write(file, b"b"))  # asked for while the first round runs

    def broken() -> None:
        raise RuntimeError("broken join")

    flush.join_next_round(broken)
    executor.run_all()

    assert isinstance(first[0], float)
    assert isinstance(second[0], float)
    assert fs.read_file("/d/log") == b"ab"
    assert [event["log_failure"].value.args[0] for event in logged_errors] == ["broken join"]
    logged_errors.clear()


# -- writes ahead: the round writes a log's appends to its active segment ------------------


def _started(node: Node) -> None:
    """Each log's first append: it creates the segment file on a writer thread."""
    for log in node.logs:
        log.append([Record(b"first")])
    node.executor.run_all()


def test_a_later_append_is_written_by_the_round_itself_and_acknowledged_once_it_ends() -> None:
    node = Node()
    _started(node)

    ack = fired(node.logs[0].append([Record(b"second")]))

    # No writer thread: the round writes the bytes, then syncs them.
    assert node.job_names() == ["_round"]
    assert node.durable_records(node.fs.crash(), 0) == 1
    assert ack == []
    node.executor.run_next()
    assert ack == [Appended(1, 1)]
    assert node.durable_records(node.fs.crash(), 0) == 2


def test_appends_arriving_while_a_round_runs_go_together_into_the_next_one() -> None:
    node = Node()
    _started(node)
    log = node.logs[0]
    rounds = node.flush.rounds

    first = fired(log.append([Record(b"a")]))
    # The round for "a" started at once. "b", "c" and "d" come while it runs: the log takes
    # them when the next round starts, so that they go in it together, as one write.
    second = fired(log.append([Record(b"b")]))
    third = fired(log.append([Record(b"c")]))
    fourth = fired(log.append([Record(b"d")]))
    assert node.job_names() == ["_round"]

    node.executor.run_next()
    assert first == [Appended(1, 1)]
    assert second == third == fourth == []
    assert node.durable_records(node.fs.crash(), 0) == 2

    node.executor.run_next()
    assert second == [Appended(2, 1)]
    assert third == [Appended(3, 1)]
    assert fourth == [Appended(4, 1)]
    assert node.durable_records(node.fs.crash(), 0) == 5
    assert [stored.record.value for stored in log.read(0)] == [b"first", b"a", b"b", b"c", b"d"]
    assert node.flush.rounds == rounds + 2
    assert node.executor.pending == []


def test_a_roll_waits_until_the_writes_ahead_of_it_are_durable() -> None:
    node = Node()
    _started(node)
    log = node.logs[0]
    ack = fired(log.append([Record(b"a")]))

    rolled = fired(log.roll())

    # The seal would read the segment's length: it does not start while "a" is in flight.
    assert node.job_names() == ["_round"]
    node.executor.run_next()
    assert ack == [Appended(1, 1)]
    node.executor.run_all()
    assert len(rolled) == 1
    assert rolled[0].record_count == 2  # type: ignore[attr-defined]


def test_a_failed_round_fails_its_append_and_the_appends_written_ahead_after_it(
    logged_errors: list[dict[str, Any]],
) -> None:
    node = Node()
    _started(node)
    log = node.logs[0]
    first = fired(log.append([Record(b"a")]))
    second = fired(log.append([Record(b"b")]))  # in the next round, whose sync will succeed
    node.fs.failing_syncs = 1

    node.executor.run_next()
    node.executor.run_all()

    assert isinstance(first[0].value, LogFailedError)  # type: ignore[attr-defined]
    assert isinstance(second[0].value, LogFailedError)  # type: ignore[attr-defined]
    assert log.failed
    assert log.end_offset == 1, "nothing after the failure was acknowledged"
    assert len(logged_errors) == 1
    logged_errors.clear()


def test_a_roll_held_behind_a_write_that_fails_fails_with_it(
    logged_errors: list[dict[str, Any]],
) -> None:
    node = Node()
    _started(node)
    log = node.logs[0]
    ack = fired(log.append([Record(b"a")]))
    rolled = fired(log.roll())
    node.fs.failing_syncs = 1

    node.executor.run_all()

    assert isinstance(ack[0].value, LogFailedError)  # type: ignore[attr-defined]
    assert isinstance(rolled[0].value, LogFailedError)  # type: ignore[attr-defined]
    assert [entry.operation for entry in node.fs.journal].count("sync-failed") == 1
    assert len(log.segments()) == 1, "the held roll never ran"
    assert log.segments()[0].state is not CopyState.SEALED
    logged_errors.clear()


def test_a_long_queue_of_operations_that_end_at_once_runs_through_and_the_log_goes_on() -> None:
    node = Node()
    _started(node)
    log = node.logs[0]
    ahead = fired(log.append([Record(b"a")]))
    # Each is refused when it starts (the last segment is never deleted): it ends at once,
    # and the next one starts from its end. Held behind the write ahead, they all start
    # together once it is durable.
    refused = [fired(log.delete_segment(0)) for _ in range(3000)]

    node.executor.run_next()

    assert ahead == [Appended(1, 1)]
    assert all(
        len(outcome) == 1 and isinstance(outcome[0].value, SegmentStateError)  # type: ignore[attr-defined]
        for outcome in refused
    )
    after = fired(log.append([Record(b"b")]))
    node.executor.run_all()
    assert after == [Appended(2, 1)]
