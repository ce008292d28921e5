"""Digests of a range log's segment copies, file by file: what ``logbroker cluster verify``
compares between the nodes holding copies of one sealed segment.

Each file is hashed with **SHA-256**, not CRC32C: the command's claim is that copies are
byte-identical, and a 32-bit linear checksum cannot carry that claim (copies that differ by a
pattern that is itself a CRC codeword, or by chance one in 2^32, would look identical), while
SHA-256 makes equal digests equal bytes. It costs about 0.7 s per GiB on one core, in a reader
thread; the command is an operator's check, not a hot path.

The job reads files outside the log's write queue, so a copy sealed, cut or deleted while it
runs may be seen before, after or (its files read at different moments) in between: a digest
is a snapshot of the files as they were read. A file that is gone when read counts as missing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from enum import StrEnum

import attrs

from logbroker.storage._fs import FileSystem
from logbroker.storage._segment import (
    EPOCH_SUFFIX,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    SEAL_SUFFIX,
    CopyState,
)

DIGEST_SIZE = hashlib.sha256().digest_size
#: Files are read in pieces of this size, so that hashing a segment holds no more in memory.
_READ_BYTES = 1024 * 1024


class SegmentFile(StrEnum):
    """The files of a segment copy, by what they hold."""

    LOG = "log"
    INDEX = "index"
    SEALED = "sealed"
    EPOCH = "epoch"

    @property
    def suffix(self) -> str:
        return _SUFFIXES[self]


_SUFFIXES = {
    SegmentFile.LOG: LOG_SUFFIX,
    SegmentFile.INDEX: INDEX_SUFFIX,
    SegmentFile.SEALED: SEAL_SUFFIX,
    SegmentFile.EPOCH: EPOCH_SUFFIX,
}


@attrs.frozen
class CopyDigests:
    """One segment copy as this node holds it: its state and the SHA-256 of each of its files.

    An active copy is listed without digests (it is still being written); for any other copy, a
    file missing from ``digests`` is not on disk."""

    base_offset: int
    state: CopyState
    digests: Mapping[SegmentFile, bytes] = attrs.field(factory=dict)


@attrs.frozen
class CopyFiles:
    """Where a copy's files are: the path of its log without the ``.log`` suffix."""

    base_offset: int
    state: CopyState
    stem: str


def _digest_file(fs: FileSystem, path: str) -> tuple[bytes, int] | None:
    """The SHA-256 of the file at ``path`` and its size, or ``None`` when there is none."""
    digest = hashlib.sha256()
    size = 0
    try:
        reader = fs.open_read(path)
        try:
            while piece := reader.read(size, _READ_BYTES):
                digest.update(piece)
                size += len(piece)
        finally:
            reader.close()
    except FileNotFoundError:
        return None
    return digest.digest(), size


def digest_copies(
    fs: FileSystem, copies: Sequence[CopyFiles], max_bytes: int, max_copies: int
) -> tuple[list[CopyDigests], int]:
    """The digests of ``copies``, in order, stopping before ``max_copies`` copies and once
    ``max_bytes`` of files are hashed (always at least one copy), and the bytes hashed.
    Blocking: a reader thread's."""
    found: list[CopyDigests] = []
    hashed = 0
    for copy in copies:
        if len(found) >= max_copies or (found and hashed >= max_bytes):
            break
        if copy.state is CopyState.ACTIVE:
            found.append(CopyDigests(copy.base_offset, copy.state))
            continue
        digests = {}
        for kind in SegmentFile:
            digested = _digest_file(fs, copy.stem + kind.suffix)
            if digested is not None:
                digests[kind], size = digested
                hashed += size
        found.append(CopyDigests(copy.base_offset, copy.state, digests))
    return found, hashed
