"""Argument types and output shared by the benchmark scripts in this directory."""

from __future__ import annotations

import argparse
import json
from typing import Any


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
