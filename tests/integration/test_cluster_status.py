"""``logbroker cluster status`` against the real single-node ``twistd logbroker``: one live node,
this one, doing its own chores; the same cluster on the dashboard's ``/metrics``.

Needs the composition root to give the client port and the dashboard the node's cluster view,
with the ports it bound (``ClientFactory.cluster``, ``DashboardApp.cluster``,
``Metrics.watch_cluster``)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.twistd import RunningBroker, broker_env, running_broker

pytestmark = pytest.mark.integration

LOGBROKER = str(Path(sys.executable).with_name("logbroker"))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    settings = {"SVC_NODE_ID": "solo-1", "SVC_LOG_ATTRIBUTES": "zone=a,rack=r1"}
    with running_broker(tmp_path_factory.mktemp("broker"), settings=settings) as running:
        yield running


def cluster_status(
    broker: RunningBroker, *args: str, user: str = "admin", password: str = "admin123"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            LOGBROKER,
            "--server",
            f"127.0.0.1:{broker.port}",
            "--user",
            user,
            "--password",
            password,
            "cluster",
            "status",
            *args,
        ],
        capture_output=True,
        text=True,
        env=broker_env({}),
        timeout=60,
        check=False,
    )


def test_cluster_status_shows_one_live_node_answering_and_doing_the_chores(
    broker: RunningBroker,
) -> None:
    result = cluster_status(broker)

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "control plane:     local" in lines
    assert "chores holder:     solo-1" in lines
    assert "domain violations: 0" in lines
    header = next(i for i, line in enumerate(lines) if line.startswith("NODE"))
    [row] = lines[header + 1 :]
    cells = row.split()
    assert cells[:2] == ["solo-1", "alive"]
    assert cells[2].endswith(f":{broker.port}")
    assert "zone=a,rack=r1" in cells
    assert cells[-2:] == ["answering", "chores"]


def test_cluster_status_json_is_one_object_with_the_bound_ports(broker: RunningBroker) -> None:
    result = cluster_status(broker, "--json")

    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    assert (document["node_id"], document["control_plane"]) == ("solo-1", "local")
    assert document["chores_holder"] == "solo-1"
    assert (document["domain_violations"], document["lease_age_seconds"]) == (0, None)
    [node] = document["nodes"]
    assert (node["node_id"], node["state"], node["answering"], node["chores"]) == (
        "solo-1",
        "alive",
        True,
        True,
    )
    assert node["client_port"] == broker.port
    assert node["dashboard_port"] == broker.dashboard_port
    assert node["attributes"] == {"zone": "a", "rack": "r1"}


def test_cluster_status_is_for_admins(broker: RunningBroker) -> None:
    result = cluster_status(broker, user="consumer", password="consumer123")

    assert result.returncode == 1
    assert "permission_denied" in result.stderr


def test_the_dashboard_shows_the_same_cluster(broker: RunningBroker) -> None:
    base = f"http://127.0.0.1:{broker.dashboard_port}/metrics"
    with urllib.request.urlopen(base, timeout=30) as response:
        payload = json.load(response)
    request = urllib.request.Request(base, headers={"Accept": "text/plain"})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()

    cluster = payload["cluster"]
    assert [(n["node_id"], n["state"]) for n in cluster["nodes"]] == [("solo-1", "alive")]
    assert cluster["chores_holder"] == "solo-1"
    assert 'svc_cluster_nodes{state="alive"} 1.0' in text
    assert 'svc_cluster_nodes{state="dead"} 0.0' in text
