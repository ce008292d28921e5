"""``twistd logbroker`` as a real process: plugin discovery, recovery at start, clean stop."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
from twisted.application.service import IServiceMaker
from twisted.plugin import getPlugins

from logbroker.storage import SYNC_THREAD, shared_sync_refusal
from tests.integration.twistd import TWISTD, broker_env, run_twistd, wait_for_line

pytestmark = pytest.mark.integration


def test_plugin_is_found_by_twisted() -> None:
    makers = {maker.tapname: maker for maker in getPlugins(IServiceMaker)}

    assert "logbroker" in makers
    assert "log broker" in makers["logbroker"].description


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
    assert broker.returncode == 0, output
    assert "Server Shut Down" in output
    assert "1 ranges in" in output
    assert "native batch encoder" in output
    if shared_sync_refusal() is None:
        thread = "the native sync thread" if SYNC_THREAD == "native" else "a Python thread"
        assert f"one sync for every range's writes, on {thread}" in output
    else:
        assert "SVC_FSYNC_SCOPE=filesystem cannot be used here" in output
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


@pytest.mark.parametrize(
    ("settings", "args", "line"),
    [
        (
            {"SVC_SEGMENT_MAX_BYTES": "64MB"},
            [],
            "SVC_SEGMENT_MAX_BYTES='64MB' is invalid: expected an integer from 1024 to 4294967295",
        ),
        (
            {"SVC_TCP_PORT": "abc"},
            [],
            "SVC_TCP_PORT='abc' is invalid: expected an integer from 0 to 65535",
        ),
        (
            {"SVC_TCP_PORT": "4040"},
            ["--port", "abc"],
            "SVC_TCP_PORT='abc' is invalid: expected an integer from 0 to 65535",
        ),
        (
            {},
            ["--env", "prod"],
            "SVC_DATA_DIR is not set: expected an absolute path, which prod requires",
        ),
    ],
)
def test_twistd_names_a_bad_setting_in_one_line_and_exits_with_status_2(
    tmp_path: Path, settings: dict[str, str], args: list[str], line: str
) -> None:
    broker = subprocess.run(
        [TWISTD, "-n", "--pidfile=", "logbroker", *args],
        cwd=tmp_path,
        env=broker_env(settings),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert broker.returncode == 2, broker.stderr
    assert broker.stderr.splitlines() == [f"logbroker: {line}"]


def test_twistd_warns_about_an_unknown_setting_by_name_and_still_starts(tmp_path: Path) -> None:
    broker = run_twistd(tmp_path, settings={"SVC_TYPO_PORT": "4040"})
    try:
        seen = wait_for_line(broker, "Storage ready")
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.communicate(timeout=30)

    warning = "logbroker: warning: unknown setting SVC_TYPO_PORT is ignored"
    assert f"{warning} (did you mean SVC_TCP_PORT?)\n" in seen, "".join(seen)


def test_twistd_flags_override_the_environment(tmp_path: Path) -> None:
    # A bad SVC_TCP_PORT would stop the boot (above); the flag's value replaces it.
    broker = run_twistd(
        tmp_path,
        "--port",
        "0",
        "--data-dir",
        str(tmp_path / "elsewhere"),
        settings={"SVC_TCP_PORT": "abc", "SVC_DATA_DIR": str(tmp_path / "from-env")},
    )
    try:
        seen = wait_for_line(broker, "Storage ready")
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.communicate(timeout=30)

    warnings = [line for line in seen if "logbroker: warning:" in line]
    # A single node on the defaults has nothing to warn of.
    assert warnings == [], "".join(seen)
    assert (tmp_path / "elsewhere" / "FORMAT").exists()
    assert not (tmp_path / "from-env").exists()


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


def test_a_node_keeps_its_id_and_refuses_another_one_for_its_data(tmp_path: Path) -> None:
    first = run_twistd(tmp_path, settings={"SVC_NODE_ID": "broker-1"})
    try:
        seen = wait_for_line(first, "This node is broker-1")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    assert (tmp_path / "data" / "NODE_ID").read_text() == "broker-1\n", "".join(seen)

    again = run_twistd(tmp_path)
    try:
        wait_for_line(again, "This node is broker-1")
    finally:
        again.send_signal(signal.SIGTERM)
        again.communicate(timeout=30)

    other = run_twistd(tmp_path, settings={"SVC_NODE_ID": "broker-2"})
    output, _ = other.communicate(timeout=60)
    assert other.returncode == 2, output
    assert "SVC_NODE_ID='broker-2' is invalid: expected broker-1, the id of the node" in output


def test_a_damaged_control_state_stops_the_boot_with_status_1_naming_the_file(
    tmp_path: Path,
) -> None:
    control = tmp_path / "data" / "control"
    control.mkdir(parents=True)
    (tmp_path / "data" / "FORMAT").write_text("logbroker storage format 1\n")
    (control / "state.json").write_text('{"format":1,"crc32c":1,"state":{}}\n')

    broker = run_twistd(tmp_path)
    output, _ = broker.communicate(timeout=60)

    assert broker.returncode == 1, output
    assert "The broker could not get ready:" in output
    assert str(control / "state.json") in output
    assert "Traceback" not in output
