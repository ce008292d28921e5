"""The ``logbroker`` console script against the real ``twistd logbroker``: what a user types and
what they see (stdout, stderr, exit status)."""

from __future__ import annotations

import base64
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from logbroker.client.blocking import BlockingClient
from logbroker.records import Record
from tests.integration.twistd import RunningBroker, broker_env, running_broker

pytestmark = pytest.mark.integration

LOGBROKER = str(Path(sys.executable).with_name("logbroker"))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """One broker for the module: each test uses topics and users of its own."""
    with running_broker(tmp_path_factory.mktemp("broker")) as running:
        yield running


def run(
    broker: RunningBroker | None,
    *args: str,
    user: str | None = "admin",
    password: str | None = "admin123",
    stdin: bytes = b"",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """``logbroker --server 127.0.0.1:PORT [--user U --password P] ARGS``."""
    command = [LOGBROKER]
    if broker is not None:
        command += ["--server", f"127.0.0.1:{broker.port}"]
    if user is not None:
        command += ["--user", user]
    if password is not None:
        command += ["--password", password]
    return subprocess.run(
        [*command, *args],
        input=stdin,
        capture_output=True,
        env=broker_env(env or {}),
        timeout=60,
        check=False,
    )


def ok(result: subprocess.CompletedProcess[bytes]) -> str:
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode()


def json_lines(result: subprocess.CompletedProcess[bytes]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in ok(result).splitlines()]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def admin(broker: RunningBroker) -> BlockingClient:
    return BlockingClient.connect("127.0.0.1", broker.port, "admin", "admin123")


# -- topics --------------------------------------------------------------------------------


def test_topic_create_and_list(broker: RunningBroker) -> None:
    assert ok(run(broker, "topic", "create", "listed.a")) == "created topic listed.a\n"
    ok(run(broker, "topic", "create", "listed.b", "--keyspace-bits", "16"))

    lines = ok(run(broker, "topic", "list", user="consumer", password="consumer123"))

    assert "listed.a keyspace_bits=8 ranges=4" in lines.splitlines()
    assert "listed.b keyspace_bits=16 ranges=4" in lines.splitlines()


def test_connection_options_may_follow_the_subcommand(broker: RunningBroker) -> None:
    result = run(
        None,
        "topic",
        "list",
        "--server",
        f"127.0.0.1:{broker.port}",
        "--user",
        "app",
        "--password",
        "app123",
        user=None,
        password=None,
    )

    assert result.returncode == 0, result.stderr


def test_credentials_come_from_the_environment(broker: RunningBroker) -> None:
    env = {"SVC_CLIENT_USER": "app", "SVC_CLIENT_PASSWORD": "app123"}

    result = run(broker, "topic", "list", user=None, password=None, env=env)

    assert result.returncode == 0, result.stderr


# -- produce and consume -------------------------------------------------------------------


def test_produce_from_arguments_and_stdin_then_consume_json(broker: RunningBroker) -> None:
    ok(run(broker, "topic", "create", "roundtrip"))
    before = time.time() * 1000
    from_args = run(
        broker,
        "produce",
        "roundtrip",
        "first",
        "sécond",
        "--key",
        "k1",
        "--header",
        "trace=abc",
        "--header",
        "empty=",
        "--timestamp",
        "1700000000000",
    )
    from_stdin = run(broker, "produce", "roundtrip", stdin=b"line one\n\nline three\nlast")

    assert ok(from_args) == "2\n"
    assert ok(from_stdin) == "4\n"
    records = json_lines(run(broker, "consume", "roundtrip", "--json"))
    keyed = [r for r in records if r["key"] == "k1"]
    keyless = [r for r in records if r["key"] is None]
    assert keyed == [
        {
            "key": "k1",
            "value": value,
            "timestamp": 1_700_000_000_000,
            "headers": [["trace", "abc"], ["empty", ""]],
        }
        for value in ("first", "sécond")
    ]
    assert [r["value"] for r in keyless] == ["line one", "", "line three", "last"]
    assert all(before <= r["timestamp"] <= time.time() * 1000 for r in keyless)
    assert all(r["headers"] == [] for r in keyless)


def test_consume_prints_values_as_text_and_a_summary_on_stderr(broker: RunningBroker) -> None:
    ok(run(broker, "topic", "create", "plain"))
    ok(run(broker, "produce", "plain", "--key", "k", "one", "two"))

    result = run(broker, "consume", "plain")

    assert ok(result) == "one\ntwo\n"
    assert b"consumed 2 records; next cursor: " in result.stderr


def test_values_that_are_not_utf8_are_base64_with_their_encoding(broker: RunningBroker) -> None:
    ok(run(broker, "topic", "create", "binary"))
    binary = Record(
        b"\xff\x00\xfe", key=b"\x80k", timestamp_ms=5, headers=((b"h", b"\xc3"), (b"n", None))
    )
    with admin(broker) as client:
        client.produce("binary", [binary])

    [record] = json_lines(run(broker, "consume", "binary", "--json"))

    assert record == {
        "key": b64(b"\x80k"),
        "key_encoding": "base64",
        "value": b64(b"\xff\x00\xfe"),
        "encoding": "base64",
        "timestamp": 5,
        "headers": [[b64(b"h"), b64(b"\xc3")], [b64(b"n"), None]],
        "headers_encoding": "base64",
    }


def test_a_large_stdin_is_produced_in_batches(broker: RunningBroker) -> None:
    ok(run(broker, "topic", "create", "bulk"))
    lines = b"".join(b"record %d\n" % i for i in range(25_000))

    assert ok(run(broker, "produce", "bulk", stdin=lines)) == "25000\n"
    consumed = ok(run(broker, "consume", "bulk")).splitlines()
    assert sorted(consumed) == sorted(f"record {i}" for i in range(25_000))


def test_consume_with_a_group_resumes_where_the_last_one_stopped(broker: RunningBroker) -> None:
    ok(run(broker, "topic", "create", "grouped"))
    ok(run(broker, "produce", "grouped", "--key", "k", *[str(i) for i in range(6)]))

    first = ok(run(broker, "consume", "grouped", "--group", "g", "--max", "4"))
    second = ok(run(broker, "consume", "grouped", "--group", "g"))
    nothing_left = ok(run(broker, "consume", "grouped", "--group", "g"))
    again = ok(run(broker, "consume", "grouped", "--group", "g", "--from-start", "--max", "2"))

    assert first.split() == ["0", "1", "2", "3"]
    assert second.split() == ["4", "5"]
    assert nothing_left == ""
    assert again.split() == ["0", "1"]
    # --from-start committed its batch: the group is back at 2.
    assert ok(run(broker, "consume", "grouped", "--group", "g")).split() == ["2", "3", "4", "5"]


def test_consume_from_a_cursor(broker: RunningBroker) -> None:
    ok(run(broker, "topic", "create", "cursored"))
    ok(run(broker, "produce", "cursored", "--key", "k", "a", "b"))
    first = run(broker, "consume", "cursored")
    cursor = first.stderr.decode().rsplit("next cursor: ", 1)[1].strip()
    ok(run(broker, "produce", "cursored", "--key", "k", "c"))

    assert ok(run(broker, "consume", "cursored", "--cursor", cursor)) == "c\n"


@pytest.fixture
def interruptible() -> Iterator[None]:
    """Children that take Ctrl-C (SIGINT) however this test run was started: one started in
    the background by a shell ignores SIGINT, and so would the CLI it starts."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("interruptible")
def test_follow_prints_records_produced_after_it_started_until_interrupted(
    broker: RunningBroker,
) -> None:
    ok(run(broker, "topic", "create", "followed"))
    ok(run(broker, "produce", "followed", "before"))
    follower = subprocess.Popen(
        [LOGBROKER, "--server", f"127.0.0.1:{broker.port}", "consume", "followed", "--follow"],
        env=broker_env({"SVC_CLIENT_USER": "app", "SVC_CLIENT_PASSWORD": "app123"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert follower.stdout is not None
        assert follower.stdout.readline() == b"before\n"  # caught up, now long-polling
        ok(run(broker, "produce", "followed", "after"))
        assert follower.stdout.readline() == b"after\n"
        follower.send_signal(signal.SIGINT)
        _, stderr = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()

    assert follower.returncode == 0
    assert stderr == b""


# -- users and ACLs ------------------------------------------------------------------------


def test_user_and_acl_subcommands(broker: RunningBroker) -> None:
    add = run(broker, "user", "add", "bob", "--password", "pw1", "--permissions", "produce,consume")
    assert ok(add) == "created user bob\n"
    assert "bob permissions=consume,produce" in ok(run(broker, "user", "list")).splitlines()
    ok(run(broker, "user", "passwd", "bob", "--password", "pw2"))
    assert run(broker, "topic", "list", user="bob", password="pw1").returncode == 1
    assert run(broker, "topic", "list", user="bob", password="pw2").returncode == 0

    ok(run(broker, "acl", "grant", "bob", "produce", "orders.*"))
    ok(run(broker, "acl", "grant", "bob", "consume", "audit"))
    assert ok(run(broker, "acl", "list", "bob")).splitlines() == [
        "consume audit",
        "produce orders.*",
    ]
    ok(run(broker, "acl", "revoke", "bob", "produce", "orders.*"))
    assert ok(run(broker, "acl", "list", "bob")) == "consume audit\n"

    assert ok(run(broker, "user", "delete", "bob")) == "deleted user bob\n"
    assert "bob" not in ok(run(broker, "user", "list"))


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "user", "reason"),
    [
        (("consume", "no-such-topic"), "admin", "no_such_topic"),
        (("produce", "anything", "v"), "consumer", "permission_denied"),
        (("user", "list"), "app", "permission_denied"),
        (("topic", "create", "bad/name"), "admin", "invalid_topic_name"),
        (("user", "delete", "nobody"), "admin", "user_not_found"),
    ],
)
def test_a_refusal_exits_1_with_its_reason_on_stderr(
    broker: RunningBroker, args: tuple[str, ...], user: str, reason: str
) -> None:
    result = run(broker, *args, user=user, password=f"{user}123")

    assert result.returncode == 1
    assert result.stderr.decode().startswith(f"logbroker: {reason} (")
    assert result.stdout == b""


def test_wrong_credentials_exit_1(broker: RunningBroker) -> None:
    result = run(broker, "topic", "list", password="wrong")

    assert result.returncode == 1
    assert "logbroker: invalid_credentials (log in as 'admin'" in result.stderr.decode()
    assert "SVC_CLIENT_PASSWORD" in result.stderr.decode()


def test_missing_credentials_exit_2_naming_the_flags_and_variables() -> None:
    result = run(None, "topic", "list", user=None, password=None)

    assert result.returncode == 2
    stderr = result.stderr.decode()
    for name in ("--user", "--password", "SVC_CLIENT_USER", "SVC_CLIENT_PASSWORD"):
        assert name in stderr


def test_an_unreachable_broker_exits_1_naming_the_server() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]

    result = run(None, "--server", f"127.0.0.1:{port}", "topic", "list")

    assert result.returncode == 1
    assert f"logbroker: cannot connect to 127.0.0.1:{port}" in result.stderr.decode()


def test_bad_usage_exits_2() -> None:
    assert run(None, "consume").returncode == 2
    assert run(None, "produce", "t", "--header", "no-equals-sign").returncode == 2
    assert run(None, "consume", "t", "--from-start", "--cursor", "c").returncode == 2


# -- bench ---------------------------------------------------------------------------------


def test_bench_produce_reports_throughput_and_latency_then_consume_drains(
    broker: RunningBroker,
) -> None:
    produced = ok(
        run(broker, "bench", "produce", "bench-cli", "-c", "2", "-w", "2", "-b", "10", "-t", "1")
    )

    figures = re.search(r"records/s ([\d,]+)  MB/s [\d.]+  requests ([\d,]+)  errors 0", produced)
    assert figures is not None, produced
    assert re.search(r"p50 [\d.]+  p99 [\d.]+  p99\.9 [\d.]+", produced), produced
    stored = sum(1 for _ in _drain(broker, "bench-cli"))
    requests = int(figures.group(2).replace(",", ""))
    assert stored >= requests * 10  # every acknowledged record is there

    consumed = ok(run(broker, "bench", "consume", "bench-cli"))
    assert f"consume bench-cli: {stored:,} records" in consumed


def test_bench_consume_of_an_unknown_topic_names_the_reason(broker: RunningBroker) -> None:
    result = run(broker, "bench", "consume", "no-such-topic")

    assert result.returncode == 1
    assert b"no_such_topic" in result.stderr


def _drain(broker: RunningBroker, topic: str) -> Iterator[object]:
    with admin(broker) as client:
        cursor = None
        while True:
            batch = client.fetch(topic, cursor, None, None, 1000, 0)
            if not batch.records:
                return
            yield from batch.records
            cursor = batch.next_cursor
