"""The ``logbroker`` command's pure parts: arguments, the JSON record format, stdin batching.
Its talk with a real broker is in ``tests/integration/test_cli.py``."""

from __future__ import annotations

import argparse
import base64
import io
import json

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbroker import cli
from logbroker.client.blocking import BrokerRefused
from logbroker.records import Record
from logbroker.wire import ClusterInfo, ClusterNodeInfo

nbytes = st.one_of(st.none(), st.binary(max_size=20))
records = st.builds(
    Record,
    value=st.binary(max_size=40),
    key=nbytes,
    timestamp_ms=st.integers(0, 2**64 - 1),
    headers=st.lists(st.tuples(nbytes, nbytes), max_size=3).map(tuple),
)


def parse(*argv: str) -> argparse.Namespace:
    parser = cli._parser()
    return parser.parse_args(argv)


# -- arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "server"),
    [
        ("localhost:4040", cli.Server("localhost", 4040)),
        ("10.0.0.5:9000", cli.Server("10.0.0.5", 9000)),
        ("broker.internal", cli.Server("broker.internal", 4040)),
        ("[::1]:4041", cli.Server("::1", 4041)),
        ("::1", cli.Server("::1", 4040)),
    ],
)
def test_server_addresses(text: str, server: cli.Server) -> None:
    assert cli.parse_server(text) == server


@pytest.mark.parametrize("text", ["", ":4040", "host:", "host:0", "host:65536", "host:x"])
def test_bad_server_addresses_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected HOST:PORT"):
        cli.parse_server(text)


def test_server_names_print_as_given() -> None:
    assert str(cli.Server("::1", 4040)) == "[::1]:4040"
    assert str(cli.Server("localhost", 4040)) == "localhost:4040"


def test_connection_options_after_the_subcommand_override_those_before() -> None:
    args = parse("--server", "a:1", "--user", "u1", "topic", "list", "--user", "u2")

    assert (args.server, args.user, args.password) == (cli.Server("a", 1), "u2", None)


def test_connection_options_default_to_localhost_and_nothing() -> None:
    args = parse("topic", "list")

    assert (args.server, args.user, args.password) == (cli.Server("localhost", 4040), None, None)


def test_user_add_takes_the_new_password_after_the_subcommand() -> None:
    args = parse(
        "--password", "mine", "user", "add", "bob", "--password", "his", "--permissions", "a,b"
    )

    assert (args.password, args.new_password, args.permissions) == ("mine", "his", ("a", "b"))


def test_produce_headers() -> None:
    args = parse("produce", "t", "--header", "a=1", "--header", "b=x=y", "--header", "c=")

    assert args.header == [(b"a", b"1"), (b"b", b"x=y"), (b"c", b"")]


@pytest.mark.parametrize(
    "argv",
    [
        ["produce", "t", "--header", "novalue"],
        ["produce", "t", "--timestamp", "-1"],
        ["consume", "t", "--max", "0"],
        ["consume", "t", "--from-start", "--cursor", "c"],
        ["topic", "create", "t", "--keyspace-bits", "256"],
        ["acl", "grant", "u", "delete", "t"],
        ["produce", "t", "v", "--unknown"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)

    assert exited.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_produce_values_may_come_before_and_after_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(cli, "_run_client_command", lambda args, _: seen.append(args.values) or 0)

    cli.main(["produce", "t", "a", "--key", "k", "b", "-5"])

    assert seen == [["a", "b", "-5"]]


def test_no_credentials_is_a_usage_error_naming_flags_and_variables(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SVC_CLIENT_USER", raising=False)
    monkeypatch.delenv("SVC_CLIENT_PASSWORD", raising=False)

    with pytest.raises(SystemExit) as exited:
        cli.main(["topic", "list"])

    assert exited.value.code == 2
    assert (
        "no user or password given: pass --user USER and --password PASSWORD, "
        "or set SVC_CLIENT_USER and SVC_CLIENT_PASSWORD"
    ) in capsys.readouterr().err


def test_only_the_missing_credential_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SVC_CLIENT_USER", "app")
    monkeypatch.delenv("SVC_CLIENT_PASSWORD", raising=False)

    with pytest.raises(SystemExit):
        cli.main(["topic", "list"])

    assert "no password given: pass --password PASSWORD, or set SVC_CLIENT_PASSWORD" in (
        capsys.readouterr().err
    )


# -- the JSON record format ----------------------------------------------------------------


def test_a_text_record_as_json() -> None:
    record = Record(b"caf\xc3\xa9", key=b"k", timestamp_ms=7, headers=((b"h", b"v"), (None, b"")))

    assert cli.record_json(record) == {
        "key": "k",
        "value": "café",
        "timestamp": 7,
        "headers": [["h", "v"], [None, ""]],
    }


def test_a_null_key_is_null() -> None:
    assert cli.record_json(Record(b"v"))["key"] is None


def test_bytes_that_are_not_utf8_are_base64_and_marked() -> None:
    record = Record(b"\xff", key=b"\xfe", headers=((b"ok", b"\x80"), (b"n", None)))

    assert cli.record_json(record) == {
        "key": "/g==",
        "key_encoding": "base64",
        "value": "/w==",
        "encoding": "base64",
        "timestamp": 0,
        "headers": [["b2s=", "gA=="], ["bg==", None]],
        "headers_encoding": "base64",
    }


def test_each_field_is_marked_on_its_own() -> None:
    as_json = cli.record_json(Record(b"text", key=b"\xff"))

    assert as_json["key_encoding"] == "base64"
    assert "encoding" not in as_json
    assert "headers_encoding" not in as_json


@given(records)
def test_every_record_can_be_read_back_from_its_json_line(record: Record) -> None:
    out = io.BytesIO()
    cli._print_records([record], True, out)
    line = out.getvalue()
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    loaded = json.loads(line)

    def decode(text: str | None, marker: str) -> bytes | None:
        if text is None:
            return None
        return base64.b64decode(text) if loaded.get(marker) == "base64" else text.encode()

    headers = tuple(
        (decode(name, "headers_encoding"), decode(value, "headers_encoding"))
        for name, value in loaded["headers"]
    )
    value = decode(loaded["value"], "encoding")
    assert value is not None
    key = decode(loaded["key"], "key_encoding")
    assert Record(value, key, loaded["timestamp"], headers) == record


# -- stdin ---------------------------------------------------------------------------------


def test_stdin_lines_lose_their_newline_only() -> None:
    stream = io.BytesIO(b"a\n\n b \r\nlast")

    assert list(cli._lines(stream)) == [b"a", b"", b" b \r", b"last"]


def test_batches_hold_at_most_1000_records_or_about_1_mib() -> None:
    small = [Record(b"x")] * 2500
    big = [Record(bytes(400_000))] * 5

    assert [len(batch) for batch in cli._batches(small)] == [1000, 1000, 500]
    assert [len(batch) for batch in cli._batches(big)] == [3, 2]
    assert list(cli._batches([])) == []


# -- cluster status ------------------------------------------------------------------------

THREE_NODES = ClusterInfo(
    cluster_id="prod",
    node_id="n2",
    control_plane="etcd",
    chores_holder="n1",
    domain_violations=1,
    lease_age_ms=1250,
    under_replicated=4,
    unavailable_ranges=2,
    nodes=(
        ClusterNodeInfo("n1", "10.0.0.1", 4040, 4041, 4042, True, 3, (("zone", "a"),), "0.1"),
        ClusterNodeInfo("n2", "fd00::2", 4040, 4041, 4042, True, 1, (("zone", "b"),), "0.1"),
        ClusterNodeInfo("n3", "10.0.0.3", 4040, 4041, 4042, False, 0, (), "0.1"),
    ),
)


def test_cluster_status_is_facts_then_one_row_per_node_with_its_marks() -> None:
    assert cli.cluster_table(THREE_NODES) == [
        "cluster:           prod",
        "control plane:     etcd",
        "chores holder:     n1",
        "domain violations: 1",
        "under-replicated:  4 segments",
        "unavailable:       2 ranges",
        "lease age:         1.2 s",
        "",
        "NODE  STATE  ADDRESS         PEER PORT  ATTRIBUTES  SEGMENTS LED",
        "n1    alive  10.0.0.1:4040   4042       zone=a      3             chores",
        "n2    alive  [fd00::2]:4040  4042       zone=b      1             answering",
        "n3    dead   10.0.0.3:4040   4042       -           0",
    ]
    just_started = cli.cluster_table(
        attrs.evolve(THREE_NODES, under_replicated=None, unavailable_ranges=None)
    )
    assert just_started[4:6] == [
        "under-replicated:  not counted yet",
        "unavailable:       not counted yet",
    ]


def test_a_single_node_shows_no_lease_and_is_both_answering_and_chores() -> None:
    alone = ClusterInfo(
        "logbroker",
        "n1",
        "local",
        "n1",
        0,
        None,
        (ClusterNodeInfo("n1", "localhost", 4040, 4041, 0, True, 0),),
    )

    lines = cli.cluster_table(alone)

    assert "lease age" not in "\n".join(lines)
    assert lines[-1].split() == [
        "n1",
        "alive",
        "localhost:4040",
        "-",  # no peer port
        "-",
        "0",
        "answering",
        "chores",
    ]


def test_cluster_status_json_is_one_object() -> None:
    document = cli.cluster_json(THREE_NODES)

    assert json.loads(json.dumps(document)) == document
    assert {key: document[key] for key in document if key != "nodes"} == {
        "cluster_id": "prod",
        "node_id": "n2",
        "control_plane": "etcd",
        "chores_holder": "n1",
        "domain_violations": 1,
        "under_replicated_segments": 4,
        "unavailable_ranges": 2,
        "lease_age_seconds": 1.25,
    }
    assert document["nodes"][1] == {
        "node_id": "n2",
        "state": "alive",
        "address": "[fd00::2]:4040",
        "host": "fd00::2",
        "client_port": 4040,
        "dashboard_port": 4041,
        "peer_port": 4042,
        "attributes": {"zone": "b"},
        "segments_led": 1,
        "version": "0.1",
        "answering": True,
        "chores": False,
    }
    assert [node["state"] for node in document["nodes"]] == ["alive", "alive", "dead"]  # type: ignore[index]


class FakeClusterClient:
    def __init__(self, answer: ClusterInfo | BrokerRefused) -> None:
        self._answer = answer

    def describe_cluster(self) -> ClusterInfo:
        if isinstance(self._answer, BrokerRefused):
            raise self._answer
        return self._answer


@pytest.mark.parametrize("as_json", [False, True])
def test_cluster_status_prints_the_table_or_the_json(
    as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse("cluster", "status", *(["--json"] if as_json else []))

    status = args.run(args, FakeClusterClient(THREE_NODES))

    out = capsys.readouterr().out
    assert status == 0
    if as_json:
        assert json.loads(out) == cli.cluster_json(THREE_NODES)
    else:
        assert out == "\n".join(cli.cluster_table(THREE_NODES)) + "\n"


def test_a_broker_without_a_cluster_view_is_explained(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("cluster", "status")

    status = args.run(args, FakeClusterClient(BrokerRefused("invalid_operation", 1)))

    assert status == 1
    assert "built without a view of its cluster" in capsys.readouterr().err


def test_other_refusals_go_to_the_common_handling() -> None:
    args = parse("cluster", "status")

    with pytest.raises(BrokerRefused):
        args.run(args, FakeClusterClient(BrokerRefused("permission_denied", 1)))
