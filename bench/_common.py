"""What the benchmark scripts in this directory share: argument types, output, scratch
directories, starting and stopping brokers, and metering CPU and latency."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from logbroker.benchmark import ProduceReport
    from logbroker.client.blocking import BlockingClient

DEFAULT_WORK_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".work")
HOST = "127.0.0.1"
#: Development accounts of env mode ``test``: admin creates the topics, app produces and consumes.
ADMIN = ("admin", "admin123")
APP = ("app", "app123")
TWISTD = os.path.join(os.path.dirname(sys.executable), "twistd")
#: The line a broker logs once its client port listens, with the port.
LISTENING = re.compile(r"listening for clients on (\S+):(\d+)")
#: A run that has not finished this long after its window has hung (a lost connection).
RUN_GRACE_SECONDS = 30
#: ``SVC_MAX_FRAME_SIZE``'s default: a produce request must fit in one frame.
MAX_FRAME = 16 * 1024 * 1024
#: How long a process, a cluster or a topic may take to be ready.
READY_SECONDS = 60.0


def unwind_on_sigterm() -> None:
    """From now on a SIGTERM unwinds through the caller's cleanup (outside the reactor: setup
    and teardown; while the reactor runs, its own handler stops it, which unwinds the same
    way)."""
    signal.signal(signal.SIGTERM, _raise_on_sigterm)


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def announce_start(json_output: bool) -> None:
    """Print the time and the load average at the start (unless the output is JSON)."""
    if not json_output:
        started = datetime.now(UTC)
        print(f"{started:%Y-%m-%d %H:%M:%S} UTC, load average at start: {loadavg()}", flush=True)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}: {text!r}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def batch_sizes(text: str) -> list[int]:
    return [positive_int(part.strip()) for part in text.split(",")]


def emit(as_json: bool, kind: str, result: dict[str, Any], text: str, digits: int = 3) -> None:
    """Print one result: ``text`` for people, or one JSON object (floats rounded) with --json."""
    if as_json:
        rounded = {
            key: round(value, digits) if isinstance(value, float) else value
            for key, value in result.items()
        }
        print(json.dumps({"bench": kind, **rounded}), flush=True)
    else:
        print(text, flush=True)


def add_work_directory_option(parser: argparse.ArgumentParser, what: str = "measure") -> None:
    """``--dir``: where ``work_directory`` makes its scratch directory."""
    parser.add_argument(
        "--dir",
        help=f"directory on the disk to {what}; a temporary directory is created in it and "
        "removed afterwards (default: under bench/.work)",
    )


def add_load_options(
    parser: argparse.ArgumentParser,
    *,
    connections: int,
    connections_help: str,
    warmup: float,
    warmed: str,
) -> None:
    """The options of a closed-loop produce load: connections, requests in flight on each,
    records per request and their size, and the rounds (their length, a warm-up of each
    ``warmed`` thing first, how many)."""
    parser.add_argument(
        "--connections", type=positive_int, default=connections, help=connections_help
    )
    parser.add_argument(
        "--in-flight", type=positive_int, default=8, help="requests in flight per connection (8)"
    )
    parser.add_argument("--batch", type=positive_int, default=100, help="records per request (100)")
    parser.add_argument(
        "--record-bytes", type=positive_int, default=100, help="value bytes per record (100)"
    )
    parser.add_argument(
        "--seconds", type=positive_float, default=10.0, help="length of each round (10)"
    )
    parser.add_argument(
        "--warmup",
        type=positive_float,
        default=warmup,
        help=f"unrecorded run per {warmed} before the rounds, seconds ({warmup:g})",
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=3, help="rounds; the summary takes medians (3)"
    )


@contextlib.contextmanager
def work_directory(root: str | None, prefix: str) -> Iterator[str]:
    """A scratch directory on the disk to measure, removed afterwards.

    It is made in ``root`` when given, else under ``bench/.work`` (on the project's disk, not a
    tmpfs), which is removed too once no other benchmark is using it.
    """
    if root is None:
        os.makedirs(DEFAULT_WORK_ROOT, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix=prefix, dir=root or DEFAULT_WORK_ROOT) as workdir:
            yield workdir
    finally:
        if root is None:
            with contextlib.suppress(OSError):
                os.rmdir(DEFAULT_WORK_ROOT)


# -- processes ----------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind((HOST, 0))
        return [int(probe.getsockname()[1]) for probe in probes]


def stop(process: subprocess.Popen[bytes], seconds: float = 60) -> None:
    """SIGTERM (an orderly stop), then SIGKILL if it has not exited within ``seconds``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


# -- metering -----------------------------------------------------------------------------


def own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    # utime and stime are fields 14 and 15 of stat(5); fields[0] here is field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU time of this process (the load generator, ``client_cpu``) and of named groups of
    processes (all their threads, ``<name>_cpu``) since the meter was made, as cores busy on
    average over the wall time."""

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self._groups = dict(groups)
        self._started = time.perf_counter()
        self._own = own_cpu()
        self._before = {name: self._cpu(pids) for name, pids in self._groups.items()}

    @staticmethod
    def _cpu(pids: Sequence[int]) -> float:
        return sum(process_cpu(pid) for pid in pids)

    def read(self) -> dict[str, float]:
        wall = time.perf_counter() - self._started
        result = {"client_cpu": (own_cpu() - self._own) / wall}
        for name, pids in self._groups.items():
            result[f"{name}_cpu"] = (self._cpu(pids) - self._before[name]) / wall
        return result


def percentiles(report: ProduceReport) -> dict[str, float]:
    return {
        "p50_ms": report.percentile(50),
        "p99_ms": report.percentile(99),
        "p999_ms": report.percentile(99.9),
    }


def produce_result(system: str, report: ProduceReport) -> dict[str, Any]:
    return {
        "system": system,
        "records_per_s": report.records_per_second,
        "mb_per_s": report.megabytes_per_second,
        **percentiles(report),
        "requests": report.requests,
        "errors": report.errors,
    }


def produce_line(prefix: str, result: dict[str, Any]) -> str:
    line = (
        f"{prefix}  {result['system']:<16}"
        f"  records/s={result['records_per_s']:>9,.0f}"
        f"  MB/s={result['mb_per_s']:>6.1f}"
        f"  p50_ms={result['p50_ms']:>7.2f}  p99_ms={result['p99_ms']:>7.2f}"
        f"  p99.9_ms={result['p999_ms']:>7.2f}  errors={result['errors']}"
        f"  cpu client={result['client_cpu']:.2f} server={result['server_cpu']:.2f}"
    )
    if "aof_rewrites" in result:
        line += f"  aof_rewrites={result['aof_rewrites']}"
    return line


# -- brokers ------------------------------------------------------------------------------


@attrs.frozen
class Node:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: str
    data: str
    #: The ``SVC_`` settings it was started with (``restart`` starts it again with them).
    settings: Mapping[str, str] = attrs.field(eq=False, repr=False)

    @property
    def directory(self) -> str:
        return os.path.dirname(self.data)

    def client(self, account: tuple[str, str] = ADMIN) -> BlockingClient:
        from logbroker.client.blocking import BlockingClient

        return BlockingClient.connect(HOST, self.port, *account, timeout=30)


@contextlib.contextmanager
def running_node(
    name: str,
    directory: str,
    settings: Mapping[str, str],
    profile: str | None = None,
    *,
    restart: bool = False,
) -> Iterator[Node]:
    """``twistd -n logbroker`` in env mode test on free loopback ports, its output in a file;
    only ``settings`` of this process's ``SVC_`` variables reach it. With ``profile`` (a file),
    it runs under cProfile, which profiles its main (reactor) thread and writes the statistics
    to that file when it stops. ``directory`` must not exist, unless ``restart``: then it is a
    stopped node's, whose data directory is kept, and the output goes to a new file
    (``twistd-2.log``, ``twistd-3.log``...) so that the first one's is kept too."""
    os.makedirs(directory, exist_ok=restart)
    log = _new_log(directory)
    data = os.path.join(directory, "data")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.upper().startswith("SVC_") and key != "MIX_ENV"
    }
    env.update(
        SVC_ENV="test",
        SVC_DATA_DIR=data,
        SVC_BIND_HOST=HOST,
        SVC_TCP_PORT="0",
        SVC_DASHBOARD_PORT="0",
        **settings,
    )
    command = [TWISTD, "-n", "--pidfile=", "--logfile=-", "logbroker"]
    if profile is not None:
        command = [sys.executable, "-m", "cProfile", "-o", os.path.abspath(profile), *command]
    with open(log, "wb") as output:
        process = subprocess.Popen(
            command,
            cwd=directory,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + READY_SECONDS
        while True:
            match = LISTENING.search(tail(log, 400))
            if match is not None:
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{tail(log)}")
            time.sleep(0.05)
        yield Node(name, process, int(match.group(2)), log, data, dict(settings))
    finally:
        stop(process, 30)


def restarted(node: Node, profile: str | None = None) -> contextlib.AbstractContextManager[Node]:
    """``node`` (stopped or killed) started again on its directory, with its settings."""
    return running_node(node.name, node.directory, node.settings, profile, restart=True)


def _new_log(directory: str) -> str:
    """``twistd.log`` in ``directory``, or ``twistd-<n>.log`` with the first free ``n``."""
    path = os.path.join(directory, "twistd.log")
    number = 1
    while os.path.exists(path):
        number += 1
        path = os.path.join(directory, f"twistd-{number}.log")
    return path
