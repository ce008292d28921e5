"""The extension ``verify_cluster`` (key 68): its request, its ok payload's documented bytes,
round trips, later versions and refusals (``logbroker.wire.verify``, docs/protocol.md)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from logbroker import wire
from logbroker.wire import (
    MAX_LISTED_PROBLEMS,
    ProtocolViolation,
    VerifyCluster,
    VerifyInfo,
    VerifyProblemInfo,
    decode_request,
    decode_verify,
    encode_request,
    encode_verify,
)
from logbroker.wire.verify import FILE_NAMES

U32 = st.integers(0, 2**32 - 1)
names = st.text(max_size=12)


@st.composite
def problems(draw: st.DrawFn) -> VerifyProblemInfo:
    range_id = draw(st.one_of(st.none(), names))
    return VerifyProblemInfo(
        kind=draw(names),
        node_id=draw(names),
        range_id=range_id,
        base_offset=None if range_id is None else draw(st.integers(0, 2**64 - 1)),
        files=tuple(name for name in FILE_NAMES if draw(st.booleans())),
        detail=draw(names),
    )


reports = st.builds(
    VerifyInfo,
    node_id=names,
    segments_checked=U32,
    copies_checked=U32,
    copies_unchecked=U32,
    problem_count=U32,
    problems=st.lists(problems(), max_size=4).map(tuple),
)

REPORT = VerifyInfo(
    node_id="n1",
    segments_checked=12,
    copies_checked=35,
    copies_unchecked=1,
    problem_count=2,
    problems=(
        VerifyProblemInfo("unavailable", "n3", None, None, (), "dead"),
        VerifyProblemInfo("differs", "n2", "t-0", 4096, ("index", "sealed"), "x"),
    ),
)
REPORT_BYTES = (
    b"\x01"  # version 1
    b"\x01\x00\x00\x00\x02n1"  # str "n1": the answering node
    b"\x00\x00\x00\x0c"  # 12 segments checked
    b"\x00\x00\x00\x23"  # 35 copies checked
    b"\x00\x00\x00\x01"  # 1 copy not checked
    b"\x00\x00\x00\x02"  # 2 problems found
    b"\x00\x00\x00\x02"  # 2 listed
    b"\x00\x00\x00\x2a"  # the first: 42 bytes
    b"\x01\x00\x00\x00\x0bunavailable"
    b"\x01\x00\x00\x00\x02n3"
    b"\x00"  # null range id: a node's problem
    b"\x00\x00\x00\x00\x00\x00\x00\x00"  # base offset 0
    b"\x00"  # no files
    b"\x01\x00\x00\x00\x04dead"
    b"\x00\x00\x00\x2a"  # the second: 42 bytes
    b"\x01\x00\x00\x00\x07differs"
    b"\x01\x00\x00\x00\x02n2"
    b"\x01\x00\x00\x00\x03t-0"
    b"\x00\x00\x00\x00\x00\x00\x10\x00"  # base offset 4096
    b"\x06"  # index and sealed
    b"\x01\x00\x00\x00\x01x"
)


def test_a_verify_cluster_exchange_has_the_documented_bytes() -> None:
    assert encode_request(3, VerifyCluster()) == b"\x00\x00\x00\x06\x00\x44\x00\x00\x00\x03"
    assert decode_request(b"\x00\x44\x00\x00\x00\x03").request == VerifyCluster()
    assert encode_verify(REPORT) == REPORT_BYTES
    assert decode_verify(REPORT_BYTES) == REPORT


@given(reports)
def test_verify_payloads_round_trip(report: VerifyInfo) -> None:
    assert decode_verify(encode_verify(report)) == report


def test_a_later_version_is_read_for_the_fields_this_one_knows() -> None:
    later = bytearray(REPORT_BYTES)
    later[0] = 2
    # A later version's field at the end of the first problem, and after the problems.
    first_end = len(REPORT_BYTES) - (4 + 42)
    start = 1 + 7 + 5 * 4  # the first problem's length
    later[start : start + 4] = (42 + 3).to_bytes(4, "big")
    later[first_end:first_end] = b"new"
    later += b"\xff\xff"

    assert decode_verify(bytes(later)) == REPORT


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\x00" + REPORT_BYTES[1:], "versions start at 1"),
        (REPORT_BYTES + b"\x00", "bytes left"),
        (REPORT_BYTES[:-1], "needs 42 bytes"),
        (b"\x01\x00" + REPORT_BYTES[8:], "answering node is null"),
        (REPORT_BYTES.replace(b"\x06\x01\x00\x00\x00\x01x", b"\x16\x01\x00\x00\x00\x01x"), "bits"),
    ],
)
def test_a_payload_that_breaks_the_layout_is_refused(payload: bytes, why: str) -> None:
    with pytest.raises(ProtocolViolation, match=why):
        decode_verify(payload)


def test_past_the_listing_limit_problems_are_counted_not_listed() -> None:
    many = (VerifyProblemInfo("missing_copy", "n1", "t-0", 0, (), ""),) * (MAX_LISTED_PROBLEMS + 3)
    report = VerifyInfo("n1", 1, 3, 0, len(many), many)

    decoded = decode_verify(wire.encode_verify(report))

    assert decoded.problem_count == MAX_LISTED_PROBLEMS + 3
    assert len(decoded.problems) == MAX_LISTED_PROBLEMS
