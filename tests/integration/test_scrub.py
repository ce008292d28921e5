"""The integrity scrub of a real single ``twistd logbroker``: it checks the sealed segments on
disk in rotation, counts them ``verified`` on ``/metrics``, and finds a byte flipped in a
sealed segment file under the running broker: ``unrepairable`` (one node has no other copy),
the checksum failure counted, and a log line naming the segment and the byte position."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from logbroker.client.blocking import BlockingClient
from logbroker.records import Record
from tests.integration.twistd import (
    RunningBroker,
    Samples,
    flip_byte,
    running_broker,
    scrape,
    wait_until,
)

pytestmark = pytest.mark.integration


def scrubbed(samples: Samples, result: str) -> float:
    return samples[("svc_storage_scrub_segments_total", (("result", result),))]


def wait_for(
    broker: RunningBroker, done: Callable[[Samples], bool], seconds: float = 30
) -> Samples:
    deadline = time.monotonic() + seconds
    while True:
        samples = scrape(broker.dashboard_port)
        if done(samples):
            return samples
        assert time.monotonic() < deadline, samples
        time.sleep(0.1)


def test_a_single_node_scrubs_its_sealed_segments_and_finds_a_flipped_byte(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    settings = {
        "SVC_DATA_DIR": str(data),
        "SVC_SEGMENT_MAX_BYTES": "4096",
        "SVC_TOPIC_RANGES": "1",
        "SVC_SCRUB_INTERVAL_MS": "100",
        "SVC_SCRUB_SEGMENTS_PER_TICK": "4",
    }
    with running_broker(tmp_path, settings=settings) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            client.create_topic("scrubbed")
            for batch in range(20):
                records = [Record(b"v" * 200, key=b"k%d" % batch)] * 5
                assert client.produce("scrubbed", records) == 5
        # A full segment is sealed behind the appends (decision 0024): the last may lag.
        wait_until(lambda: len(list(data.rglob("*.sealed"))) >= 4, 10)
        sealed = sorted(p.with_suffix(".log") for p in data.rglob("*.sealed"))

        # Every sealed segment checked, each found whole; the scrub says it runs.
        samples = wait_for(broker, lambda s: scrubbed(s, "verified") >= 2 * len(sealed))
        assert samples[("svc_scrub_enabled", ())] == 1
        assert scrubbed(samples, "unrepairable") == 0

        # Bit rot under the running broker, in the middle of the second sealed segment.
        damaged = sealed[1]
        flip_byte(damaged)

        samples = wait_for(broker, lambda s: scrubbed(s, "unrepairable") >= 2)
        failures = ("svc_storage_integrity_failures_total", (("reason", "checksum"),))
        assert samples[failures] == 1, "the damage counted once, found at every cycle"
        output = broker.stop()

    lines = [line for line in output.splitlines() if "Scrub: sealed segment" in line]
    assert lines, output
    base = int(damaged.stem)
    assert f"@{base} is damaged at byte " in lines[0]
    assert "unrepairable" in lines[0]
