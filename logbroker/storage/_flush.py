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

Why a write is durable when its flush fires: its bytes were in the page cache before it asked,
and the round that covers it started after it asked. A flush that fails fails the write it
covered, and that log takes itself out of service, as after a failed fsync of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from logbroker.storage._executor import Executor
from logbroker.storage._fs import FileSystem, Syncable, close_each

#: A file to flush, the flush's Deferred, when it was asked for, and whether to close the
#: file once flushed.
_Asked = tuple[Syncable, Deferred[float], float, bool]


class SharedFlush:
    """Flushes for the range logs of one node, in rounds (see the module docstring)."""

    def __init__(self, fs: FileSystem, executor: Executor, clock: IReactorTime) -> None:
        self._fs = fs
        self._executor = executor
        self._clock = clock
        self._asked: list[_Asked] = []
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

    def flush_each(
        self, files: Sequence[Syncable], *, close: bool = False
    ) -> list[Deferred[float]]:
        """``flush`` of each of ``files``, asked for together: one round covers them all."""
        asked = [self._ask(file, close) for file in files]
        if not self._running:
            self._start_round()
        return asked

    def _ask(self, file: Syncable, close: bool) -> Deferred[float]:
        done: Deferred[float] = Deferred()
        self._asked.append((file, done, self._clock.seconds(), close))
        return done

    def _start_round(self) -> None:
        asked, self._asked = self._asked, []
        self._running = True
        self.rounds += 1
        files = [file for file, _, _, _ in asked]
        closing = [file for file, _, _, close in asked if close]
        if closing:
            syncing = self._executor.run(_sync_then_close, self._fs, files, closing)
        else:
            syncing = self._executor.run(self._fs.sync_files, files)
        syncing.addBoth(self._round_done, asked)

    def _round_done(self, result: list[OSError | None] | Failure, asked: list[_Asked]) -> None:
        self._running = False
        now = self._clock.seconds()
        outcomes: list[OSError | None] | list[Failure]
        outcomes = [result] * len(asked) if isinstance(result, Failure) else result
        for (_, done, since, _), outcome in zip(asked, outcomes, strict=True):
            if outcome is None:
                done.callback(now - since)
            else:
                done.errback(outcome)
        # Flushes asked for meanwhile (or by these callbacks) go out together, at once.
        if self._asked and not self._running:
            self._start_round()


def _sync_then_close(
    fs: FileSystem, files: list[Syncable], closing: list[Syncable]
) -> list[OSError | None]:
    try:
        return fs.sync_files(files)
    finally:
        close_each(closing)
