"""The fsync ceiling: how fast this disk makes appended bytes durable, with nothing in the way.

For each batch size it runs a plain loop on one file: one ``os.write`` of ``batch * record_bytes``
bytes, then one ``os.fdatasync``, again and again. There is no framing, no checksums, no index, no
reactor and no copying beyond the single write, so no durable group-commit append path (one fsync
per batch) can beat these figures on the same disk. A log benchmark prints them next to its own
numbers from the same run, so the gap between the two is the cost of the log itself rather than
of the disk.

Each batch size gets a fresh file that grows as it is written (nothing is preallocated, as in a
log that appends), a warm-up of about 0.3 s that is not counted, then ``--seconds`` of wall time,
stopped early after 50,000,000 records so it always ends (a fast virtual disk does about 4M
records/s at batch 1000, so the cap only bites on runs of ten seconds or more). Latency
percentiles are per iteration: one write plus its fdatasync.

Run it on the disk the log will live on; the default directory is under the system temp dir,
which may be a different disk or even tmpfs, where fdatasync costs nothing::

    python bench/fsync_ceiling.py --dir /var/lib/logbroker --batch-sizes 1,100,1000 --seconds 3
    python bench/fsync_ceiling.py --json

Another script in ``bench/`` can print the ceiling beside its own figures with
``from fsync_ceiling import measure_ceiling`` (scripts run as ``python bench/x.py`` have
``bench/`` on ``sys.path``).

Linux only: ``os.fdatasync`` does not exist on macOS or Windows.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

from _common import batch_sizes, positive_float, positive_int

MAX_RECORDS = 50_000_000
WARMUP_SECONDS = 0.3


def measure_ceiling(
    directory: str, batch_size: int, record_bytes: int, seconds: float
) -> dict[str, float]:
    """Measure write + fdatasync of ``batch_size`` records per iteration in ``directory``.

    Returns ``batch``, ``records_per_s``, ``mb_per_s`` (10**6 bytes), ``fsyncs_per_s``,
    ``p50_ms`` and ``p99_ms`` (per-iteration latency), ``record_bytes`` and ``seconds`` (the wall
    time actually measured, which is shorter than asked when the record cap is reached). The files
    it writes are removed before it returns.
    """
    if batch_size < 1 or record_bytes < 1:
        raise ValueError("batch_size and record_bytes must be at least 1")
    if seconds <= 0:
        raise ValueError("seconds must be positive")
    # Random bytes, so a compressing file system cannot make the writes smaller than asked.
    payload = os.urandom(batch_size * record_bytes)
    max_iterations = max(1, MAX_RECORDS // batch_size)
    _sync_loop(directory, payload, WARMUP_SECONDS, max_iterations)
    elapsed, latencies = _sync_loop(directory, payload, seconds, max_iterations)
    iterations = len(latencies)
    if iterations >= 2:
        p99 = statistics.quantiles(latencies, n=100, method="inclusive")[98]
    else:
        p99 = latencies[0]
    return {
        "batch": batch_size,
        "records_per_s": iterations * batch_size / elapsed,
        "mb_per_s": iterations * len(payload) / elapsed / 1e6,
        "fsyncs_per_s": iterations / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": p99 * 1000,
        "record_bytes": record_bytes,
        "seconds": elapsed,
    }


def _sync_loop(
    directory: str, payload: bytes, seconds: float, max_iterations: int
) -> tuple[float, list[float]]:
    """Append ``payload`` and fdatasync until time or iterations run out, on a fresh file.

    Always runs at least one iteration. Returns the elapsed wall time and each iteration's latency,
    both in seconds.
    """
    fd, path = tempfile.mkstemp(prefix="ceiling-", suffix=".log", dir=directory)
    try:
        latencies: list[float] = []
        start = time.perf_counter()
        deadline = start + seconds
        while True:
            before = time.perf_counter()
            written = os.write(fd, payload)
            os.fdatasync(fd)
            after = time.perf_counter()
            if written != len(payload):
                raise OSError(f"short write to {path}: {written} of {len(payload)} bytes")
            latencies.append(after - before)
            if after >= deadline or len(latencies) >= max_iterations:
                return after - start, latencies
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Measure the write + fdatasync ceiling for batched appends on one disk."
    )
    parser.add_argument(
        "--dir",
        help="directory on the disk to measure; a subdirectory is created in it and removed "
        "afterwards (default: a temporary directory under the system temp dir)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=batch_sizes,
        default=[1, 100, 1000],
        help="comma-separated records per write + fdatasync (default: 1,100,1000)",
    )
    parser.add_argument(
        "--record-bytes", type=positive_int, default=100, help="bytes per record (default: 100)"
    )
    parser.add_argument(
        "--seconds",
        type=positive_float,
        default=3.0,
        help="measured wall time per batch size, after the warm-up (default: 3.0)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="fsync-ceiling-", dir=args.dir) as workdir:
        for batch_size in args.batch_sizes:
            result = measure_ceiling(workdir, batch_size, args.record_bytes, args.seconds)
            if args.json:
                rounded = {key: round(value, 3) for key, value in result.items()}
                print(json.dumps({"bench": "ceiling", **rounded}), flush=True)
            else:
                print(
                    f"ceiling  batch={batch_size}"
                    f"  records/s={result['records_per_s']:.0f}"
                    f"  MB/s={result['mb_per_s']:.1f}"
                    f"  fsyncs/s={result['fsyncs_per_s']:.1f}"
                    f"  p50_fsync_ms={result['p50_ms']:.2f}"
                    f"  p99_fsync_ms={result['p99_ms']:.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
