"""``Metrics``: every series, fed through the paths that feed it in the broker."""

from __future__ import annotations

from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from logbroker import __version__
from logbroker.cluster.view import MembershipView, SingleNodeView
from logbroker.config import SpreadPolicy
from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.maintenance.periodic import PeriodicTask
from logbroker.maintenance.scrub import NoOtherCopy, Scrubber
from logbroker.metrics import (
    CONTROLPLANE_OPS,
    CONTROLPLANE_RESULTS,
    PEER_REFUSALS,
    Metrics,
    MetricsSnapshot,
    ReactorLagProbe,
)
from logbroker.placement import PlacementRule
from logbroker.records import Record
from logbroker.storage import DamageReason, LogConfig
from logbroker.testing import ManualExecutor, MemoryFileSystem
from tests.unit.broker.helpers import make_broker_and_control
from tests.unit.cluster.test_membership import Cluster, record
from tests.unit.controlplane.helpers import make_topic, started
from tests.unit.metrics.helpers import (
    GROUP_COMMIT,
    open_reporting_log,
    populated_metrics,
    reopen_with_rot,
)
from tests.unit.storage.helpers import (
    append_each,
    batch_positions,
    failure_of,
    result_of,
    segment_path,
)


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the text exposition, parsed back: (name, labels) -> value."""
    text = metrics.render_text().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


def produce(broker: Any, topic: str, records: list[Record]) -> Deferred[int]:
    deferred: Deferred[int] = broker.produce(topic, records)
    return deferred


# -- the registry --------------------------------------------------------------------------------


def test_every_series_shows_from_the_start_at_zero() -> None:
    metrics = Metrics(Clock())

    exported = samples(metrics)

    expected_zero = [
        ("svc_auth_attempts_total", {"result": "ok"}),
        ("svc_auth_attempts_total", {"result": "invalid_credentials"}),
        ("svc_auth_attempts_total", {"result": "rate_limited"}),
        ("svc_rate_limit_blocks_total", {"action": "auth"}),
        ("svc_rate_limit_blocks_total", {"action": "dashboard_auth"}),
        ("svc_rate_limit_blocks_total", {"action": "publish"}),
        ("svc_rate_limit_blocks_total", {"action": "subscribe"}),
        ("svc_connection_limit_blocks_total", {"limit": "per_ip"}),
        ("svc_connection_limit_blocks_total", {"limit": "global"}),
        ("svc_session_expired_total", {}),
        ("svc_session_hijack_attempt_total", {}),
        ("svc_tls_handshakes_total", {"outcome": "ok"}),
        ("svc_tls_handshakes_total", {"outcome": "failed"}),
        ("svc_open_connections", {}),
        ("svc_storage_scrub_segments_total", {"result": "verified"}),
        ("svc_storage_scrub_segments_total", {"result": "repaired"}),
        ("svc_storage_scrub_segments_total", {"result": "unrepairable"}),
        *[("svc_storage_integrity_failures_total", {"reason": r.value}) for r in DamageReason],
        ("svc_domain_violations", {}),
        ("svc_group_commit_flush_records_count", {}),
        ("svc_group_commit_flush_duration_seconds_count", {}),
        ("svc_ready", {}),
        ("svc_reactor_lag_seconds", {}),
        ("svc_uptime_seconds", {}),
        ("svc_topics", {}),
        ("svc_ranges", {}),
        ("svc_storage_bytes", {}),
        ("svc_storage_segments", {"state": "active"}),
        ("svc_storage_segments", {"state": "sealed"}),
        ("svc_storage_segments", {"state": "closed"}),
        ("svc_cluster_nodes", {"state": "alive"}),
        ("svc_cluster_nodes", {"state": "dead"}),
        *[
            ("svc_controlplane_requests_total", {"op": op, "result": result})
            for op in CONTROLPLANE_OPS
            for result in CONTROLPLANE_RESULTS
        ],
        *[("svc_controlplane_request_seconds_count", {"op": op}) for op in CONTROLPLANE_OPS],
        ("svc_peer_connections", {}),
        ("svc_peer_bytes_total", {"direction": "in"}),
        ("svc_peer_bytes_total", {"direction": "out"}),
        *[("svc_peer_connections_refused_total", {"reason": r}) for r in PEER_REFUSALS],
    ]
    for name, labels in expected_zero:
        assert exported[(name, tuple(sorted(labels.items())))] == 0, (name, labels)
    assert exported[("svc_build_info", (("version", __version__),))] == 1
    assert ("svc_process_cpu_seconds_total", ()) in exported
    assert all(name.startswith("svc_") for name, _ in exported)


def test_series_go_on_the_injected_registry_and_never_on_the_global_one() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(Clock(), registry)

    metrics.session_expired()

    assert metrics.registry is registry
    assert registry.get_sample_value("svc_session_expired_total") == 1
    global_names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(name.startswith("svc_") for name in global_names)


def test_the_snapshot_of_a_new_registry() -> None:
    clock = Clock()
    clock.advance(100)
    metrics = Metrics(clock)
    clock.advance(7.5)

    assert metrics.snapshot() == MetricsSnapshot(
        produced_records={},
        produced_bytes={},
        consumed_records={},
        consumed_bytes={},
        auth_attempts={"ok": 0, "invalid_credentials": 0, "rate_limited": 0},
        rate_limit_blocks={"auth": 0, "dashboard_auth": 0, "publish": 0, "subscribe": 0},
        connection_limit_blocks={"per_ip": 0, "global": 0},
        sessions_expired=0,
        session_hijack_attempts=0,
        tls_handshakes={"ok": 0, "failed": 0},
        open_connections=0,
        integrity_failures={reason.value: 0 for reason in DamageReason},
        scrub_segments={"verified": 0, "repaired": 0, "unrepairable": 0},
        retention_segments_removed=0,
        retention_bytes_removed=0,
        domain_violations=0,
        periodic_task_failures={},
        group_commit_flushes=0,
        reactor_lag_seconds=0.0,
        ready=False,
        uptime_seconds=7.5,
        topics=0,
        ranges=0,
        storage_bytes=0,
        storage_segments={"active": 0, "sealed": 0, "closed": 0},
        cluster_nodes={"alive": 0, "dead": 0},
        peer_connections=0,
        peer_bytes={"in": 0, "out": 0},
    )


# -- the broker: produce and fetch ---------------------------------------------------------------


def test_produced_records_and_bytes_count_when_acknowledged() -> None:
    executor = ManualExecutor()
    metrics = Metrics(Clock())
    broker, _, _, _ = make_broker_and_control(metrics=metrics, executor=executor)
    creating = broker.create_topic("orders", 0)
    executor.run_all()
    result_of(creating)
    records = [Record(b"12345", key=b"ab"), Record(b"678")]

    producing = produce(broker, "orders", records)
    assert metrics.snapshot().produced_records == {}, "not durable yet"
    executor.run_all()

    assert result_of(producing) == 2
    snapshot = metrics.snapshot()
    assert snapshot.produced_records == {"orders": 2}
    assert snapshot.produced_bytes == {"orders": 10}, "key and value bytes"
    assert value(metrics, "svc_produced_records_total", topic="orders") == 2


def test_a_refused_produce_counts_nothing() -> None:
    metrics = Metrics(Clock())
    broker, _, _, _ = make_broker_and_control(metrics=metrics)

    failure_of(produce(broker, "missing", [Record(b"v")]))

    assert metrics.snapshot().produced_records == {}


def test_fetched_records_and_bytes_count_as_consumed() -> None:
    metrics = Metrics(Clock())
    broker, _, _, _ = make_broker_and_control(metrics=metrics)
    result_of(broker.create_topic("orders", 0))
    result_of(produce(broker, "orders", [Record(b"v%d" % n, key=b"key") for n in range(5)]))

    first = result_of(broker.fetch("orders", None, None, None, 3, 0))
    rest = result_of(broker.fetch("orders", first.next_cursor, None, None, 0, 0))
    result_of(broker.fetch("orders", rest.next_cursor, None, None, 0, 0))

    assert (first.count, rest.count) == (3, 2)
    snapshot = metrics.snapshot()
    assert snapshot.consumed_records == {"orders": 5}
    assert snapshot.consumed_bytes == {"orders": 5 * (2 + 3)}
    assert value(metrics, "svc_consumed_bytes_total", topic="orders") == 25


def test_a_long_poll_counts_what_it_hands_out_once_woken() -> None:
    clock = Clock()
    metrics = Metrics(clock)
    broker, _, _, _ = make_broker_and_control(clock, metrics=metrics)
    result_of(broker.create_topic("orders", 0))
    polling = broker.fetch("orders", None, None, None, 0, 5000)
    assert metrics.snapshot().consumed_records == {}

    result_of(produce(broker, "orders", [Record(b"late")]))

    assert result_of(polling).count == 1
    assert metrics.snapshot().consumed_records == {"orders": 1}


def test_topics_ranges_and_segments_are_read_at_scrape_time() -> None:
    metrics = Metrics(Clock())
    broker, storage, _, control = make_broker_and_control(metrics=metrics)
    metrics.watch(control, storage)
    result_of(broker.create_topic("orders", 0))
    result_of(broker.create_topic("audit", 1))
    result_of(produce(broker, "orders", [Record(b"x" * 100)]))
    result_of(storage.logs["orders.0"].roll())

    snapshot = metrics.snapshot()

    assert (snapshot.topics, snapshot.ranges) == (2, 4 + 2)
    # Ranges hold no segment before their first append; the roll started orders.0's next one.
    assert snapshot.storage_segments == {"active": 1, "sealed": 1, "closed": 0}
    sizes = sum(info.byte_size for log in storage.logs.values() for info in log.segments())
    assert 100 < snapshot.storage_bytes == sizes
    assert value(metrics, "svc_storage_segments", state="sealed") == 1
    assert value(metrics, "svc_ranges") == 6


# -- storage -------------------------------------------------------------------------------------


def test_rot_found_on_open_counts_as_an_integrity_failure(
    logged_errors: list[dict[str, Any]],
) -> None:
    metrics = Metrics(Clock())

    reopen_with_rot(metrics)

    assert len(logged_errors) == 1
    logged_errors.clear()
    assert metrics.snapshot().integrity_failures == {
        **{reason.value: 0 for reason in DamageReason},
        "checksum": 1,
    }
    assert value(metrics, "svc_storage_integrity_failures_total", reason="checksum") == 1
    # Rot in the active segment: not corruption at rest.
    assert value(metrics, "svc_storage_sealed_integrity_failures_total", reason="checksum") == 0


def test_a_torn_tail_of_an_active_segment_is_not_counted() -> None:
    fs = MemoryFileSystem()
    range_log = open_reporting_log(fs, Metrics(Clock()))
    append_each(range_log, 0, 3)
    result_of(range_log.close())
    start, end = batch_positions(fs, segment_path(0))[-1]
    fs.write_atomic(segment_path(0), fs.read_file(segment_path(0))[: (start + end) // 2])
    metrics = Metrics(Clock())

    reopened = open_reporting_log(fs, metrics)

    assert reopened.end_offset == 2, "the torn batch was dropped"
    assert set(metrics.snapshot().integrity_failures.values()) == {0}


def test_damage_in_a_sealed_segment_found_by_verify_counts_once(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    metrics = Metrics(Clock())
    range_log = open_reporting_log(fs, metrics)
    append_each(range_log, 0, 5)
    result_of(range_log.roll())
    fs.corrupt(segment_path(0), batch_positions(fs, segment_path(0))[3][1] - 2)

    for _ in range(2):
        assert not result_of(range_log.verify_segment(0)).verified

    assert len(logged_errors) == 1
    logged_errors.clear()
    assert metrics.snapshot().integrity_failures["checksum"] == 1
    assert value(metrics, "svc_storage_sealed_integrity_failures_total", reason="checksum") == 1
    assert value(metrics, "svc_scrub_enabled") == 0


def test_group_commit_flushes_are_observed_once_each_with_their_records() -> None:
    clock = Clock()
    metrics = Metrics(clock)
    range_log = open_reporting_log(MemoryFileSystem(), metrics, GROUP_COMMIT, clock)

    for n in range(4):
        range_log.append([Record(b"value-%d" % n)])
    clock.advance(0.005)
    range_log.append([Record(b"alone")])
    clock.advance(0.005)

    assert metrics.snapshot().group_commit_flushes == 3
    assert value(metrics, "svc_group_commit_flush_records_count") == 3
    assert value(metrics, "svc_group_commit_flush_records_sum") == 3 + 1 + 1
    assert value(metrics, "svc_group_commit_flush_records_bucket", le="1.0") == 2
    assert value(metrics, "svc_group_commit_flush_records_bucket", le="5.0") == 3
    assert value(metrics, "svc_group_commit_flush_duration_seconds_count") == 3
    assert value(metrics, "svc_group_commit_flush_duration_seconds_sum") >= 0


def test_without_group_commit_every_job_is_a_flush_too() -> None:
    metrics = Metrics(Clock())
    range_log = open_reporting_log(MemoryFileSystem(), metrics, LogConfig(group_commit=False))

    append_each(range_log, 0, 2)

    assert value(metrics, "svc_group_commit_flush_records_sum") == 2
    assert metrics.snapshot().group_commit_flushes == 2


def test_scrub_results_are_exported_from_the_start_and_move_as_the_scrub_checks(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs = MemoryFileSystem()
    metrics = Metrics(Clock())
    range_log = open_reporting_log(fs, metrics)
    append_each(range_log, 0, 5)
    result_of(range_log.roll())
    append_each(range_log, 5, 1)
    scrubber = Scrubber(
        {"topic.0": range_log}, started(fs), 1, metrics, NoOtherCopy(metrics), Clock()
    )

    def results() -> dict[str, float]:
        return {
            result: value(metrics, "svc_storage_scrub_segments_total", result=result)
            for result in ("verified", "repaired", "unrepairable")
        }

    # Every result is a series before the first check: the "scrub stalled" alert watches the
    # verified total advance, which needs it from the start.
    assert results() == {"verified": 0, "repaired": 0, "unrepairable": 0}
    result_of(scrubber.tick())
    assert results() == {"verified": 1, "repaired": 0, "unrepairable": 0}
    fs.corrupt(segment_path(0), batch_positions(fs, segment_path(0))[1][1] - 2)
    result_of(scrubber.tick())
    assert results() == {"verified": 1, "repaired": 0, "unrepairable": 1}
    assert metrics.snapshot().scrub_segments == {"verified": 1, "repaired": 0, "unrepairable": 1}
    logged_errors.clear()


def test_domain_violations_show_at_zero_until_a_cluster_view_counts_them() -> None:
    metrics = Metrics(Clock())

    assert metrics.snapshot().domain_violations == 0
    assert value(metrics, "svc_domain_violations") == 0


# -- the cluster ---------------------------------------------------------------------------------


def test_a_single_node_is_one_live_node_without_a_lease_age() -> None:
    metrics = Metrics(Clock())
    metrics.watch_cluster(SingleNodeView("logbroker", record("n1"), started(MemoryFileSystem())))

    assert metrics.snapshot().cluster_nodes == {"alive": 1, "dead": 0}
    assert value(metrics, "svc_cluster_nodes", state="alive") == 1
    assert value(metrics, "svc_cluster_nodes", state="dead") == 0
    assert value(metrics, "svc_domain_violations") == 0
    assert not [name for name, _ in samples(metrics) if name.startswith("svc_membership")], (
        "no lease, no sample"
    )
    assert b"# TYPE svc_membership_lease_age_seconds gauge" in metrics.render_text()


class _Counted:
    """A replication count (``ReplicationHealth``), before its first count."""

    count: int | None = None
    unavailable: int | None = None


def test_a_cluster_s_nodes_violations_and_lease_age_are_read_at_scrape_time() -> None:
    cluster = Cluster()
    try:
        nodes = [cluster.join(f"n{i}", ttl_ms=3000) for i in (1, 2, 3)]
        control = started(MemoryFileSystem())
        topic, ranges = make_topic("orders", ranges=1)
        result_of(control.create_topic(topic, ranges))
        # Every test node is in zone a: a set of two spans one zone, short of the two asked.
        meta = SegmentMeta("orders.0", 0, SegmentState.ACTIVE, None, None, ("n2", "n3"), 0)
        result_of(control.put_segment(meta))
        metrics = Metrics(cluster.clock)
        replication = _Counted()
        metrics.watch_cluster(
            MembershipView(
                "prod",
                nodes[0],
                control,
                PlacementRule(2, "zone", 2, SpreadPolicy.SOFT),
                replication,
            )
        )
        assert not [n for n, _ in samples(metrics) if n == "svc_under_replicated_segments"], (
            "not counted yet, no sample"
        )
        assert not [n for n, _ in samples(metrics) if n == "svc_unavailable_ranges"]
        replication.count = 4
        replication.unavailable = 2
        assert value(metrics, "svc_under_replicated_segments") == 4
        assert value(metrics, "svc_unavailable_ranges") == 2
        assert metrics.snapshot().cluster_nodes == {"alive": 3, "dead": 0}
        assert metrics.snapshot().domain_violations == 1
        assert value(metrics, "svc_domain_violations") == 1
        assert value(metrics, "svc_membership_lease_age_seconds") == 0

        # n3 stops keeping its lease alive: once its TTL has passed, it is dead.
        result_of(nodes[2].stopService())
        cluster.advance(4)

        assert value(metrics, "svc_cluster_nodes", state="alive") == 2
        assert value(metrics, "svc_cluster_nodes", state="dead") == 1
        assert value(metrics, "svc_membership_lease_age_seconds") < 3
    finally:
        cluster.stop()


def test_controlplane_requests_count_by_op_and_result_and_time_by_op() -> None:
    metrics = Metrics(Clock())

    metrics.controlplane_request("txn", "ok", 0.004)
    metrics.controlplane_request("txn", "error", 0.006)
    metrics.controlplane_request("keepalive", "unavailable", 2.0)

    assert value(metrics, "svc_controlplane_requests_total", op="txn", result="ok") == 1
    assert value(metrics, "svc_controlplane_requests_total", op="txn", result="error") == 1
    assert value(metrics, "svc_controlplane_requests_total", op="range", result="ok") == 0
    assert (
        value(metrics, "svc_controlplane_requests_total", op="keepalive", result="unavailable") == 1
    )
    assert value(metrics, "svc_controlplane_request_seconds_count", op="txn") == 2
    assert value(metrics, "svc_controlplane_request_seconds_sum", op="txn") == pytest.approx(0.01)
    assert value(metrics, "svc_controlplane_request_seconds_bucket", op="txn", le="0.005") == 1
    assert value(metrics, "svc_controlplane_request_seconds_bucket", op="keepalive", le="1.0") == 0


@pytest.mark.parametrize(("op", "result"), [("put", "ok"), ("txn", "timeout"), ("lease", "error")])
def test_a_controlplane_op_or_result_outside_the_set_is_refused(op: str, result: str) -> None:
    metrics = Metrics(Clock())

    with pytest.raises(KeyError):
        metrics.controlplane_request(op, result, 0.1)

    assert all(labels != (("op", op), ("result", result)) for _, labels in samples(metrics))


def test_peer_connections_and_bytes() -> None:
    metrics = Metrics(Clock())

    metrics.peer_connection_opened()
    metrics.peer_connection_opened()
    metrics.peer_connection_closed()
    metrics.peer_bytes("in", 100)
    metrics.peer_bytes("out", 40)
    metrics.peer_bytes("out", 2)

    snapshot = metrics.snapshot()
    assert snapshot.peer_connections == 1
    assert snapshot.peer_bytes == {"in": 100, "out": 42}
    assert value(metrics, "svc_peer_connections") == 1
    assert value(metrics, "svc_peer_bytes_total", direction="out") == 42
    with pytest.raises(KeyError):
        metrics.peer_bytes("sideways", 1)


def test_refused_peer_connections_are_counted_by_reason() -> None:
    metrics = Metrics(Clock())

    metrics.peer_connection_refused("tls")
    metrics.peer_connection_refused("tls")
    metrics.peer_connection_refused("per_ip_limit")

    assert PEER_REFUSALS == ("per_ip_limit", "total_limit", "tls", "certificate", "handshake")
    assert value(metrics, "svc_peer_connections_refused_total", reason="tls") == 2
    assert value(metrics, "svc_peer_connections_refused_total", reason="per_ip_limit") == 1
    assert value(metrics, "svc_peer_connections_refused_total", reason="certificate") == 0
    with pytest.raises(KeyError):
        metrics.peer_connection_refused("bored")


# -- clients and security ------------------------------------------------------------------------


def test_client_and_security_counters() -> None:
    metrics = Metrics(Clock())

    metrics.auth_attempt("ok")
    metrics.auth_attempt("ok")
    metrics.auth_attempt("rate_limited")
    metrics.rate_limit_blocked("auth")
    metrics.rate_limit_blocked("dashboard_auth")
    metrics.rate_limit_blocked("dashboard_auth")
    metrics.connection_refused("global")
    metrics.session_expired()
    metrics.session_hijack_attempt()
    metrics.session_hijack_attempt()
    metrics.tls_handshake("ok")
    metrics.tls_handshake("failed")

    snapshot = metrics.snapshot()
    assert snapshot.auth_attempts == {"ok": 2, "invalid_credentials": 0, "rate_limited": 1}
    assert snapshot.rate_limit_blocks == {
        "auth": 1,
        "dashboard_auth": 2,
        "publish": 0,
        "subscribe": 0,
    }
    assert snapshot.connection_limit_blocks == {"per_ip": 0, "global": 1}
    assert (snapshot.sessions_expired, snapshot.session_hijack_attempts) == (1, 2)
    assert snapshot.tls_handshakes == {"ok": 1, "failed": 1}
    assert value(metrics, "svc_rate_limit_blocks_total", action="dashboard_auth") == 2
    assert value(metrics, "svc_session_hijack_attempt_total") == 2


def test_an_unknown_label_value_is_refused_not_made_into_a_new_series() -> None:
    metrics = Metrics(Clock())

    with pytest.raises(KeyError):
        metrics.rate_limit_blocked("produce")

    assert ("svc_rate_limit_blocks_total", (("action", "produce"),)) not in samples(metrics)


def test_open_connections_are_read_from_their_source_at_scrape_time() -> None:
    metrics = Metrics(Clock())
    open_now = [3]
    metrics.watch_connections(lambda: open_now[0])
    assert metrics.snapshot().open_connections == 3

    open_now[0] = 2

    assert metrics.snapshot().open_connections == 2
    assert value(metrics, "svc_open_connections") == 2


# -- the process ---------------------------------------------------------------------------------


def test_ready_and_uptime() -> None:
    clock = Clock()
    metrics = Metrics(clock)
    clock.advance(42)

    metrics.set_ready(True)
    assert metrics.snapshot().ready
    assert value(metrics, "svc_ready") == 1
    assert value(metrics, "svc_uptime_seconds") == 42
    metrics.set_ready(False)

    assert not metrics.snapshot().ready
    assert value(metrics, "svc_ready") == 0


def test_the_reactor_lag_probe_reports_how_late_its_call_came() -> None:
    clock = Clock()
    metrics = Metrics(clock)
    probe = ReactorLagProbe(clock, metrics.reactor_lag, delay=0.1)
    task = PeriodicTask("reactor_lag", 1.0, probe, clock, metrics=metrics)

    task.start(now=True)
    clock.advance(0.1)
    assert metrics.snapshot().reactor_lag_seconds == 0, "on time"
    clock.advance(0.9)  # the next probe asks for a call at 1.1
    clock.advance(0.35)  # and the reactor gets to it at 1.35

    assert metrics.snapshot().reactor_lag_seconds == pytest.approx(0.25)
    assert value(metrics, "svc_reactor_lag_seconds") == pytest.approx(0.25)
    result_of(task.stop())
    assert not clock.getDelayedCalls()


def test_periodic_task_failures_and_last_success_by_task(
    logged_errors: list[dict[str, Any]],
) -> None:
    clock = Clock()
    metrics = Metrics(clock)
    outcomes: list[Exception | None] = [None, RuntimeError("boom")]

    def work() -> None:
        outcome = outcomes.pop(0) if outcomes else None
        if outcome is not None:
            raise outcome

    task = PeriodicTask("retention", 60, work, clock, metrics=metrics)
    assert value(metrics, "svc_periodic_task_failures_total", task="retention") == 0
    assert ("svc_periodic_task_last_success_timestamp_seconds", (("task", "retention"),)) not in (
        samples(metrics)
    ), "absent until the first success"

    clock.advance(1000)
    task.start(now=True)
    clock.advance(60)
    logged_errors.clear()

    assert value(metrics, "svc_periodic_task_failures_total", task="retention") == 1
    assert metrics.snapshot().periodic_task_failures == {"retention": 1}
    assert (
        value(metrics, "svc_periodic_task_last_success_timestamp_seconds", task="retention") == 1000
    )
    result_of(task.stop())


def test_a_populated_registry_renders_every_kind_of_series(
    logged_errors: list[dict[str, Any]],
) -> None:
    metrics = populated_metrics(logged_errors)

    snapshot = metrics.snapshot()

    assert snapshot.produced_records == snapshot.consumed_records == {"orders": 10}
    assert snapshot.integrity_failures["checksum"] == 1
    assert snapshot.group_commit_flushes > 0
    assert snapshot.reactor_lag_seconds == pytest.approx(0.15)
    assert snapshot.topics == 1
    assert metrics.render_text().startswith(b"# HELP svc_")
