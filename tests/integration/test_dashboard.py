"""The dashboard port of the real ``twistd logbroker``, over HTTP (treq): probes, the auth rate
limit's statistics after TCP clients from 127.0.0.3 hammered it, sessions shared with the client
port, the Prometheus exposition checked by promtool, and a port in use refused at boot."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted

from logbroker.client.blocking import BlockingClient, BrokerRefused
from tests.integration.twistd import run_twistd, running_broker
from tests.unit.dashboard.helpers import bearer, http_from

pytestmark = pytest.mark.integration


def open_from(source: str, port: int) -> BlockingClient:
    """A client-port connection from the loopback address ``source``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return BlockingClient(sock)


async def get(port: int, path: str, source: str = "127.0.0.1", **options: Any) -> tuple[int, Any]:
    response = await http_from(source).get(f"http://127.0.0.1:{port}{path}", **options)
    if response.headers.getRawHeaders("Content-Type") == ["application/json"]:
        return response.code, await response.json()
    return response.code, await response.content()


def promtool_problems(exposition: bytes) -> tuple[int, str]:
    promtool = shutil.which("promtool")
    # Missing promtool is a broken test machine, not a reason to skip the check.
    assert promtool is not None, "promtool is missing: run scripts/install --test"
    checked = subprocess.run(
        [promtool, "check", "metrics"],
        input=exposition,
        capture_output=True,
        timeout=60,
        check=False,
    )
    return checked.returncode, (checked.stdout + checked.stderr).decode()


@pytest_twisted.ensureDeferred
async def test_probes_and_the_auth_limit_s_statistics_after_tcp_hammering(
    tmp_path: Path,
) -> None:
    settings = {
        "SVC_RATE_LIMIT_ENABLED": "true",
        "SVC_AUTH_RATE_LIMIT": "3",
        "SVC_AUTH_RATE_WINDOW_MS": "600000",
    }
    with running_broker(tmp_path, settings=settings) as broker:
        port = broker.dashboard_port
        assert await get(port, "/health") == (200, {"status": "ok"})
        assert await get(port, "/ready") == (200, {"status": "ready"})

        refused = []
        for _ in range(8):
            with open_from("127.0.0.3", broker.port) as client:
                with pytest.raises(BrokerRefused) as error:
                    client.auth("admin", "wrong")
                refused.append(error.value.reason)
        blocked = refused.count("rate_limit_exceeded")
        # Three attempts pass, perhaps a fourth on the fraction of a token refilled meanwhile.
        assert blocked in (4, 5), refused

        code, limits = await get(port, "/rate_limits")
        assert code == 200
        assert limits["top_blocked"] == {
            "auth": [["127.0.0.3", blocked]],
            "publish": [],
            "subscribe": [],
            "channel_publish": [],
            "channel_subscribe": [],
        }
        assert limits["enabled"] is True
        assert limits["config"]["auth"] == {"limit": 3, "window_ms": 600000}
        assert sorted(limits["config"]) == ["auth", "publish", "subscribe"]

        code, metrics = await get(port, "/metrics")
        assert code == 200
        assert metrics["system"]["rate_limiting"]["auth_blocked"] == blocked
        assert metrics["system"]["dashboard"]["auth_blocked"] == 0
        assert metrics["node"]["status"] == "ready"

        code, text = await get(port, "/metrics", headers={"Accept": ["text/plain"]})
        assert code == 200
        assert f'svc_rate_limit_blocks_total{{action="auth"}} {blocked}.0'.encode() in text
        assert b"svc_ready 1.0" in text
        assert promtool_problems(text) == (0, "")
        broker.stop()
    assert broker.process.returncode == 0


@pytest_twisted.ensureDeferred
async def test_a_client_port_session_is_the_dashboard_s_from_the_same_ip_only(
    tmp_path: Path,
) -> None:
    with running_broker(tmp_path) as broker:
        with open_from("127.0.0.1", broker.port) as client:
            token = client.auth("admin", "admin123")
        port = broker.dashboard_port

        code, users = await get(port, "/users", headers=bearer(token))
        assert code == 200
        assert {"username": "admin", "permissions": ["admin"]} in users["users"]
        assert await get(port, "/users", source="127.0.0.2", headers=bearer(token)) == (
            401,
            {"s": "err", "reason": "session_hijack_attempt"},
        )
        code, metrics = await get(port, "/metrics")
        assert metrics["system"]["sessions"]["hijack_attempts"] == 1


def test_a_dashboard_port_in_use_stops_the_boot_with_status_2_naming_it(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as holder:
        holder.bind(("::", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        broker = run_twistd(tmp_path, settings={"SVC_DASHBOARD_PORT": str(taken)})
        output, _ = broker.communicate(timeout=60)

    assert broker.returncode == 2, output
    assert f"logbroker: SVC_DASHBOARD_PORT='{taken}' is invalid" in output
