"""Atomic replaces and new segment files whose syncs ride the shared flush.

A replica's fence writes an epoch marker; starting a segment writes one and creates the log
file; sealing a copy writes its index and seal marker. Each is a small file made durable by an
fsync of the file and one of its directory. One at a time that is nothing, but a failover does
it for every range the dead node led, on every surviving copy, all at once: at 1,000 topics
about 6,000 fsyncs on each node, and a few writer threads run only a few at once, so the claims
waited seconds for the disk (``bench/cluster_scale.py``).

``AtomicWrites`` does the same steps in the same order (write the temporary file, sync it,
rename it over the target, sync the directory), but each sync is a flush of the node's
``SharedFlush``: every marker staged while a round runs is made durable by the next round,
together with the appends of every range (one ``syncfs`` per file system on the real one).
Several files replaced together (a seal's index, then its seal marker) have their temporary
files written and synced in one round, then are renamed in order, a round after each.
Without a shared flush (``SVC_FSYNC_SCOPE=file``, or a kernel whose ``syncfs`` cannot be
trusted) each write is ``FileSystem.write_atomic`` in a writer thread, as before.

Why it is as safe as ``write_atomic``: the rename is asked for only once a round that started
after the temporary file was written has finished (its bytes are on disk before its name
points at them), and the caller hears of success only once a round that started after the
rename has finished.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from logbroker._deferreds import gather
from logbroker.storage._executor import Executor
from logbroker.storage._flush import SharedFlush
from logbroker.storage._fs import AppendFile, FileSystem, Syncable
from logbroker.storage._jobs import create_segment


class AtomicWrites:
    """Durable small-file writes of the range logs of one node (see the module docstring)."""

    def __init__(self, fs: FileSystem, executor: Executor, flush: SharedFlush | None) -> None:
        self._fs = fs
        self._executor = executor
        self._flush = flush

    def replace(self, files: Sequence[tuple[str, bytes]]) -> Deferred[None]:
        """Replace each ``(path, data)`` of ``files`` atomically, in order: each one's name
        is durable before the next one's is changed. Fire once the last is durable."""
        flush = self._flush
        if flush is None:
            return self._executor.run(_write_each, self._fs, files)
        if not files:
            return succeed(None)
        # Every temporary file is written at once and made durable by one round: only their
        # names must become durable in order (a seal marker's never before its index's), so a
        # seal's two sidecars cost three rounds, not four.
        done = self._executor.run(_stage_each, self._fs, files).addCallback(_all_synced, flush)
        for path, _ in files:
            done.addCallback(self._publish_one, flush, path)
        return done

    def _publish_one(self, _: object, flush: SharedFlush, path: str) -> Deferred[None]:
        return self._executor.run(_publish, self._fs, path).addCallback(_synced, flush)

    def create(self, path: str) -> Deferred[AppendFile]:
        """Create the file ``path`` for appending, its directory entry durable."""
        flush = self._flush
        directory = posixpath.dirname(path)
        if flush is None:
            return self._executor.run(create_segment, self._fs, directory, path)

        def created(opened: tuple[AppendFile, Syncable]) -> Deferred[AppendFile]:
            writer, directory_handle = opened

            def failed(failure: Failure) -> Failure:
                writer.close()
                return failure

            return _synced(directory_handle, flush).addCallbacks(lambda _: writer, failed)

        creating = self._executor.run(_create_unsynced, self._fs, directory, path)
        return creating.addCallback(created)


def _synced(handle: Syncable, flush: SharedFlush) -> Deferred[None]:
    """Fire once a flush round made ``handle`` durable; the round closes it either way."""
    return flush.flush(handle, close=True).addCallback(lambda _: None)


def _all_synced(handles: Sequence[Syncable], flush: SharedFlush) -> Deferred[None]:
    """Fire once one flush round made every one of ``handles`` durable (the round closes them)."""
    return gather(flush.flush_each(handles, close=True)).addCallback(lambda _: None)


def _stage_each(fs: FileSystem, files: Sequence[tuple[str, bytes]]) -> list[Syncable]:
    """``stage_atomic`` each of ``files``; if one fails, those staged are closed."""
    staged: list[Syncable] = []
    try:
        for path, data in files:
            staged.append(fs.stage_atomic(path, data))
    except BaseException:
        for handle in staged:
            handle.close()
        raise
    return staged


def _write_each(fs: FileSystem, files: Sequence[tuple[str, bytes]]) -> None:
    for path, data in files:
        fs.write_atomic(path, data)


def _create_unsynced(fs: FileSystem, directory: str, path: str) -> tuple[AppendFile, Syncable]:
    writer = fs.create_append(path)
    try:
        return writer, fs.open_dir(directory)
    except BaseException:
        writer.close()
        raise


def _publish(fs: FileSystem, path: str) -> Syncable:
    fs.publish_atomic(path)
    return fs.open_dir(posixpath.dirname(path))
