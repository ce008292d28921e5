"""Rates from successive counter samples, and the shape of ``/rate_limits``, without HTTP."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from logbroker.cluster.membership import NodeRecord
from logbroker.cluster.view import ClusterNode, ClusterStatus, ControlPlaneKind
from logbroker.config import RateLimit
from logbroker.dashboard.payload import RateMeter, cluster_payload, rate_limits_payload
from logbroker.metrics import Metrics
from logbroker.security.ratelimit import Action, RateLimiter


def test_the_first_sample_has_no_rate_the_next_one_does() -> None:
    meter: RateMeter[str] = RateMeter()
    assert meter.rates(100.0, {"a": 5}) is None
    assert meter.rates(101.5, {"a": 20, "b": 3}) == {"a": 10.0, "b": 2.0}


def test_rates_follow_a_change_within_the_window() -> None:
    meter: RateMeter[str] = RateMeter(window=5.0, min_interval=0.5)
    seen = {}
    for t in range(11):
        # 10 per second for five seconds, then nothing.
        seen[t] = meter.rates(float(t), {"a": 10 * min(t, 5)})
    assert seen[1] == {"a": 10.0}
    assert seen[5] == {"a": 10.0}
    assert seen[6] == {"a": 8.0}  # over 1..6
    assert seen[10] == {"a": 0.0}  # over 5..10


def test_after_an_idle_spell_the_first_look_has_no_rate_rather_than_an_average() -> None:
    meter: RateMeter[str] = RateMeter(window=5.0)
    meter.rates(0.0, {"a": 0})
    assert meter.rates(60.0, {"a": 6000}) is None
    assert meter.rates(62.0, {"a": 6100}) == {"a": 50.0}


def test_samples_closer_than_the_minimum_interval_are_not_kept() -> None:
    meter: RateMeter[str] = RateMeter(window=1.0, min_interval=0.5)
    meter.rates(0.0, {"a": 0})
    assert meter.rates(0.3, {"a": 90}) == {"a": 300.0}
    # Had the sample at 0.3 been kept, it would be the base now (10 per second).
    assert meter.rates(1.3, {"a": 100}) == {"a": pytest.approx(100 / 1.3)}


def test_rate_limits_payload_has_the_five_top_blocked_keys_and_three_configs() -> None:
    limiter = RateLimiter(
        {
            Action.AUTH: RateLimit(1, 1000),
            Action.DASHBOARD_AUTH: RateLimit(1, 1000),
            Action.PUBLISH: RateLimit(5, 2000),
            Action.SUBSCRIBE: RateLimit(6, 3000),
        },
        enabled=True,
        clock=Clock(),
    )
    for _ in range(3):
        limiter.check("10.0.0.1", Action.AUTH)
        limiter.check("10.0.0.2", Action.DASHBOARD_AUTH)

    payload = rate_limits_payload(limiter)

    assert payload == {
        "enabled": True,
        "top_blocked": {
            "auth": [["10.0.0.1", 2]],
            "publish": [],
            "subscribe": [],
            "channel_publish": [],
            "channel_subscribe": [],
        },
        "config": {
            "auth": {"limit": 1, "window_ms": 1000},
            "publish": {"limit": 5, "window_ms": 2000},
            "subscribe": {"limit": 6, "window_ms": 3000},
        },
    }


def test_the_cluster_object_lists_every_node_with_its_state_and_marks() -> None:
    status = ClusterStatus(
        cluster_id="prod",
        node_id="n2",
        control_plane=ControlPlaneKind.ETCD,
        nodes=(
            ClusterNode(NodeRecord("n1", "10.0.0.1", 4040, 4041, 4042, (("zone", "a"),)), True, 3),
            ClusterNode(NodeRecord("n2", "fd00::2", 4040, 4041, 4042, (), "0.1"), True, 1),
            ClusterNode(NodeRecord("n3", "10.0.0.3", 4040, 4041, 4042), False, 0),
        ),
        chores_holder="n1",
        domain_violations=2,
        lease_age_seconds=0.12345,
        under_replicated=3,
    )
    metrics = Metrics(Clock())
    metrics.peer_connection_opened()
    metrics.peer_bytes("in", 10)
    metrics.peer_bytes("out", 20)

    payload = cluster_payload(status, metrics.snapshot())

    assert {key: value for key, value in payload.items() if key != "nodes"} == {
        "cluster_id": "prod",
        "node_id": "n2",
        "control_plane": "etcd",
        "chores_holder": "n1",
        "domain_violations": 2,
        "under_replicated": 3,
        "lease_age_seconds": 0.123,
        "peers": {"connections": 1, "bytes_in": 10, "bytes_out": 20},
    }
    assert payload["nodes"] == [
        {
            "node_id": "n1",
            "state": "alive",
            "address": "10.0.0.1:4040",
            "dashboard_port": 4041,
            "peer_port": 4042,
            "attributes": {"zone": "a"},
            "segments_led": 3,
            "version": "",
            "answering": False,
            "chores": True,
        },
        {
            "node_id": "n2",
            "state": "alive",
            "address": "[fd00::2]:4040",
            "dashboard_port": 4041,
            "peer_port": 4042,
            "attributes": {},
            "segments_led": 1,
            "version": "0.1",
            "answering": True,
            "chores": False,
        },
        {
            "node_id": "n3",
            "state": "dead",
            "address": "10.0.0.3:4040",
            "dashboard_port": 4041,
            "peer_port": 4042,
            "attributes": {},
            "segments_led": 0,
            "version": "",
            "answering": False,
            "chores": False,
        },
    ]
