"""Verification speed over one sealed 64 MiB segment read from the page cache, per core.

What it measures: how many bytes per second one thread checks when it verifies a whole sealed
segment, the job behind ``RangeLog.verify_segment`` and ``logbroker storage verify``. Two paths:

* batch-CRC: ``fs.read_file`` of the segment (from the page cache) then
  ``verify_segment_bytes(data, base, seal)``, which is ``scan_batches`` (one CRC32C per batch
  frame) plus the seal's size and count check. This is exactly what the log's verify job does.
* per-record: ``verify_records_only(data)``, which ignores the batch checksums and checks every
  record frame on its own, for comparison.

Each path is timed with the file read included (what a verify costs) and on bytes already in
memory (the checking alone); the read alone is timed too. Figures are GB/s (10**9 bytes/s) of
wall time on one thread, best and median of ``--repeat`` runs; the CPU time of the thread is
reported beside the wall time, since a shared machine can steal wall time. Target: at least
1 GB/s per core on the batch-CRC path.

Why: a sealed segment is verified in full on a schedule and on demand; the batch CRC exists so
that this costs one checksum call per batch rather than Python work per record.

Setup: the segment is written directly with ``encode_batch`` (batches of ``--batch`` records of
``--record-bytes`` random value bytes, offsets contiguous from 0) into a file of at most
``--size-mib`` MiB, the most the default 64 MiB roll size lets a segment hold, and then read once
to make sure it is in the page cache.

Run it from the repository root with the project's virtualenv (about 15 s)::

    .venv/bin/python bench/verify.py
    .venv/bin/python bench/verify.py --repeat 9 --json

``--dir`` names the directory to build the segment in; a temporary directory is created in it and
removed afterwards. The default is a temporary directory under ``bench/.work`` (on the same file
system as the working tree; ``bench/.work`` itself is removed again when left empty).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import add_work_directory_option, positive_int, work_directory

from logbroker.storage import OsFileSystem, Record, Seal
from logbroker.storage._format import encode_batch, verify_records_only
from logbroker.storage._segment import LOG_SUFFIX, segment_stem, verify_segment_bytes

TARGET_GB_PER_S = 1.0
TARGET_PATH = "batch_crc_with_read"


def build_segment(
    directory: str, size_mib: int, batch_size: int, record_bytes: int
) -> tuple[str, Seal]:
    """Write a segment of whole batches, at most ``size_mib`` MiB, and return it and its seal."""
    records = [
        Record(os.urandom(record_bytes), timestamp_ms=1_700_000_000_000 + i)
        for i in range(batch_size)
    ]
    limit = size_mib * 1024 * 1024
    path = os.path.join(directory, segment_stem(0) + LOG_SUFFIX)
    size = 0
    offset = 0
    with open(path, "wb") as f:
        while True:
            data = encode_batch(offset, records)
            if size + len(data) > limit:
                break
            f.write(data)
            size += len(data)
            offset += batch_size
        f.flush()
        os.fsync(f.fileno())
    if size == 0:
        raise ValueError(f"a batch of {batch_size} records does not fit in {size_mib} MiB")
    return path, Seal(0, offset, size, int(time.time() * 1000))


def _timed(job: Callable[[], object]) -> tuple[float, float]:
    """Run ``job`` once; return its wall time and this thread's CPU time, in seconds."""
    wall, cpu = time.perf_counter(), time.thread_time()
    job()
    return time.perf_counter() - wall, time.thread_time() - cpu


def measure(path: str, seal: Seal, repeat: int) -> dict[str, dict[str, float]]:
    """Time each path ``repeat`` times; GB/s figures keyed by path name."""
    fs = OsFileSystem()
    fs.read_file(path)  # warm the page cache
    in_memory = fs.read_file(path)

    def batch_crc(data: bytes) -> None:
        result = verify_segment_bytes(data, seal.base_offset, seal)
        if not result.verified or result.record_count != seal.record_count:
            raise AssertionError(f"segment failed verification: {result}")

    def per_record(data: bytes) -> None:
        damage = verify_records_only(data)
        if damage is not None:
            raise AssertionError(f"segment failed verification: {damage}")

    paths: dict[str, Callable[[], object]] = {
        "read_only": lambda: fs.read_file(path),
        "batch_crc_with_read": lambda: batch_crc(fs.read_file(path)),
        "batch_crc_in_memory": lambda: batch_crc(in_memory),
        "per_record_with_read": lambda: per_record(fs.read_file(path)),
        "per_record_in_memory": lambda: per_record(in_memory),
    }
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    # Interleave the paths, so that a noisy moment hurts all of them rather than one.
    for _ in range(repeat):
        for name, job in paths.items():
            timings[name].append(_timed(job))
    results = {}
    for name, runs in timings.items():
        walls = [wall for wall, _ in runs]
        cpus = [cpu for _, cpu in runs]
        results[name] = {
            "best_gb_per_s": seal.byte_size / min(walls) / 1e9,
            "median_gb_per_s": seal.byte_size / statistics.median(walls) / 1e9,
            "median_cpu_gb_per_s": seal.byte_size / statistics.median(cpus) / 1e9,
            "median_ms": statistics.median(walls) * 1000,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Measure single-thread verification speed of a sealed segment in page cache."
    )
    add_work_directory_option(parser, "build the segment in")
    parser.add_argument(
        "--size-mib", type=positive_int, default=64, help="segment size limit in MiB (64)"
    )
    parser.add_argument(
        "--batch", type=positive_int, default=1000, help="records per batch (default: 1000)"
    )
    parser.add_argument(
        "--record-bytes", type=positive_int, default=100, help="value bytes per record (100)"
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=7, help="timed runs of each path (default: 7)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    args = parser.parse_args()

    with work_directory(args.dir, "bench-verify-") as workdir:
        path, seal = build_segment(workdir, args.size_mib, args.batch, args.record_bytes)
        results = measure(path, seal, args.repeat)

    segment: dict[str, Any] = {
        "bytes": seal.byte_size,
        "records": seal.record_count,
        "batches": seal.record_count // args.batch,
        "repeat": args.repeat,
    }
    if not args.json:
        print(
            f"segment: {seal.byte_size} bytes ({seal.byte_size / 2**20:.1f} MiB), "
            f"{seal.record_count} records in batches of {args.batch}, "
            f"{args.record_bytes}-byte values; {args.repeat} runs per path, one thread",
            flush=True,
        )
    for name, figures in results.items():
        if args.json:
            rounded = {key: round(value, 3) for key, value in figures.items()}
            print(json.dumps({"bench": "verify", "path": name, **segment, **rounded}), flush=True)
        else:
            print(
                f"{name:<22}  best={figures['best_gb_per_s']:6.2f} GB/s"
                f"  median={figures['median_gb_per_s']:6.2f} GB/s"
                f"  ({figures['median_ms']:7.1f} ms)"
                f"  median by CPU time={figures['median_cpu_gb_per_s']:6.2f} GB/s",
                flush=True,
            )
    median = results[TARGET_PATH]["median_gb_per_s"]
    met = median >= TARGET_GB_PER_S
    if args.json:
        print(
            json.dumps(
                {
                    "bench": "verify_target",
                    "path": TARGET_PATH,
                    "median_gb_per_s": round(median, 3),
                    "target_gb_per_s": TARGET_GB_PER_S,
                    "target_met": met,
                }
            ),
            flush=True,
        )
    else:
        print(
            f"target: {TARGET_PATH} >= {TARGET_GB_PER_S:g} GB/s per core: "
            f"{'met' if met else 'MISSED'} (median {median:.2f} GB/s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
