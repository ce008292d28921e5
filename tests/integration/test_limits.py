"""Connection limits and the auth rate limit of the real ``twistd logbroker``, with clients on
several loopback addresses (127.0.0.2 is another client IP on Linux) and on IPv6 ``::1``."""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from logbroker.client.blocking import BlockingClient, BrokerRefused, ConnectionClosed
from logbroker.records import Record
from tests.integration.twistd import RunningBroker, running_broker

pytestmark = pytest.mark.integration


def open_from(source: str, port: int) -> BlockingClient:
    """A connection to the broker from the loopback address ``source``."""
    family = socket.AF_INET6 if ":" in source else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.bind((source, 0))
    sock.connect(("::1" if family == socket.AF_INET6 else "127.0.0.1", port))
    return BlockingClient(sock)


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[RunningBroker]:
    # The spec's security-focused example tuning.
    settings = {
        "SVC_RATE_LIMIT_ENABLED": "true",
        "SVC_AUTH_RATE_LIMIT": "5",
        "SVC_AUTH_RATE_WINDOW_MS": "120000",
        "SVC_CONNECTION_LIMIT_ENABLED": "true",
        "SVC_MAX_CONN_PER_IP": "50",
    }
    with running_broker(tmp_path, settings=settings) as broker:
        yield broker


def test_connections_past_the_per_ip_cap_get_the_error_frame_and_slots_free_on_close(
    limited: RunningBroker,
) -> None:
    with ExitStack() as stack:
        held = [stack.enter_context(open_from("127.0.0.1", limited.port)) for _ in range(50)]
        with open_from("127.0.0.1", limited.port) as refused:
            response = refused.receive()
            assert (response.correlation_id, response.reason) == (0, "connection_limit_exceeded")
            with pytest.raises(ConnectionClosed):
                refused.receive()
        # Another client IP is not affected.
        with open_from("127.0.0.2", limited.port) as other:
            other.auth("app", "app123")
        # Closing connections frees their slots, and only theirs.
        for client in held[:3]:
            client.close()
        for _ in range(3):
            stack.enter_context(_once_a_slot_is_free(limited.port))
        with open_from("127.0.0.1", limited.port) as refused:
            assert refused.receive().reason == "connection_limit_exceeded"


def _once_a_slot_is_free(port: int) -> BlockingClient:
    """A new logged-in connection once the broker has seen an earlier one close (it counts a
    connection down when it reads the close, which can trail the client's close a moment)."""
    for _ in range(200):
        client = open_from("127.0.0.1", port)
        try:
            client.auth("app", "app123")
        except BrokerRefused as error:
            client.close()
            reason = error.reason
        else:
            return client
        assert reason == "connection_limit_exceeded"
    raise AssertionError("the slots of closed connections were never freed")


def test_an_attacker_hammering_auth_is_blocked_while_other_ips_are_not(
    limited: RunningBroker,
) -> None:
    with open_from("127.0.0.3", limited.port) as attacker:
        reasons = []
        for _ in range(8):
            try:
                attacker.auth("admin", "guess")
            except BrokerRefused as error:
                reasons.append(error.reason)
    # Five in the burst, plus one: each check takes tens of milliseconds (the password hash),
    # which refills the empty bucket above 0, and the spec's table allows any count above 0.
    assert reasons == ["invalid_credentials"] * 6 + ["rate_limit_exceeded"] * 2
    with open_from("127.0.0.4", limited.port) as bystander:
        bystander.auth("admin", "admin123")
    # The attacker's IP stays blocked on a new connection, even with the right password.
    with open_from("127.0.0.3", limited.port) as attacker, pytest.raises(BrokerRefused) as error:
        attacker.auth("admin", "admin123")
    assert error.value.reason == "rate_limit_exceeded"


def test_an_ipv6_client_on_the_loopback_is_served_and_its_session_bound_to_it(
    tmp_path: Path,
) -> None:
    with running_broker(tmp_path) as broker:
        with open_from("::1", broker.port) as client:
            token = client.auth("app", "app123")
            client.create_topic("six")
        with open_from("::1", broker.port) as resumed:
            assert resumed.auth(None, token) == token
            assert [topic.name for topic in resumed.list_topics()] == ["six"]
        with open_from("127.0.0.1", broker.port) as elsewhere, pytest.raises(BrokerRefused) as e:
            elsewhere.auth(None, token)
        assert e.value.reason == "invalid_credentials"


def test_the_high_traffic_tuning_is_reported_and_publish_is_never_limited(tmp_path: Path) -> None:
    # The spec's high-traffic example tuning, with a publish limit well below what is sent.
    settings = {
        "SVC_RATE_LIMIT_ENABLED": "true",
        "SVC_PUBLISH_RATE_LIMIT": "10000",
        "SVC_MAX_TOTAL_CONN": "50000",
    }
    with running_broker(tmp_path, settings=settings) as broker:
        with BlockingClient.connect("127.0.0.1", broker.port, "app", "app123") as client:
            client.create_topic("busy")
            batch = [Record(b"x" * 10)] * 1000
            # 30 000 records within a second or two: three times the publish limit.
            assert sum(client.produce("busy", batch) for _ in range(30)) == 30_000
        base = f"http://127.0.0.1:{broker.dashboard_port}"
        with urllib.request.urlopen(f"{base}/rate_limits", timeout=30) as response:
            limits = json.load(response)
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            rate_limiting = json.load(response)["system"]["rate_limiting"]
    assert limits["config"]["publish"] == {"limit": 10000, "window_ms": 1000}
    assert limits["top_blocked"]["publish"] == []
    assert rate_limiting["publish_blocked"] == 0
