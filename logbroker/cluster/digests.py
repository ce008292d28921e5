"""The peer op ``digests`` (11): what segment copies a node holds, with the SHA-256 of each of
their files, for ``logbroker cluster verify`` (``logbroker.cluster.verify``).

A node's answer can be far larger than a peer frame (thousands of ranges, each of many
segments), and computing it reads every sealed byte the node holds. So the one request for a
node's copies is answered in pages: each page covers the copies after a cursor (a range and a
base offset), in (range, base offset) order, and says whether more follow; the asking node
sends the next request from the last copy it got. A page stops once its files add up to
``PAGE_HASH_BYTES`` or its encoding to about ``PAGE_BYTES`` (always at least one copy), so no
page takes long to compute nor comes near the 32 MiB frame limit. Files are hashed off the
reactor thread, in the storage's reader threads (``RangeLog.copy_digests``), one range at a
time.

Payloads (``text`` as in ``logbroker.peer.frames``; integers big-endian)::

    request = has_cursor:u8 [text(range_id) base_offset:u64]
                                  0x00: from the first copy; 0x01: the copies after this one
    ok      = more:u8 count:u32 copy*
                                  more 0x01: copies after the last one may follow
    copy    = text(range_id) base_offset:u64 state:u8 files:u8 digest[32]*
                                  state 0 active, 1 sealed, 2 closed; files: a bit per file
                                  present (0x01 log, 0x02 index, 0x04 sealed, 0x08 epoch),
                                  and the file's SHA-256 for each bit set, in that order (an
                                  active copy is listed with none)

Every decoder is strict: a payload that does not parse exactly to its end, a flag other than
0x00 or 0x01, an unknown state or file bit raises ``MalformedPeerMessage``.
"""

from __future__ import annotations

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from logbroker.peer.frames import (
    PeerOp,
    encode_text,
    read_exactly,
    read_text,
    text_field,
    u64_field,
)
from logbroker.peer.requester import PeerRequester
from logbroker.storage import DIGEST_SIZE, CopyDigests, CopyState, OpenLogs, SegmentFile
from logbroker.wire import primitives as p
from logbroker.wire.primitives import Reader, Truncated

#: A page stops once the files it hashed add up to this much (a few seconds of reading).
PAGE_HASH_BYTES = 256 * 1024 * 1024
#: A page stops before its encoding could pass this many bytes.
PAGE_BYTES = 4 * 1024 * 1024

_STATES = (CopyState.ACTIVE, CopyState.SEALED, CopyState.CLOSED)
_FILES = (SegmentFile.LOG, SegmentFile.INDEX, SegmentFile.SEALED, SegmentFile.EPOCH)
#: The most bytes a copy of a range with a name of ``n`` bytes takes: this plus ``n``.
_COPY_OVERHEAD = 2 + 8 + 1 + 1 + DIGEST_SIZE * len(_FILES)


@attrs.frozen
class CopyCursor:
    """A copy a page of digests starts after."""

    range_id: str = attrs.field(validator=text_field)
    base_offset: int = attrs.field(validator=u64_field)


@attrs.frozen
class NodeCopy:
    """A segment copy a node holds, of range ``range_id``."""

    range_id: str = attrs.field(validator=text_field)
    copy: CopyDigests

    @property
    def cursor(self) -> CopyCursor:
        return CopyCursor(self.range_id, self.copy.base_offset)


@attrs.frozen
class DigestPage:
    copies: tuple[NodeCopy, ...]
    #: Copies after the last one may follow: ask again from it.
    more: bool


def encode_digests_request(after: CopyCursor | None) -> bytes:
    if after is None:
        return p.u8(0)
    return p.u8(1) + encode_text(after.range_id) + p.u64(after.base_offset)


def _flag(reader: Reader, what: str) -> bool:
    value = reader.u8()
    if value > 1:
        raise Truncated(f"{what} is {value:#04x}, neither 0x00 nor 0x01")
    return value == 1


def decode_digests_request(payload: bytes) -> CopyCursor | None:
    def read(reader: Reader) -> CopyCursor | None:
        if not _flag(reader, "the cursor marker"):
            return None
        return CopyCursor(read_text(reader), reader.u64())

    return read_exactly(payload, read, "digests request")


def _encode_copy(copy: NodeCopy) -> bytes:
    digests = copy.copy.digests
    present = [kind for kind in _FILES if kind in digests]
    bits = sum(1 << _FILES.index(kind) for kind in present)
    return b"".join(
        [
            encode_text(copy.range_id),
            p.u64(copy.copy.base_offset),
            p.u8(_STATES.index(copy.copy.state)),
            p.u8(bits),
            *(digests[kind] for kind in present),
        ]
    )


def encode_digest_page(page: DigestPage) -> bytes:
    return b"".join(
        [p.u8(1 if page.more else 0), p.u32(len(page.copies)), *map(_encode_copy, page.copies)]
    )


def _read_copy(reader: Reader) -> NodeCopy:
    range_id = read_text(reader)
    base_offset = reader.u64()
    state = reader.u8()
    if state >= len(_STATES):
        raise Truncated(f"copy state {state} is none of 0 (active), 1 (sealed), 2 (closed)")
    bits = reader.u8()
    if bits >> len(_FILES):
        raise Truncated(f"file bits {bits:#04x} name files that do not exist")
    digests = {
        kind: reader.raw(DIGEST_SIZE) for index, kind in enumerate(_FILES) if bits >> index & 1
    }
    return NodeCopy(range_id, CopyDigests(base_offset, _STATES[state], digests))


def decode_digest_page(payload: bytes) -> DigestPage:
    def read(reader: Reader) -> DigestPage:
        more = _flag(reader, "the more marker")
        count = reader.u32()
        # A copy takes at least 12 bytes (an empty range id, its offset, state and bits).
        if count * 12 > reader.remaining:
            raise Truncated(f"{count} copies cannot fit in {reader.remaining} bytes")
        return DigestPage(tuple(_read_copy(reader) for _ in range(count)), more)

    return read_exactly(payload, read, "digests page")


class DigestServer:
    """Answers the ``digests`` op from this node's range logs."""

    def __init__(
        self,
        storage: OpenLogs,
        page_hash_bytes: int = PAGE_HASH_BYTES,
        page_bytes: int = PAGE_BYTES,
    ) -> None:
        self._storage = storage
        self._page_hash_bytes = page_hash_bytes
        self._page_bytes = page_bytes

    def serve(self, payload: bytes) -> Deferred[bytes]:
        """The ok payload answering ``payload``; ``MalformedPeerMessage`` when it does not
        decode."""
        after = decode_digests_request(payload)
        return Deferred.fromCoroutine(self._page(after)).addCallback(encode_digest_page)

    async def _page(self, after: CopyCursor | None) -> DigestPage:
        logs = self._storage.logs
        names = sorted(name for name in logs if after is None or name >= after.range_id)
        copies: list[NodeCopy] = []
        hashed = size = 0
        for name in names:
            copy_size = _COPY_OVERHEAD + len(name.encode())
            room = (self._page_bytes - size) // copy_size
            if room < 1:
                return DigestPage(tuple(copies), more=True)
            start = after.base_offset if after is not None and name == after.range_id else None
            found, took = await logs[name].copy_digests(start, self._page_hash_bytes - hashed, room)
            copies.extend(NodeCopy(name, copy) for copy in found)
            hashed += took
            size += len(found) * copy_size
            # Either budget spent: this range may hold more copies after the last one.
            if len(found) == room or hashed >= self._page_hash_bytes:
                return DigestPage(tuple(copies), more=True)
        return DigestPage(tuple(copies), more=False)


async def node_copies(
    requester: PeerRequester, node_id: str, clock: IReactorTime, page_timeout: float
) -> list[NodeCopy]:
    """Every segment copy ``node_id`` holds, page after page; fails with the first page that
    fails (a ``PeerError``) or takes longer than ``page_timeout`` seconds (``TimeoutError``)."""
    copies: list[NodeCopy] = []
    after: CopyCursor | None = None
    while True:
        asking = requester.request(node_id, PeerOp.DIGESTS, encode_digests_request(after))
        page = decode_digest_page(await asking.addTimeout(page_timeout, clock))
        copies.extend(page.copies)
        if not page.more or not page.copies:
            return copies
        after = page.copies[-1].cursor
