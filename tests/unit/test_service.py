"""The composition root: what ``build_service`` sets up before the reactor runs."""

from __future__ import annotations

import errno
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.error import CannotListenError
from twisted.internet.protocol import Factory
from twisted.internet.testing import MemoryReactorClock

from logbroker.config import ANY_ADDRESS, BrokerConfig, ConfigError
from logbroker.service import GIL_SWITCH_INTERVAL_SECONDS, build_service, listen_tcp
from logbroker.storage import DataDirectory, OsFileSystem


@pytest.fixture
def switch_interval() -> Iterator[None]:
    """Restore this test process's GIL switch interval, which the composition root changes."""
    before = sys.getswitchinterval()
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@pytest.mark.usefixtures("switch_interval")
def test_the_broker_hands_the_gil_to_its_writer_threads_within_half_a_millisecond(
    tmp_path: Path,
) -> None:
    sys.setswitchinterval(0.005)
    config, _ = BrokerConfig.from_env({}, cwd=str(tmp_path))
    data_dir = DataDirectory.open(config.storage.data_dir, OsFileSystem())

    root = build_service(MemoryReactorClock(), config, data_dir)

    assert root.getServiceNamed("storage") is not None
    assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_SECONDS)


class _NoIpv6Reactor(MemoryReactorClock):
    """A host whose kernel has no IPv6: listening on ``::`` fails as it would there."""

    def listenTCP(self, port: int, factory: object, backlog: int = 50, interface: str = "") -> Any:
        if ":" in interface:
            raise CannotListenError(interface, port, OSError(errno.EAFNOSUPPORT, "no IPv6"))
        return super().listenTCP(port, factory, backlog, interface)  # type: ignore[arg-type]


def test_without_ipv6_the_default_address_falls_back_to_every_ipv4_interface() -> None:
    reactor = _NoIpv6Reactor()
    listen_tcp(reactor, 4040, Factory(), ANY_ADDRESS, "SVC_TCP_PORT")
    [(port, _, _, interface)] = reactor.tcpServers
    assert (port, interface) == (4040, "0.0.0.0")


def test_an_explicit_ipv6_address_that_cannot_be_listened_on_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as error:
        listen_tcp(_NoIpv6Reactor(), 4041, Factory(), "::1", "SVC_DASHBOARD_PORT")
    assert error.value.variable == "SVC_DASHBOARD_PORT"
    assert "4041" in str(error.value)
