"""Keeps the control plane's record of this node's segments in step with its range logs.

The spec: when a segment is sealed, the control plane records its record count and byte size (a
sealed segment becomes an independently replicable and repairable unit). ``SegmentRecorder``
hears of every seal from the range logs (their ``on_sealed`` hook) and records the sealed segment
and the range's next active segment. A change that could not be recorded (the control plane
failed or was stopping) is logged and made good at the next start, when ``reconcile`` compares
every open log with the record: seals are facts on disk, so recording them again is idempotent.
A sealed segment whose record is missing is recorded again, even one retention removed while
the node stopped before deleting its copy: a record lost is told from one removed by nothing
else, and recording a removed segment again only brings it back until the next retention pass
(it is still the oldest), where forgetting a lost one would lose its records.

On one node every segment's replica set is this node alone, at epoch 0; the cluster's placement
and failover will decide both once they land.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from twisted.internet.defer import Deferred, gatherResults
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker.controlplane import ANY_RECORD, ControlPlane, SegmentMeta, SegmentState
from logbroker.storage import CopyState, RangeLog, SegmentInfo, StorageError

log = Logger()


class SegmentRecorder:
    def __init__(self, control_plane: ControlPlane, node_id: str) -> None:
        self._control = control_plane
        self._node_id = node_id

    def sealed(self, range_id: str, info: SegmentInfo) -> None:
        """A range log sealed a segment (the range logs' ``on_sealed`` hook): record it sealed
        with its counts, and the segment that follows it as the range's active one."""
        # In one change: a record of the next segment without the seal before it would look
        # like a range whose first segments retention removed (``delete_removed_copies``).
        sealed = self._sealed(range_id, info)
        active = self._active(range_id, info.next_offset)
        recording = self._control.put_segments([(sealed, ANY_RECORD), (active, ANY_RECORD)])
        recording.addErrback(self._failed, sealed)

    def reconcile(self, logs: Mapping[str, RangeLog]) -> Deferred[None]:
        """Record what the open logs hold and the control plane does not know yet."""
        changes = []
        for range_id, range_log in sorted(logs.items()):
            changes += self._missing(range_id, range_log.segments())
        return gatherResults(
            [self._record(meta) for meta in changes], consumeErrors=True
        ).addCallback(lambda _: None)

    def _missing(self, range_id: str, segments: Sequence[SegmentInfo]) -> list[SegmentMeta]:
        recorded = {meta.base_offset: meta for meta in self._control.segments(range_id)}
        missing = []
        for info in segments:
            known = recorded.get(info.base_offset)
            if info.state is CopyState.SEALED:
                if known is None or known.state is not SegmentState.SEALED:
                    missing.append(self._sealed(range_id, info))
            elif info.state is CopyState.ACTIVE and known is None:
                missing.append(self._active(range_id, info.base_offset))
        return missing

    def _sealed(self, range_id: str, info: SegmentInfo) -> SegmentMeta:
        known = self._known(range_id, info.base_offset)
        return SegmentMeta(
            range_id,
            info.base_offset,
            SegmentState.SEALED,
            info.record_count,
            info.byte_size,
            known.replicas if known is not None else (self._node_id,),
            known.epoch if known is not None else 0,
        )

    def _active(self, range_id: str, base_offset: int) -> SegmentMeta:
        return SegmentMeta(
            range_id, base_offset, SegmentState.ACTIVE, None, None, (self._node_id,), 0
        )

    def _known(self, range_id: str, base_offset: int) -> SegmentMeta | None:
        return next(
            (m for m in self._control.segments(range_id) if m.base_offset == base_offset), None
        )

    def _record(self, meta: SegmentMeta) -> Deferred[None]:
        return self._control.put_segment(meta).addErrback(self._failed, meta)

    def _failed(self, failure: Failure, meta: SegmentMeta) -> None:
        log.warn(
            "Could not record segment {range_id}@{base_offset} ({state}) in the control"
            " plane: {error}; it is recorded at the next start",
            range_id=meta.range_id,
            base_offset=meta.base_offset,
            state=meta.state.value,
            error=failure.getErrorMessage(),
        )


async def delete_removed_copies(
    control: ControlPlane, copy: RangeLog | None, range_id: str
) -> list[int]:
    """Delete this node's copies of ``range_id``'s segments that retention removed (those
    wholly before its first recorded segment); their base offsets. A log's last segment keeps
    where the range ends: on one node it is the active segment, never removed; a replica whose
    last copy is a removed sealed segment (its range idle since) first starts an empty segment
    where the range's first recorded segment begins, at that segment's epoch, so that the
    sealed one can go too (the primary's first bytes for it go there)."""
    metas = control.segments(range_id)
    if copy is None or not metas:
        return []
    first = metas[0]
    held = copy.segments()
    removed = [
        info
        for info in held
        if info.base_offset < first.base_offset and info.next_offset <= first.base_offset
    ]
    deleted = []
    for info in removed:
        try:
            if info.base_offset == copy.segments()[-1].base_offset:
                if info.state is not CopyState.SEALED:
                    break  # an open copy ends the log: healing decides about it
                await copy.start_segment(first.base_offset, first.epoch)
            await copy.delete_segment(info.base_offset)
        except StorageError as error:
            log.warn(
                "Could not delete this node's copy of {range_id}@{segment}:"
                " {error}; tried again later",
                range_id=range_id,
                segment=info.base_offset,
                error=str(error),
            )
            break
        deleted.append(info.base_offset)
        log.info(
            "Deleted this node's copy of {range_id}@{segment}: retention removed the segment",
            range_id=range_id,
            segment=info.base_offset,
        )
    return deleted
