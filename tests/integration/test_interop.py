"""A client written from the protocol description alone, by someone who never saw this code,
passes its checks against the real broker (``tests/interop``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.twistd import broker_env, running_broker

pytestmark = pytest.mark.integration

CHECK = Path(__file__).parent.parent / "interop" / "check.py"


def test_an_independent_client_passes_every_check(tmp_path: Path) -> None:
    with running_broker(tmp_path) as broker:
        result = subprocess.run(
            [sys.executable, str(CHECK)],
            env=broker_env({"PORT": str(broker.port), "RUN": "ci"}),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        output = broker.stop()

    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout, result.stdout
    assert broker.process.returncode == 0, output
