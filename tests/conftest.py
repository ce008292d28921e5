"""Suite-wide fixtures: a test fails if it logged an error it did not expect."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.python.failure import Failure

# Reproducible in CI: the same examples every run, no wall-clock deadline on a shared machine.
settings.register_profile(
    "logbroker",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("logbroker")


@pytest.fixture(autouse=True)
def logged_errors() -> Iterator[list[dict[str, Any]]]:
    """Every error-level Twisted log event of the test, including unhandled Deferred failures.

    A test that expects errors asks for this fixture, asserts on them, then clears the list;
    anything left at the end fails the test.
    """
    captured: list[dict[str, Any]] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_level") in (LogLevel.error, LogLevel.critical):
            captured.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        yield captured
        gc.collect()
    finally:
        globalLogPublisher.removeObserver(observe)
    if captured:
        lines = []
        for event in captured:
            failure = event.get("log_failure")
            text = formatEvent(event)
            if isinstance(failure, Failure):
                text += "\n" + failure.getTraceback()
            lines.append(text)
        pytest.fail("unexpected errors were logged:\n" + "\n".join(lines))
