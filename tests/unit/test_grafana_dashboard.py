"""The shipped Grafana dashboard asks only for series the broker exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from twisted.internet.task import Clock

from logbroker.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "etc" / "grafana" / "logbroker-dashboard.json"


def exported_names() -> set[str]:
    """Every series name the registry exports, also those of labelled families that have no
    sample yet (per-topic counters before any traffic)."""
    names = set()
    for family in Metrics(Clock()).registry.collect():
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def test_every_series_in_the_dashboard_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expr in expressions for name in re.findall(r"\bsvc_[a-z_]+", expr)}
    exported = exported_names()

    assert len(expressions) >= 10
    assert sorted(used - exported) == []
