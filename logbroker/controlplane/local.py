"""The control plane of a single node: one state file in the data directory.

The whole state lives in memory and in ``<directory>/state.json`` (see ``_format``). A change is
applied to an immutable copy of the state; the copy is serialized and atomically replaces the
file (temporary file, fsync, rename, directory fsync) in an executor job, so the reactor never
waits on the disk, and a crash at any moment leaves either the old file or the new one. Only
once that job has returned do reads see the new state and the change's Deferred fire.

Group commit: at most one write is in flight. Changes asked for while it runs queue up, each
checked against the state including those queued before it, and all go out in the next single
write, so a burst of consumer group commits costs one fsync, not one each.

A write that fails fails the changes it carried and every change queued behind it (they were
checked against a state that never became durable); the durable state stays as it was and the
next change starts from it. If the failure came after the rename (the directory fsync), the
file may already hold the failed changes; the next write replaces it, and a crash before that
write may bring them back, as after any write whose outcome was unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.controlplane._format import decode_state, encode_state
from logbroker.controlplane._interface import ControlPlane
from logbroker.controlplane._reads import StateControlPlane
from logbroker.controlplane._state import (
    Change,
    ControlState,
    DeleteSegment,
)
from logbroker.controlplane.errors import (
    ControlPlaneClosedError,
    ControlPlaneError,
    ControlPlaneWriteError,
    NotFoundError,
)
from logbroker.storage import Executor, FileSystem

STATE_FILE = "state.json"
LOCK_FILE = "LOCK"
#: A single node's control plane: this directory of its data directory.
SINGLE_NODE_CONTROL = "control"

log = Logger()

#: A change's Deferred, and the state as that change left it.
_Queued = tuple[Deferred[ControlState], ControlState]


def _nothing(_: object) -> None:
    return None


@attrs.frozen
class _Loaded:
    lock: object
    state: ControlState
    removed_temporary: bool


def _load_job(fs: FileSystem, directory: str) -> _Loaded:
    fs.make_dirs(directory)
    try:
        lock = fs.lock(f"{directory}/{LOCK_FILE}")
    except BlockingIOError:
        raise ControlPlaneError(
            f"control plane directory {directory} is in use by another logbroker process; "
            "stop it, or point SVC_DATA_DIR elsewhere"
        ) from None
    path = f"{directory}/{STATE_FILE}"
    # A crash during a write leaves this behind; it is never the state.
    temporary = path + ".tmp"
    removed = fs.exists(temporary)
    if removed:
        fs.remove(temporary)
        fs.sync_dir(directory)
    state = decode_state(fs.read_file(path), path) if fs.exists(path) else ControlState()
    return _Loaded(lock, state, removed)


def _write_job(fs: FileSystem, path: str, state: ControlState) -> None:
    fs.write_atomic(path, encode_state(state))


def forget_segments(
    fs: FileSystem, directory: str, segments: Sequence[tuple[str, int]]
) -> list[tuple[str, int]]:
    """Remove the records of ``segments`` (``(range id, base offset)``) from the state file in
    ``directory``, offline: the broker must be stopped (its lock is taken). Those that were
    recorded, in order. For ``logbroker storage salvage``: the broker records the segments it
    finds at its next start."""
    try:
        lock = fs.lock(f"{directory}/{LOCK_FILE}")
    except BlockingIOError:
        raise ControlPlaneError(
            f"control plane directory {directory} is in use by a running logbroker; stop it first"
        ) from None
    try:
        path = f"{directory}/{STATE_FILE}"
        state = decode_state(fs.read_file(path), path)
        forgotten = []
        for range_id, base_offset in segments:
            try:
                state = DeleteSegment(range_id, base_offset).apply(state)
            except NotFoundError:
                continue
            forgotten.append((range_id, base_offset))
        if forgotten:
            fs.write_atomic(path, encode_state(state))
        return forgotten
    finally:
        close = getattr(lock, "close", None)
        if close is not None:
            close()


class LocalControlPlane(StateControlPlane):
    """A ``ControlPlane`` kept in one file under ``directory`` (created if missing)."""

    def __init__(self, directory: str, *, fs: FileSystem, executor: Executor) -> None:
        super().__init__()
        self.directory = directory
        self.path = f"{directory}/{STATE_FILE}"
        self._fs = fs
        self._executor = executor
        self._lock: object | None = None
        #: What reads see: the state as last written. ``None`` until started.
        self._durable: ControlState | None = None
        #: The durable state with every change asked for since applied.
        self._pending = ControlState()
        #: Changes applied to ``_pending`` and not yet handed to a write.
        self._queued: list[_Queued] = []
        self._writing = False
        self._kicking = False
        self._closing = False
        self._closed = False
        self._close_waiters: list[Deferred[None]] = []

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> Deferred[None]:
        return self._executor.run(_load_job, self._fs, self.directory).addCallback(self._loaded)

    def _loaded(self, loaded: _Loaded) -> None:
        self._lock = loaded.lock
        self._durable = self._pending = loaded.state
        self._view_replaced(None, loaded.state)
        if loaded.removed_temporary:
            log.info("Removed {path}.tmp, left by an interrupted write", path=self.path)
        log.info(
            "Control plane loaded from {path}: {topics} topics, {users} users",
            path=self.path,
            topics=len(loaded.state.topics),
            users=len(loaded.state.users),
        )

    def close(self) -> Deferred[None]:
        if self._closed:
            return succeed(None)
        self._closing = True
        closed: Deferred[None] = Deferred()
        self._close_waiters.append(closed)
        self._kick()
        return closed

    # -- reads ---------------------------------------------------------------------------------

    def _read(self) -> ControlState:
        if self._durable is None:
            raise ControlPlaneClosedError(f"the control plane in {self.directory} is not started")
        return self._durable

    # -- the writer ----------------------------------------------------------------------------

    def _submit(self, change: Change) -> Deferred[ControlState]:
        """Queue ``change``; fire, once it is durable, with the state as it left it."""
        if self._durable is None or self._closing:
            state = "closing" if self._closing else "not started"
            return fail(
                ControlPlaneClosedError(f"the control plane in {self.directory} is {state}")
            )
        try:
            self._pending = change.apply(self._pending)
        except ControlPlaneError:
            return fail()
        done: Deferred[ControlState] = Deferred()
        self._queued.append((done, self._pending))
        self._kick()
        return done

    def _kick(self) -> None:
        # A loop, not recursion: with an executor that fires at once, each write finishes
        # inside _start_write, and its callbacks may queue the next changes.
        if self._kicking:
            return
        self._kicking = True
        try:
            while self._queued and not self._writing:
                self._start_write()
        finally:
            self._kicking = False
        if self._closing and not self._writing and not self._queued and not self._closed:
            self._finish_close()

    def _start_write(self) -> None:
        carried, self._queued = self._queued, []
        state = self._pending
        self._writing = True
        self._executor.run(_write_job, self._fs, self.path, state).addCallbacks(
            self._written,
            self._write_failed,
            callbackArgs=(state, carried),
            errbackArgs=(carried,),
        )

    def _written(self, _: None, state: ControlState, carried: list[_Queued]) -> None:
        before, self._durable = self._durable, state
        self._view_replaced(before, state)
        # Still counted as writing: changes the callbacks ask for queue up for one next write.
        for done, after in carried:
            done.callback(after)
        self._writing = False
        self._kick()

    def _write_failed(self, failure: Failure, carried: list[_Queued]) -> None:
        assert self._durable is not None
        behind, self._queued = self._queued, []
        self._pending = self._durable
        log.failure(
            "Could not write the control state to {path}; {count} changes did not take effect",
            failure,
            path=self.path,
            count=len(carried) + len(behind),
        )
        reason = failure.getErrorMessage()
        for done, _ in carried:
            done.errback(
                ControlPlaneWriteError(
                    f"writing {self.path} failed ({reason}); the change did not take effect"
                )
            )
        for done, _ in behind:
            done.errback(
                ControlPlaneWriteError(
                    f"writing {self.path} failed ({reason}) for a change asked for before this "
                    "one; this change did not take effect either, retry it"
                )
            )
        self._writing = False
        self._kick()

    def _finish_close(self) -> None:
        self._closed = True
        self._lock = None
        waiters, self._close_waiters = self._close_waiters, []
        for closed in waiters:
            closed.callback(None)


if TYPE_CHECKING:
    # mypy proves here that LocalControlPlane implements the whole ControlPlane interface.
    _implements: type[ControlPlane] = LocalControlPlane
