"""A control plane process killed with SIGKILL mid-stream loses none of its acknowledged
changes, and leaves a state file that parses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from logbroker.controlplane import LocalControlPlane
from logbroker.storage import OsFileSystem
from logbroker.testing import ImmediateExecutor
from tests.integration.controlplane_writer import cursor, password_hash
from tests.unit.storage.helpers import result_of

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_sigkilled_control_plane_loses_no_acknowledged_change(tmp_path: Path) -> None:
    directory = tmp_path / "control"
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.controlplane_writer", str(directory), "16"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    acks: list[list[str]] = []
    try:
        assert writer.stdout.readline().strip() == "ready"
        for line in writer.stdout:
            acks.append(line.split())
            if len(acks) >= 3000:
                break
        os.kill(writer.pid, signal.SIGKILL)
        rest, _ = writer.communicate(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    # Acknowledgements printed before the kill landed also count.
    acks.extend(line.split() for line in rest.splitlines() if line.startswith("ack "))
    assert writer.returncode == -signal.SIGKILL

    json.loads((directory / "state.json").read_bytes())
    control = LocalControlPlane(str(directory), fs=OsFileSystem(), executor=ImmediateExecutor())
    result_of(control.start())
    assert not (directory / "state.json.tmp").exists()
    latest: dict[str, int] = {}
    for ack in acks:
        match ack:
            case ["ack", "topic", name]:
                assert control.topic(name) is not None, name
            case ["ack", "user", name]:
                user = control.user(name)
                assert user is not None, name
                assert user.password_hash == password_hash(int(name[1:]))
            case ["ack", "position", group, sequence]:
                latest[group] = max(latest.get(group, 0), int(sequence))
            case _:
                raise AssertionError(ack)
    assert len(latest) == 3
    for group, sequence in latest.items():
        # Later commits may have landed unacknowledged; earlier ones never win.
        stored = control.group_position("orders", group)
        assert stored is not None
        assert stored >= cursor(sequence), group
    result_of(control.close())
