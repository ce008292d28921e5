"""The one reason table: every reason is answered on both ports, and the ports answer from it."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from logbroker import wire
from logbroker.broker.errors import BrokerError
from logbroker.controlplane import ControlPlaneError, ControlPlaneWriteError
from logbroker.errors import CLIENT_REASON, HTTP_STATUS, LogbrokerError, Reason
from logbroker.security import SecurityError
from logbroker.storage import StorageError
from logbroker.wire import WireError
from tests.unit.server.test_protocol import Server, world

__all__ = ["world"]


def test_every_reason_has_a_status_and_a_client_reason() -> None:
    assert set(HTTP_STATUS) == set(Reason)
    assert set(CLIENT_REASON) == set(Reason)
    assert all(400 <= status <= 599 for status in HTTP_STATUS.values())


def test_the_client_port_answers_only_what_a_v1_client_can_act_on() -> None:
    # Internal reasons fold into ``unreachable``: retry later or through another node.
    internal = {
        Reason.CONTROL_PLANE_UNAVAILABLE,
        Reason.STORAGE_ERROR,
        Reason.INTERNAL_ERROR,
        Reason.CONTENDED,
        Reason.COMPACTED,
        Reason.LEASE_NOT_FOUND,
    }
    for reason in internal:
        assert CLIENT_REASON[reason] is Reason.UNREACHABLE
    assert not internal & set(CLIENT_REASON.values())


@pytest.mark.parametrize(
    "base", [BrokerError, ControlPlaneError, SecurityError, StorageError, WireError]
)
def test_every_domain_error_shares_the_base(base: type[Exception]) -> None:
    assert issubclass(base, LogbrokerError)


def test_a_domain_error_carries_its_reason_and_detail() -> None:
    error = ControlPlaneWriteError("writing state.json failed")

    assert error.reason is Reason.CONTROL_PLANE_UNAVAILABLE
    assert error.detail == str(error) == "writing state.json failed"
    assert BrokerError(Reason.NO_SUCH_TOPIC, "no topic 'x'").reason is Reason.NO_SUCH_TOPIC


def test_a_control_plane_that_cannot_write_is_answered_unreachable(
    world: tuple[Clock, Server], logged_errors: list[object]
) -> None:
    _, server = world
    client = server.connect()
    client.login()
    server.users._control._fs.failing_atomic_writes = 1  # type: ignore[attr-defined]

    client.send(wire.CreateTopic("orders", 0))

    assert client.one() == wire.Response(2, b"", "unreachable")
    # The control plane logs the failed write itself.
    assert len(logged_errors) == 1
    logged_errors.clear()
