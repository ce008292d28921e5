"""Prometheus' own ``promtool`` accepts the ``/metrics`` text exposition and the shipped alert
rules, whose alerts fire (and stay quiet) as ``tests/prometheus`` expects."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.unit.metrics.helpers import populated_metrics

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "etc" / "prometheus" / "logbroker-alerts.yml"
ALERT_TESTS = ROOT / "tests" / "prometheus" / "logbroker-alerts-test.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    # Missing promtool is a broken test machine, not a reason to skip the check.
    assert found is not None, "promtool is missing: run scripts/install --test (Debian prometheus)"
    return found


def test_promtool_finds_no_problem_in_a_populated_exposition(
    logged_errors: list[dict[str, Any]],
) -> None:
    exposition = populated_metrics(logged_errors).render_text()

    checked = subprocess.run(
        [promtool(), "check", "metrics"],
        input=exposition,
        capture_output=True,
        timeout=60,
        check=False,
    )

    problems = (checked.stdout + checked.stderr).decode()
    assert (checked.returncode, problems) == (0, "")


def test_promtool_accepts_the_shipped_alert_rules() -> None:
    checked = subprocess.run(
        [promtool(), "check", "rules", str(ALERTS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 9 rules found" in checked.stdout


def test_each_alert_fires_on_what_it_watches_and_only_on_that() -> None:
    tested = subprocess.run(
        [promtool(), "test", "rules", ALERT_TESTS.name],
        cwd=ALERT_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout
