"""Salvage of a single node's damaged segments, offline (``logbroker storage salvage``).

Recovery never truncates a copy damaged by rot (the spec's rule 7): the frames after the damage
stay on disk for this. On a single node there is no other copy to repair from, and reads of a
range stop at its damage, so one flipped byte hides every later record of the range, intact
sealed segments included. Salvage is the operator's way back, with the broker stopped:

1. Each damaged segment's files are copied, as they are, into ``<data dir>/salvage/<range>/``
   (for forensics), then removed.
2. What of it still verifies is written back as sealed segments of their own: the whole
   batches before the damage at the segment's base offset, and each run of whole batches found
   after it (every batch and record checksum passing, offsets in order) at its first offset.
   The records of the damaged batches are lost; a read of the range goes from the last record
   before the damage to the first one after it.
3. If the damaged segment was the range's last, an empty active segment is started past every
   offset the damaged copy may hold, so that no new record takes the offset of a lost one.
4. The control plane's records of the damaged segments are removed; the broker records the
   segments it finds at its next start.

``plan_salvage`` (no I/O) decides what is kept; ``salvage_range`` carries it out.
"""

from __future__ import annotations

import time

import attrs

from logbroker.storage._format import (
    BATCH_MAGIC,
    Damage,
    batch_claim,
    decode_seal,
    scan_batches,
)
from logbroker.storage._fs import FileSystem
from logbroker.storage._jobs import _delete_files, _seal_files
from logbroker.storage._segment import (
    LOG_SUFFIX,
    SEAL_SUFFIX,
    group_segment_files,
    salvage_end_offset,
    sealed_files,
    segment_stem,
)
from logbroker.storage.inspect import segment_report

#: Where a batch header's magic lies within it.
_MAGIC_AT = 4
#: Where a batch header's base offset lies within it, and its header's length.
_BASE_AT = 12
_HEADER = 28
#: The directory, inside the data directory, damaged segments are set aside in.
SALVAGE_DIRECTORY = "salvage"


@attrs.frozen
class Run:
    """Whole, verified batches kept from a damaged segment."""

    base_offset: int
    record_count: int
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes>")

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count


@attrs.frozen
class SalvagePlan:
    base_offset: int
    damage: Damage
    #: What is kept, in offset order.
    runs: tuple[Run, ...]
    #: Past every offset the damaged copy may hold: where the range may go on from.
    resume_offset: int


def plan_salvage(data: bytes, base_offset: int) -> SalvagePlan | None:
    """What of a segment whose log is ``data`` is kept; ``None`` if it is not damaged."""
    scan = scan_batches(data, 0, base_offset)
    if scan.damage is None:
        return None
    runs: list[Run] = []
    expected = base_offset
    if scan.batches:
        expected = scan.batches[-1].next_offset
        runs.append(Run(base_offset, expected - base_offset, bytes(data[: scan.end])))
    resume = salvage_end_offset(data, scan.end, expected)
    found = data.find(BATCH_MAGIC, scan.end + 1 + _MAGIC_AT)
    while found != -1:
        start = found - _MAGIC_AT
        if start + _HEADER <= len(data):
            base = int.from_bytes(data[start + _BASE_AT : start + _BASE_AT + 8], "big")
            claimed = batch_claim(data, start, base)
            if claimed is not None and base >= expected:
                # A sane header past the damage, even of a damaged batch, says offsets its
                # records may hold: the range never goes on from below them.
                resume = max(resume, claimed)
            after = scan_batches(data, start, base)
            if after.batches and base >= expected:
                expected = after.batches[-1].next_offset
                runs.append(Run(base, expected - base, bytes(data[start : after.end])))
                resume = max(resume, expected)
                if after.damage is None:
                    break
                resume = max(resume, salvage_end_offset(data, after.end, expected))
                found = data.find(BATCH_MAGIC, after.end + 1 + _MAGIC_AT)
                continue
        found = data.find(BATCH_MAGIC, found + 1)
    return SalvagePlan(base_offset, scan.damage, tuple(runs), resume)


@attrs.frozen
class Salvaged:
    """What salvage did to one damaged segment."""

    range_name: str
    plan: SalvagePlan
    #: Where its files were set aside.
    kept_in: str
    #: The empty active segment started after it (its base offset), when it was the last.
    started: int | None


def salvage_range(fs: FileSystem, data_path: str, range_name: str) -> list[Salvaged]:
    """Salvage every damaged segment of ``range_name`` (a torn tail of an unsealed segment is
    not damage: recovery drops it). Blocking; the broker must be stopped (the caller holds the
    data directory's lock)."""
    directory = f"{data_path}/ranges/{range_name}"
    groups, _ = group_segment_files(fs, directory)
    bases = sorted(base for base, kinds in groups.items() if "log" in kinds)
    salvaged = []
    for base in bases:
        stem = f"{directory}/{segment_stem(base)}"
        report = segment_report(fs, range_name, stem, base, "sealed" in groups[base])
        if not report.damaged:
            continue
        plan = plan_salvage(fs.read_file(stem + LOG_SUFFIX), base)
        if plan is None:
            continue  # the seal marker alone is damaged: healing the marker is not salvage
        sealed_count = _sealed_count(fs, stem)
        kept_in = _set_aside(fs, data_path, range_name, stem, groups[base])
        _delete_files(fs, directory, stem)
        for run in plan.runs:
            _write_sealed(fs, f"{directory}/{segment_stem(run.base_offset)}{LOG_SUFFIX}", run)
        started = None
        if base == bases[-1]:
            started = max(plan.resume_offset, base + (sealed_count or 0))
            active = f"{directory}/{segment_stem(started)}{LOG_SUFFIX}"
            if not fs.exists(active):
                fs.write_atomic(active, b"")
        fs.sync_dir(directory)
        salvaged.append(Salvaged(range_name, plan, kept_in, started))
    return salvaged


def _set_aside(fs: FileSystem, data_path: str, range_name: str, stem: str, kinds: set[str]) -> str:
    """Copy a segment's files, as they are, out of the range's directory; where to."""
    name = stem.rsplit("/", 1)[1]
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept_in = f"{data_path}/{SALVAGE_DIRECTORY}/{range_name}/{name}-{stamp}"
    fs.make_dirs(kept_in)
    for kind in sorted(kinds):
        fs.write_atomic(f"{kept_in}/{name}.{kind}", fs.read_file(f"{stem}.{kind}"))
    fs.sync_dir(kept_in)
    return kept_in


def _write_sealed(fs: FileSystem, path: str, run: Run) -> None:
    """A run of verified batches as a sealed segment: its sidecars, then its log."""
    sealed = sealed_files(run.data, run.base_offset)
    if sealed is None:
        raise ValueError(f"the batches kept for {path} do not verify whole")
    _seal_files(fs, path, sealed.seal, sealed.index, None)
    fs.write_atomic(path, run.data)


def _sealed_count(fs: FileSystem, stem: str) -> int | None:
    """The record count a segment's seal marker records, if it has a readable one."""
    try:
        return decode_seal(fs.read_file(stem + SEAL_SUFFIX)).record_count
    except (OSError, ValueError):
        return None
