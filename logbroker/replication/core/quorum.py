"""The primary's bookkeeping for one active segment: a sans-IO core (no Twisted, no I/O).

The primary appends a batch to its own log, keeps the stored bytes in a ``Backlog`` and sends
them to every replica through its ``ReplicaStream`` (a bounded window of bytes in flight per
replica). Replicas answer with how far their copy is durable; ``CommitTracker`` turns those
answers and the primary's own durable end into the commit index: the highest offset that a
quorum (``floor(RF/2)+1`` copies, the primary's own included) holds durably. A produce is
acknowledged once the commit index is past its last record; readers never see past it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

import attrs


def quorum_size(replication_factor: int) -> int:
    """How many copies must hold a record durably before it is acknowledged."""
    if replication_factor < 1:
        raise ValueError(f"a replication factor is at least 1, not {replication_factor}")
    return replication_factor // 2 + 1


@attrs.frozen
class Chunk:
    """Whole stored batches of one segment: ``[offset, next_offset)``, starting at byte
    ``position`` of the segment's file."""

    offset: int
    next_offset: int
    position: int
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes>")

    @property
    def end_position(self) -> int:
        return self.position + len(self.data)


@attrs.frozen
class CopyEnd:
    """Where a copy of a segment ends: the offset after its last record, and its byte length."""

    offset: int
    position: int


class CommitTracker:
    """How far each copy of the active segment is durable, and so the commit index."""

    def __init__(self, durable: Mapping[str, int], quorum: int) -> None:
        self._durable = dict(durable)
        if not 1 <= quorum <= len(self._durable):
            raise ValueError(f"a quorum of {quorum} out of {len(self._durable)} copies")
        self._quorum = quorum
        self._commit = self._quorum_end()

    def _quorum_end(self) -> int:
        return sorted(self._durable.values(), reverse=True)[self._quorum - 1]

    @property
    def commit(self) -> int:
        return self._commit

    @property
    def quorum(self) -> int:
        return self._quorum

    def durable(self, copy: str) -> int:
        return self._durable[copy]

    def advance(self, copy: str, end: int) -> bool:
        """``copy`` is durable up to ``end`` (news of an earlier end changes nothing); answers
        whether the commit index moved."""
        if end <= self._durable[copy]:
            return False
        self._durable[copy] = end
        commit = self._quorum_end()
        if commit <= self._commit:
            return False
        self._commit = commit
        return True


class Backlog:
    """The active segment's batches that some replica may still need, newest last.

    Bounded: past ``max_bytes`` the oldest chunks go even if a replica still lacks them; that
    replica is caught up from the primary's log on disk instead.
    """

    def __init__(self, max_bytes: int) -> None:
        self._chunks: deque[Chunk] = deque()
        self._bytes = 0
        self._max_bytes = max_bytes

    @property
    def bytes(self) -> int:
        return self._bytes

    def add(self, chunk: Chunk) -> None:
        if self._chunks and self._chunks[-1].next_offset != chunk.offset:
            raise ValueError(
                f"a chunk from offset {chunk.offset} does not follow the backlog's end "
                f"{self._chunks[-1].next_offset}"
            )
        self._chunks.append(chunk)
        self._bytes += len(chunk.data)
        while self._bytes > self._max_bytes and len(self._chunks) > 1:
            self._drop()

    def _drop(self) -> None:
        self._bytes -= len(self._chunks.popleft().data)

    def release(self, offset: int) -> None:
        """Every replica holds everything before ``offset``: forget it."""
        while self._chunks and self._chunks[0].next_offset <= offset:
            self._drop()

    def take(self, offset: int, max_bytes: int) -> list[Chunk] | None:
        """The chunks from the one starting at ``offset``, about ``max_bytes`` of them (at least
        one), or ``None`` when the backlog no longer holds ``offset`` (read it from disk). An
        offset at the backlog's end gives no chunk."""
        if not self._chunks or offset < self._chunks[0].offset:
            return None
        if offset >= self._chunks[-1].next_offset:
            return [] if offset == self._chunks[-1].next_offset else None
        taken: list[Chunk] = []
        size = 0
        for chunk in self._chunks:
            if chunk.next_offset <= offset:
                continue
            if chunk.offset != offset and not taken:
                # Not a chunk boundary: only a replica's own answer names an offset to send
                # from, and replicas end at batch ends, which chunks keep.
                return None
            if taken and size + len(chunk.data) > max_bytes:
                break
            taken.append(chunk)
            size += len(chunk.data)
        return taken


def join(chunks: Sequence[Chunk]) -> Chunk:
    """One chunk of consecutive chunks, to send in one message."""
    if len(chunks) == 1:
        return chunks[0]
    return Chunk(
        chunks[0].offset,
        chunks[-1].next_offset,
        chunks[0].position,
        b"".join(chunk.data for chunk in chunks),
    )


class ReplicaStream:
    """What the primary has sent one replica and not yet heard back about.

    Sends are pipelined up to ``window_bytes`` in flight. An answer that the copy ends
    elsewhere (a message lost or reordered, a replica that restarted) rewinds the stream to
    where the copy ends; a link that failed rewinds it to the last durable end heard of.
    """

    def __init__(self, node: str, offset: int, position: int, window_bytes: int) -> None:
        self.node = node
        #: Where the next send starts.
        self.next_offset = offset
        self.next_position = position
        #: The copy's durable end, as last heard (``None`` until the replica has answered).
        self.durable_offset: int | None = None
        self.durable_position = 0
        self._window_bytes = window_bytes
        #: ``(next_offset, size)`` of each message in flight, in send order.
        self._in_flight: deque[tuple[int, int]] = deque()
        self._in_flight_bytes = 0
        #: Bumped at every rewind: answers to messages sent before it are stale.
        self.generation = 0

    @property
    def in_flight_bytes(self) -> int:
        return self._in_flight_bytes

    @property
    def idle(self) -> bool:
        return not self._in_flight

    def room(self) -> int:
        """How many more bytes may be sent now (at least one message when none is in flight)."""
        if not self._in_flight:
            return max(self._window_bytes, 1)
        return max(self._window_bytes - self._in_flight_bytes, 0)

    def sent(self, chunk: Chunk) -> int:
        """``chunk`` went out; returns the generation its answer must carry to count."""
        if chunk.offset != self.next_offset:
            raise ValueError(f"sent from {chunk.offset}, the stream is at {self.next_offset}")
        self._in_flight.append((chunk.next_offset, len(chunk.data)))
        self._in_flight_bytes += len(chunk.data)
        self.next_offset = chunk.next_offset
        self.next_position = chunk.end_position
        return self.generation

    def stored(self, generation: int, end_offset: int, end_position: int) -> None:
        """A message of ``generation`` was stored: the copy is durable up to ``end_offset``."""
        self._heard(end_offset, end_position)
        if generation != self.generation:
            return
        while self._in_flight and self._in_flight[0][0] <= end_offset:
            _, size = self._in_flight.popleft()
            self._in_flight_bytes -= size

    def _heard(self, end_offset: int, end_position: int) -> None:
        if self.durable_offset is None or end_offset > self.durable_offset:
            self.durable_offset = end_offset
            self.durable_position = end_position

    def rewind(self, offset: int, position: int) -> None:
        """Send from ``offset`` next: what was in flight is forgotten (its answers, if any come,
        no longer count against the window)."""
        self.generation += 1
        self._in_flight.clear()
        self._in_flight_bytes = 0
        self.next_offset = offset
        self.next_position = position

    def restart_from_durable(self, fallback_offset: int, fallback_position: int) -> None:
        """The link failed: what was in flight may be lost. Send again from the last durable
        end heard of (or the fallback, when the replica never answered)."""
        if self.durable_offset is None:
            self.rewind(fallback_offset, fallback_position)
        else:
            self.rewind(self.durable_offset, self.durable_position)
