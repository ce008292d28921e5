"""Which copy a damaged sealed copy may be repaired from, decided: the pure rules behind
``logbroker.replication.repair`` (the spec's "Integrity scrub", rules 2-5). No I/O.

- **Only an intact, complete copy is a source** (rule 3). A replica reads its own copy back
  whole and says what it found (``CopyCheck``); its copy qualifies only if every checksum
  passed, it is at the segment's sealed epoch, and it holds exactly the record count and byte
  size the control plane recorded at sealing. A copy intact but short (or long) is not a
  source: fetched, it would replace one damaged copy with another.
- **Sources in replica-set order**, so that every node repairing the same segment asks the
  same one first.
- **The primary steps back first** (rule 4). A node that finds its copy damaged while it is
  first in the segment's replica set moves itself to the end, so that readers go to an intact
  copy. The range's last segment is left as it is: its first replica is the range's primary,
  which is chosen by a claim, not by a repair.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.replication.replica_codec import CheckOutcome, CopyCheck


def qualifies(check: CopyCheck | None, record: SegmentMeta) -> bool:
    """Whether a replica's answer shows a copy intact and complete against ``record`` (a
    replica that did not answer, ``None``, does not)."""
    return (
        check is not None
        and record.state is SegmentState.SEALED
        and check.outcome is CheckOutcome.INTACT
        and check.epoch == record.epoch
        and check.record_count == record.record_count
        and check.byte_size == record.byte_size
    )


def repair_sources(
    record: SegmentMeta, node_id: str, checks: Mapping[str, CopyCheck | None]
) -> list[str]:
    """The members of ``record``'s replica set, other than ``node_id``, whose copies qualify,
    in replica-set order."""
    return [
        node for node in record.replicas if node != node_id and qualifies(checks.get(node), record)
    ]


def stepped_back(record: SegmentMeta, node_id: str, is_last: bool) -> SegmentMeta | None:
    """``record`` with ``node_id`` moved to the end of its replica set, if it is first there
    (and the segment is not the range's last); ``None`` if nothing is to change."""
    replicas = record.replicas
    if is_last or len(replicas) < 2 or replicas[0] != node_id:
        return None
    return attrs.evolve(record, replicas=(*replicas[1:], node_id))


def describe(check: CopyCheck | None, record: SegmentMeta) -> str:
    """Why a replica's copy does or does not qualify, for the log."""
    if check is None:
        return "did not answer"
    if check.outcome is CheckOutcome.ABSENT:
        return f"holds no sealed copy at epoch {record.epoch}"
    if check.outcome is CheckOutcome.DAMAGED:
        return f"its copy is damaged at byte {check.position}"
    if qualifies(check, record):
        return "intact and complete"
    return (
        f"its copy is intact but holds {check.record_count} records in {check.byte_size}"
        f" bytes at epoch {check.epoch}, not {record.record_count} in {record.byte_size} at"
        f" {record.epoch}"
    )
