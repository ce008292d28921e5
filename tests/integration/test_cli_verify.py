"""``logbroker storage verify`` on real files: damage is reported with its byte position,
and no file changes size (or content) on open or on verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock

from logbroker.storage import DataDirectory, OsFileSystem, RangeLog
from logbroker.storage._format import scan_batches
from logbroker.testing import ImmediateExecutor
from tests.unit.storage.helpers import append_each, result_of

pytestmark = pytest.mark.integration

LOGBROKER = str(Path(sys.executable).with_name("logbroker"))


def run_verify(data_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LOGBROKER, "storage", "verify", str(data_dir), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def sealed_range(data_dir: Path) -> Path:
    fs = OsFileSystem()
    range_dir = DataDirectory.open(str(data_dir), fs).range_path("orders/0")
    log = result_of(RangeLog.open(range_dir, fs=fs, clock=Clock(), executor=ImmediateExecutor()))
    append_each(log, 0, 20)
    result_of(log.roll())
    append_each(log, 20, 3)
    result_of(log.close())
    return Path(range_dir) / f"{0:020d}.log"


def test_clean_data_directory_verifies(tmp_path: Path) -> None:
    sealed_range(tmp_path / "data")

    result = run_verify(tmp_path / "data")

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert all("verified" in line for line in lines)
    assert "2 segments checked, 0 damaged" in result.stderr


def test_flipped_byte_in_sealed_segment_is_reported_with_its_position(
    tmp_path: Path, logged_errors: list[dict[str, Any]]
) -> None:
    segment = sealed_range(tmp_path / "data")
    batches = scan_batches(segment.read_bytes()).batches
    record_start = batches[12].position + 24  # the record frame inside the 13th batch
    flipped = record_start + 35
    with open(segment, "r+b") as f:
        f.seek(flipped)
        original = f.read(1)
        f.seek(flipped)
        f.write(bytes([original[0] ^ 0x01]))
    before = segment.read_bytes()

    result = run_verify(tmp_path / "data")
    as_json = run_verify(tmp_path / "data", "--json")

    assert result.returncode == 1
    assert f"DAMAGED at byte {record_start} (checksum)" in result.stdout
    assert "1 damaged" in result.stderr
    damaged = next(json.loads(line) for line in as_json.stdout.splitlines())
    assert damaged["damage"] == {"position": record_start, "reason": "checksum"}
    assert damaged["record_count"] == 12
    assert segment.read_bytes() == before

    # Opening the range (what the broker does at start) does not change the file either.
    log = result_of(
        RangeLog.open(
            str(segment.parent), fs=OsFileSystem(), clock=Clock(), executor=ImmediateExecutor()
        )
    )
    verification = result_of(log.verify_segment(0))
    result_of(log.close())
    assert [event["reason"] for event in logged_errors] == ["checksum"]
    logged_errors.clear()
    assert verification.damage is not None
    assert verification.damage.position == record_start
    assert os.path.getsize(segment) == len(before)
    assert segment.read_bytes() == before


def test_torn_tail_of_the_active_segment_is_reported_but_not_damage(tmp_path: Path) -> None:
    sealed_range(tmp_path / "data")
    active = tmp_path / "data" / "ranges" / "orders" / "0" / f"{20:020d}.log"
    size = active.stat().st_size
    with open(active, "ab") as f:
        f.write(b"LB\x01\x00\x00\x00")

    result = run_verify(tmp_path / "data")

    assert result.returncode == 0
    assert f"torn tail at byte {size}" in result.stdout
    assert active.stat().st_size == size + 6


def test_newer_format_is_refused_with_exit_status_3(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "FORMAT").write_text("logbroker storage format 2\n")

    result = run_verify(tmp_path / "data")

    assert result.returncode == 3
    assert "uses storage format 2" in result.stderr
    assert "formats up to 1" in result.stderr
