"""The cluster as an operator sees it, on one node and on a cluster of three."""

from __future__ import annotations

from logbroker.cluster.view import ControlPlaneKind, MembershipView, SingleNodeView
from logbroker.config import SpreadPolicy
from logbroker.controlplane import LocalControlPlane, SegmentMeta, SegmentState
from logbroker.placement import PlacementRule
from logbroker.testing import MemoryFileSystem
from tests.unit.cluster.test_membership import Cluster, record
from tests.unit.controlplane.helpers import make_topic, started
from tests.unit.storage.helpers import result_of


def _led_by_n1(ranges: int) -> LocalControlPlane:
    """A local control plane with a topic of ``ranges`` ranges, each active segment on n1."""
    control = started(MemoryFileSystem())
    topic, made = make_topic("orders", ranges=ranges)
    result_of(control.create_topic(topic, made))
    for range_ in made:
        meta = SegmentMeta(range_.range_id, 0, SegmentState.ACTIVE, None, None, ("n1",), 0)
        result_of(control.put_segment(meta))
    return control


def test_a_single_node_is_a_cluster_of_one_leading_its_active_segments() -> None:
    control = _led_by_n1(2)

    status = SingleNodeView("logbroker", record("n1"), control).status()

    assert status.control_plane is ControlPlaneKind.LOCAL
    assert [(n.node_id, n.alive, n.segments_led) for n in status.nodes] == [("n1", True, 2)]
    assert status.chores_holder == "n1"
    assert status.lease_age_seconds is None


def test_a_cluster_view_shows_every_member_and_counts_domain_violations() -> None:
    cluster = Cluster()
    try:
        nodes = [cluster.join(f"n{i}") for i in (1, 2, 3)]
        control = started(MemoryFileSystem())
        topic, ranges = make_topic("orders", ranges=1)
        result_of(control.create_topic(topic, ranges))
        # Every test node is in zone a: a set of two spans one zone, short of the two asked.
        meta = SegmentMeta("orders.0", 0, SegmentState.ACTIVE, None, None, ("n2", "n3"), 0)
        result_of(control.put_segment(meta))
        rule = PlacementRule(2, "zone", 2, SpreadPolicy.SOFT)

        status = MembershipView("prod", nodes[0], control, rule).status()

        assert status.control_plane is ControlPlaneKind.ETCD
        assert [(n.node_id, n.alive, n.segments_led) for n in status.nodes] == [
            ("n1", True, 0),
            ("n2", True, 1),
            ("n3", True, 0),
        ]
        assert status.chores_holder == "n1"
        assert status.domain_violations == 1
        assert status.lease_age_seconds == 0
    finally:
        cluster.stop()


def test_the_view_reads_again_only_the_ranges_whose_records_changed() -> None:
    control = _led_by_n1(40)
    view = SingleNodeView("logbroker", record("n1"), control)
    read: list[str] = []
    segments = control.segments

    def counted(range_id: str) -> list[SegmentMeta]:
        read.append(range_id)
        return segments(range_id)

    control.segments = counted  # type: ignore[method-assign]
    assert view.status().nodes[0].segments_led == 40
    assert len(read) == 40

    read.clear()
    assert view.status().nodes[0].segments_led == 40
    assert read == [], "nothing changed"

    # One range's active segment moves to another node; another is sealed with nothing after.
    moved = SegmentMeta("orders.3", 0, SegmentState.ACTIVE, None, None, ("n2", "n1"), 1)
    result_of(control.put_segment(moved))
    sealed = SegmentMeta("orders.5", 0, SegmentState.SEALED, 0, 0, ("n1",), 0)
    result_of(control.put_segment(sealed))
    assert view.status().nodes[0].segments_led == 38
    assert sorted(read) == ["orders.3", "orders.5"]

    # A range's segment record is deleted: it counts no more.
    read.clear()
    result_of(control.delete_segment("orders.7", 0))
    assert view.status().nodes[0].segments_led == 37
    assert read == ["orders.7"]
