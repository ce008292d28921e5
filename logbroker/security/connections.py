"""Connection accounting: concurrent connections per client IP and in total.

A connection is counted when it is accepted and uncounted when it ends, for whatever reason. An
increment that takes a count over its limit is rolled back at once and the connection refused:
the per-IP cap is checked first (``connection_limit_exceeded``), then the total
(``global_limit_exceeded``). Disabled (``SVC_CONNECTION_LIMIT_ENABLED=false``), connections are
still counted, for the open-connections figures, but never refused.
"""

from __future__ import annotations

import heapq
import ipaddress
from collections.abc import Callable

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.interfaces import IAddress

from logbroker.config import ConnectionLimitSettings
from logbroker.wire import Reason

#: The identifier of a client whose address cannot be read (spec: "Resources").
UNKNOWN_CLIENT = "unknown"


def client_identifier(address: IAddress | object | None) -> str:
    """The spec's client IP identifier: dotted decimal for IPv4, colon-separated hexadecimal
    groups for IPv6 (all eight, lower case, no leading zeros: ``0:0:0:0:0:0:0:1``), and
    ``unknown`` when the peer address cannot be read. An IPv4 client reaching a dual-stack
    listener arrives as an IPv4-mapped IPv6 address and is named by its IPv4 address, so that one
    client has one identifier whichever listener it used."""
    if not isinstance(address, IPv4Address | IPv6Address):
        return UNKNOWN_CLIENT
    try:
        # An IPv6 address may carry a zone (``fe80::1%eth0``): the interface is not the client.
        parsed = ipaddress.ip_address(address.host.partition("%")[0])
    except ValueError:
        return UNKNOWN_CLIENT
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        groups = parsed.packed
        return ":".join(f"{int.from_bytes(groups[i : i + 2], 'big'):x}" for i in range(0, 16, 2))
    return str(parsed)


class ConnectionRegistry:
    def __init__(
        self,
        settings: ConnectionLimitSettings,
        *,
        on_refused: Callable[[Reason], None] = lambda reason: None,
    ) -> None:
        self._settings = settings
        self._on_refused = on_refused
        self._per_ip: dict[str, int] = {}
        self.total = 0

    def acquire(self, client_ip: str) -> Reason | None:
        """Count a new connection from ``client_ip``; the reason to refuse it, if over a limit
        (then nothing stays counted)."""
        count = self._per_ip.get(client_ip, 0) + 1
        self._per_ip[client_ip] = count
        self.total += 1
        refusal: Reason | None = None
        if self._settings.enabled:
            if count > self._settings.max_per_ip:
                refusal = Reason.CONNECTION_LIMIT_EXCEEDED
            elif self.total > self._settings.max_total:
                refusal = Reason.GLOBAL_LIMIT_EXCEEDED
        if refusal is not None:
            self.release(client_ip)
            self._on_refused(refusal)
        return refusal

    def release(self, client_ip: str) -> None:
        """A connection counted by ``acquire`` has ended."""
        count = self._per_ip[client_ip] - 1
        if count:
            self._per_ip[client_ip] = count
        else:
            del self._per_ip[client_ip]
        self.total -= 1

    def count(self, client_ip: str) -> int:
        return self._per_ip.get(client_ip, 0)

    def busiest(self, count: int = 10) -> list[tuple[str, int]]:
        """The client IPs holding the most connections, most first (ties by IP)."""
        return heapq.nsmallest(count, self._per_ip.items(), key=lambda item: (-item[1], item[0]))
