"""The shipped scrub alerts fire on what a real broker exports when their condition is real, not
only on series written by hand: a real single ``twistd logbroker`` is scraped while it is whole
and after a byte of a sealed segment rots under it, and a real broker whose scrub is enabled but
verifies nothing is scraped; the samples become ``promtool test rules`` input series (one scrape
held for each minute of the rule test's time), run against ``etc/prometheus/logbroker-alerts.yml``.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from logbroker.client.blocking import BlockingClient
from logbroker.records import Record
from tests.integration.test_promtool import ALERTS, promtool
from tests.integration.test_scrub import scrubbed, wait_for
from tests.integration.twistd import (
    RunningBroker,
    Samples,
    flip_byte,
    running_broker,
    wait_until,
)

pytestmark = pytest.mark.integration

#: The series the scrub alerts read.
WATCHED = ("svc_storage_scrub_segments_total", "svc_scrub_enabled", "svc_storage_segments")
#: The labels Prometheus adds to every series it scrapes from the node.
TARGET = {"instance": "n1", "job": "logbroker"}


def filled(tmp_path: Path, settings: dict[str, str]) -> Any:
    data = tmp_path / "data"
    return running_broker(
        tmp_path,
        settings={
            "SVC_DATA_DIR": str(data),
            "SVC_SEGMENT_MAX_BYTES": "4096",
            "SVC_TOPIC_RANGES": "1",
            **settings,
        },
    )


def produce(broker: RunningBroker) -> None:
    with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
        client.create_topic("watched")
        for batch in range(20):
            assert client.produce("watched", [Record(b"v" * 200, key=b"k%d" % batch)] * 5) == 5


def input_series(minutes: Sequence[Samples]) -> list[dict[str, str]]:
    """The watched series of the scrapes, one scrape per minute, as promtool input series."""
    keys = sorted({key for samples in minutes for key in samples if key[0] in WATCHED})
    series = []
    for name, labels in keys:
        selector = ",".join(f'{k}="{v}"' for k, v in (*labels, *TARGET.items()))
        values = " ".join(repr(samples.get((name, labels), 0.0)) for samples in minutes)
        series.append({"series": f"{name}{{{selector}}}", "values": values})
    return series


def expected_alert(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """The alert ``name`` of the shipped rules with ``labels``, annotations as Prometheus
    renders them for this target."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rule = next(r for group in groups for r in group["rules"] if r.get("alert") == name)
    annotations = {
        key: value.replace("{{ $labels.instance }}", TARGET["instance"])
        for key, value in rule["annotations"].items()
    }
    return {"exp_labels": {**rule["labels"], **labels, **TARGET}, "exp_annotations": annotations}


def promtool_test(tmp_path: Path, minutes: Sequence[Samples], checks: list[dict[str, Any]]) -> str:
    test = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "input_series": input_series(minutes), "alert_rule_test": checks}
        ],
    }
    path = tmp_path / "live-alerts-test.yml"
    path.write_text(json.dumps(test, indent=1))  # JSON is YAML
    run = subprocess.run(
        [promtool(), "test", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr + path.read_text()
    return run.stdout


def test_unrepairable_pages_on_a_real_broker_s_exposition_once_a_sealed_segment_rots(
    tmp_path: Path,
) -> None:
    settings = {"SVC_SCRUB_INTERVAL_MS": "100", "SVC_SCRUB_SEGMENTS_PER_TICK": "4"}
    with filled(tmp_path, settings) as broker:
        produce(broker)
        data = tmp_path / "data"
        # A full segment is sealed behind the appends (decision 0024): the last may lag.
        wait_until(lambda: len(list(data.rglob("*.sealed"))) >= 4, 10)
        sealed = sorted(p.with_suffix(".log") for p in data.rglob("*.sealed"))
        whole = wait_for(broker, lambda s: scrubbed(s, "verified") >= len(sealed))
        flip_byte(sealed[1])
        rotten = wait_for(broker, lambda s: scrubbed(s, "unrepairable") >= 1)
        broker.stop()
    assert scrubbed(whole, "unrepairable") == 0

    # Whole for 10 minutes, then rotten for 10.
    promtool_test(
        tmp_path,
        [whole] * 10 + [rotten] * 10,
        [
            {"eval_time": "9m", "alertname": "LogbrokerScrubUnrepairable", "exp_alerts": []},
            {
                "eval_time": "15m",
                "alertname": "LogbrokerScrubUnrepairable",
                "exp_alerts": [
                    expected_alert("LogbrokerScrubUnrepairable", {"result": "unrepairable"})
                ],
            },
            {"eval_time": "15m", "alertname": "LogbrokerScrubStalled", "exp_alerts": []},
        ],
    )


def test_stalled_fires_on_a_real_broker_whose_scrub_is_on_and_verifies_nothing(
    tmp_path: Path,
) -> None:
    # Enabled, sealed segments held, and a pass a day: the verified total does not advance.
    with filled(tmp_path, {"SVC_SCRUB_INTERVAL_MS": str(24 * 3600 * 1000)}) as broker:
        produce(broker)
        stuck = wait_for(
            broker,
            lambda s: s[("svc_storage_segments", (("state", "sealed"),))] >= 4,
        )
        broker.stop()
    assert stuck[("svc_scrub_enabled", ())] == 1
    assert scrubbed(stuck, "verified") == 0

    promtool_test(
        tmp_path,
        [stuck] * 300,
        [
            # The verified total must stand still for 2 hours, then 30 minutes more.
            {"eval_time": "2h", "alertname": "LogbrokerScrubStalled", "exp_alerts": []},
            {
                "eval_time": "4h",
                "alertname": "LogbrokerScrubStalled",
                "exp_alerts": [expected_alert("LogbrokerScrubStalled", {})],
            },
            {"eval_time": "4h", "alertname": "LogbrokerScrubUnrepairable", "exp_alerts": []},
        ],
    )
