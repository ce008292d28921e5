"""Repairing a damaged sealed copy from an intact, complete one (the spec's scrub rules 2-5):
which replica qualifies, decided over random answers; and the repair carried out on in-process
nodes, each with its own ``MemoryFileSystem``, the damage flipped into their files."""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from logbroker.broker.errors import BrokerError
from logbroker.cluster.retention import (
    SegmentTimesServer,
    cluster_newest_times,
    decode_times,
    decode_times_request,
    encode_times,
    encode_times_request,
)
from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.peer.frames import PeerOp
from logbroker.records import Record
from logbroker.replication.core import repair as rules
from logbroker.replication.healing import Healer
from logbroker.replication.repair import RETRY_DEFERRED_SECONDS, RepairOutcome, SegmentRepairs
from logbroker.replication.replica_codec import (
    CheckOutcome,
    CopyCheck,
    FenceRequest,
    decode_check,
    encode_check,
    encode_fence,
)
from logbroker.storage import DamageReason, IntegrityEvent
from logbroker.testing import MemoryFileSystem
from tests.unit.replication.harness import RANGE, Cluster, cluster
from tests.unit.replication.test_healing import ROLL_BYTES, append_each
from tests.unit.storage.helpers import batch_positions, failure_of, result_of

NODES = ("a", "b", "c")
SUFFIXES = (".log", ".index", ".sealed", ".epoch")

#: Spans of the ``svc.scrub.repair`` trace, exported in memory (the provider is global: set once
#: for the test process).
SPANS = InMemorySpanExporter()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(SPANS))
trace.set_tracer_provider(_provider)


# -- which replica qualifies -------------------------------------------------------------------

SEALED = SegmentMeta(RANGE, 100, SegmentState.SEALED, 40, 5000, NODES, 3)

checks = st.one_of(
    st.none(),
    st.builds(
        CopyCheck,
        st.sampled_from(CheckOutcome),
        st.sampled_from([2, 3, 4]),
        st.sampled_from([39, 40, 41]),
        st.sampled_from([4999, 5000, 5001]),
        st.integers(0, 5000),
    ),
)


@given(st.fixed_dictionaries({node: checks for node in NODES}), st.sampled_from(NODES))
def test_only_other_intact_complete_copies_at_the_sealed_epoch_qualify_in_replica_set_order(
    answers: dict[str, CopyCheck | None], node: str
) -> None:
    sources = rules.repair_sources(SEALED, node, answers)

    expected = [
        other
        for other in NODES
        if other != node
        and (answer := answers[other]) is not None
        and answer.outcome is CheckOutcome.INTACT
        and (answer.epoch, answer.record_count, answer.byte_size) == (3, 40, 5000)
    ]
    assert sources == expected
    for other in NODES:
        qualifies = rules.qualifies(answers[other], SEALED)
        assert (rules.describe(answers[other], SEALED) == "intact and complete") == qualifies


@given(st.permutations(NODES), st.sampled_from(NODES), st.booleans())
def test_a_primary_steps_back_to_the_end_of_the_replica_set_unless_the_segment_is_the_last(
    replicas: list[str], node: str, is_last: bool
) -> None:
    record = attrs.evolve(SEALED, replicas=tuple(replicas))

    moved = rules.stepped_back(record, node, is_last)

    if is_last or replicas[0] != node:
        assert moved is None
    else:
        assert moved is not None
        assert moved.replicas == (*replicas[1:], node)
        assert attrs.evolve(moved, replicas=record.replicas) == record


@given(checks.filter(lambda check: check is not None))
def test_a_copy_check_goes_through_the_codec_unchanged(check: CopyCheck) -> None:
    assert decode_check(encode_check(check)) == check


# -- repairs on in-process nodes ----------------------------------------------------------------


class Outcomes:
    def __init__(self) -> None:
        self.counted: Counter[str] = Counter()

    def scrub_checked(self, result: str) -> None:
        self.counted[result] += 1


@attrs.define
class Sealed:
    world: Cluster
    segments: list[SegmentMeta]

    def path(self, meta: SegmentMeta, suffix: str = ".log") -> str:
        return f"/data/ranges/{RANGE}/{meta.base_offset:020d}{suffix}"

    def fs(self, node: str) -> MemoryFileSystem:
        return self.world.storages[node].fs

    def rot(self, node: str, meta: SegmentMeta) -> int:
        """Flip a byte inside the second batch of ``node``'s copy; the flipped byte's position."""
        _, end = batch_positions(self.fs(node), self.path(meta))[1]
        self.fs(node).corrupt(self.path(meta), end - 2)
        return end - 2

    def repairs(self, node: str) -> tuple[SegmentRepairs, Outcomes]:
        outcomes = Outcomes()
        context = self.world.context(node)
        return SegmentRepairs(context, Healer(context), outcomes), outcomes

    def repair(self, repairs: SegmentRepairs, meta: SegmentMeta, position: int) -> RepairOutcome:
        repairing = repairs.repair(RANGE, meta.base_offset, position, "flipped by the test")
        self.world.settle()
        outcome: RepairOutcome = result_of(repairing)
        return outcome

    def identical(self, meta: SegmentMeta) -> bool:
        return all(
            self.fs(node).read_file(self.path(meta, suffix))
            == self.fs("a").read_file(self.path(meta, suffix))
            for node in NODES
            for suffix in SUFFIXES
        )


def sealed_on_every_node() -> Sealed:
    world = cluster()
    lead = world.lead("a", ROLL_BYTES)
    append_each(world, lead, 30)
    segments = [m for m in world.control.segments(RANGE) if m.state is SegmentState.SEALED]
    assert len(segments) >= 3
    assert all(m.replicas == NODES for m in segments)
    return Sealed(world, segments)


def test_a_follower_s_rotten_copy_is_refetched_from_an_intact_one_traced_and_counted(
    logged: list[dict[str, Any]],
) -> None:
    sealed = sealed_on_every_node()
    meta = sealed.segments[1]
    position = sealed.rot("c", meta)
    repairs, outcomes = sealed.repairs("c")
    SPANS.clear()

    assert sealed.repair(repairs, meta, position) is RepairOutcome.REPAIRED

    assert sealed.identical(meta)
    assert outcomes.counted == Counter(repaired=1)
    assert repairs.unrepairable == {}
    [span] = SPANS.get_finished_spans()
    assert span.name == "svc.scrub.repair"
    assert span.attributes is not None
    assert span.attributes["logbroker.segment"] == f"{RANGE}@{meta.base_offset}"
    assert span.attributes["logbroker.damage.position"] == position
    assert span.attributes["logbroker.repair.source"] == "a"
    assert span.attributes["logbroker.repair.outcome"] == "repaired"
    [event] = [e for e in logged if e.get("event") == "svc.scrub.repair"]
    assert (event["segment"], event["position"], event["outcome"]) == (
        f"{RANGE}@{meta.base_offset}",
        position,
        "repaired",
    )
    # The replica set is as it was: c was not its first member.
    assert world_record(sealed, meta).replicas == NODES


def world_record(sealed: Sealed, meta: SegmentMeta) -> SegmentMeta:
    return next(
        m for m in sealed.world.control.segments(RANGE) if m.base_offset == meta.base_offset
    )


def test_the_primary_of_a_damaged_copy_moves_itself_to_the_end_of_the_replica_set_first() -> None:
    sealed = sealed_on_every_node()
    meta = sealed.segments[0]
    position = sealed.rot("a", meta)
    repairs, outcomes = sealed.repairs("a")

    assert sealed.repair(repairs, meta, position) is RepairOutcome.REPAIRED

    assert world_record(sealed, meta).replicas == ("b", "c", "a")
    assert sealed.identical(meta)
    assert outcomes.counted == Counter(repaired=1)


def test_with_no_intact_complete_replica_nothing_is_deleted_and_it_is_unrepairable(
    logged_errors: list[dict[str, Any]],
) -> None:
    sealed = sealed_on_every_node()
    meta = sealed.segments[1]
    position = sealed.rot("c", meta)
    sealed.rot("a", meta)
    # b's copy lost its end: its frames verify, but it is short of the sealed size.
    short = batch_positions(sealed.fs("b"), sealed.path(meta))[1][1]
    sealed.fs("b").truncate(sealed.path(meta), short)
    damaged = sealed.fs("c").read_file(sealed.path(meta))
    repairs, outcomes = sealed.repairs("c")

    assert sealed.repair(repairs, meta, position) is RepairOutcome.UNREPAIRABLE

    assert sealed.fs("c").read_file(sealed.path(meta)) == damaged
    assert outcomes.counted == Counter(unrepairable=1)
    assert list(repairs.unrepairable) == [(RANGE, meta.base_offset)]
    [error] = [e for e in logged_errors if e["log_format"].startswith("Scrub: sealed segment")]
    assert error["segment"] == f"{RANGE}@{meta.base_offset}"
    assert error["position"] == position
    assert "a its copy is damaged at byte" in error["why"]
    assert f"b its copy is damaged at byte {short}" in error["why"]

    # Found again, it is counted again: it never clears by itself.
    assert sealed.repair(repairs, meta, position) is RepairOutcome.UNREPAIRABLE
    assert outcomes.counted == Counter(unrepairable=2)
    logged_errors.clear()


def test_a_replica_reads_its_own_copy_back_whole_when_asked_to_verify_it(
    logged_errors: list[dict[str, Any]],
) -> None:
    sealed = sealed_on_every_node()
    meta = sealed.segments[1]
    position = sealed.rot("b", meta)

    def check(node: str, epoch: int = meta.epoch) -> CopyCheck:
        request = encode_fence(FenceRequest(RANGE, meta.base_offset, epoch))
        asking = sealed.world.peers.request(node, PeerOp.VERIFY_COPY, request)
        sealed.world.settle()
        answer: CopyCheck = decode_check(result_of(asking))
        return answer

    assert check("a") == CopyCheck(
        CheckOutcome.INTACT, meta.epoch, meta.record_count, meta.byte_size
    )
    damaged = check("b")
    assert (damaged.outcome, damaged.epoch) == (CheckOutcome.DAMAGED, meta.epoch)
    # Where its frame or record whose checksum fails starts.
    assert batch_positions(sealed.fs("b"), sealed.path(meta))[0][1] <= damaged.position <= position
    assert check("c", epoch=meta.epoch + 1).outcome is CheckOutcome.ABSENT
    # b found its own damage: it is counted and logged there.
    assert [e["segment"] for e in logged_errors] == [sealed.path(meta)]
    logged_errors.clear()


def test_healing_hands_a_copy_found_damaged_to_the_repair_which_waits_for_replicas_down(
    logged_errors: list[dict[str, Any]], logged: list[dict[str, Any]]
) -> None:
    sealed = sealed_on_every_node()
    meta = sealed.segments[1]
    sealed.rot("c", meta)
    copy = sealed.world.storages["c"].logs[RANGE]
    verifying = copy.verify_segment(meta.base_offset)  # as a read would, it finds the damage
    sealed.world.settle()
    assert result_of(verifying).damage is not None
    outcomes = Outcomes()
    # The other replicas are down: they may hold intact copies, so nothing is decided, nothing
    # counted, and healing does not fetch the copy behind the repair's back.
    sealed.world.peers.dead.update({"a", "b"})
    healer = Healer(sealed.world.context("c"))
    SegmentRepairs(sealed.world.context("c"), healer, outcomes)

    healer.tick([RANGE])
    sealed.world.settle()
    assert outcomes.counted == Counter()
    assert not sealed.identical(meta)
    assert [e for e in logged if "cannot be repaired now" in e.get("log_format", "")]

    # Back: the next look after the retry delay repairs it.
    sealed.world.peers.dead.clear()
    healer.tick([RANGE])
    sealed.world.settle()
    assert outcomes.counted == Counter(), "not before the retry delay"
    sealed.world.clock.advance(RETRY_DEFERRED_SECONDS)
    healer.tick([RANGE])
    sealed.world.settle()
    assert outcomes.counted == Counter(repaired=1)
    assert sealed.identical(meta)
    assert [e["log_format"].split(" ")[0] for e in logged_errors] == ["Integrity"]
    logged_errors.clear()


def test_a_segment_no_longer_held_is_forgotten(logged_errors: list[dict[str, Any]]) -> None:
    sealed = sealed_on_every_node()
    meta = sealed.segments[1]
    for node in NODES:
        sealed.rot(node, meta)
    repairs, _ = sealed.repairs("c")
    assert sealed.repair(repairs, meta, 0) is RepairOutcome.UNREPAIRABLE
    assert list(repairs.unrepairable) == [(RANGE, meta.base_offset)]

    repairs.forget_missing(set())

    assert repairs.unrepairable == {}
    logged_errors.clear()


def test_a_read_meeting_damage_in_the_primary_s_sealed_copy_goes_on_from_the_other_copies(
    logged_errors: list[dict[str, Any]],
) -> None:
    world = cluster()
    lead = world.lead("a", ROLL_BYTES)
    append_each(world, lead, 30)
    sealed = Sealed(
        world, [m for m in world.control.segments(RANGE) if m.state is SegmentState.SEALED]
    )
    meta = sealed.segments[1]
    assert meta.record_count is not None
    # The first batch: a read from the segment's start finds nothing before the damage.
    first_end = batch_positions(sealed.fs("a"), sealed.path(meta))[0][1]
    sealed.fs("a").corrupt(sealed.path(meta), first_end - 2)

    for _ in range(2):  # the read that finds the damage, and one after it
        reading = lead.handle(RANGE).read(meta.base_offset, 1000, 1 << 20)
        world.settle()
        read = result_of(reading)

        assert (read.count, read.next_offset) == (
            meta.record_count,
            meta.base_offset + meta.record_count,
        )
    assert [e["segment"] for e in logged_errors] == [sealed.path(meta)]
    logged_errors.clear()


def test_damage_a_range_log_reports_in_a_sealed_copy_is_repaired_at_once() -> None:
    sealed = sealed_on_every_node()
    meta = sealed.segments[1]
    position = sealed.rot("c", meta)
    repairs, outcomes = sealed.repairs("c")
    event = IntegrityEvent(
        DamageReason.CHECKSUM, sealed.path(meta), meta.base_offset, position, True
    )
    torn = IntegrityEvent(DamageReason.INCOMPLETE, sealed.path(meta), meta.base_offset, 0, False)
    index = IntegrityEvent(
        DamageReason.INDEX, sealed.path(meta, ".index"), meta.base_offset, 0, True
    )

    for ignored in (torn, index):
        repairs.damage_found(RANGE, ignored)
        sealed.world.clock.advance(0)
        sealed.world.settle()
    assert outcomes.counted == Counter()
    repairs.damage_found(RANGE, event)
    sealed.world.clock.advance(0)
    sealed.world.settle()

    assert outcomes.counted == Counter(repaired=1)
    assert sealed.identical(meta)


# -- when sealed copies' newest records were written (retention by age in a cluster) -----------


@given(
    st.lists(st.tuples(st.text(min_size=1, max_size=12), st.integers(0, 2**64 - 1)), max_size=20)
)
def test_a_segment_times_request_goes_through_the_codec_unchanged(
    keys: list[tuple[str, int]],
) -> None:
    assert decode_times_request(encode_times_request(keys)) == keys


@given(st.lists(st.one_of(st.none(), st.integers(0, 2**64 - 2)), max_size=20))
def test_segment_times_go_through_the_codec_unchanged(times: list[int | None]) -> None:
    assert decode_times(encode_times(times)) == times


def test_the_newest_record_times_come_from_a_live_replica_this_node_first() -> None:
    sealed = sealed_on_every_node()
    world = sealed.world
    for node in NODES:
        server = SegmentTimesServer(world.storages[node])
        world.peers.ops[node][PeerOp.SEGMENT_TIMES] = lambda sender, payload, server=server: (
            server.serve(payload)
        )
    expected = {
        (RANGE, info.base_offset): info.max_timestamp_ms
        for info in world.storages["a"].logs[RANGE].segments()
        if info.max_timestamp_ms is not None
    }
    # c holds no copy of the first segment any more: a live replica that does answers for it.
    first = sealed.segments[0]
    deleting = world.storages["c"].logs[RANGE].delete_segment(first.base_offset)
    world.settle()
    result_of(deleting)
    context = world.context("c")
    newest = cluster_newest_times("c", world.control, context.requester, context.is_live)

    asking = newest([RANGE])
    world.settle()
    found = result_of(asking)

    sealed_bases = {m.base_offset for m in world.control.segments(RANGE)[:-1]}
    assert found == {key: t for key, t in expected.items() if key[1] in sealed_bases} | {
        (RANGE, first.base_offset): expected[(RANGE, first.base_offset)]
    }


# -- a copy whose disk failed, back in service ---------------------------------------------------


def test_a_primary_whose_disk_failed_leads_again_once_its_copy_is_back_in_service(
    logged_errors: list[dict[str, Any]],
) -> None:
    world = cluster()
    lead = world.lead("a")
    append_each(world, lead, 3)
    copy = world.storages["a"].logs[RANGE]
    world.storages["a"].fs.failing_syncs = 1
    failing = lead.handle(RANGE).append([Record(b"not-acked", key=b"k")])
    world.settle()
    world.clock.advance(0.1)
    world.settle()
    assert copy.failed
    assert isinstance(failure_of(failing).value, BrokerError)

    back = copy.return_to_service()
    world.settle()
    assert result_of(back) is True
    # The leader stopped when its copy failed; the sweep claims the range again (a new epoch,
    # every copy fenced and brought to one end), and it takes appends.
    for _ in range(10):
        world.clock.advance(0.5)
        lead.sweep([RANGE])
        world.settle()
    appended = lead.handle(RANGE).append([Record(b"after", key=b"k")])
    world.settle()
    world.clock.advance(0.1)
    world.settle()
    result_of(appended)

    # Every copy holds the same records: what was acknowledged, and the new one. The record
    # whose local write failed was sent to the replicas too: the claim may commit it (its
    # producer was told it failed, as with any answer in doubt, and a stamped retry is not
    # stored twice), but on every copy alike.
    stored = {node: world.stored(node) for node in NODES}
    assert stored["a"] == stored["b"] == stored["c"], stored
    assert stored["a"][:3] == [b"value-000", b"value-001", b"value-002"]
    assert stored["a"][-1] == b"after"
    logged_errors.clear()


def test_a_replica_whose_disk_failed_catches_up_once_its_copy_is_back_in_service(
    logged_errors: list[dict[str, Any]],
) -> None:
    world = cluster()
    lead = world.lead("a")
    append_each(world, lead, 2)
    copy = world.storages["c"].logs[RANGE]
    world.storages["c"].fs.failing_syncs = 1
    # Committed on a and b: a quorum; c's copy goes out of service.
    append_each(world, lead, 1)
    assert copy.failed

    back = copy.return_to_service()
    world.settle()
    assert result_of(back) is True
    for _ in range(6):
        world.clock.advance(0.5)
        lead.sweep([RANGE])
        world.settle()
    append_each(world, lead, 1)
    for _ in range(6):
        world.clock.advance(0.5)
        world.settle()

    assert world.stored("c") == world.stored("a") == world.stored("b")
    assert len(world.stored("a")) == 4
    logged_errors.clear()
