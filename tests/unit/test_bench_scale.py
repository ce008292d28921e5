"""The pure helpers of ``bench/cluster_scale.py``: the keys that reach every range of a topic
(a topic is writable only once each range took one), the percentiles of when topics became
writable, and the counters read from etcd's and the brokers' metrics. The benchmark's figures
are only as right as these."""

from __future__ import annotations

import pytest

from logbroker.broker.keyspace import DEFAULT_KEYSPACE_BITS, split_keyspace
from logbroker.key_routing import key_slot
from tests.bench_scripts import load_bench_script

scale = load_bench_script("cluster_scale")


@pytest.mark.parametrize("ranges", [1, 4, 16])
def test_the_probe_s_keys_fall_one_in_each_range(ranges: int) -> None:
    keys = scale.range_keys(ranges)
    cuts = split_keyspace(DEFAULT_KEYSPACE_BITS, ranges)
    assert len(keys) == ranges
    for key, (start, end) in zip(keys, cuts, strict=True):
        assert start <= key_slot(key, DEFAULT_KEYSPACE_BITS) < end


def test_percentiles_are_seconds_since_the_event() -> None:
    times = [10.0 + t for t in (3.0, 1.0, 2.0, 4.0)]
    assert scale._percentile_seconds(times, 10.0, 0.5) == 2.0
    assert scale._percentile_seconds(times, 10.0, 0.9) == 4.0
    assert scale._percentile_seconds([12.5], 10.0, 0.5) == 2.5


def test_etcd_s_metrics_lines_are_read_with_or_without_labels() -> None:
    text = (
        "# HELP etcd_mvcc_txn_total Total number of txns seen by this member.\n"
        "etcd_mvcc_txn_total 42\n"
        'etcd_network_client_grpc_received_bytes_total{type="unary"} 1.5e+06\n'
    )
    assert dict(scale._METRIC.findall(text)) == {
        "etcd_mvcc_txn_total": "42",
        "etcd_network_client_grpc_received_bytes_total": "1.5e+06",
    }
