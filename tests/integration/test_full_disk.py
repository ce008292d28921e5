"""A real single ``twistd logbroker`` whose data directory is a small tmpfs filled to the brim
(ENOSPC): the produce that cannot be written is refused ``storage_unavailable`` (its own reason,
not the ``unreachable`` of a broker going away), ``/ready`` answers 503 naming storage, the
ranges out of service are counted in ``svc_storage_ranges_out_of_service``, the broker stays up
(``/health``), and what was acknowledged before reads back whole. Once space is freed, the
range takes writes again by itself, without a restart. Needs root (it mounts the tmpfs), as
the whole suite on its CI machine has."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from logbroker.client.blocking import BlockingClient, BrokerRefused
from logbroker.records import Record
from tests.integration.twistd import running_broker, scrape

pytestmark = pytest.mark.integration


@pytest.fixture
def small_volume(tmp_path: Path) -> Iterator[Path]:
    assert os.geteuid() == 0, "this test mounts a tmpfs: run the suite as root, as CI does"
    volume = tmp_path / "volume"
    volume.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(volume)], check=True)
    try:
        yield volume
    finally:
        subprocess.run(["umount", "-l", str(volume)], check=False)


def ready(dashboard_port: int) -> tuple[int, dict[str, str]]:
    url = f"http://127.0.0.1:{dashboard_port}/ready"
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def read_all(client: BlockingClient) -> list[bytes]:
    values: list[bytes] = []
    cursor = None
    while True:
        batch = client.fetch("filling", cursor, None, None, 1000, 0)
        if not batch.records:
            return values
        values += [record.value for record in batch.records]
        cursor = batch.next_cursor


def test_a_full_disk_refuses_produces_storage_unavailable_until_space_is_freed(
    tmp_path: Path, small_volume: Path
) -> None:
    data = small_volume / "data"
    # Room the operator can free later.
    filler = small_volume / "filler"
    filler.write_bytes(bytes(1024 * 1024))
    settings = {"SVC_DATA_DIR": str(data), "SVC_TOPIC_RANGES": "1"}
    with running_broker(tmp_path, settings=settings) as broker:
        acknowledged: list[bytes] = []
        refusal = None
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            client.create_topic("filling")
            assert ready(broker.dashboard_port)[0] == 200
            for batch in range(400):
                values = [b"%04d-%d-" % (batch, n) + b"x" * 1000 for n in range(10)]
                try:
                    client.produce(
                        "filling", [Record(v, key=b"k") for v in values], give_up_after=0.5
                    )
                except BrokerRefused as refused:
                    refusal = refused
                    break
                acknowledged += values
            assert refusal is not None, "4 MiB never filled up"
            assert refusal.reason == "storage_unavailable", refusal
            read = read_all(client)

        status, body = ready(broker.dashboard_port)
        samples = scrape(broker.dashboard_port)
        with urllib.request.urlopen(
            f"http://127.0.0.1:{broker.dashboard_port}/health", timeout=10
        ) as health:
            assert health.status == 200

        # Space freed: within a few seconds the range takes writes again, by itself.
        filler.unlink()
        deadline = time.monotonic() + 30
        while ready(broker.dashboard_port)[0] != 200:
            assert time.monotonic() < deadline, ready(broker.dashboard_port)
            time.sleep(0.2)
        after = [b"after-%d-" % n + b"x" * 100 for n in range(10)]
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            assert client.produce("filling", [Record(v, key=b"k") for v in after]) == 10
            everything = read_all(client)
        back = scrape(broker.dashboard_port)
        output = broker.stop()

    assert (status, body["status"]) == (503, "not_ready")
    assert body["reason"].startswith("storage: a write or fsync failed")
    assert samples[("svc_storage_ranges_out_of_service", ())] == 1
    # Nothing acknowledged is lost, nothing refused is served.
    assert read == acknowledged
    assert everything == acknowledged + after
    assert back[("svc_storage_ranges_out_of_service", ())] == 0
    assert "is back in service: a probe write and fsync succeeded" in output
