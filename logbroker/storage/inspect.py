"""Read-only checks of a data directory, for operators (``logbroker storage verify``).

Unlike opening a range log, nothing here changes a file: a torn tail is reported, not dropped.
"""

from __future__ import annotations

import attrs

from logbroker.storage._format import Damage, DamageReason, decode_seal
from logbroker.storage._fs import FileSystem
from logbroker.storage._segment import (
    LOG_SUFFIX,
    SEAL_SUFFIX,
    Verification,
    group_segment_files,
    segment_stem,
    verify_segment_bytes,
)
from logbroker.storage.store import DataDirectory


@attrs.frozen
class SegmentReport:
    range_name: str
    path: str
    sealed: bool
    verification: Verification
    #: The damage is only a torn tail of a segment without its own seal marker: never
    #: acknowledged, and recovery drops it when the broker opens the range.
    torn_tail: bool

    @property
    def damaged(self) -> bool:
        return self.verification.damage is not None and not self.torn_tail


def segment_report(
    fs: FileSystem, range_name: str, stem: str, base: int, has_marker: bool
) -> SegmentReport:
    """The verification of one segment's files (changing nothing)."""
    path = stem + LOG_SUFFIX
    data = fs.read_file(path)
    seal = None
    if has_marker:
        try:
            seal = decode_seal(fs.read_file(stem + SEAL_SUFFIX))
            if seal.base_offset != base:
                raise ValueError(f"seal marker names base offset {seal.base_offset}")
        except ValueError:
            bad_marker = Verification(base, Damage(0, DamageReason.METADATA), 0, 0)
            return SegmentReport(range_name, path, True, bad_marker, False)
    verification = verify_segment_bytes(data, base, seal)
    damage = verification.damage
    torn = damage is not None and damage.torn and not has_marker
    return SegmentReport(range_name, path, has_marker, verification, torn)


def verify_data_directory(path: str, fs: FileSystem) -> list[SegmentReport]:
    """Verify every segment of every range under ``path``. Blocking; reads every byte."""
    data_dir = DataDirectory.open(path, fs, create=False)
    reports = []
    for range_name in data_dir.range_names():
        directory = data_dir.range_path(range_name)
        groups, _ = group_segment_files(fs, directory)
        bases = sorted(base for base, kinds in groups.items() if "log" in kinds)
        for base in bases:
            stem = f"{directory}/{segment_stem(base)}"
            has_marker = "sealed" in groups[base]
            reports.append(segment_report(fs, range_name, stem, base, has_marker))
    return reports
