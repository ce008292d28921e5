"""What the certification reads of the cluster: the control plane's segment records (who
leads what), each node's health as the operator's commands show it, and whether every sealed
copy is identical; and the check failure the harness's waits raise."""

from __future__ import annotations

import base64
import collections
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.certify.load import ADMIN
from tests.certify.nodes import Broker, EtcdMember

TOPIC = "certify"
PROBE_TOPIC = "certify-probe"
CLUSTER_ID = "certify"
LOGBROKER = str(Path(sys.executable).with_name("logbroker"))


#: A problem a check found: the guarantee it breaks (0: the drill's own), and what it is.
Problem = tuple[int, str]


class CheckFailed(Exception):
    """A check between drills did not hold within its bound."""


def wait_until(
    condition: Callable[[], bool],
    seconds: float,
    what: str,
    explain: Callable[[], object] = lambda: "",
) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise CheckFailed(f"not within {seconds:g} s: {what} ({explain()})")
        time.sleep(0.25)


class ClusterView:
    """The cluster's state, read from its etcd members and through its brokers."""

    def __init__(self, etcd: list[EtcdMember], brokers: list[Broker]) -> None:
        self.etcd = etcd
        self.brokers = brokers

    def broker(self, node_id: str) -> Broker:
        return next(b for b in self.brokers if b.node_id == node_id)

    def others(self, broker: Broker) -> list[Broker]:
        return [b for b in self.brokers if b is not broker]

    def segments(self) -> list[dict[str, Any]]:
        """Every segment's record in the control plane, read from whichever member answers."""
        prefix = f"/logbroker/{CLUSTER_ID}/state/segments/".encode()
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        body = json.dumps(
            {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()}
        ).encode()
        for member in self.etcd:
            request = urllib.request.Request(f"http://{member.endpoint}/v3/kv/range", data=body)
            try:
                with urllib.request.urlopen(request, timeout=3) as answer:
                    found = json.load(answer).get("kvs", [])
            except OSError:
                continue
            return [json.loads(base64.b64decode(kv["value"])) for kv in found]
        raise CheckFailed("no etcd member answered")

    def busy_primary(self) -> tuple[Broker, str]:
        """The primary of the load's busiest range (its active segment's first replica), and
        the range."""
        active = [
            s
            for s in self.segments()
            if s["state"] == "active" and s["range_id"].startswith(TOPIC + ".")
        ]
        if not active:
            raise CheckFailed(f"no active segment of {TOPIC} in the control plane")
        led = collections.Counter(s["replicas"][0] for s in active)
        node_id = led.most_common(1)[0][0]
        range_id = next(s["range_id"] for s in active if s["replicas"][0] == node_id)
        return self.broker(node_id), range_id

    def led_by(self, broker: Broker) -> list[str]:
        """The load's ranges whose active segment ``broker`` leads (is the first replica of)."""
        return [
            s["range_id"]
            for s in self.segments()
            if s["state"] == "active"
            and s["range_id"].startswith(TOPIC + ".")
            and s["replicas"][0] == broker.node_id
        ]

    def quietest(self) -> Broker:
        """The node leading the fewest of the load's ranges."""
        return min(self.brokers, key=lambda broker: len(self.led_by(broker)))

    def cluster_status(self, broker: Broker) -> dict[str, Any] | None:
        """``logbroker cluster status --json`` through ``broker``; None if it did not answer."""
        done = subprocess.run(
            [
                LOGBROKER, "--server", broker.server, "--user", ADMIN[0],
                "--password", ADMIN[1], "cluster", "status", "--json",
            ],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if done.returncode != 0:
            return None
        status: dict[str, Any] = json.loads(done.stdout)
        return status

    def health(self, under_replicated: bool = True) -> str | None:
        """None when every node is ready and sees 3 of 3 alive (and, with
        ``under_replicated``, counts no segment under-replicated); else what is missing."""
        for broker in self.brokers:
            if not broker.ready():
                return f"{broker.node_id} not ready"
        for broker in self.brokers:
            status = self.cluster_status(broker)
            if status is None:
                return f"`cluster status` through {broker.node_id} failed"
            alive = sorted(n["node_id"] for n in status["nodes"] if n["state"] == "alive")
            if len(alive) < len(self.brokers):
                return f"{broker.node_id} sees alive only {', '.join(alive) or 'none'}"
            count = status["under_replicated_segments"]
            if under_replicated and count != 0:
                return f"{broker.node_id} counts {count} under-replicated segments"
        return None

    def verify_copies(self) -> tuple[bool, str]:
        """``logbroker cluster verify`` through the first node: whether every sealed segment
        file is byte-identical on every node of its replica set, and what it printed."""
        done = subprocess.run(
            [
                LOGBROKER, "--server", self.brokers[0].server, "--user", ADMIN[0],
                "--password", ADMIN[1], "cluster", "verify",
            ],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        return done.returncode == 0, (done.stdout + done.stderr).strip()
