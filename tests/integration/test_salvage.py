"""``logbroker storage salvage`` on a real single ``twistd logbroker``'s data directory: a byte
flipped in a sealed segment hides every later record of its range (reads stop at the damage,
and the scrub counts it unrepairable, there being no other copy); with the broker stopped, the
salvage sets the segment aside for forensics and writes back what of it verifies, and the
restarted broker serves every record but those of the damaged batch, its scrub finding nothing
more, and ``storage verify`` passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from logbroker.client.blocking import BlockingClient
from logbroker.records import Record
from tests.cluster import read_all
from tests.integration.test_scrub import scrubbed, wait_for
from tests.integration.twistd import broker_env, flip_byte, running_broker

pytestmark = pytest.mark.integration

LOGBROKER = str(Path(sys.executable).with_name("logbroker"))


def storage(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LOGBROKER, "storage", *args],
        capture_output=True,
        text=True,
        env=broker_env({}),
        timeout=60,
        check=False,
    )


def test_salvage_brings_back_every_record_but_the_damaged_batch_s(tmp_path: Path) -> None:
    data = tmp_path / "data"
    settings = {
        "SVC_DATA_DIR": str(data),
        "SVC_SEGMENT_MAX_BYTES": "4096",
        "SVC_TOPIC_RANGES": "1",
        "SVC_SCRUB_INTERVAL_MS": "100",
        "SVC_SCRUB_SEGMENTS_PER_TICK": "8",
    }
    produced = [b"%03d-%d-" % (batch, n) + b"v" * 200 for batch in range(20) for n in range(5)]
    with running_broker(tmp_path, settings=settings) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            client.create_topic("kept")
            for start in range(0, len(produced), 5):
                records = [Record(value, key=b"k") for value in produced[start : start + 5]]
                assert client.produce("kept", records) == 5
        broker.stop()
    sealed = sorted(p.with_suffix(".log") for p in data.rglob("*.sealed"))
    assert len(sealed) >= 4
    damaged = sealed[1]
    flip_byte(damaged)
    rotten = damaged.read_bytes()

    with running_broker(tmp_path, settings=settings) as broker:
        hidden = read_all(broker, "kept", "app", "app123")
        wait_for(broker, lambda samples: scrubbed(samples, "unrepairable") >= 1)
        # Running: the data directory is locked, and nothing is changed.
        refused = storage("salvage", str(data))
        broker.stop()
    # Reads stop at the damage: every later record, later sealed segments included, is hidden.
    assert len(hidden) < len(produced) - 5
    assert refused.returncode == 1
    assert "in use by another logbroker process" in refused.stderr

    salvaged = storage("salvage", str(data), "--json")

    assert salvaged.returncode == 0, salvaged.stderr
    [report] = [json.loads(line) for line in salvaged.stdout.splitlines()]
    assert report["base_offset"] == int(damaged.stem)
    kept_in = Path(report["set_aside_in"])
    assert (kept_in / damaged.name).read_bytes() == rotten
    lost = sum(
        b - a
        for a, b in zip(
            [report["base_offset"]] + [end for _, end in report["kept"]],
            [start for start, _ in report["kept"]] + [int(sealed[2].stem)],
            strict=True,
        )
    )
    assert 1 <= lost <= 5, report
    with running_broker(tmp_path, settings=settings) as broker:
        back = read_all(broker, "kept", "app", "app123")
        samples = wait_for(broker, lambda found: scrubbed(found, "verified") >= 2 * len(sealed))
        assert scrubbed(samples, "unrepairable") == 0
        broker.stop()
    assert len(back) == len(produced) - lost
    assert set(back) <= set(produced)
    assert back[-1] == produced[-1]
    verified = storage("verify", str(data))
    assert verified.returncode == 0, verified.stdout + verified.stderr
