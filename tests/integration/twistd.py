"""Running the real ``twistd logbroker`` in a subprocess, for the integration tests."""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import attrs
from prometheus_client.parser import text_string_to_metric_families

TWISTD = str(Path(sys.executable).with_name("twistd"))
_LISTENING = re.compile(r"listening for clients on (\S+):(\d+)")
_DASHBOARD = re.compile(r"Dashboard listening on (\S+):(\d+)")


#: A ``/metrics`` exposition parsed back: (name, labels) -> value.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(dashboard_port: int, context: ssl.SSLContext | None = None) -> Samples:
    """A broker's ``/metrics`` as Prometheus reads it (HTTPS when given a ``context``)."""
    scheme = "http" if context is None else "https"
    request = urllib.request.Request(
        f"{scheme}://127.0.0.1:{dashboard_port}/metrics", headers={"Accept": "text/plain"}
    )
    with urllib.request.urlopen(request, timeout=30, context=context) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def broker_env(settings: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without its broker settings, plus ``settings``: a variable
    exported in the shell that runs the tests must not change what they see."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.upper().startswith("SVC_") and name != "MIX_ENV"
    }
    return {**env, **settings}


def run_twistd(
    cwd: Path, *args: str, settings: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """Start ``twistd -n logbroker`` in ``cwd``; the client and dashboard ports are free ones
    unless ``settings`` name them, so tests never collide on 4040 and 4041."""
    return subprocess.Popen(
        [TWISTD, "-n", "--pidfile=", "--logfile=-", "logbroker", *args],
        cwd=cwd,
        env=broker_env({"SVC_TCP_PORT": "0", "SVC_DASHBOARD_PORT": "0", **(settings or {})}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def flip_byte(path: Path, position: int | None = None) -> int:
    """Flip one bit of the byte at ``position`` (the middle by default) in place, as bit rot
    does, and return the position. Rewriting the whole file would truncate it first, and a
    running broker's scrub reading in between would find a short file, not the flip."""
    with path.open("r+b") as file:
        if position is None:
            position = file.seek(0, os.SEEK_END) // 2
        file.seek(position)
        byte = file.read(1)
        assert byte, f"{path} has no byte at {position}"
        file.seek(position)
        file.write(bytes([byte[0] ^ 0x40]))
    return position


def wait_until(check: object, seconds: float) -> None:
    """Call ``check`` every 0.1 s until it returns true; fail after ``seconds``."""
    assert callable(check)
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


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


@attrs.define
class RunningBroker:
    process: subprocess.Popen[str]
    port: int
    dashboard_port: int
    output: list[str]

    def stop(self) -> str:
        """SIGTERM, wait for the clean stop; the whole output."""
        self.process.send_signal(signal.SIGTERM)
        rest, _ = self.process.communicate(timeout=60)
        self.output.append(rest)
        return "".join(self.output)

    def kill(self) -> None:
        self.process.kill()
        rest, _ = self.process.communicate(timeout=60)
        self.output.append(rest)


@contextmanager
def running_broker(
    cwd: Path, *args: str, settings: Mapping[str, str] | None = None
) -> Iterator[RunningBroker]:
    """A broker in env mode ``test`` (development accounts seeded) that is ready for clients."""
    process = run_twistd(cwd, *args, settings={"SVC_ENV": "test", **(settings or {})})
    try:
        seen = wait_for_line(process, "listening for clients on", seconds=60)
        match = _LISTENING.search(seen[-1])
        assert match is not None, "".join(seen)
        # The dashboard port serves from the start: its line comes first.
        dashboard = next(filter(None, map(_DASHBOARD.search, seen)), None)
        assert dashboard is not None, "".join(seen)
        yield RunningBroker(process, int(match.group(2)), int(dashboard.group(2)), seen)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=60)
