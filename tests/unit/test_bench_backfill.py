"""The pure helpers of ``bench/backfill.py`` (and the restart of ``bench/_common.py``): what a
node's data directory holds of a topic, what it fetched, what etcd's records say is sealed and
where, when a catch-up's conditions came to hold, and what a broker's log says healing did. The
benchmark's figures, and its decision that a catch-up is done, are only as right as these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock

from logbroker import wire
from logbroker.storage._segment import segment_stem
from tests.bench_scripts import load_bench_script

backfill = load_bench_script("backfill")
common = load_bench_script("_common")
Sealed = backfill.SealedSegment


def _file(data: Path, range_id: str, name: str, size: int) -> None:
    directory = data / "ranges" / range_id
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(b"x" * size)


def _log(data: Path, range_id: str, base_offset: int, size: int) -> None:
    _file(data, range_id, f"{segment_stem(base_offset)}.log", size)


def _record(
    range_id: str, base: int, state: str, count: int | None, size: int | None, *replicas: str
) -> dict[str, Any]:
    return {
        "range_id": range_id,
        "base_offset": base,
        "state": state,
        "record_count": count,
        "byte_size": size,
        "replicas": list(replicas),
        "epoch": 0,
    }


# -- segment files --------------------------------------------------------------------------


def test_segment_sizes_are_the_log_files_of_the_topics_ranges_by_segment(tmp_path: Path) -> None:
    _log(tmp_path, "t.0", 0, 100)
    _log(tmp_path, "t.0", 40, 70)
    _log(tmp_path, "t.1", 0, 0)
    _file(tmp_path, "t.0", f"{segment_stem(0)}.index", 64)
    _file(tmp_path, "t.0", f"{segment_stem(0)}.sealed", 48)
    _file(tmp_path, "t.0", "notes.log", 5)
    _log(tmp_path, "tx.0", 0, 30)

    assert backfill.segment_sizes(str(tmp_path), "t") == {
        ("t.0", 0): 100,
        ("t.0", 40): 70,
        ("t.1", 0): 0,
    }


def test_a_data_directory_without_the_topic_has_no_segments(tmp_path: Path) -> None:
    assert backfill.segment_sizes(str(tmp_path / "missing"), "t") == {}


def test_range_totals_add_up_each_ranges_segments() -> None:
    sizes = {("t.0", 0): 100, ("t.0", 40): 70, ("t.1", 0): 5}

    assert backfill.range_totals(sizes) == {"t.0": 170, "t.1": 5}


# -- what was fetched -----------------------------------------------------------------------


def test_fetched_counts_the_new_and_resized_files_that_are_not_empty() -> None:
    before = {("t.0", 0): 30, ("t.0", 40): 0, ("t.1", 0): 500}
    after = {
        ("t.0", 0): 1000,  # a short copy replaced by the whole one
        ("t.0", 40): 900,  # an empty active segment filled by an install
        ("t.0", 80): 0,  # a new empty active segment: nothing fetched
        ("t.1", 0): 500,  # held whole before: not fetched
        ("t.1", 10): 700,  # new
    }

    assert backfill.fetched(before, after) == backfill.Fetched(3, 2600)


def test_nothing_changed_is_nothing_fetched() -> None:
    sizes = {("t.0", 0): 30}

    assert backfill.fetched(sizes, dict(sizes)) == backfill.Fetched(0, 0)


# -- etcd's records -------------------------------------------------------------------------


def test_sealed_segments_are_those_holding_records() -> None:
    records = [
        _record("t.0", 0, "sealed", 10, 1400, "n1", "n2"),
        _record("t.0", 10, "sealed", 0, 0, "n1", "n2"),
        _record("t.0", 10, "active", None, None, "n1", "n2", "n3"),
    ]

    assert backfill.sealed_segments(records) == [Sealed("t.0", 0, 1400, ("n1", "n2"))]


def test_sets_are_complete_when_every_one_has_the_factor_with_the_node() -> None:
    full = Sealed("t.0", 0, 1, ("n1", "n2", "n3"))

    assert backfill.sets_complete([full, Sealed("t.1", 0, 1, ("n2", "n3", "n1"))], "n3", 3)
    assert not backfill.sets_complete([full, Sealed("t.1", 0, 1, ("n1", "n2"))], "n3", 3)
    assert not backfill.sets_complete([Sealed("t.1", 0, 1, ("n1", "n2", "n4"))], "n3", 3)
    assert backfill.sets_complete([], "n3", 3)


# -- holding every sealed segment whole -----------------------------------------------------


SEGMENTS = [Sealed("t.0", 0, 1000, ()), Sealed("t.0", 40, 900, ()), Sealed("t.1", 0, 700, ())]
WHOLE = {("t.0", 0): 1000, ("t.0", 40): 900, ("t.0", 80): 0, ("t.1", 0): 700}


def test_every_sealed_segment_at_its_size_and_the_others_bytes_is_whole() -> None:
    assert backfill.holds_whole(SEGMENTS, WHOLE, [dict(WHOLE), {**WHOLE, ("t.0", 80): 0}])


def test_a_missing_or_short_sealed_segment_is_not_whole() -> None:
    missing = {key: size for key, size in WHOLE.items() if key != ("t.0", 40)}
    short = {**WHOLE, ("t.1", 0): 699}

    assert not backfill.holds_whole(SEGMENTS, missing, [])
    assert not backfill.holds_whole(SEGMENTS, short, [])


def test_a_range_with_other_bytes_than_another_nodes_is_not_whole() -> None:
    # Every sealed segment whole, but another node holds more of t.1 (a segment etcd did not
    # list as sealed yet, or an active one).
    other = {**WHOLE, ("t.1", 10): 50}

    assert not backfill.holds_whole(SEGMENTS, WHOLE, [dict(WHOLE), other])
    assert not backfill.holds_whole(SEGMENTS, {**WHOLE, ("t.1", 10): 50}, [dict(WHOLE)])


# -- milestones -----------------------------------------------------------------------------


def test_a_milestone_is_when_its_condition_came_to_hold_for_good() -> None:
    milestones = backfill.Milestones()

    milestones.observe(0.1, {"sets": False, "whole": False})
    milestones.observe(0.2, {"sets": True, "whole": False})
    milestones.observe(0.3, {"sets": False, "whole": False})  # a set shrank again (a roll)
    milestones.observe(0.4, {"sets": True, "whole": True})
    milestones.observe(0.5, {"sets": True, "whole": True})

    assert milestones.since == {"sets": 0.4, "whole": 0.4}
    assert milestones.holding("sets", "whole")


def test_a_condition_that_stopped_holding_is_not_holding() -> None:
    milestones = backfill.Milestones()

    milestones.observe(0.1, {"count": True, "whole": True})
    milestones.observe(0.2, {"count": False, "whole": True})

    assert milestones.since == {"count": None, "whole": 0.1}
    assert milestones.holding("whole")
    assert not milestones.holding("whole", "count")
    assert not milestones.holding("never seen")


# -- the load -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("megabytes", "batch", "record_bytes", "requests"),
    [(200, 100, 1024, 1954), (1, 100, 10_000, 1), (0.5, 1, 1000, 500), (0.0011, 1, 1000, 2)],
)
def test_requests_for_make_at_least_the_megabytes_of_values(
    megabytes: float, batch: int, record_bytes: int, requests: int
) -> None:
    assert backfill.requests_for(megabytes, batch, record_bytes) == requests


# -- the broker's log -----------------------------------------------------------------------


LOG = """\
2026-11-27T11:08:25+0000 [logbroker.replication.healing#info] Fetched t.0@0 whole (89997 bytes) \
from a replica: this node's copy is complete
2026-11-27T11:08:25+0000 [logbroker.replication.healing#warn] This node's copy of t.0@84 cannot \
be healed yet: the whole copy cannot be put in place here (ranges/t.0 holds offsets up to 5908; \
a segment cannot start at 3388, before that)
2026-11-27T11:08:26+0000 [logbroker.replication.healing#info] Fetched t.0@84 whole (1169417 \
bytes) from a replica: this node's copy is complete
2026-11-27T11:08:26+0000 [logbroker.replication.healing#info] Fetched t.0@84 whole (1169417 \
bytes) from a replica: this node's copy is complete
2026-11-27T11:08:26+0000 [logbroker.replication.healing#warn] This node's copy of t.1@7 cannot \
be healed yet: no live replica holds it whole
2026-11-27T11:08:26+0000 [logbroker.replication.healing#info] Fetched other.0@0 whole (5 bytes) \
from a replica: this node's copy is complete
"""


def test_installs_count_every_whole_copy_put_in_place_and_every_refused_one() -> None:
    assert backfill.installs(LOG, "t") == backfill.Installs(3, 89997 + 2 * 1169417, 1)
    assert backfill.installs(LOG, "other") == backfill.Installs(1, 5, 0)
    assert backfill.installs("", "t") == backfill.Installs(0, 0, 0)


# -- starting a node again ------------------------------------------------------------------


def test_a_restarted_node_logs_to_a_new_file_beside_the_earlier_ones(tmp_path: Path) -> None:
    assert common._new_log(str(tmp_path)) == str(tmp_path / "twistd.log")
    (tmp_path / "twistd.log").write_text("first life")
    assert common._new_log(str(tmp_path)) == str(tmp_path / "twistd-2.log")
    (tmp_path / "twistd-2.log").write_text("second life")
    assert common._new_log(str(tmp_path)) == str(tmp_path / "twistd-3.log")


# -- producing until enough is acknowledged ---------------------------------------------------


class _Connection:
    """Keeps what was sent, for the test to answer."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def send(self, frame: bytes, due: float, answered: Any) -> None:
        self.pending.append(answered)

    def answer(self, reason: str | None = None) -> None:
        self.pending.pop(0)(wire.Response(0, b"", reason), 0.0)


def test_the_loop_sends_until_enough_are_acknowledged_and_resends_refused_ones() -> None:
    clock = Clock()
    connection = _Connection()
    loop = backfill._UntilAcknowledged(clock, b"frame", 4)

    loop.send(connection)
    loop.send(connection)
    assert len(connection.pending) == 2
    connection.answer()  # 1 acknowledged; a third is sent
    connection.answer("no_quorum")  # refused: sent again a moment later
    assert len(connection.pending) == 1
    clock.advance(0.05)
    assert len(connection.pending) == 2
    connection.answer()  # 2; the fourth is sent
    connection.answer()  # 3; nothing more to send
    assert len(connection.pending) == 1
    assert not loop.done.called
    connection.answer()  # 4

    assert loop.done.called
    assert loop.acknowledged == 4
    assert loop.refusals == {"no_quorum": 1}
    assert connection.pending == []
    assert not clock.getDelayedCalls()


def test_keeping_a_rounds_logs_copies_every_brokers_log_files_and_nothing_else(
    tmp_path: Path,
) -> None:
    round_directory = tmp_path / "backfill-1"
    for node, names in {"n1": ["twistd.log"], "n3": ["twistd.log", "twistd-2.log"]}.items():
        (round_directory / node / "data").mkdir(parents=True)
        (round_directory / node / "data" / "x.log").write_text("data")
        for name in names:
            (round_directory / node / name).write_text(f"{node} {name}")

    backfill._keep_logs(str(round_directory), str(tmp_path / "kept" / "backfill-1"))

    kept = tmp_path / "kept" / "backfill-1"
    assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*") if p.is_file()) == [
        "n1/twistd.log",
        "n3/twistd-2.log",
        "n3/twistd.log",
    ]
    assert (kept / "n3" / "twistd-2.log").read_text() == "n3 twistd-2.log"
