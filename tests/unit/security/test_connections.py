"""Connection accounting per IP and in total, and client identifiers."""

from __future__ import annotations

import pytest
from twisted.internet.address import IPv4Address, IPv6Address, UNIXAddress

from logbroker.config import ConnectionLimitSettings
from logbroker.security.connections import ConnectionRegistry, client_identifier
from logbroker.wire import Reason


def registry(
    per_ip: int = 2, total: int = 3, enabled: bool = True
) -> tuple[ConnectionRegistry, list[Reason]]:
    refused: list[Reason] = []
    settings = ConnectionLimitSettings(enabled=enabled, max_per_ip=per_ip, max_total=total)
    return ConnectionRegistry(settings, on_refused=refused.append), refused


def test_the_per_ip_cap_refuses_and_rolls_back() -> None:
    connections, refused = registry()
    assert connections.acquire("a") is None
    assert connections.acquire("a") is None
    assert connections.acquire("a") is Reason.CONNECTION_LIMIT_EXCEEDED
    assert (connections.count("a"), connections.total) == (2, 2)
    assert refused == [Reason.CONNECTION_LIMIT_EXCEEDED]
    connections.release("a")
    assert connections.acquire("a") is None


def test_the_total_cap_refuses_other_ips_and_rolls_back() -> None:
    connections, refused = registry()
    for ip in ("a", "a", "b"):
        assert connections.acquire(ip) is None
    assert connections.acquire("c") is Reason.GLOBAL_LIMIT_EXCEEDED
    assert (connections.count("c"), connections.total) == (0, 3)
    assert len(refused) == 1
    assert refused == [Reason.GLOBAL_LIMIT_EXCEEDED]
    connections.release("b")
    assert connections.acquire("c") is None


def test_the_per_ip_cap_is_checked_first() -> None:
    connections, _ = registry(per_ip=1, total=1)
    assert connections.acquire("a") is None
    assert connections.acquire("a") is Reason.CONNECTION_LIMIT_EXCEEDED


def test_disabled_counts_but_never_refuses() -> None:
    connections, refused = registry(per_ip=1, total=1, enabled=False)
    for _ in range(5):
        assert connections.acquire("a") is None
    assert connections.total == 5
    assert refused == []
    assert len(refused) == 0
    for _ in range(5):
        connections.release("a")
    assert connections.total == 0
    assert connections.count("a") == 0


@pytest.mark.parametrize(
    ("address", "identifier"),
    [
        (IPv4Address("TCP", "127.0.0.1", 5000), "127.0.0.1"),
        (IPv6Address("TCP", "::1", 5000), "0:0:0:0:0:0:0:1"),
        (IPv6Address("TCP", "2001:DB8::0012:1", 5000), "2001:db8:0:0:0:0:12:1"),
        (IPv6Address("TCP", "fe80::1%eth0", 5000), "fe80:0:0:0:0:0:0:1"),
        (IPv6Address("TCP", "::ffff:10.1.2.3", 5000), "10.1.2.3"),
        (UNIXAddress(b"/run/sock"), "unknown"),
        (IPv4Address("TCP", "not an address", 5000), "unknown"),
        (None, "unknown"),
    ],
)
def test_client_identifiers(address: object, identifier: str) -> None:
    assert client_identifier(address) == identifier


def test_the_busiest_ips_come_most_first_and_ties_by_ip() -> None:
    connections, _refused = registry(per_ip=10, total=10)
    for ip in ("b", "a", "c", "c", "b", "c"):
        connections.acquire(ip)
    assert connections.busiest(2) == [("c", 3), ("b", 2)]
    connections.release("c")
    connections.release("c")
    assert connections.busiest() == [("b", 2), ("a", 1), ("c", 1)]
