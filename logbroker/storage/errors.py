"""Errors the storage engine raises; each says what happened, where, and what to do."""

from __future__ import annotations

from logbroker.errors import LogbrokerError, Reason


class StorageError(LogbrokerError):
    """Base of every storage error."""

    default_reason = Reason.STORAGE_ERROR


class OverloadedError(StorageError):
    """Too many records are waiting for their fsync; the append was refused at once."""

    default_reason = Reason.OVERLOADED


class LogClosedError(StorageError):
    """The range log is closed (the broker is shutting down)."""


class LogFailedError(StorageError):
    """A write or fsync failed; the range log accepts no appends until it is reopened.

    Nothing that might not be on disk was acknowledged. ``RangeLog.return_to_service`` takes
    appends again once the disk does (or a restart's recovery keeps exactly what reached the
    disk). Clients are told ``storage_unavailable``, not the ``unreachable`` of a broker going
    away.
    """

    default_reason = Reason.STORAGE_UNAVAILABLE


class OffsetOutOfRangeError(StorageError):
    """A read asked for an offset below the start of the log (deleted by retention)."""

    default_reason = Reason.OFFSET_OUT_OF_RANGE

    def __init__(self, offset: int, start_offset: int, end_offset: int) -> None:
        super().__init__(
            f"offset {offset} is below the log start {start_offset} (log end {end_offset})"
        )
        self.offset = offset
        self.start_offset = start_offset
        self.end_offset = end_offset


class NotContiguousError(StorageError):
    """Raw bytes from a primary do not start where this copy ends."""


class InvalidBatchError(StorageError):
    """Raw bytes from a primary are not whole, verified batches."""


class SegmentNotFoundError(StorageError):
    """No segment with that base offset exists in this range."""


class SegmentStateError(StorageError):
    """The operation does not apply to the segment in its current state."""


class FencedError(StorageError):
    """A writer's replication epoch is older than the one the segment copy was fenced at (or the
    copy's epoch is unknown until it is fenced again): a newer primary owns the segment."""


class FormatTooNewError(StorageError):
    """The data directory was written by a newer storage format than this build reads."""

    def __init__(self, path: str, found: int, supported: int) -> None:
        super().__init__(
            f"data directory {path} uses storage format {found}, but this logbroker reads "
            f"formats up to {supported}: upgrade logbroker, or point SVC_DATA_DIR elsewhere"
        )
        self.path = path
        self.found = found
        self.supported = supported


class NotADataDirectoryError(StorageError):
    """The directory holds files but no format marker; refusing to write into it."""
