"""Many files made durable at once: one ``fdatasync`` per file, or one ``syncfs`` for them all.

A produce of keyed records reaches many ranges, and each range is its own file: today each
range's group commit ends in an ``fdatasync`` of that file, so a write to a thousand ranges costs
a thousand flushes. ``syncfs`` flushes every file of one file system in one call. This measures
what that would save on this disk, with nothing else in the way: ``--files`` files (one per
range), each round one append of ``--record-bytes`` to every file, then

- ``fdatasync`` of every file, from a pool of ``--threads`` threads (the writer threads a broker
  node runs: each append and its flush is one job, as in the storage engine);
- or one ``syncfs`` after all the appends.

Each way runs ``--rounds`` rounds after one warm-up round; printed: the median and the slowest
round, and files made durable per second at the median. ``syncfs`` also flushes whatever else
is dirty on that file system (another program's writes): on a disk the broker shares, that is
the cost it would pay too.

Run it on the disk the brokers' data lives on (by default it works under ``bench/.work``)::

    .venv/bin/python bench/many_files_sync.py --files 1000 --json
    .venv/bin/python bench/many_files_sync.py --dir /var/lib/logbroker --threads 16

Linux only (``syncfs`` through the C library).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from _common import add_work_directory_option, positive_int, work_directory

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def syncfs(fd: int) -> None:
    """Flush the whole file system holding ``fd`` (``OSError`` when the kernel reports an
    error, which may have been on any of its files)."""
    if _libc.syncfs(fd) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def per_file(fds: Sequence[int], data: bytes, threads: int) -> Callable[[], None]:
    def one(fd: int) -> None:
        os.write(fd, data)
        os.fdatasync(fd)

    def run() -> None:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, fds))

    return run


def all_at_once(fds: Sequence[int], data: bytes) -> Callable[[], None]:
    def run() -> None:
        for fd in fds:
            os.write(fd, data)
        syncfs(fds[0])

    return run


def measure(run: Callable[[], None], files: int, rounds: int) -> dict[str, float]:
    run()  # warm-up
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    return {"median_ms": median * 1000, "max_ms": max(times) * 1000, "files_per_s": files / median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_work_directory_option(parser)
    parser.add_argument("--files", type=positive_int, default=1000, help="files (ranges)")
    parser.add_argument("--threads", type=positive_int, default=4, help="fdatasync threads")
    parser.add_argument("--record-bytes", type=positive_int, default=100)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    data = os.urandom(args.record_bytes)
    with work_directory(args.dir, "many-files-sync-") as workdir:
        fds = [
            os.open(os.path.join(workdir, f"{index:05d}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
            for index in range(args.files)
        ]
        try:
            ways = {
                f"fdatasync_{args.threads}_threads": per_file(fds, data, args.threads),
                "syncfs": all_at_once(fds, data),
            }
            for way, run in ways.items():
                result = {"way": way, "files": args.files, **measure(run, args.files, args.rounds)}
                if args.json:
                    rounded = {
                        k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()
                    }
                    print(json.dumps({"bench": "many_files_sync", **rounded}), flush=True)
                else:
                    print(
                        f"{way:22s} {args.files} files: median {result['median_ms']:.1f} ms,"
                        f" slowest {result['max_ms']:.1f} ms,"
                        f" {result['files_per_s']:.0f} files/s",
                        flush=True,
                    )
        finally:
            for fd in fds:
                os.close(fd)


if __name__ == "__main__":
    main()
