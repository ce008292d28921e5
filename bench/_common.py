"""Argument types and output shared by the benchmark scripts in this directory."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

DEFAULT_WORK_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".work")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


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
