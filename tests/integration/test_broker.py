"""The real ``twistd logbroker`` driven over TCP by the blocking client: records round-trip
byte for byte, errors carry their reasons, data and positions survive restarts and SIGKILL."""

from __future__ import annotations

import itertools
import json
import socket
import struct
import threading
from pathlib import Path

import pytest

from logbroker import wire
from logbroker.client.blocking import BlockingClient, BrokerRefused
from logbroker.records import Record
from tests.integration.twistd import run_twistd, running_broker

pytestmark = pytest.mark.integration

SHAPES = [
    Record(b"plain"),
    Record(b"", key=b""),  # empty key and empty value, distinct from null
    Record(b"\x00\xff" * 50, key=None, timestamp_ms=2**64 - 1),
    Record(b"v", key=b"k", timestamp_ms=1_700_000_000_000, headers=((b"h", b"x"), (None, b""))),
    Record(bytes(range(256)), key=bytes(range(255, -1, -1)), headers=((b"", None),)),
]


def drain(client: BlockingClient, topic: str, group: str | None = None) -> list[Record]:
    records: list[Record] = []
    cursor = None
    while True:
        batch = client.fetch(topic, cursor, group, None, 1000, 0)
        if not batch.records:
            return records
        records.extend(batch.records)
        cursor = batch.next_cursor


def test_every_record_shape_round_trips_through_the_real_broker(tmp_path: Path) -> None:
    with running_broker(tmp_path) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            client.create_topic("shapes")
            assert client.produce("shapes", SHAPES) == len(SHAPES)

            fetched = drain(client, "shapes")

        output = broker.stop()

    assert sorted(fetched, key=repr) == sorted(SHAPES, key=repr)
    assert broker.process.returncode == 0, output
    assert "every range flushed and fsynced" in output


def test_errors_carry_their_reasons(tmp_path: Path) -> None:
    with running_broker(tmp_path) as broker:
        with pytest.raises(BrokerRefused, match="invalid_credentials"):
            BlockingClient.connect("127.0.0.1", broker.port, "admin", "wrong")
        with BlockingClient.connect("127.0.0.1", broker.port, "consumer", "consumer123") as c:
            with pytest.raises(BrokerRefused, match="permission_denied"):
                c.produce("t", [Record(b"v")])
            with pytest.raises(BrokerRefused, match="no_such_topic"):
                c.fetch("t")
        with BlockingClient.connect("127.0.0.1", broker.port, "admin", "admin123") as admin:
            admin.create_topic("t")
            with pytest.raises(BrokerRefused, match="already_exists"):
                admin.create_topic("t")
            with pytest.raises(BrokerRefused, match="invalid_cursor"):
                admin.fetch("t", "not-a-cursor")


def test_the_first_frame_must_be_auth(tmp_path: Path) -> None:
    with (
        running_broker(tmp_path) as broker,
        socket.create_connection(("127.0.0.1", broker.port), timeout=30) as sock,
    ):
        sock.sendall(wire.encode_request(5, wire.ListUsers()))
        data = b""
        while chunk := sock.recv(4096):
            data += chunk

    [body] = wire.FrameDecoder().feed(data)
    assert wire.decode_response(body) == wire.Response(5, b"", "auth_required")


def test_a_frame_over_the_maximum_is_refused_with_correlation_id_0(tmp_path: Path) -> None:
    settings = {"SVC_MAX_FRAME_SIZE": "1024"}
    with (
        running_broker(tmp_path, settings=settings) as broker,
        socket.create_connection(("127.0.0.1", broker.port), timeout=30) as sock,
    ):
        sock.sendall(struct.pack(">I", 1025))
        data = b""
        while chunk := sock.recv(4096):
            data += chunk

    [body] = wire.FrameDecoder().feed(data)
    assert wire.decode_response(body) == wire.Response(0, b"", "frame_too_large")


def test_the_blocking_client_raises_a_connection_level_error(tmp_path: Path) -> None:
    settings = {"SVC_MAX_FRAME_SIZE": "1024"}
    with (
        running_broker(tmp_path, settings=settings) as broker,
        BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client,
    ):
        client.create_topic("t")
        with pytest.raises(BrokerRefused, match="frame_too_large") as raised:
            client.produce("t", [Record(bytes(2048))])

    assert raised.value.correlation_id == 0


def test_records_and_group_positions_survive_a_restart(tmp_path: Path) -> None:
    with running_broker(tmp_path) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            client.create_topic("orders")
            client.produce("orders", [Record(bytes([i]), key=b"k") for i in range(10)])
            first = client.fetch("orders", None, "billing", None, 4, 0)
            client.commit("orders", "billing", first.next_cursor)
        broker.stop()

    with (
        running_broker(tmp_path) as broker,
        BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client,
    ):
        resumed = drain(client, "orders", "billing")
        everything = drain(client, "orders")
        cursor_still_valid = client.fetch("orders", first.next_cursor, None, None, 1000, 0)

    assert [r.value for r in resumed] == [bytes([i]) for i in range(4, 10)]
    assert [r.value for r in everything] == [bytes([i]) for i in range(10)]
    assert [r.value for r in cursor_still_valid.records] == [bytes([i]) for i in range(4, 10)]


def test_a_broker_sigkilled_mid_stream_loses_no_acknowledged_produce(tmp_path: Path) -> None:
    acknowledged: list[bytes] = []
    enough = threading.Event()

    def produce_until_killed(port: int) -> None:
        with BlockingClient.connect("127.0.0.1", port, "app", "app123") as client:
            for i in itertools.count():
                values = [f"{i}-{j}".encode() for j in range(10)]
                records = [Record(v, key=str(j).encode()) for j, v in enumerate(values)]
                try:
                    client.produce("durable", records)
                except OSError:
                    return  # killed mid-request: this produce was never acknowledged
                acknowledged.extend(values)
                if len(acknowledged) >= 2000:
                    enough.set()

    with running_broker(tmp_path) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as admin:
            admin.create_topic("durable")
        producer = threading.Thread(target=produce_until_killed, args=(broker.port,))
        producer.start()
        assert enough.wait(timeout=120)
        broker.kill()  # SIGKILL while the producer still has a request in flight
        producer.join(timeout=60)

    with (
        running_broker(tmp_path) as broker,
        BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client,
    ):
        stored = {record.value for record in drain(client, "durable")}

    assert len(acknowledged) >= 2000
    assert set(acknowledged) <= stored


def test_a_port_in_use_stops_the_boot_naming_the_variable(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        broker = run_twistd(
            tmp_path, settings={"SVC_TCP_PORT": str(port), "SVC_BIND_HOST": "127.0.0.1"}
        )
        output, _ = broker.communicate(timeout=60)

    assert broker.returncode == 2, output
    assert f"SVC_TCP_PORT='{port}' is invalid" in output


def test_the_dev_accounts_are_seeded_with_their_permissions(tmp_path: Path) -> None:
    with (
        running_broker(tmp_path, settings={"SVC_ENV": "dev"}) as broker,
        BlockingClient.connect("127.0.0.1", broker.port, "admin", "admin123") as admin,
    ):
        users = dict(admin.list_users())

    assert users == {
        "admin": ("admin",),
        "app": ("consume", "produce"),
        "consumer": ("consume",),
        "producer": ("produce",),
    }


def test_sigterm_with_commits_in_flight_stops_cleanly_and_keeps_what_was_answered(
    tmp_path: Path,
) -> None:
    with (
        running_broker(tmp_path) as broker,
        BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client,
    ):
        client.create_topic("t")
        client.produce("t", [Record(b"v")] * 5)
        cursor = client.fetch("t", None, None, None, 1000, 0).next_cursor
        for _ in range(50):  # pipelined: queued behind one another in the control plane
            client.send(wire.Commit("t", "g", cursor))
        output = broker.stop()

    assert broker.process.returncode == 0, output
    assert "every range flushed and fsynced" in output


def test_a_long_poll_is_answered_when_another_client_produces(tmp_path: Path) -> None:
    with (
        running_broker(tmp_path) as broker,
        BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as consumer,
        BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as producer,
    ):
        producer.create_topic("t")
        polling = consumer.send(wire.Fetch("t", None, None, None, 0, 30_000))
        producer.produce("t", [Record(b"late")])

        response = consumer.receive()

    assert response.correlation_id == polling
    assert [r.value for r in wire.decode_records(response.payload).records] == [b"late"]


def test_a_subscription_never_exceeds_its_window_and_resumes_after_acks(tmp_path: Path) -> None:
    with (
        running_broker(tmp_path) as broker,
        BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client,
    ):
        client.create_topic("t")
        client.produce("t", [Record(b"%d" % i) for i in range(50)])
        subscription = client.send(wire.Subscribe("t", "g", "m", 20, 8))
        received: list[Record] = []
        cursor = None
        while len(received) < 20:
            push = client.receive()
            assert push.correlation_id == subscription
            batch = wire.decode_records(push.payload)
            assert len(batch.records) <= 8
            received.extend(batch.records)
            cursor = batch.next_cursor
        assert len(received) == 20  # the window is full: nothing more comes without acks
        client.send(wire.StreamAck("t", "g", "m", cursor, 20))
        while len(received) < 40:
            received.extend(wire.decode_records(client.receive().payload).records)

    assert [r.value for r in received[:40]] == [b"%d" % i for i in range(40)]


def test_each_sealed_segment_s_counts_are_recorded_in_the_control_plane(tmp_path: Path) -> None:
    settings = {"SVC_SEGMENT_MAX_BYTES": "1024", "SVC_TOPIC_RANGES": "1"}
    with running_broker(tmp_path, settings=settings) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            client.create_topic("orders")
            for i in range(40):
                client.produce("orders", [Record(b"x" * 100, key=b"k%d" % i)])
        output = broker.stop()
    assert broker.process.returncode == 0, output

    state = json.loads((tmp_path / "data" / "control" / "state.json").read_text())["state"]
    node_id = (tmp_path / "data" / "NODE_ID").read_text().strip()
    segments = sorted(
        (s for s in state["segments"] if s["range_id"] == "orders.0"),
        key=lambda s: s["base_offset"],
    )
    files = sorted((tmp_path / "data" / "ranges" / "orders.0").glob("*.log"))
    sealed, active = segments[:-1], segments[-1]
    assert len(sealed) >= 3
    assert len(segments) == len(files)
    # Every sealed segment: its record count and byte size as stored, on this node alone.
    next_base = 0
    for meta, file in zip(sealed, files, strict=False):
        assert meta["state"] == "sealed"
        assert meta["base_offset"] == next_base == int(file.stem)
        assert meta["byte_size"] == file.stat().st_size
        assert meta["replicas"] == [node_id]
        next_base += meta["record_count"]
    assert active["state"] == "active"
    assert active["base_offset"] == next_base
    assert active["record_count"] is None
    assert sum(s["record_count"] for s in sealed) <= 40
