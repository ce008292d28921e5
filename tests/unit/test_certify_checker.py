"""The certification's checker on its own (``tests/certify``): what the follower read against
the final log, the firewall rules of a fault, and the verdicts of the report. The harness
runs them for real in ``tests/certify/test_certify.py``; these pin the judgements."""

from __future__ import annotations

from typing import cast

import pytest

from logbroker import wire
from logbroker.client import BrokerRefused
from logbroker.records import Record
from tests.certify import load, network
from tests.certify.drills import final_copies
from tests.certify.harness import SHORT, Certification, Outcome, _probe_failures
from tests.certify.load import Follower, follower_problems
from tests.certify.network import Block, NetworkUnavailable
from tests.certify.report import DrillRecord, Report
from tests.certify.view import CheckFailed

FINAL = [(b"a", b"a#0"), (b"b", b"b#0"), (b"a", b"a#1"), (b"a", b"a#2"), (b"b", b"b#1")]


def test_a_follower_that_read_the_start_of_each_key_is_fine_in_any_interleaving() -> None:
    followed = [(b"b", b"b#0"), (b"a", b"a#0"), (b"a", b"a#1")]
    assert follower_problems(followed, FINAL) == []


def test_a_follower_that_skipped_read_twice_or_read_what_is_gone_is_caught() -> None:
    skipped = [(b"a", b"a#0"), (b"a", b"a#2")]
    twice = [(b"a", b"a#0"), (b"a", b"a#0")]
    gone = [(b"b", b"b#0"), (b"b", b"b#1"), (b"b", b"b#9")]
    unknown_key = [(b"c", b"c#0")]

    assert follower_problems(skipped, FINAL) == [
        "the follower's record 1 of key a was a#2, the final log has a#1 there"
    ]
    assert follower_problems(twice, FINAL) == [
        "the follower's record 1 of key a was a#0, the final log has a#1 there"
    ]
    assert follower_problems(gone, FINAL) == [
        "the follower's record 2 of key b was b#9, the final log has nothing there"
    ]
    assert follower_problems(unknown_key, FINAL) == [
        "the follower's record 0 of key c was c#0, the final log has nothing there"
    ]


class _ScriptedClient:
    """A node as the follower meets it: each fetch takes the next answer (a batch, or an
    error to raise); once they are all taken, the follower is stopped."""

    def __init__(self, follower: Follower, answers: list[wire.RecordsPayload | Exception]):
        self._follower = follower
        self._answers = answers
        self.cursors: list[str | None] = []

    def fetch(self, topic: str, cursor: str | None, *rest: object) -> wire.RecordsPayload:
        self.cursors.append(cursor)
        answer = self._answers.pop(0)
        if not self._answers:
            self._follower._stopping.set()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def close(self) -> None:
        pass


def test_a_node_refusing_the_follower_its_own_cursor_breaks_guarantee_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every cursor the follower sends is one a node gave it: told it is past the range's end,
    # the follower met a node that holds less than another one served as committed.
    follower = Follower(["10.77.0.1:4040", "10.77.0.2:4040"], 0, "t")
    batch = wire.RecordsPayload((Record(b"a#0", b"a"),), "cursor-1")
    client = _ScriptedClient(
        follower, [batch, BrokerRefused("invalid_cursor", 2), wire.RecordsPayload((), None)]
    )
    monkeypatch.setattr(load, "connect", lambda server: client)
    follower._work()

    assert client.cursors == [None, "cursor-1", "cursor-1"]
    assert follower.failures == {"invalid_cursor": 1}
    [problem] = follower.problems(FINAL)
    assert problem.startswith("a node refused the follower its own cursor (invalid_cursor) at ")
    assert problem.endswith(" through 10.77.0.1:4040")
    assert follower.read == [(b"a", b"a#0")]


def test_other_refusals_only_move_the_follower(monkeypatch: pytest.MonkeyPatch) -> None:
    follower = Follower(["10.77.0.1:4040", "10.77.0.2:4040"], 0, "t")
    client = _ScriptedClient(
        follower, [BrokerRefused("unreachable", 2), wire.RecordsPayload((), None)]
    )
    monkeypatch.setattr(load, "connect", lambda server: client)
    follower._work()

    assert follower.failures == {"unreachable": 1}
    assert follower.moves == 1
    assert follower.problems(FINAL) == []


def test_a_cut_from_peers_drops_both_ways_on_the_peer_port_only() -> None:
    rules = Block(peers=(1, 2), ports=(4042,), local_ports=(4042,)).rules()
    assert rules == [
        "add rule inet certify output ip daddr { 10.77.0.1, 10.77.0.2 } tcp dport { 4042 } drop",
        "add rule inet certify output ip daddr { 10.77.0.1, 10.77.0.2 } tcp sport { 4042 } drop",
        "add rule inet certify input ip saddr { 10.77.0.1, 10.77.0.2 } tcp sport { 4042 } drop",
        "add rule inet certify input ip saddr { 10.77.0.1, 10.77.0.2 } tcp dport { 4042 } drop",
    ]


def test_a_one_way_cut_drops_every_outgoing_packet_and_nothing_coming_in() -> None:
    assert Block(incoming=False).rules() == ["add rule inet certify output drop"]


def test_a_cut_from_etcd_names_the_loopback_too() -> None:
    assert Block(peers=(2,), loopback=True, ports=(2379,), incoming=False).rules() == [
        "add rule inet certify output ip daddr { 10.77.0.2, 127.0.0.1 } tcp dport { 2379 } drop"
    ]


def test_a_guarantee_no_drill_checks_is_not_exercised_and_the_run_not_certified() -> None:
    report = Report()
    report.drills.append(DrillRecord("power-kill", Outcome(recovered_after=1.0, healthy_after=2.0)))

    verdicts = report.verdicts()

    assert verdicts[2] == ("passed", "1 of 1 drills; slowest 2.0 s (power-kill)")
    assert verdicts[5] == ("not exercised", "no drill of this run checks it")
    assert verdicts[1][0] == "not exercised", "the run did not reach its end"
    assert report.passed
    assert not report.certified
    assert report.table()[-1].startswith("NOT CERTIFIED")


def test_a_finding_of_many_drills_is_given_once_with_their_count() -> None:
    report = Report()
    for node in ("n3", "n3", "n2"):
        outcome = Outcome(recovered_after=1.0, healthy_after=2.0, exercised={2, 3, 6})
        outcome.notes[6] = f"5 copies of {node} damaged"
        report.drills.append(DrillRecord("storage faults", outcome))

    verdicts = report.verdicts()

    assert verdicts[6] == (
        "passed",
        "3 of 3 drills; 5 copies of n3 damaged (in 2 drills); 5 copies of n2 damaged",
    )


def test_a_drill_that_could_not_run_fails_every_guarantee_it_speaks_for() -> None:
    report = Report()
    report.drills.append(DrillRecord("stall", Outcome(problems=[(0, "no primary found")])))

    verdicts = report.verdicts()

    assert verdicts[2][0] == verdicts[3][0] == "FAILED"
    assert "stall: no primary found" in verdicts[3][1]
    assert not report.passed


def test_the_harness_refuses_without_root_or_its_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tests.certify.network.os.geteuid", lambda: 1000)
    with pytest.raises(NetworkUnavailable, match="needs root"):
        network.require_network_tools()

    monkeypatch.setattr("tests.certify.network.os.geteuid", lambda: 0)
    monkeypatch.setattr(
        "tests.certify.network.shutil.which", lambda tool: None if tool == "nft" else tool
    )
    with pytest.raises(NetworkUnavailable, match="install Debian's nftables"):
        network.require_network_tools()


def test_a_slow_recovery_names_each_node_s_failed_probes_as_their_reason_changed() -> None:
    said = {
        "n3": [(0.0, "unreachable"), (2.14, "not_primary")],
        "n1": [(0.3, "timeout")],
    }
    assert _probe_failures(said) == (
        "n1: at 0.3 s timeout; n3: at 0.0 s unreachable, then at 2.1 s not_primary"
    )
    assert _probe_failures({}) == "none (the probes were slow, not failing)"


class _CopiesSettling:
    """A cluster whose ``cluster verify`` finds copies being sealed at its first looks: the
    end's check of guarantee 4 sees through the harness (``final_copies``)."""

    def __init__(self, looks: list[tuple[bool, str]], settles: bool) -> None:
        self._looks = looks
        self._settles = settles
        self.view = self
        self.timing = SHORT
        self.marks: list[str] = []

    def verify_copies(self) -> tuple[bool, str]:
        return self._looks.pop(0)

    def mark(self, event: str) -> None:
        self.marks.append(event)

    def wait_identical(self, seconds: float) -> tuple[float, str]:
        if not self._settles:
            raise CheckFailed(f"not within {seconds:g} s: every sealed copy identical (still)")
        return 1.5, "checked 9 sealed segments, 27 copies: every copy complete and identical"


SEALING = "p.1@45 on n1: unsealed (its copy is still active, though the segment is sealed)"


def test_copies_identical_at_the_first_look_pass_as_they_are() -> None:
    identical = (True, "checked 9 sealed segments, 27 copies: every copy complete and identical")
    cluster = _CopiesSettling([identical], settles=False)

    assert final_copies(cast(Certification, cluster)) == (*identical, None)
    assert cluster.marks == []


def test_copies_being_sealed_at_the_end_pass_once_identical_and_the_report_says_so() -> None:
    cluster = _CopiesSettling([(False, SEALING)], settles=True)
    report = Report()

    report.copies(*final_copies(cast(Certification, cluster)))

    passed, evidence = report.verdicts()[4]
    assert passed == "passed"
    assert evidence.startswith("`cluster verify`: checked 9 sealed segments, 27 copies")
    assert f"(the first look, while segments were being sealed: {SEALING})" in evidence
    assert cluster.marks[-1] == "`cluster verify`: every sealed copy identical, 1.5 s later"


def test_copies_that_never_become_identical_fail_guarantee_4() -> None:
    cluster = _CopiesSettling([(False, SEALING)], settles=False)
    report = Report()

    report.copies(*final_copies(cast(Certification, cluster)))

    failed, evidence = report.verdicts()[4]
    assert failed == "FAILED"
    assert "not within 45 s: every sealed copy identical" in evidence
    assert not report.passed
