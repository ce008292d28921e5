"""The composition root: what ``build_service`` sets up before the reactor runs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from twisted.internet.testing import MemoryReactorClock

from logbroker.config import BrokerConfig
from logbroker.service import GIL_SWITCH_INTERVAL_SECONDS, build_service
from logbroker.storage import DataDirectory, OsFileSystem


@pytest.fixture
def switch_interval() -> Iterator[None]:
    """Restore this test process's GIL switch interval, which the composition root changes."""
    before = sys.getswitchinterval()
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@pytest.mark.usefixtures("switch_interval")
def test_the_broker_hands_the_gil_to_its_writer_threads_within_half_a_millisecond(
    tmp_path: Path,
) -> None:
    sys.setswitchinterval(0.005)
    config, _ = BrokerConfig.from_env({}, cwd=str(tmp_path))
    data_dir = DataDirectory.open(config.storage.data_dir, OsFileSystem())

    root = build_service(MemoryReactorClock(), config, data_dir)

    assert root.getServiceNamed("storage") is not None
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_SECONDS)
