"""A writer process killed with SIGKILL mid-stream loses none of its acknowledged appends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from twisted.internet.task import Clock

from logbroker.storage import LogConfig, OsFileSystem, RangeLog
from logbroker.testing import ImmediateExecutor
from tests.integration.writer import batch_records
from tests.unit.storage.helpers import result_of

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("group_commit", "batch"), [(False, 1), (True, 1), (False, 50), (True, 50)]
)
def test_sigkilled_writer_loses_no_acknowledged_append(
    tmp_path: Path, group_commit: bool, batch: int
) -> None:
    directory = str(tmp_path / "range")
    writer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.writer",
            directory,
            "20000",
            "1" if group_commit else "0",
            str(batch),
            "16",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    acks: list[tuple[int, int, int]] = []
    try:
        assert writer.stdout.readline().strip() == "ready"
        for line in writer.stdout:
            _, base, count, sequence = line.split()
            acks.append((int(base), int(count), int(sequence)))
            if len(acks) >= 1500:
                break
        os.kill(writer.pid, signal.SIGKILL)
        rest, _ = writer.communicate(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    # Acknowledgements printed before the kill landed also count.
    for line in rest.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "ack":
            acks.append((int(parts[1]), int(parts[2]), int(parts[3])))
    assert writer.returncode == -signal.SIGKILL

    log = result_of(
        RangeLog.open(
            directory,
            fs=OsFileSystem(),
            clock=Clock(),
            executor=ImmediateExecutor(),
            config=LogConfig(roll_bytes=20000),
        )
    )
    try:
        assert len(log.segments()) > 2, "the stream should have crossed segment rolls"
        highest = max(base + count for base, count, _ in acks)
        assert log.end_offset >= highest
        for base, count, sequence in acks:
            stored = log.read(base, max_records=count)
            assert [s.offset for s in stored] == list(range(base, base + count))
            assert [s.record for s in stored] == batch_records(sequence, batch)
    finally:
        result_of(log.close())
