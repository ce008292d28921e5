"""The peer op ``segment_times`` (14): when the newest record of sealed copies was written, for
retention's age rule in a cluster (``logbroker.maintenance.retention``).

The control plane records a sealed segment's record count and byte size, not its records'
times; each copy's seal marker records its newest record's time. The node that decides
retention (the chores lease holder) asks, for each sealed segment that could go, the live
members of its replica set in turn (itself first) until one knows: a segment no one answers
for is not removed by age at this pass. Requests list at most ``CHUNK`` segments, so that no
answer nears a frame's limit whatever the cluster holds.

Payloads (``text`` as in ``logbroker.peer.frames``; integers big-endian)::

    request = count:u32 (text(range_id) base_offset:u64)*
    ok      = count:u32 newest_ms:u64*      one per segment asked, in order;
                                            2^64-1: no sealed copy here, or its time unknown
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from logbroker.controlplane import ControlPlane, SegmentState
from logbroker.maintenance.retention import NewestTimes
from logbroker.peer.frames import PeerOp, encode_text, read_exactly, read_text
from logbroker.peer.requester import PeerRequester
from logbroker.storage import CopyState, OpenLogs
from logbroker.wire.primitives import Reader, Truncated

log = Logger()

#: The most segments one request asks about.
CHUNK = 8192
#: In an answer: nothing known of that segment here.
UNKNOWN = 2**64 - 1

_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

#: ``(range id, base offset)``: a segment.
SegmentKey = tuple[str, int]


def encode_times_request(keys: Sequence[SegmentKey]) -> bytes:
    return _U32.pack(len(keys)) + b"".join(
        encode_text(range_id) + _U64.pack(base) for range_id, base in keys
    )


def decode_times_request(payload: bytes) -> list[SegmentKey]:
    def read(reader: Reader) -> list[SegmentKey]:
        count = reader.u32()
        # Each takes at least 10 bytes (an empty text and the offset).
        if count * 10 > reader.remaining or count > CHUNK:
            raise Truncated(f"{count} segments cannot be asked in {reader.remaining} bytes")
        return [(read_text(reader), reader.u64()) for _ in range(count)]

    return read_exactly(payload, read, "segment_times request")


def encode_times(times: Sequence[int | None]) -> bytes:
    return _U32.pack(len(times)) + b"".join(
        _U64.pack(UNKNOWN if time is None else time) for time in times
    )


def decode_times(payload: bytes) -> list[int | None]:
    def read(reader: Reader) -> list[int | None]:
        count = reader.u32()
        if count * 8 != reader.remaining:
            raise Truncated(f"{count} times are not {reader.remaining} bytes")
        return [None if (time := reader.u64()) == UNKNOWN else time for _ in range(count)]

    return read_exactly(payload, read, "segment_times answer")


class SegmentTimesServer:
    """Answers ``segment_times`` from this node's sealed copies."""

    def __init__(self, storage: OpenLogs) -> None:
        self._storage = storage

    def serve(self, payload: bytes) -> Deferred[bytes]:
        times: list[int | None] = []
        for range_id, base in decode_times_request(payload):
            copy = self._storage.logs.get(range_id)
            info = None if copy is None else copy.segment(base)
            sealed = info is not None and info.state is CopyState.SEALED and info.damage is None
            times.append(info.max_timestamp_ms if sealed and info is not None else None)
        return succeed(encode_times(times))


def cluster_newest_times(
    node_id: str,
    control: ControlPlane,
    requester: PeerRequester,
    is_live: Callable[[str], bool],
) -> NewestTimes:
    """Retention's ``NewestTimes`` in a cluster: asked of the live replicas of each sealed
    segment that could go (every segment of a range but its last), this node first, the next
    one only where the one before did not know."""

    def newest(range_ids: Sequence[str]) -> Deferred[Mapping[SegmentKey, int]]:
        return Deferred.fromCoroutine(_newest(range_ids))

    async def _newest(range_ids: Sequence[str]) -> Mapping[SegmentKey, int]:
        # Each segment's live holders, this node first: asked in that order until one knows.
        holders: dict[SegmentKey, list[str]] = {}
        for range_id in range_ids:
            for meta in control.segments(range_id)[:-1]:
                if meta.state is not SegmentState.SEALED:
                    break
                live = [n for n in meta.replicas if n == node_id or is_live(n)]
                live.sort(key=lambda n: n != node_id)
                holders[(range_id, meta.base_offset)] = live
        found: dict[SegmentKey, int] = {}
        while holders:
            asked: dict[str, list[SegmentKey]] = defaultdict(list)
            for key, nodes in holders.items():
                if nodes:
                    asked[nodes.pop(0)].append(key)
            if not asked:
                break
            for node, keys in asked.items():
                found.update(await _ask(node, keys))
            holders = {key: nodes for key, nodes in holders.items() if key not in found and nodes}
        return found

    async def _ask(node: str, keys: list[SegmentKey]) -> dict[SegmentKey, int]:
        known: dict[SegmentKey, int] = {}
        for start in range(0, len(keys), CHUNK):
            chunk = keys[start : start + CHUNK]
            try:
                answer = decode_times(
                    await requester.request(node, PeerOp.SEGMENT_TIMES, encode_times_request(chunk))
                )
            except Exception as error:
                log.info(
                    "Retention: {node} did not say when {count} segments were written ({error})",
                    node=node,
                    count=len(chunk),
                    error=str(error),
                )
                continue
            known.update(
                (key, time) for key, time in zip(chunk, answer, strict=False) if time is not None
            )
        return known

    return newest
