"""``bench/many_files_sync.py``: both ways append to every file, and each is measured."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench_script

bench = load_bench_script("many_files_sync")


def test_both_ways_append_once_to_every_file_per_round(tmp_path: Path) -> None:
    paths = [tmp_path / f"{index}.log" for index in range(3)]
    fds = [os.open(path, os.O_WRONLY | os.O_CREAT, 0o644) for path in paths]
    try:
        per_file = bench.measure(bench.per_file(fds, b"ab", 2), len(fds), 2)
        at_once = bench.measure(bench.all_at_once(fds, b"cd"), len(fds), 2)
    finally:
        for fd in fds:
            os.close(fd)

    # A warm-up round and two measured ones each.
    assert [path.read_bytes() for path in paths] == [b"ab" * 3 + b"cd" * 3] * 3
    for result in (per_file, at_once):
        assert result["max_ms"] >= result["median_ms"] > 0
        assert result["files_per_s"] == pytest.approx(len(fds) / (result["median_ms"] / 1000))
