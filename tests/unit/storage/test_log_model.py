"""A model-based test of RangeLog: random appends, rolls, crashes, rot and reopens.

A hypothesis state machine drives one range log on a ``MemoryFileSystem`` with small segments
and a ``ManualExecutor``, so appends can be left in flight when the power goes. A model keeps
every record appended at each offset and which of them were acknowledged, and checks after
every step that:

* every acknowledged record reads back byte-exact, across crashes and reopens, unless injected
  rot hit its batch (or one before it in the same file): then reads may stop early;
* no read returns a record other than the one appended at its offset, and reads return
  contiguous offsets from the one asked for;
* recovery never cuts fsynced bytes, never shrinks a file holding rot or a sealed file, and
  never loses the end of the log below an acknowledged record that rot did not touch;
* integrity errors are logged, and verification fails, only for segments that rot was
  injected into.

Rot is one flipped byte at a time, at most one per batch: two flips in one batch header can make
rot that bytes alone cannot tell from a torn write.
"""

from __future__ import annotations

import posixpath
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from twisted.internet.task import Clock
from twisted.logger import formatEvent
from twisted.python.failure import Failure

from logbroker.storage import (
    Appended,
    IntegrityEvent,
    LogClosedError,
    LogConfig,
    LogFailedError,
    RangeLog,
    Record,
    StorageError,
    StoredRecord,
    Verification,
)
from logbroker.storage._format import BatchInfo, iter_batch_records, scan_batches
from logbroker.testing import ManualExecutor, MemoryFileSystem
from tests.unit.storage.helpers import failure_of, result_of

RANGE_DIR = "/data/ranges/topic/0"
SEGMENT_SUFFIXES = (".log", ".index", ".sealed")

_small_bytes = st.binary(max_size=24)
_headers = st.lists(st.tuples(st.none() | _small_bytes, st.none() | _small_bytes), max_size=2)
_records = st.builds(
    Record,
    value=st.binary(max_size=80),
    key=st.none() | _small_bytes,
    timestamp_ms=st.integers(0, 2**64 - 1),
    headers=_headers.map(tuple),
)
_batches = st.lists(_records, min_size=1, max_size=5)


def _stem(path: str) -> str:
    return path.rsplit(".", 1)[0]


def _base_of(path: str) -> int:
    return int(posixpath.basename(path)[:20])


class LogModel(RuleBasedStateMachine):
    def __init__(self, logged_errors: list[dict[str, Any]]) -> None:
        super().__init__()
        # A failed example may leave its errors behind; each example judges only its own.
        logged_errors.clear()
        self.logged_errors = logged_errors
        self.fs = MemoryFileSystem()
        #: The record last appended at each offset (acknowledged or not).
        self.expected: dict[int, Record] = {}
        #: Offsets whose record in ``expected`` was acknowledged.
        self.acked: set[int] = set()
        #: Bytes flipped in each file: position -> xor (flips that cancel out are dropped).
        self.flips: dict[str, dict[int, int]] = {}
        #: For a file with rot: its size when a reopen first could have found the rot. Batches
        #: written after that went into a file known to be damaged, which must never happen.
        self.known_end: dict[str, int] = {}
        #: Base offsets of appends given to the current log that have not resolved yet.
        self.unresolved: set[int] = set()
        #: Set while a step injects an fsync failure: appends may then fail.
        self.failure_expected = False
        self.problems: list[str] = []
        self.events: list[IntegrityEvent] = []
        self.config = LogConfig()
        self.clock = Clock()
        self.executor = ManualExecutor()
        self.log: RangeLog | None = None

    # -- helpers ---------------------------------------------------------------------------------

    def _open(self) -> RangeLog:
        self.clock = Clock()
        self.executor = ManualExecutor()
        self.unresolved = set()
        opened = RangeLog.open(
            RANGE_DIR,
            fs=self.fs,
            clock=self.clock,
            executor=self.executor,
            config=self.config,
            on_integrity_event=self.events.append,
        )
        self.executor.run_all()
        log: RangeLog = result_of(opened)
        self.log = log
        return log

    def _settle(self) -> None:
        """Run every writer job and timer until the log is idle."""
        while True:
            if self.executor.pending:
                self.executor.run_all()
                continue
            calls = self.clock.getDelayedCalls()
            if calls:
                self.clock.advance(max(call.getTime() for call in calls) - self.clock.seconds())
                continue
            return

    def _log_files(self) -> list[str]:
        return [
            path
            for path in self.fs.files()
            if posixpath.dirname(path) == RANGE_DIR and path.endswith(".log")
        ]

    def _segment_files(self) -> list[str]:
        return [
            path
            for path in self.fs.files()
            if posixpath.dirname(path) == RANGE_DIR and path.endswith(SEGMENT_SUFFIXES)
        ]

    def _rotted(self, path: str) -> bool:
        """Whether rot was injected into any file of the segment ``path`` belongs to."""
        stem = _stem(path)
        return any(_stem(flipped) == stem for flipped in self.flips)

    def _tainted(self) -> set[int]:
        """Offsets whose current record sits at or after injected rot in the file holding it.

        An offset held by several files (rot let the log reuse offsets that only the damaged
        copy held) is read from the one with the highest base offset.
        """
        holder: dict[int, tuple[int, bool]] = {}
        for path in self._log_files():
            base = _base_of(path)
            size = self.fs.size(path)
            first = min((p for p in self.flips.get(path, {}) if p < size), default=size)
            known = self.known_end.get(path, size)
            for batch in self._batches_as_written(path):
                rotted = batch.end > first and batch.position < known
                for offset in range(batch.base_offset, batch.next_offset):
                    if offset not in holder or holder[offset][0] <= base:
                        holder[offset] = (base, rotted)
        return {offset for offset, (_, rotted) in holder.items() if rotted}

    def _batches_as_written(self, path: str) -> list[BatchInfo]:
        """The batches of a segment file, found with the injected flips undone."""
        data = bytearray(self.fs.read_file(path))
        for position, xor in self.flips.get(path, {}).items():
            if position < len(data):
                data[position] ^= xor
        return scan_batches(bytes(data)).batches

    def _drain_errors(self) -> None:
        for event in self.logged_errors:
            text = formatEvent(event)
            segment = event.get("segment")
            if not (
                text.startswith("Integrity failure")
                and isinstance(segment, str)
                and self._rotted(segment)
            ):
                self.problems.append(f"unexpected error logged: {text}")
        self.logged_errors.clear()
        for found in self.events:
            if found.counted and not self._rotted(found.segment):
                self.problems.append(f"integrity event without injected rot: {found}")
        self.events.clear()

    def _append(self, records: list[Record]) -> None:
        log = self.log
        assert log is not None
        base = log.next_offset
        appended = log.append(records)
        assert log.next_offset == base + len(records), "an append was refused"
        for index, stored in enumerate(records):
            self.expected[base + index] = stored
            self.acked.discard(base + index)
        self.unresolved.add(base)

        def done(result: object) -> None:
            if log is not self.log:
                self.problems.append(f"append at {base} resolved after its log was abandoned")
                return
            self.unresolved.discard(base)
            if isinstance(result, Failure):
                if self.failure_expected and result.check(LogFailedError):
                    return
                if type(result.value) is StorageError and self.flips:
                    # A read found rot in the segment this append was being written to: the
                    # records landed after the rot, so the append fails (never acknowledged).
                    return
                self.problems.append(f"append at {base} failed: {result.getTraceback()}")
                return
            if result != Appended(base, len(records)):
                self.problems.append(f"append at {base} acknowledged as {result!r}")
            for index, stored in enumerate(records):
                if self.expected.get(base + index) != stored:
                    self.problems.append(f"offset {base + index} was reused while in flight")
                self.acked.add(base + index)

        appended.addBoth(done)

    def _check_stored(self, start: int, stored: list[StoredRecord]) -> None:
        log = self.log
        assert log is not None
        offsets = [item.offset for item in stored]
        assert offsets == list(range(start, start + len(stored))), (start, offsets)
        for item in stored:
            assert item.offset < log.end_offset, (item.offset, log.end_offset)
            assert item.offset in self.expected, f"offset {item.offset} was never appended"
            assert item.record == self.expected[item.offset], f"wrong record at {item.offset}"

    def _check_recovery(
        self,
        durable: dict[str, bytes],
        sizes_before: dict[str, int],
        sealed_sizes: dict[str, int],
    ) -> None:
        """Reopen ``self.fs`` and check what recovery did to the files."""
        for path in self.flips:
            if self.fs.exists(path):
                self.known_end.setdefault(path, self.fs.size(path))
        log = self._open()
        for path, prefix in durable.items():
            assert self.fs.exists(path), f"{path} with fsynced bytes is gone"
            assert self.fs.read_file(path)[: len(prefix)] == prefix, f"{path} lost fsynced bytes"
        for path, size in sizes_before.items():
            rot = [p for p in self.flips.get(path, {}) if p < size]
            if rot:
                assert self.fs.size(path) == size, f"{path} with rot at {rot} was cut"
        for path, size in sealed_sizes.items():
            assert self.fs.size(path) == size, f"sealed {path} changed size"
        # Rot the crash dropped is gone; the bytes written there from now on are new.
        for path in list(self.flips):
            size = self.fs.size(path) if self.fs.exists(path) else 0
            kept = {p: x for p, x in self.flips[path].items() if p < size}
            if kept:
                self.flips[path] = kept
            else:
                del self.flips[path]
                self.known_end.pop(path, None)
        assert log.next_offset == log.end_offset
        for offset in [o for o in self.expected if o >= log.next_offset and o not in self.acked]:
            del self.expected[offset]
        tainted = self._tainted()
        lost = sorted(o for o in self.acked if o >= log.end_offset and o not in tainted)
        assert not lost, f"end offset {log.end_offset} fell below acknowledged offsets {lost}"

    # -- rules -----------------------------------------------------------------------------------

    @initialize(
        roll_bytes=st.integers(400, 2000),
        group_commit=st.booleans(),
        flush_max_records=st.integers(1, 8),
    )
    def start(self, roll_bytes: int, group_commit: bool, flush_max_records: int) -> None:
        self.config = LogConfig(
            roll_bytes=roll_bytes,
            group_commit=group_commit,
            group_commit_interval_ms=5,
            flush_max_records=flush_max_records,
        )
        self._open()

    @rule(records=_batches)
    def append(self, records: list[Record]) -> None:
        self._append(records)
        self._settle()

    @rule(records=_batches)
    def append_in_flight(self, records: list[Record]) -> None:
        self._append(records)

    @precondition(lambda self: bool(self.executor.pending))
    @rule()
    def run_one_job(self) -> None:
        self.executor.run_next()

    @rule(milliseconds=st.integers(1, 6))
    def advance_clock(self, milliseconds: int) -> None:
        self.clock.advance(milliseconds / 1000)

    @rule()
    def settle(self) -> None:
        self._settle()
        assert not self.unresolved, f"appends at {sorted(self.unresolved)} never resolved"

    @rule(wait=st.booleans())
    def roll(self, wait: bool) -> None:
        assert self.log is not None
        rolled = self.log.roll()

        def done(result: object) -> None:
            if isinstance(result, Failure) and not (
                self.failure_expected and result.check(LogFailedError)
            ):
                self.problems.append(f"roll failed: {result.getTraceback()}")

        rolled.addBoth(done)
        if wait:
            self._settle()

    @rule(data=st.data(), mid_write=st.booleans())
    def crash(self, data: st.DataObject, mid_write: bool) -> None:
        log = self.log
        assert log is not None
        if mid_write and self.executor.pending:
            # The power goes while a job runs: it wrote, but its fsync never returned.
            self.failure_expected = True
            self.fs.failing_syncs = 1
            while self.executor.pending and self.fs.failing_syncs:
                self.executor.run_next()
            self.fs.failing_syncs = 0
            self.failure_expected = False
            if log.failed:
                failures = [e for e in self.logged_errors if "seal failed" in formatEvent(e)]
                assert len(failures) == 1, self.logged_errors
                self.logged_errors.remove(failures[0])
        durable: dict[str, bytes] = {}
        for path in self._log_files():
            durable[path] = self.fs.read_file(path)[: self.fs.durable_size(path)]
        sealed_sizes = {
            path: self.fs.size(path)
            for path in self._log_files()
            if self.fs.exists(_stem(path) + ".sealed")
        }

        def keep(path: str, unsynced: int) -> int:
            if unsynced == 0:
                return 0
            kept: int = data.draw(st.integers(0, unsynced), label=f"keep of {path}")
            return kept

        self.fs = self.fs.crash(keep)
        sizes_before = {path: self.fs.size(path) for path in self._log_files()}
        self._check_recovery(durable, sizes_before, sealed_sizes)

    @rule()
    def reopen(self) -> None:
        log = self.log
        assert log is not None
        closed = log.close()
        self._settle()
        assert result_of(closed) is None
        assert not self.unresolved, f"close left appends at {sorted(self.unresolved)} unresolved"
        refused = log.append([Record(b"late")])
        assert failure_of(refused).check(LogClosedError)
        sizes = {path: self.fs.size(path) for path in self._log_files()}
        sealed_sizes = {
            path: size for path, size in sizes.items() if self.fs.exists(_stem(path) + ".sealed")
        }
        durable = {path: self.fs.read_file(path) for path in sizes}
        self._check_recovery(durable, sizes, sealed_sizes)
        # Everything was fsynced before the close: recovery has nothing to cut.
        assert {path: self.fs.size(path) for path in self._log_files()} == sizes

    @precondition(lambda self: any(self.fs.size(p) > 0 for p in self._segment_files()))
    @rule(data=st.data())
    def corrupt(self, data: st.DataObject) -> None:
        files = [path for path in self._segment_files() if self.fs.size(path) > 0]
        path = data.draw(st.sampled_from(files), label="file")
        position = data.draw(st.integers(0, self.fs.size(path) - 1), label="position")
        xor = data.draw(st.integers(1, 255), label="xor")
        # One flip per batch (and per sidecar): two flips in one batch header can make rot
        # that no reader could tell from a torn write (say, its length and its record count).
        spans = [(0, self.fs.size(path))]
        if path.endswith(".log"):
            spans = [(b.position, b.end) for b in self._batches_as_written(path)]
        for start, end in spans:
            if start <= position < end and any(start <= p < end for p in self.flips.get(path, {})):
                return
        self.fs.corrupt(path, position, xor)
        flips = self.flips.setdefault(path, {})
        flips[position] = flips.get(position, 0) ^ xor
        if not flips[position]:
            del flips[position]
        if not flips:
            del self.flips[path]
            self.known_end.pop(path, None)

    @precondition(lambda self: self.log is not None and bool(self.log.segments()))
    @rule(data=st.data())
    def verify(self, data: st.DataObject) -> None:
        log = self.log
        assert log is not None
        base = data.draw(st.sampled_from([s.base_offset for s in log.segments()]), label="base")
        results: list[Any] = []
        log.verify_segment(base).addBoth(results.append)
        self._settle()
        assert len(results) == 1
        verification = results[0]
        assert isinstance(verification, Verification), verification
        if not self._rotted(f"{RANGE_DIR}/{base:020d}.log"):
            assert verification.verified, f"segment {base} without rot fails: {verification}"
        self._drain_errors()

    @rule(data=st.data())
    def read_somewhere(self, data: st.DataObject) -> None:
        log = self.log
        assert log is not None
        low = log.start_offset
        offset = data.draw(st.integers(low, max(low, log.end_offset) + 1), label="offset")
        max_records = data.draw(st.integers(1, 12), label="max_records")
        self._check_stored(offset, log.read(offset, max_records=max_records))
        raw = log.read_raw(offset, max_bytes=data.draw(st.integers(1, 3000), label="max_bytes"))
        if raw:
            scan = scan_batches(raw)
            assert scan.damage is None, scan.damage
            first = scan.batches[0]
            assert first.base_offset <= offset < first.next_offset, (offset, first)
            stored = [item for b in scan.batches for item in iter_batch_records(memoryview(raw), b)]
            self._check_stored(scan.batches[0].base_offset, stored)
        self._drain_errors()

    def teardown(self) -> None:
        # Every step's errors were judged by the invariants; a failed step leaves its errors
        # here, and the failure itself says more than they do.
        self.logged_errors.clear()

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def reads_return_what_was_acknowledged(self) -> None:
        log = self.log
        if log is None:
            return
        assert not log.failed
        assert log.start_offset <= log.end_offset <= log.next_offset
        seen: set[int] = set()
        starts = {segment.base_offset for segment in log.segments()} | {log.start_offset}
        for start in sorted(starts):
            if start >= log.end_offset:
                continue
            stored = log.read(start, max_records=1_000_000, max_bytes=1 << 30)
            self._check_stored(start, stored)
            seen.update(item.offset for item in stored)
        missing = sorted(self.acked - seen - self._tainted())
        assert not missing, f"acknowledged offsets {missing} do not read back"
        self._drain_errors()

    @invariant()
    def nothing_unexpected_happened(self) -> None:
        self._drain_errors()
        assert not self.problems, "\n".join(self.problems)


def test_range_log_matches_its_model(logged_errors: list[dict[str, Any]]) -> None:
    run_state_machine_as_test(
        lambda: LogModel(logged_errors),
        settings=settings(max_examples=100, stateful_step_count=40, report_multiple_bugs=False),
    )
    assert not logged_errors


def test_rot_in_a_batch_whose_length_also_rotted_is_never_truncated(
    logged_errors: list[dict[str, Any]],
) -> None:
    # Found by the machine before it kept to one flip per batch. The batch's length now runs
    # past the end of the file, as a torn write's would, but one of its records is whole and
    # fails its checksum, which a torn write never leaves: this is rot, and nothing after it
    # (here: two more acknowledged batches) may be cut.
    fs = MemoryFileSystem()
    executor = ManualExecutor()

    def open_log(events: list[IntegrityEvent]) -> RangeLog:
        opened = RangeLog.open(
            RANGE_DIR, fs=fs, clock=Clock(), executor=executor, on_integrity_event=events.append
        )
        executor.run_all()
        log: RangeLog = result_of(opened)
        return log

    log = open_log([])
    for number in range(3):
        appended = log.append([Record(b"value-%d" % number)])
        executor.run_all()
        assert result_of(appended) == Appended(number, 1)
    closed = log.close()
    executor.run_all()
    result_of(closed)
    path = f"{RANGE_DIR}/{0:020d}.log"
    data = fs.read_file(path)
    first = scan_batches(data).batches[0]
    length_at = data.find(first.length.to_bytes(4, "big"), first.position, first.position + 24)
    assert length_at >= 0
    fs.corrupt(path, length_at + 1, 0x01)
    fs.corrupt(path, first.end - 1, 0x01)
    events: list[IntegrityEvent] = []

    log = open_log(events)

    assert fs.size(path) == len(data), "rot was truncated as if it were a torn write"
    assert [event.counted for event in events] == [True]
    assert log.end_offset == 3, "offsets that frames after the rot hold are never reused"
    assert len(logged_errors) == 1
    logged_errors.clear()
