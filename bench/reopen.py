"""Reopen time of a ~1 GiB range after the process writing it was SIGKILLed.

What it measures: the wall time of ``RangeLog.open`` (recovery: list the directory, trust each
sealed segment by its seal marker and file size and load its index sidecar, read and scan only
the unsealed active segment, cut a torn tail) on a range of about ``--size-mib`` MiB, in a fresh
Python process each time, on the real reactor with ``OsFileSystem`` and ``ThreadPoolExecutor``.
The time runs from the call to the Deferred firing with the log. Target: at most 2 s.

Why: after a crash every range on the node reopens before it serves again, so recovery must not
scale with the size of the range; only the active segment is scanned.

How the range is built: a child process (this script with a hidden option) appends batches of
``--batch`` records of 100-byte values to a ``RangeLog`` with the default configuration (64 MiB
roll size) in a closed loop of 16 outstanding appends. The parent watches the directory and
sends SIGKILL once the segment files hold at least ``--size-mib`` MiB and the newest (active)
segment holds at least ``--tail-mib`` MiB, so the kill lands mid-stream with a partly filled
active segment, often in the middle of a write. The build stops with an error after
``--build-timeout`` seconds (the default 1 GiB takes about 10 s).

The figures, each from its own fresh process:

* first: the first open after the kill, which also truncates the torn tail, if any;
* cold: page cache dropped first (``sync; echo 3 > /proc/sys/vm/drop_caches``, needs root; this
  also empties the page cache of anything else running on the machine; ``--no-cold`` skips it),
  median of ``--repeat`` runs. The first open is cold too when dropping is possible;
* warm: after one untimed open, median of ``--repeat`` runs with the files in the page cache.

``process_s`` is the whole child process (interpreter start, imports, open, close) for context.

Run it from the repository root with the project's virtualenv (about 30 s)::

    .venv/bin/python bench/reopen.py
    .venv/bin/python bench/reopen.py --size-mib 256 --repeat 3 --json
    .venv/bin/python bench/reopen.py --tail-mib 63        # worst case: a nearly full tail

``--dir`` names a directory on the disk to measure; a temporary directory is created in it and
removed afterwards. The default is a temporary directory under ``bench/.work`` (on the same file
system as the working tree; ``bench/.work`` itself is removed again when left empty). Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from _common import add_work_directory_option, emit, positive_int, work_directory
from twisted.internet import task
from twisted.internet.defer import Deferred, ensureDeferred
from twisted.python.failure import Failure

from logbroker.storage import (
    IntegrityEvent,
    LogConfig,
    OsFileSystem,
    RangeLog,
    Record,
    ThreadPoolExecutor,
)

TARGET_SECONDS = 2.0
WRITER_CONCURRENCY = 16
POLL_SECONDS = 0.02
DROP_CACHES = "/proc/sys/vm/drop_caches"


# -- the writer child ------------------------------------------------------------------------


async def _write_forever(reactor: Any, directory: str, batch: int, record_bytes: int) -> None:
    executor = ThreadPoolExecutor(reactor)
    executor.start()
    log = await RangeLog.open(
        directory, fs=OsFileSystem(), clock=reactor, executor=executor, config=LogConfig()
    )
    records = [
        Record(os.urandom(record_bytes), timestamp_ms=1_700_000_000_000 + i) for i in range(batch)
    ]
    failed: Deferred[None] = Deferred()

    def issue() -> None:
        log.append(records).addCallbacks(lambda _: issue(), fail)

    def fail(failure: Failure) -> None:
        if not failed.called:
            failed.errback(failure)

    for _ in range(WRITER_CONCURRENCY):
        issue()
    await failed  # appends go on until the parent kills this process


# -- the open child --------------------------------------------------------------------------


async def _open_once(reactor: Any, directory: str) -> None:
    executor = ThreadPoolExecutor(reactor)
    executor.start()
    events: list[IntegrityEvent] = []
    try:
        started = time.perf_counter()
        log = await RangeLog.open(
            directory,
            fs=OsFileSystem(),
            clock=reactor,
            executor=executor,
            on_integrity_event=events.append,
        )
        open_s = time.perf_counter() - started
        segments = log.segments()
        await log.close()
    finally:
        executor.stop()
    print(
        json.dumps(
            {
                "open_s": open_s,
                "segments": len(segments),
                "sealed": sum(1 for s in segments if s.state.value == "sealed"),
                "active_bytes": segments[-1].byte_size if segments else 0,
                "bytes": sum(s.byte_size for s in segments),
                "records": log.end_offset - log.start_offset,
                "events": [f"{e.reason.value}@{e.position}" for e in events],
            }
        ),
        flush=True,
    )


# -- the parent ------------------------------------------------------------------------------


def _segment_sizes(directory: str) -> list[int]:
    """Sizes of the segment log files, oldest first (names are zero-padded base offsets)."""
    with os.scandir(directory) as entries:
        logs = sorted(
            (entry.name, entry.stat().st_size)
            for entry in entries
            if entry.name.endswith(".log") and entry.is_file()
        )
    return [size for _, size in logs]


def build_range(
    directory: str, size_mib: int, tail_mib: int, batch: int, timeout: float
) -> dict[str, Any]:
    """Run the writer child until the range is big enough, then SIGKILL it."""
    os.makedirs(directory)
    command = [sys.executable, os.path.abspath(__file__), "--writer-child", directory]
    command += ["--batch", str(batch)]
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while True:
            if child.poll() is not None:
                error = child.stderr.read().decode() if child.stderr else ""
                raise RuntimeError(f"writer child exited with {child.returncode}:\n{error}")
            sizes = _segment_sizes(directory)
            total = sum(sizes)
            if total >= size_mib * 2**20 and sizes and sizes[-1] >= tail_mib * 2**20:
                break
            if time.perf_counter() - started > timeout:
                raise RuntimeError(
                    f"the build reached only {total / 2**20:.0f} MiB in {timeout:g} s"
                )
            time.sleep(POLL_SECONDS)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        elapsed = time.perf_counter() - started
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stderr is not None:
            child.stderr.close()
    names = os.listdir(directory)
    sizes = _segment_sizes(directory)
    return {
        "build_s": elapsed,
        "build_mb_per_s": sum(sizes) / elapsed / 1e6,
        "files": len(names),
        "segments": len(sizes),
        "seal_markers": sum(1 for name in names if name.endswith(".sealed")),
        "bytes_on_disk": sum(sizes),
        "active_bytes_on_disk": sizes[-1] if sizes else 0,
    }


def drop_caches() -> bool:
    """Write back and drop the page cache; False if this process is not allowed to."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def open_in_child(directory: str) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--open-child", directory]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    process_s = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"open child exited with {done.returncode}:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = process_s
    return result


def _describe(run: dict[str, Any]) -> str:
    events = ", ".join(run["events"]) or "none"
    return (
        f"open={run['open_s'] * 1000:7.1f} ms  process={run['process_s'] * 1000:7.1f} ms  "
        f"segments={run['segments']} (sealed {run['sealed']})  "
        f"active={run['active_bytes'] / 2**20:.1f} MiB  events: {events}"
    )


def _summary(args: argparse.Namespace, kind: str, runs: list[dict[str, Any]]) -> float:
    opens = [run["open_s"] for run in runs]
    median = statistics.median(opens)
    emit(
        args.json,
        "reopen_summary",
        {
            "cache": kind,
            "runs": len(runs),
            "median_open_s": median,
            "min_open_s": min(opens),
            "max_open_s": max(opens),
            "median_process_s": statistics.median(run["process_s"] for run in runs),
            "target_s": TARGET_SECONDS,
            "target_met": median <= TARGET_SECONDS,
        },
        f"{kind:<5} median open={median * 1000:7.1f} ms  (min {min(opens) * 1000:.1f}, "
        f"max {max(opens) * 1000:.1f}, {len(runs)} runs)  target <= {TARGET_SECONDS:g} s: "
        f"{'met' if median <= TARGET_SECONDS else 'MISSED'}",
    )
    return median


def run_parent(args: argparse.Namespace, workdir: str) -> None:
    directory = os.path.join(workdir, "range")
    build = build_range(directory, args.size_mib, args.tail_mib, args.batch, args.build_timeout)
    emit(
        args.json,
        "reopen_build",
        build,
        f"built {build['bytes_on_disk'] / 2**20:.0f} MiB in {build['build_s']:.1f} s "
        f"({build['build_mb_per_s']:.0f} MB/s), SIGKILLed: {build['segments']} segment files, "
        f"{build['seal_markers']} seal markers, active {build['active_bytes_on_disk'] / 2**20:.1f}"
        f" MiB",
    )
    cold = not args.no_cold and drop_caches()
    first = open_in_child(directory)
    emit(
        args.json,
        "reopen",
        {"cache": "cold" if cold else "warm", "run": "first", **first},
        f"first open after SIGKILL ({'cold' if cold else 'warm'}): {_describe(first)}",
    )
    cold_runs = _timed_opens(args, directory, "cold") if cold else []
    if not cold and not args.no_cold:
        emit(
            args.json,
            "reopen_note",
            {"note": f"cannot write {DROP_CACHES}; cold figures skipped"},
            f"cannot write {DROP_CACHES}; cold figures skipped",
        )
    open_in_child(directory)  # warm the page cache
    warm_runs = _timed_opens(args, directory, "warm")
    if not args.json:
        print()
    if cold_runs:
        _summary(args, "cold", cold_runs)
    _summary(args, "warm", warm_runs)


def _timed_opens(args: argparse.Namespace, directory: str, cache: str) -> list[dict[str, Any]]:
    """Open the range ``--repeat`` times in fresh processes; for ``cold``, drop caches first."""
    runs = []
    for number in range(1, args.repeat + 1):
        if cache == "cold":
            drop_caches()
        run = open_in_child(directory)
        runs.append(run)
        emit(
            args.json,
            "reopen",
            {"cache": cache, "run": number, **run},
            f"{cache} {number}: {_describe(run)}",
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Measure RangeLog.open on a ~1 GiB range after its writer was SIGKILLed."
    )
    add_work_directory_option(parser)
    parser.add_argument(
        "--size-mib", type=positive_int, default=1024, help="range size to build (1024)"
    )
    parser.add_argument(
        "--tail-mib",
        type=int,
        default=32,
        help="least size of the active segment at the kill, 0..63 (default: 32)",
    )
    parser.add_argument(
        "--batch", type=positive_int, default=1000, help="records per append (1000)"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=5, help="timed opens per cache state (5)"
    )
    parser.add_argument(
        "--build-timeout", type=float, default=120.0, help="give up the build after (120 s)"
    )
    parser.add_argument("--no-cold", action="store_true", help="do not drop the page cache")
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    parser.add_argument("--writer-child", help=argparse.SUPPRESS)
    parser.add_argument("--open-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 <= args.tail_mib < 64:
        parser.error("--tail-mib must be between 0 and 63 (the roll size is 64 MiB)")

    if args.writer_child is not None:
        directory = args.writer_child

        def write(reactor: Any) -> Deferred[None]:
            return ensureDeferred(_write_forever(reactor, directory, args.batch, 100))

        task.react(write)
    if args.open_child is not None:
        target = args.open_child

        def reopen(reactor: Any) -> Deferred[None]:
            return ensureDeferred(_open_once(reactor, target))

        task.react(reopen)

    with work_directory(args.dir, "bench-reopen-") as workdir:
        run_parent(args, workdir)


if __name__ == "__main__":
    main()
