"""The shared flush's rounds on a native thread that never takes the GIL.

A ``SharedFlush`` round on a Python thread takes the GIL to start, after each file's write,
after its ``syncfs`` and to hand its result back; with the reactor busy serving requests, those
waits were about a third of a round, and every acknowledgement waits for one to two rounds
(docs/decisions/0027-native-flush-thread.md). ``NativeRounds`` runs a round on
``logbroker.storage._syncthread.SyncThread`` instead: the thread writes the round's bytes and
calls ``syncfs`` without the GIL and signals an eventfd, which the reactor watches as a reader,
so the round's outcome is taken on the reactor thread with no hop through a thread pool.

It takes the rounds it can, as ``OsFileSystem.shared_sync_fd`` says: the real file system,
syncing by ``syncfs``, the files all on one device; ``SharedFlush`` runs every other round
(and a round that closes files) on its executor as before. A ``syncfs`` that fails is handled
as the Python round handles it: the file system syncs each file on its own from then on, and
the files of that round are fsynced so, on the executor, before the round's outcome is given.
Without a compiler the module is not built and the broker says so at boot.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFDSet, IReadDescriptor
from twisted.python.failure import Failure
from zope.interface import implementer

from logbroker.storage._executor import Executor
from logbroker.storage._flush import RoundOutcome
from logbroker.storage._fs import AppendFile, OsFileSystem, Syncable, sync_each

#: Whether the native sync thread is built (the flush rounds run there) or not.
SYNC_THREAD: str
try:
    from logbroker.storage._syncthread import SyncThread
except ImportError:  # not built: no compiler where this was installed
    SYNC_THREAD = "python"
else:
    SYNC_THREAD = "native"


@implementer(IReadDescriptor)
class NativeRounds:
    """Runs ``SharedFlush`` rounds on a ``SyncThread`` (see the module docstring)."""

    def __init__(self, reactor: IReactorFDSet, fs: OsFileSystem, executor: Executor) -> None:
        if SYNC_THREAD != "native":
            raise RuntimeError("the native sync thread is not built")
        self._reactor = reactor
        self._fs = fs
        self._executor = executor
        self._thread = SyncThread()
        self._watching = False
        #: The round under way: its files, the files written and where its outcome goes.
        self._round: tuple[list[Syncable], list[AppendFile], Deferred[RoundOutcome]] | None = None

    def start(self) -> None:
        """Watch the thread's event descriptor (rounds finish on the reactor thread)."""
        if not self._watching:
            self._reactor.addReader(self)
            self._watching = True

    def stop(self) -> None:
        """Stop the thread, once its round (if any) is over; a round still waiting for its
        outcome fails, its writes in doubt. Called once no range log is open."""
        if self._watching:
            self._reactor.removeReader(self)
            self._watching = False
        self._thread.close()
        under_way, self._round = self._round, None
        if under_way is not None:
            under_way[2].errback(OSError("the flush thread stopped before its round ended"))

    def round(
        self, writes: Sequence[tuple[AppendFile, list[bytes]]], files: list[Syncable]
    ) -> Deferred[RoundOutcome] | None:
        """Write each of ``writes`` (a file and its bytes, in order) and sync ``files`` (those
        written among them) in one round on the thread; ``None`` if this round is not one it
        can take (``SharedFlush`` then runs it on its executor)."""
        if not self._watching or self._round is not None:
            return None
        sync_fd = self._fs.shared_sync_fd(files)
        if sync_fd is None:
            return None
        handed = []
        for file, parts in writes:
            # Every written file is among ``files``, which ``shared_sync_fd`` checked are the
            # file system's own descriptors.
            fileno = cast(_HasFileno, file).fileno()
            handed.append((fileno, b"".join(parts)))
        self._thread.start(handed, sync_fd)
        outcome: Deferred[RoundOutcome] = Deferred()
        self._round = (files, [file for file, _ in writes], outcome)
        return outcome

    # -- IReadDescriptor -------------------------------------------------------------------

    def fileno(self) -> int:
        return self._thread.fileno()

    def logPrefix(self) -> str:
        return "NativeRounds"

    def doRead(self) -> None:
        result = self._thread.result()
        if result is None or self._round is None:
            return
        write_errors, sync_error, seconds = result
        (files, written, outcome), self._round = self._round, None
        failed = {
            id(file): OSError(code, os.strerror(code))
            for file, code in zip(written, write_errors, strict=True)
            if code
        }
        if not sync_error:
            outcome.callback(([failed.get(id(file)) for file in files], seconds))
            return
        self._fs.shared_sync_failed(files[0], OSError(sync_error, os.strerror(sync_error)))
        synced = self._executor.run(sync_each, files)

        def each_synced(outcomes: list[OSError | None]) -> RoundOutcome:
            return [
                failed.get(id(file), each) for file, each in zip(files, outcomes, strict=True)
            ], seconds

        synced.addCallback(each_synced).chainDeferred(outcome)

    def connectionLost(self, reason: Failure) -> None:
        """The reactor dropped the descriptor (it stops): ``stop`` closes the thread."""
        self._watching = False


class _HasFileno(Protocol):
    def fileno(self) -> int: ...
