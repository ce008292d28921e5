"""The peer op ``digests`` (``logbroker.cluster.digests``): its exact bytes, strict decoding,
the pages a node answers from its range logs, and the asking side following the pages."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from logbroker.cluster.digests import (
    CopyCursor,
    DigestPage,
    DigestServer,
    NodeCopy,
    decode_digest_page,
    decode_digests_request,
    encode_digest_page,
    encode_digests_request,
    node_copies,
)
from logbroker.peer.frames import MalformedPeerMessage, PeerOp
from logbroker.records import Record
from logbroker.storage import CopyDigests, CopyState, SegmentFile
from tests.unit.storage.helpers import MemoryLogs, failure_of, result_of

MAX_U64 = 2**64 - 1
DIGEST = hashlib.sha256(b"log").digest()

digests = st.dictionaries(st.sampled_from(list(SegmentFile)), st.binary(min_size=32, max_size=32))
copies = st.builds(
    NodeCopy,
    st.text(max_size=20),
    st.builds(CopyDigests, st.integers(0, MAX_U64), st.sampled_from(list(CopyState)), digests),
)


@given(st.one_of(st.none(), st.builds(CopyCursor, st.text(max_size=30), st.integers(0, MAX_U64))))
def test_a_request_round_trips(after: CopyCursor | None) -> None:
    assert decode_digests_request(encode_digests_request(after)) == after


@given(st.builds(DigestPage, st.lists(copies, max_size=5).map(tuple), st.booleans()))
def test_a_page_round_trips(page: DigestPage) -> None:
    assert decode_digest_page(encode_digest_page(page)) == page


def test_a_page_has_the_documented_bytes() -> None:
    page = DigestPage(
        (
            NodeCopy(
                "t/0",
                CopyDigests(
                    4096,
                    CopyState.SEALED,
                    {SegmentFile.SEALED: b"\x02" * 32, SegmentFile.LOG: b"\x01" * 32},
                ),
            ),
            NodeCopy("t/0", CopyDigests(8192, CopyState.ACTIVE)),
        ),
        more=True,
    )

    encoded = encode_digest_page(page)

    assert encoded == b"".join(
        [
            b"\x01",  # more
            b"\x00\x00\x00\x02",  # two copies
            b"\x00\x03t/0",
            (4096).to_bytes(8, "big"),
            b"\x01",  # sealed
            b"\x05",  # log and sealed: in that order
            b"\x01" * 32,
            b"\x02" * 32,
            b"\x00\x03t/0",
            (8192).to_bytes(8, "big"),
            b"\x00",  # active
            b"\x00",  # no files
        ]
    )
    assert encode_digests_request(CopyCursor("t/0", 7)) == b"\x01\x00\x03t/0" + (7).to_bytes(
        8, "big"
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x02",  # neither 0 nor 1
        b"\x00\x00",  # left over
        b"\x01\x00\x03t/",  # cut short
    ],
)
def test_a_bad_request_is_refused(payload: bytes) -> None:
    with pytest.raises(MalformedPeerMessage):
        decode_digests_request(payload)


def one_copy(state: int = 1, bits: int = 1, digests: int = 1) -> bytes:
    return (
        b"\x00\x00\x00\x00\x01" + b"\x00\x01t" + bytes(8) + bytes([state, bits]) + DIGEST * digests
    )


@pytest.mark.parametrize(
    "payload",
    [
        one_copy(state=3),
        one_copy(bits=0x10),
        one_copy(digests=0),  # a digest cut short
        one_copy() + b"\x00",
        b"\x02\x00\x00\x00\x00",
        b"\x00\x00\x01\x00\x00",  # 65536 copies in no bytes
    ],
)
def test_a_bad_page_is_refused(payload: bytes) -> None:
    assert decode_digest_page(one_copy()).copies[0].copy.digests == {SegmentFile.LOG: DIGEST}
    with pytest.raises(MalformedPeerMessage):
        decode_digest_page(payload)


class Answering:
    """A requester whose node answers ``digests`` requests with ``answer``."""

    def __init__(self, answer: Callable[[bytes], Deferred[bytes]]) -> None:
        self._answer = answer

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        assert op is PeerOp.DIGESTS
        return self._answer(payload)


def node_with(ranges: dict[str, int]) -> MemoryLogs:
    """A single node's logs: each range with that many sealed segments (of two records, about
    150 bytes of files each) and an active one."""
    storage = MemoryLogs()
    for name, sealed in ranges.items():
        log = result_of(storage.open_range(name))
        for _ in range(sealed):
            result_of(log.append([Record(b"a" * 20), Record(b"b")]))
            result_of(log.roll())
        result_of(log.append([Record(b"active")]))
    return storage


def serve(server: DigestServer, after: CopyCursor | None) -> DigestPage:
    return decode_digest_page(result_of(server.serve(encode_digests_request(after))))


def listed(page: DigestPage) -> list[tuple[str, int, CopyState]]:
    return [(c.range_id, c.copy.base_offset, c.copy.state) for c in page.copies]


def test_a_node_answers_every_copy_of_every_range_in_order() -> None:
    storage = node_with({"b/1": 1, "a/0": 2})

    page = serve(DigestServer(storage), None)

    assert listed(page) == [
        ("a/0", 0, CopyState.SEALED),
        ("a/0", 2, CopyState.SEALED),
        ("a/0", 4, CopyState.ACTIVE),
        ("b/1", 0, CopyState.SEALED),
        ("b/1", 2, CopyState.ACTIVE),
    ]
    assert not page.more
    log_file = storage.fs.read_file("/data/ranges/a/0/00000000000000000002.log")
    assert page.copies[1].copy.digests[SegmentFile.LOG] == hashlib.sha256(log_file).digest()


def test_pages_end_at_their_hash_budget_and_go_on_after_their_last_copy() -> None:
    storage = node_with({"a/0": 3, "b/1": 2})
    server = DigestServer(storage, page_hash_bytes=1)

    pages = [serve(server, None)]
    while pages[-1].more:
        pages.append(serve(server, pages[-1].copies[-1].cursor))

    # Each page ends once it has hashed one sealed copy (an active one hashes nothing).
    for page in pages[:-1]:
        assert [c.copy.state for c in page.copies][-1] is CopyState.SEALED
        assert sum(c.copy.state is CopyState.SEALED for c in page.copies) == 1
    assert [item for page in pages for item in listed(page)] == listed(
        serve(DigestServer(storage), None)
    )


def test_pages_end_before_their_encoding_passes_the_page_size() -> None:
    storage = node_with({"a/0": 5})
    copy_size = 2 + 3 + 8 + 1 + 1 + 4 * 32  # the most one copy of "a/0" can take
    server = DigestServer(storage, page_bytes=2 * copy_size + 1)

    first = serve(server, None)
    second = serve(server, first.copies[-1].cursor)

    assert (len(first.copies), first.more) == (2, True)
    assert [c.copy.base_offset for c in second.copies] == [4, 6]
    assert len(encode_digest_page(first)) <= 2 * copy_size + 5


def test_the_asking_side_follows_the_pages_to_the_end() -> None:
    storage = node_with({"a/0": 3, "b/1": 1})
    server = DigestServer(storage, page_hash_bytes=1)
    asked: list[bytes] = []

    def answer(payload: bytes) -> Deferred[bytes]:
        asked.append(payload)
        return server.serve(payload)

    requester = Answering(answer)

    found = result_of(Deferred.fromCoroutine(node_copies(requester, "n1", Clock(), 10.0)))

    assert [(c.range_id, c.copy.base_offset) for c in found] == [
        ("a/0", 0),
        ("a/0", 2),
        ("a/0", 4),
        ("a/0", 6),
        ("b/1", 0),
        ("b/1", 2),
    ]
    assert len(asked) > 2, "in pages"


def test_the_asking_side_gives_up_on_a_page_that_does_not_come() -> None:
    clock = Clock()
    requester = Answering(lambda payload: Deferred())

    asking = Deferred.fromCoroutine(node_copies(requester, "n1", clock, 5.0))
    clock.advance(5.0)

    assert failure_of(asking).check(defer.TimeoutError)
    assert not clock.getDelayedCalls()
