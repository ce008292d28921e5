"""One sync for the writes of many range logs.

Each range log's group commit (``_planner``) makes one fsync cover the appends queued on that
range. With thousands of ranges written at once (keyed produce spreads a topic's records over
all of its ranges; a busy cluster, or a failover, writes to every range) the fsync per range is
what bounds a node: an ``fdatasync`` costs milliseconds whatever it covers, and a few writer
threads run only a few at once (``bench/many_files_sync.py``: an append to each of 1,000 files
made durable takes 180-210 ms by an fdatasync each, 10-18 ms by one ``syncfs``).

``SharedFlush`` is group commit across ranges. A log's write job only writes, then asks for a
flush of its file; every flush asked for while one runs goes out together in the next, as one
``FileSystem.sync_files`` call on the executor it is given (the broker gives it a thread of its
own, so that a round never waits behind a long storage job); one ``syncfs`` per file system on
the real one, see ``OsFileSystem``. One round runs at a time.

A range log's plain appends to its active segment go further: ``write`` hands the round the bytes
themselves, which the round's thread writes (one write per file, the bytes of every ask for it
joined in order) just before its sync. An append then costs no writer thread and no hop back to
the reactor between its write and its sync; what arrives while a round runs goes in the next. A
log whose write would wait for the next round builds it when that round starts
(``join_next_round``), from every append that came until then.

Why a write is durable when its flush fires: its bytes were in the page cache before it asked
(or the round wrote them before its sync), and the round that covers it started after it asked.
A flush that fails fails the write it covered, and that log takes itself out of service, as after
a failed fsync of its own.

Where the native sync thread is built, a round runs there instead of on the executor
(``native``, ``logbroker.storage._native_rounds``): the same writes and sync, without the GIL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.storage._executor import Executor
from logbroker.storage._fs import AppendFile, FileSystem, Syncable, close_each

log = Logger()


#: A round's outcome: each flushed file's error or ``None``, in the order asked, and the
#: seconds its writes and sync took.
RoundOutcome = tuple[list[OSError | None], float]


class RoundRunner(Protocol):
    """Runs a round elsewhere than on the executor (``NativeRounds``)."""

    def round(
        self, writes: Sequence[tuple[AppendFile, list[bytes]]], files: list[Syncable]
    ) -> Deferred[RoundOutcome] | None:
        """Each write, then a sync of ``files``; ``None`` if it cannot take this round."""


#: A file to flush, the flush's Deferred, when it was asked for, whether to close the file once
#: flushed, and the bytes the round writes to it first (``write``; None for ``flush``).
_Asked = tuple[Syncable, Deferred[float], float, bool, bytes | None]


class SharedFlush:
    """Flushes for the range logs of one node, in rounds (see the module docstring)."""

    def __init__(
        self,
        fs: FileSystem,
        executor: Executor,
        clock: IReactorTime,
        native: RoundRunner | None = None,
    ) -> None:
        self._fs = fs
        self._executor = executor
        self._clock = clock
        self._native = native
        self._asked: list[_Asked] = []
        #: Called when the next round starts (``write``).
        self._taken: list[Callable[[], object]] = []
        #: Called when the next round starts, before it takes its asks (``join_next_round``).
        self._joining: list[Callable[[], object]] = []
        self._running = False
        #: Rounds started so far: each one ``sync_files`` call.
        self.rounds = 0

    def flush(self, file: Syncable, *, close: bool = False) -> Deferred[float]:
        """Fire, with the seconds it waited, once everything written to ``file`` before this
        call is durable; fail with the ``OSError`` that left it in doubt. With ``close``, the
        round closes ``file`` too, after its sync, on the round's thread, whatever the
        outcome: a failover flushes and closes thousands of small files (epoch markers,
        directories) at once, and each close on the reactor thread waited for the GIL back."""
        done = self._ask(file, close)
        if not self._running:
            self._start_round()
        return done

    def write(
        self, file: AppendFile, data: bytes, taken: Callable[[], object] | None = None
    ) -> Deferred[float]:
        """Append ``data`` to ``file`` in the next round, before its sync; fire, with the
        seconds the round's writes and sync took, once it is durable (with everything written
        to ``file`` before); fail with the ``OSError`` of its write or sync. The asks of one
        file are written in the order they came. ``taken`` is called when the round that
        writes it starts (before it runs): a write asked for from then on goes in a later
        round, so a range that waits for it gathers what comes meanwhile into one write."""
        done = self._ask(file, False, data)
        if taken is not None:
            self._taken.append(taken)
        if not self._running:
            self._start_round()
        return done

    @property
    def running(self) -> bool:
        """Whether a round runs now: what is asked for goes in the next one."""
        return self._running

    def join_next_round(self, join: Callable[[], object]) -> None:
        """Call ``join`` when the next round starts, before it takes what was asked for: a
        range with appends to write while a round runs writes them from there, so that its
        write carries every append that came until the round starts, not only the first
        one (``join`` asks with ``write``, into that round). At once when no round runs."""
        if not self._running:
            join()
            return
        self._joining.append(join)

    def flush_each(
        self, files: Sequence[Syncable], *, close: bool = False
    ) -> list[Deferred[float]]:
        """``flush`` of each of ``files``, asked for together: one round covers them all."""
        asked = [self._ask(file, close) for file in files]
        if not self._running:
            self._start_round()
        return asked

    def _ask(self, file: Syncable, close: bool, data: bytes | None = None) -> Deferred[float]:
        done: Deferred[float] = Deferred()
        self._asked.append((file, done, self._clock.seconds(), close, data))
        return done

    def _start_round(self) -> None:
        # Running already: what the joiners ask for goes in this round.
        self._running = True
        joining, self._joining = self._joining, []
        for join in joining:
            try:
                join()
            except Exception:
                log.failure("A range's write for the next flush round failed to start")
        if not self._asked:
            self._running = False
            return
        asked, self._asked = self._asked, []
        taken, self._taken = self._taken, []
        self.rounds += 1
        for tell in taken:
            # What it asks for now goes in the next round. One that raises must not keep the
            # round (so every range's writes) from starting.
            try:
                tell()
            except Exception:
                log.failure("A range's notice that its write was taken by a flush round failed")
        files = [file for file, _, _, _, _ in asked]
        closing = [file for file, _, _, close, _ in asked if close]
        writes: dict[int, tuple[AppendFile, list[bytes]]] = {}
        for file, _, _, _, data in asked:
            if data is not None:
                writes.setdefault(id(file), (cast(AppendFile, file), []))[1].append(data)
        written = list(writes.values())
        syncing = None
        if self._native is not None and not closing:
            syncing = self._native.round(written, files)
        if syncing is None:
            syncing = self._executor.run(_round, self._fs, written, files, closing)
        syncing.addBoth(self._round_done, asked)

    def _round_done(self, result: RoundOutcome | Failure, asked: list[_Asked]) -> None:
        self._running = False
        now = self._clock.seconds()
        # What was asked for while this round ran goes out at once, before this round's
        # acknowledgements run: the disk then syncs the next round while the reactor answers
        # this one's requests, instead of waiting for them. A range whose write this round
        # fails has its write in the next one failed with it (``WritePipeline._settle_ahead``),
        # and a range settles its writes in the order they were written, whichever round
        # answers first (with an executor that runs a job in the caller, as in tests, the next
        # round's answers can come before this one's).
        if self._asked or self._joining:
            self._start_round()
        outcomes: list[OSError | None] | list[Failure]
        if isinstance(result, Failure):
            outcomes, took = [result] * len(asked), 0.0
        else:
            outcomes, took = result
        for (_, done, since, _, data), outcome in zip(asked, outcomes, strict=True):
            if outcome is None:
                done.callback(now - since if data is None else took)
            else:
                done.errback(outcome)
        # What these callbacks asked for, when no round was under way, goes out at once.
        if (self._asked or self._joining) and not self._running:
            self._start_round()


def _round(
    fs: FileSystem,
    writes: list[tuple[AppendFile, list[bytes]]],
    files: list[Syncable],
    closing: list[Syncable],
) -> RoundOutcome:
    """One round, on its thread: the writes asked for, then one ``sync_files`` of every file,
    then the closes asked for; each file's outcome (a failed write is its file's, whatever the
    sync says) and the seconds the writes and the sync took."""
    started = time.monotonic()
    failed: dict[int, OSError] = {}
    try:
        for file, parts in writes:
            try:
                file.write(b"".join(parts))
            except OSError as error:
                failed[id(file)] = error
        synced = fs.sync_files(files)
        outcomes = [
            failed.get(id(file), outcome) for file, outcome in zip(files, synced, strict=True)
        ]
        return outcomes, time.monotonic() - started
    finally:
        close_each(closing)
