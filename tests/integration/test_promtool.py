"""The ``/metrics`` text exposition passes Prometheus' own linter, ``promtool check metrics``."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest

from tests.unit.metrics.helpers import populated_metrics

pytestmark = pytest.mark.integration


def test_promtool_finds_no_problem_in_a_populated_exposition(
    logged_errors: list[dict[str, Any]],
) -> None:
    promtool = shutil.which("promtool")
    # Missing promtool is a broken test machine, not a reason to skip the check.
    assert promtool is not None, (
        "promtool is missing: run scripts/install --test (Debian prometheus)"
    )
    exposition = populated_metrics(logged_errors).render_text()

    checked = subprocess.run(
        [promtool, "check", "metrics"],
        input=exposition,
        capture_output=True,
        timeout=60,
        check=False,
    )

    problems = (checked.stdout + checked.stderr).decode()
    assert (checked.returncode, problems) == (0, "")
