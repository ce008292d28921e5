"""``logbroker cluster verify``: what it prints and the exit status, from the report the broker
answers (``verify_cluster``)."""

from __future__ import annotations

import argparse
import json

import pytest

from logbroker import cli
from logbroker.client.blocking import BrokerRefused
from logbroker.wire import VerifyInfo, VerifyProblemInfo

CLEAN = VerifyInfo("n1", 12, 36, 0, 0, ())
BROKEN = VerifyInfo(
    "n1",
    12,
    33,
    3,
    4,
    (
        VerifyProblemInfo(
            "unavailable", "n4", None, None, (), "dead: its membership lease is gone"
        ),
        VerifyProblemInfo("differs", "n3", "t-0", 4096, ("index",), "from the copies on n1, n2"),
        VerifyProblemInfo("missing_copy", "n2", "t-0", 8192, (), ""),
    ),
)


def parse(*argv: str) -> argparse.Namespace:
    return cli._parser().parse_args(argv)


class FakeVerifyingClient:
    def __init__(self, answer: VerifyInfo | Exception) -> None:
        self._answer = answer
        self.timeouts: list[float | None] = []

    def verify_cluster(self, timeout: float | None = None) -> VerifyInfo:
        self.timeouts.append(timeout)
        if isinstance(self._answer, Exception):
            raise self._answer
        return self._answer


def test_a_clean_cluster_is_one_summary_line() -> None:
    assert cli.verify_lines(CLEAN) == [
        "checked 12 sealed segments, 36 copies: every copy complete and identical"
    ]


def test_each_problem_names_its_segment_node_and_files_then_the_summary() -> None:
    assert cli.verify_lines(BROKEN) == [
        "n4: unavailable (dead: its membership lease is gone)",
        "t-0@4096 on n3: differs: .index (from the copies on n1, n2)",
        "t-0@8192 on n2: missing_copy",
        "... and 1 more problems, not listed",
        "checked 12 sealed segments, 33 copies (3 more on nodes not checked): 4 problems",
    ]


def test_the_json_is_one_object_with_every_listed_problem() -> None:
    document = cli.verify_json(BROKEN)

    assert document["ok"] is False
    assert (document["problem_count"], document["copies_unchecked"]) == (4, 3)
    assert document["problems"][1] == {  # type: ignore[index]
        "kind": "differs",
        "node_id": "n3",
        "range_id": "t-0",
        "base_offset": 4096,
        "files": ["index"],
        "detail": "from the copies on n1, n2",
    }
    assert cli.verify_json(CLEAN)["ok"] is True


@pytest.mark.parametrize(("report", "status"), [(CLEAN, 0), (BROKEN, 1)])
@pytest.mark.parametrize("as_json", [False, True])
def test_the_exit_status_says_whether_anything_is_wrong(
    report: VerifyInfo, status: int, as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse("cluster", "verify", "--timeout", "90", *(["--json"] if as_json else []))
    client = FakeVerifyingClient(report)

    assert args.run(args, client) == status

    out = capsys.readouterr().out
    if as_json:
        assert json.loads(out) == cli.verify_json(report)
    else:
        assert out == "\n".join(cli.verify_lines(report)) + "\n"
    assert client.timeouts == [90.0]


def test_a_single_node_broker_is_explained(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("cluster", "verify")

    status = args.run(args, FakeVerifyingClient(BrokerRefused("invalid_operation", 1)))

    assert status == 1
    assert "logbroker storage verify" in capsys.readouterr().err


def test_running_out_of_time_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("cluster", "verify")

    status = args.run(args, FakeVerifyingClient(TimeoutError("timed out")))

    assert status == 1
    assert "within 3600 s; pass a longer --timeout" in capsys.readouterr().err


def test_other_refusals_go_to_the_common_handling() -> None:
    args = parse("cluster", "verify")

    with pytest.raises(BrokerRefused):
        args.run(args, FakeVerifyingClient(BrokerRefused("permission_denied", 1)))
