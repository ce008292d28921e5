"""Suite-wide fixtures (a test fails if it logged an error it did not expect), and the order:
the simulation's seeds start in the background once collected, and its tests run last."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path
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


@pytest.fixture
def logged() -> Iterator[list[dict[str, Any]]]:
    """Every Twisted log event of the test, whatever its level, for tests of what is logged."""
    events: list[dict[str, Any]] = []
    globalLogPublisher.addObserver(events.append)
    yield events
    globalLogPublisher.removeObserver(events.append)


SIMULATION = Path(__file__).parent / "simulation"

#: The modules that test the native extensions themselves, against their Python references:
#: not collected with ``--without-native`` (there is nothing of theirs to test).
NATIVE_ONLY = frozenset(
    {
        "test_native_encoder.py",
        "test_native_record_check.py",
        "test_native_sealed_scan.py",
        "test_native_produce_path.py",
        "test_native_decoder.py",
        "test_native_rounds.py",
        "test_transcode.py",
    }
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--without-native",
        action="store_true",
        help="the suite of a tree whose native extensions are not built (as where no compiler "
        "was): everything runs on the Python paths; refused if the extensions are built",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("--without-native"):
        return
    from logbroker.storage import BATCH_ENCODER
    from logbroker.wire.primitives import RECORD_DECODER

    if "native" in {BATCH_ENCODER, RECORD_DECODER}:
        raise pytest.UsageError(
            "--without-native: the native extensions are built in this tree (batch encoder "
            f"{BATCH_ENCODER}, record decoder {RECORD_DECODER}); run it from a tree without them"
        )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("--without-native") and collection_path.name in NATIVE_ONLY:
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The simulation's tests go last: they collect what its seeds' workers found while the
    # rest of the suite ran (tests/simulation/seeds.py).
    items.sort(key=lambda item: item.path.is_relative_to(SIMULATION))


def pytest_collection_finish(session: pytest.Session) -> None:
    batches = [
        item.callspec.params["first"]
        for item in session.items
        if isinstance(item, pytest.Function)
        and item.originalname == "test_every_guarantee_holds_under_faults"
    ]
    if batches:
        from tests.simulation.seeds import BACKGROUND, batch_of

        BACKGROUND.start(batch_of(first) for first in batches)


def pytest_sessionfinish(session: pytest.Session) -> None:
    seeds = sys.modules.get("tests.simulation.seeds")
    if seeds is not None:
        seeds.BACKGROUND.stop()
