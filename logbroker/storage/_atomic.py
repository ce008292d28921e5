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
        """Replace each ``(path, data)`` of ``files`` atomically, in order: each is durable
        before the next is written. Fire once the last is durable."""
        flush = self._flush
        if flush is None:
            return self._executor.run(_write_each, self._fs, files)
        done: Deferred[None] = succeed(None)
        for path, data in files:
            done.addCallback(self._replace_one, flush, path, data)
        return done

    def _replace_one(self, _: object, flush: SharedFlush, path: str, data: bytes) -> Deferred[None]:
        fs = self._fs
        staging = self._executor.run(fs.stage_atomic, path, data)
        return (
            staging.addCallback(_synced, flush)
            .addCallback(lambda _: self._executor.run(_publish, fs, path))
            .addCallback(_synced, flush)
        )

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
