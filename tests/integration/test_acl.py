"""Per-topic ACLs of the real ``twistd logbroker``: enforced only with ``SVC_ACL_STRICT=true``."""

from __future__ import annotations

from pathlib import Path

import pytest

from logbroker.client.blocking import BlockingClient, BrokerRefused
from logbroker.records import Record
from tests.integration.twistd import running_broker

pytestmark = pytest.mark.integration

RECORD = [Record(b"x")]


def refused(call: object, *args: object) -> str:
    with pytest.raises(BrokerRefused) as error:
        call(*args)  # type: ignore[operator]
    return error.value.reason


def test_strict_acls_need_a_grant_for_produce_and_consume(tmp_path: Path) -> None:
    with running_broker(tmp_path, settings={"SVC_ACL_STRICT": "true"}) as broker:
        port = broker.port
        with BlockingClient.connect("127.0.0.1", port, "admin", "admin123") as admin:
            for topic in ("orders.eu", "orders.us", "payments"):
                admin.create_topic(topic)
            admin.produce("payments", RECORD)  # admins need no grant
            admin.grant_acl("producer", "produce", "orders.*")
            admin.grant_acl("consumer", "consume", "orders.eu")
        with BlockingClient.connect("127.0.0.1", port, "producer", "producer123") as producer:
            assert producer.produce("orders.eu", RECORD) == 1
            assert producer.produce("orders.us", RECORD) == 1
            assert refused(producer.produce, "payments", RECORD) == "permission_denied"
        with BlockingClient.connect("127.0.0.1", port, "consumer", "consumer123") as consumer:
            assert len(consumer.fetch("orders.eu").records) == 1
            assert refused(consumer.fetch, "orders.us") == "permission_denied"
            # A grant gives nothing the user's permissions do not: consumers cannot produce.
            assert refused(consumer.produce, "orders.eu", RECORD) == "permission_denied"
        with BlockingClient.connect("127.0.0.1", port, "admin", "admin123") as admin:
            admin.revoke_acl("consumer", "consume", "orders.eu")
        with BlockingClient.connect("127.0.0.1", port, "consumer", "consumer123") as consumer:
            assert refused(consumer.fetch, "orders.eu") == "permission_denied"


def test_without_strict_acls_grants_are_inert(tmp_path: Path) -> None:
    with running_broker(tmp_path) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "admin", "admin123") as admin:
            admin.create_topic("payments")
            admin.grant_acl("producer", "produce", "orders.*")
        with BlockingClient.connect("127.0.0.1", broker.port, "producer", "producer123") as p:
            assert p.produce("payments", RECORD) == 1
        with BlockingClient.connect("127.0.0.1", broker.port, "consumer", "consumer123") as c:
            assert len(c.fetch("payments").records) == 1
            # Global permissions still apply.
            assert refused(c.produce, "payments", RECORD) == "permission_denied"
