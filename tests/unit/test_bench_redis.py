"""The RESP encoder, reply parser and load connection of ``bench/_redis.py`` (the Redis side of
``bench/produce_vs_redis.py``): the benchmark is only as right as its count of replies."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.internet.testing import StringTransport

from tests.bench_scripts import load_bench_script

resp = load_bench_script("_redis")

#: One of each reply type, the awkward cases included: a bulk string holding CRLF, an empty
#: one, nulls, a nested array, a negative integer.
STREAM = (
    b"$15\r\n1700000000000-0\r\n"
    b"+OK\r\n"
    b"-ERR wrong number of arguments for 'xadd' command\r\n"
    b":-42\r\n"
    b"$4\r\na\r\nb\r\n"
    b"$0\r\n\r\n"
    b"$-1\r\n"
    b"*-1\r\n"
    b"*0\r\n"
    b"*3\r\n:1\r\n*2\r\n$1\r\nx\r\n$-1\r\n+PONG\r\n"
)
REPLIES = [
    b"1700000000000-0",
    b"OK",
    resp.ReplyError("ERR wrong number of arguments for 'xadd' command"),
    -42,
    b"a\r\nb",
    b"",
    None,
    None,
    [],
    [1, [b"x", None], b"PONG"],
]


def _feed_in_chunks(data: bytes, cuts: list[int]) -> list[Any]:
    parser = resp.ReplyParser()
    replies = []
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        replies.extend(parser.feed(data[start:cut]))
        start = cut
    assert parser.buffered == 0
    return replies


def test_whole_stream_parses_to_every_reply_in_order() -> None:
    assert resp.ReplyParser().feed(STREAM) == REPLIES


def test_one_byte_at_a_time_gives_the_same_replies() -> None:
    assert _feed_in_chunks(STREAM, list(range(1, len(STREAM)))) == REPLIES


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=20))
def test_any_chunking_gives_the_same_replies(cuts: list[int]) -> None:
    assert _feed_in_chunks(STREAM, cuts) == REPLIES


def test_an_incomplete_reply_waits_for_the_rest() -> None:
    parser = resp.ReplyParser()

    assert parser.feed(b":7\r\n$10\r\n12345") == [7]
    assert parser.buffered == len(b"$10\r\n12345")
    assert parser.feed(b"67890\r") == []
    assert parser.feed(b"\n*2\r\n:1\r\n") == [b"1234567890"]
    assert parser.feed(b":2\r\n") == [[1, 2]]
    assert parser.buffered == 0


@pytest.mark.parametrize(
    "data",
    [b"?what\r\n", b":12x\r\n", b"$3\r\nabcd\r\n", b"$-5\r\n", b"*-2\r\n"],
)
def test_bytes_that_are_not_resp_are_refused(data: bytes) -> None:
    with pytest.raises(resp.ProtocolError):
        resp.ReplyParser().feed(data)


def test_commands_are_arrays_of_bulk_strings() -> None:
    assert resp.encode_command("XADD", b"s", b"*", "v", 12) == (
        b"*5\r\n$4\r\nXADD\r\n$1\r\ns\r\n$1\r\n*\r\n$1\r\nv\r\n$2\r\n12\r\n"
    )


@given(
    value=st.binary(max_size=300),
    batch=st.integers(min_value=1, max_value=20),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=10),
)
def test_a_pipeline_is_batch_xadds_of_the_value(value: bytes, batch: int, cuts: list[int]) -> None:
    pipeline = resp.xadd_pipeline("bench", value, batch)

    # A command is a RESP array too, so the reply parser reads the pipeline as a server would.
    cuts = [cut % (len(pipeline) + 1) for cut in cuts]
    assert _feed_in_chunks(pipeline, cuts) == [[b"XADD", b"bench", b"*", b"v", value]] * batch


def test_a_keyed_pipeline_gives_each_entry_its_records_key_in_turn() -> None:
    pipeline = resp.xadd_pipeline("bench", b"v1", 5, keys=2)

    assert _feed_in_chunks(pipeline, []) == [
        [b"XADD", b"bench", b"*", b"k", b"key-%d" % (index % 2), b"v", b"v1"] for index in range(5)
    ]


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (b"1700000000000-0", True),
        (b"0-1", True),
        (b"1700000000000", False),
        (b"1700000000000-0 ", False),
        (b"OK", False),
        (resp.ReplyError("ERR"), False),
        (None, False),
        (5, False),
        ([b"1-0"], False),
    ],
)
def test_only_an_xadd_id_is_a_stream_id(reply: Any, expected: bool) -> None:
    assert resp.is_stream_id(reply) is expected


def test_load_connection_answers_a_request_once_all_its_replies_arrived() -> None:
    ready: Deferred[Any] = Deferred()
    connection = resp.RedisLoadConnection(3, ready)
    transport = StringTransport()
    connection.makeConnection(transport)
    answered: list[tuple[str | None, float]] = []

    def record(outcome: Any, due: float) -> None:
        answered.append((outcome.reason, due))

    assert ready.called
    connection.send(b"first", 1.0, record)
    connection.send(b"second", 2.0, record)
    assert transport.value() == b"firstsecond"

    ids = b"".join(b"$3\r\n%d-0\r\n" % n for n in range(3))
    connection.dataReceived(ids[:-3])
    assert answered == []
    connection.dataReceived(ids[-3:] + b"$3\r\n3-0\r\n-ERR no")
    assert answered == [(None, 1.0)]
    connection.dataReceived(b"\r\n$3\r\n5-0\r\n")

    assert answered == [(None, 1.0), ("ReplyError('ERR no')", 2.0)]
