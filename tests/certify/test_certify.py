"""The certification in every test run: its short form must certify all six guarantees, and
its negative controls must fail, so that a pass means something.

Each runs the harness as an operator would (``python -m tests.certify --short``), as root in
network namespaces of its own (docs/certification.md), and reads the table it ends with.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
_ROW = re.compile(r"^([1-6])  .*?  (passed|FAILED|not exercised)\s+(.*)$", re.MULTILINE)


@pytest.fixture(autouse=True)
def as_root() -> None:
    assert os.geteuid() == 0, (
        "the certification makes network namespaces, firewall rules and a tmpfs: run the suite"
        " as root, as CI does"
    )


def certify(directory: Path, *arguments: str) -> tuple[int, str, dict[int, tuple[str, str]]]:
    """Run the short form; its exit status, its output and its table (guarantee -> verdict,
    evidence)."""
    command = [sys.executable, "-m", "tests.certify", "--short", "--directory", str(directory)]
    done = subprocess.run(
        [*command, *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    output = done.stdout + done.stderr
    table = {int(m.group(1)): (m.group(2), m.group(3)) for m in _ROW.finditer(done.stdout)}
    return done.returncode, output, table


def test_the_short_form_certifies_all_six_guarantees(tmp_path: Path) -> None:
    code, output, table = certify(tmp_path / "run")
    # The timeline and the table, shown with -s or -rP (and in the failure below).
    print(output)
    assert code == 0, output
    assert sorted(table) == [1, 2, 3, 4, 5, 6], output
    assert {verdict for verdict, _ in table.values()} == {"passed"}, output
    assert "CERTIFIED: all six guarantees passed" in output
    assert " 0 lost, 0 read twice" in table[1][1]


def test_brokers_that_acknowledge_before_a_quorum_fail_guarantee_1(tmp_path: Path) -> None:
    drills = "partitioned power-kill"
    code, output, table = certify(tmp_path / "run", "--unsafe-acks", "--drills", drills)
    print(output)
    assert code == 1, output
    verdict, evidence = table[1]
    assert verdict == "FAILED", output
    assert re.search(r"[1-9]\d* acknowledged values lost", evidence), evidence
    # And the drill itself saw the cut primary acknowledge what it took during the cut.
    assert re.search(r"acknowledged [1-9]\d* of the produces its clients began", evidence), evidence
    assert "kept for inspection" in output


def test_a_flipped_byte_with_the_scrub_off_fails_guarantee_4_naming_it(tmp_path: Path) -> None:
    code, output, table = certify(tmp_path / "run", "--scrub-off", "--drills", "storage faults")
    print(output)
    assert code == 1, output
    rot = re.search(r"bit rot \(byte \d+ of \d+ flipped\): (n\d)'s copy of (\S+) ", output)
    assert rot is not None, output
    node, segment = rot.groups()
    verdict, evidence = table[4]
    assert verdict == "FAILED", output
    assert f"{segment} on {node}: differs" in evidence, evidence
    # Guarantee 6 still holds: the damage was done to follower copies only.
    assert table[6][0] == "passed", output


def test_an_interrupted_run_removes_every_namespace_and_mount_it_made(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    command = [sys.executable, "-m", "tests.certify", "--short", "--directory", str(directory)]
    run = subprocess.Popen(
        [*command, "--drills", "stall"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert run.stdout is not None
    seen = []
    for line in run.stdout:
        seen.append(line)
        if "== drill 1/1" in line:
            break
    run.send_signal(signal.SIGINT)  # Ctrl-C, in the middle of the drill
    rest, _ = run.communicate(timeout=300)
    output = "".join(seen) + rest

    assert run.returncode != 0, output
    assert "kept for inspection" in output
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "lbcert-" not in namespaces, namespaces
    assert str(directory) not in Path("/proc/mounts").read_text(), "the tmpfs is unmounted"
    assert (directory / "n3" / "broker.log").exists(), "each node's log is kept"
