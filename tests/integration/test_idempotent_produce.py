"""``produce_idempotent`` against the real ``twistd logbroker``: a stamp sent again is stored
once and answered its count, a new sequence is stored again, and the clients' produces go
through it."""

from __future__ import annotations

from pathlib import Path

import pytest

from logbroker import wire
from logbroker.client.blocking import BlockingClient, BrokerRefused
from logbroker.records import ProducerStamp, Record
from tests.integration.twistd import running_broker

pytestmark = pytest.mark.integration


def drain(client: BlockingClient, topic: str) -> list[Record]:
    records: list[Record] = []
    cursor = None
    while True:
        batch = client.fetch(topic, cursor, None, None, 1000, 0)
        if not batch.records:
            return records
        records.extend(batch.records)
        cursor = batch.next_cursor


def produce_stamped(
    client: BlockingClient, topic: str, stamp: ProducerStamp, records: tuple[Record, ...]
) -> int:
    return wire.decode_count(client.call(wire.ProduceIdempotent(topic, stamp, records)))


def test_a_stamp_sent_twice_is_stored_once_and_both_answers_carry_its_count(
    tmp_path: Path,
) -> None:
    with (
        running_broker(tmp_path) as broker,
        BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client,
    ):
        client.create_topic("stamped")
        sent = tuple(
            Record(b"%02d" % i, key=b"k%d" % i if i % 2 else None, timestamp_ms=i)
            for i in range(20)
        )
        stamp = ProducerStamp(0x5EED_0000_0000_0001, 0)

        answers = [produce_stamped(client, "stamped", stamp, sent) for _ in range(2)]

        assert answers == [20, 20]
        assert sorted(drain(client, "stamped"), key=repr) == sorted(sent, key=repr)

        again = ProducerStamp(stamp.producer_id, 1)
        assert produce_stamped(client, "stamped", again, sent) == 20
        assert len(drain(client, "stamped")) == 40

        later = ProducerStamp(stamp.producer_id, 40)
        assert produce_stamped(client, "stamped", later, sent) == 20
        with pytest.raises(BrokerRefused) as refused:
            produce_stamped(client, "stamped", again, sent)  # 40 - 32 >= 1: too old to tell
        assert refused.value.reason == "sequence_too_old"
        assert len(drain(client, "stamped")) == 60


def test_the_blocking_clients_produces_are_stamped_and_stored_once_each(tmp_path: Path) -> None:
    with (
        running_broker(tmp_path) as broker,
        BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client,
    ):
        client.create_topic("plain")

        assert client.produce("plain", [Record(b"a"), Record(b"b", key=b"k")]) == 2
        assert client.produce("plain", [Record(b"a")]) == 1

        assert sorted(r.value for r in drain(client, "plain")) == [b"a", b"a", b"b"]
        assert not client.sends_plain_produce


def test_a_stamp_sent_again_after_a_restart_is_stored_once(tmp_path: Path) -> None:
    sent = tuple(
        Record(b"%02d" % i, key=b"k%d" % i if i % 3 else None, timestamp_ms=i) for i in range(12)
    )
    stamp = ProducerStamp(0x5EED_0000_0000_0002, 7)
    with running_broker(tmp_path) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            client.create_topic("restarted")
            assert produce_stamped(client, "restarted", stamp, sent) == 12
        broker.stop()

    with (
        running_broker(tmp_path) as broker,
        BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client,
    ):
        assert produce_stamped(client, "restarted", stamp, sent) == 12
        assert sorted(drain(client, "restarted"), key=repr) == sorted(sent, key=repr)
