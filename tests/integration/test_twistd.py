"""``twistd logbroker`` as a real process: plugin discovery, recovery at start, clean stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from twisted.application.service import IServiceMaker
from twisted.plugin import getPlugins

pytestmark = pytest.mark.integration

TWISTD = str(Path(sys.executable).with_name("twistd"))


def test_plugin_is_found_by_twisted() -> None:
    makers = {maker.tapname: maker for maker in getPlugins(IServiceMaker)}

    assert "logbroker" in makers
    assert "log broker" in makers["logbroker"].description


def run_twistd(cwd: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [TWISTD, "-n", "--pidfile=", "--logfile=-", "logbroker", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_line(process: subprocess.Popen[str], needle: str, seconds: float = 30) -> list[str]:
    assert process.stdout is not None
    seen = []
    deadline = time.monotonic() + seconds
    for line in process.stdout:
        seen.append(line)
        if needle in line or time.monotonic() > deadline:
            break
    assert any(needle in line for line in seen), "".join(seen)
    return seen


def test_twistd_recovers_the_data_directory_and_stops_cleanly(tmp_path: Path) -> None:
    range_dir = tmp_path / "data" / "ranges" / "t" / "0"
    range_dir.mkdir(parents=True)
    (tmp_path / "data" / "FORMAT").write_text("logbroker storage format 1\n")
    (range_dir / f"{0:020d}.log").write_bytes(b"LB\x01\x00\x00")  # a torn first frame

    broker = run_twistd(tmp_path)
    try:
        seen = wait_for_line(broker, "Storage ready")
        broker.send_signal(signal.SIGTERM)
        rest, _ = broker.communicate(timeout=30)
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait()

    output = "".join(seen) + rest
    # After a clean shutdown twistd re-raises the signal it stopped on, as init systems expect.
    assert broker.returncode == -signal.SIGTERM, output
    assert "Server Shut Down" in output
    assert "1 ranges in" in output
    assert "native batch encoder" in output
    assert "Torn tail" in output
    assert "every range flushed and fsynced" in output
    assert (range_dir / f"{0:020d}.log").stat().st_size == 0


def test_twistd_refuses_a_newer_format_with_exit_status_3(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "FORMAT").write_text("logbroker storage format 7\n")

    broker = run_twistd(tmp_path, "--data-dir", str(tmp_path / "data"))
    output, _ = broker.communicate(timeout=60)

    assert broker.returncode == 3, output
    assert "uses storage format 7" in output


def test_twistd_names_a_bad_setting_and_exits_with_status_2(tmp_path: Path) -> None:
    broker = subprocess.run(
        [TWISTD, "-n", "--pidfile=", "logbroker"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "SVC_SEGMENT_MAX_BYTES": "64MB"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert broker.returncode == 2
    assert "SVC_SEGMENT_MAX_BYTES='64MB' is invalid" in broker.stderr


def test_twistd_exits_with_status_1_when_a_range_cannot_be_recovered(tmp_path: Path) -> None:
    range_dir = tmp_path / "data" / "ranges" / "t" / "0"
    range_dir.mkdir(parents=True)
    (tmp_path / "data" / "FORMAT").write_text("logbroker storage format 1\n")
    (range_dir / f"{0:020d}.log").symlink_to(tmp_path / "gone")

    broker = run_twistd(tmp_path)
    output, _ = broker.communicate(timeout=60)

    assert broker.returncode == 1, output
    assert "storage recovery failed" in output
    assert f"{0:020d}.log" in output


def test_a_second_broker_on_the_same_data_directory_is_refused(tmp_path: Path) -> None:
    first = run_twistd(tmp_path)
    try:
        wait_for_line(first, "Storage ready")
        second = run_twistd(tmp_path)
        output, _ = second.communicate(timeout=60)
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)

    assert second.returncode == 1, output
    assert "in use by another logbroker process" in output
