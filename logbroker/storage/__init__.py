"""logbroker's storage engine: durable, checksummed, crash-safe per-range logs.

See ``docs/storage-format.md`` for the bytes on disk and ``RangeLog`` for the API.
"""

from logbroker.records import Record, StoredRecord
from logbroker.storage._digests import DIGEST_SIZE, CopyDigests, SegmentFile
from logbroker.storage._executor import Executor, ThreadPoolExecutor
from logbroker.storage._flush import SharedFlush
from logbroker.storage._format import (
    BATCH_ENCODER,
    FORMAT_VERSION,
    Damage,
    DamageReason,
    EpochMarker,
    Seal,
    encode_batch,
    iter_record_frames,
)
from logbroker.storage._fs import FileSystem, OsFileSystem, close_each, shared_sync_refusal
from logbroker.storage._handles import OpenFiles
from logbroker.storage._native_rounds import SYNC_THREAD, NativeRounds
from logbroker.storage._segment import CopyState, IntegrityEvent, SegmentInfo, Verification
from logbroker.storage.errors import (
    FencedError,
    FormatTooNewError,
    InvalidBatchError,
    LogClosedError,
    LogFailedError,
    NotADataDirectoryError,
    NotContiguousError,
    OffsetOutOfRangeError,
    OverloadedError,
    SegmentNotFoundError,
    SegmentStateError,
    StorageError,
)
from logbroker.storage.log import (
    Appended,
    BatchSlice,
    Fenced,
    Flush,
    FramedRecords,
    LogConfig,
    RangeLog,
    Written,
)
from logbroker.storage.store import DataDirectory, OpenLogs, OpenOnce

__all__ = [
    "BATCH_ENCODER",
    "DIGEST_SIZE",
    "FORMAT_VERSION",
    "SYNC_THREAD",
    "Appended",
    "BatchSlice",
    "CopyDigests",
    "CopyState",
    "Damage",
    "DamageReason",
    "DataDirectory",
    "EpochMarker",
    "Executor",
    "Fenced",
    "FencedError",
    "FileSystem",
    "Flush",
    "FormatTooNewError",
    "FramedRecords",
    "IntegrityEvent",
    "InvalidBatchError",
    "LogClosedError",
    "LogConfig",
    "LogFailedError",
    "NativeRounds",
    "NotADataDirectoryError",
    "NotContiguousError",
    "OffsetOutOfRangeError",
    "OpenFiles",
    "OpenLogs",
    "OpenOnce",
    "OsFileSystem",
    "OverloadedError",
    "RangeLog",
    "Record",
    "Seal",
    "SegmentFile",
    "SegmentInfo",
    "SegmentNotFoundError",
    "SegmentStateError",
    "SharedFlush",
    "StorageError",
    "StoredRecord",
    "ThreadPoolExecutor",
    "Verification",
    "Written",
    "close_each",
    "encode_batch",
    "iter_record_frames",
    "shared_sync_refusal",
]
