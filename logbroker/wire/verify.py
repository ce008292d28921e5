"""The ok payload of the extension ``verify_cluster`` (key 68, docs/protocol.md): what the
answering node found comparing every sealed segment's copies on every node.

``verify = version:u8 str(node_id) segments_checked:u32 copies_checked:u32
copies_unchecked:u32 problem_count:u32 count:u32 problem*``, each ``problem = len:u32 body``,
``body = str(kind) str(node_id) str(range_id) base_offset:u64 files:u8 str(detail)``. A later
version only appends, at the end of the payload and at the end of a problem's body (which is
why each carries its length), so a reader of version 1 skips what it does not know.
"""

from __future__ import annotations

import attrs

from logbroker.wire import primitives as p
from logbroker.wire.messages import ProtocolViolation
from logbroker.wire.primitives import Reader, Truncated

#: The version of the payload this codec writes.
VERIFY_PAYLOAD_VERSION = 1
#: At most this many problems are listed (``problem_count`` counts them all): a node answers
#: its client within one frame however broken the cluster is.
MAX_LISTED_PROBLEMS = 10_000
#: The files a problem may name, by their bit in ``files``.
FILE_NAMES = ("log", "index", "sealed", "epoch")


@attrs.frozen
class VerifyProblemInfo:
    #: ``missing_copy``, ``missing_files``, ``differs``, ``unsealed``, ``stale_copy`` or
    #: ``unavailable`` (a reader keeps kinds it does not know as they are).
    kind: str
    node_id: str
    #: The segment; ``None`` for a problem of a whole node (``unavailable``).
    range_id: str | None
    base_offset: int | None
    #: Of ``FILE_NAMES``.
    files: tuple[str, ...]
    detail: str


@attrs.frozen
class VerifyInfo:
    #: The node that ran the check.
    node_id: str
    segments_checked: int
    copies_checked: int
    copies_unchecked: int
    #: Every problem found; ``problems`` lists at most ``MAX_LISTED_PROBLEMS`` of them.
    problem_count: int
    problems: tuple[VerifyProblemInfo, ...]


def _encode_problem(problem: VerifyProblemInfo) -> bytes:
    body = b"".join(
        [
            p.text(problem.kind),
            p.text(problem.node_id),
            p.text(problem.range_id),
            p.u64(problem.base_offset or 0),
            p.u8(sum(1 << FILE_NAMES.index(name) for name in problem.files)),
            p.text(problem.detail),
        ]
    )
    return p.u32(len(body)) + body


def encode_verify(info: VerifyInfo) -> bytes:
    """The ok payload of ``verify_cluster``; past ``MAX_LISTED_PROBLEMS``, problems are left
    out (still counted in ``problem_count``)."""
    listed = info.problems[:MAX_LISTED_PROBLEMS]
    return b"".join(
        [
            p.u8(VERIFY_PAYLOAD_VERSION),
            p.text(info.node_id),
            p.u32(info.segments_checked),
            p.u32(info.copies_checked),
            p.u32(info.copies_unchecked),
            p.u32(info.problem_count),
            p.u32(len(listed)),
            *map(_encode_problem, listed),
        ]
    )


def _required_text(reader: Reader, field: str) -> str:
    value = reader.text()
    if value is None:
        raise Truncated(f"{field} is null")
    return value


def _problem(reader: Reader) -> VerifyProblemInfo:
    body = Reader(reader.raw(reader.u32()))
    kind = _required_text(body, "a problem's kind")
    node_id = _required_text(body, "a problem's node")
    range_id = body.text()
    base_offset = body.u64()
    bits = body.u8()
    if bits >> len(FILE_NAMES):
        raise Truncated(f"file bits {bits:#04x} name files that do not exist")
    files = tuple(name for index, name in enumerate(FILE_NAMES) if bits >> index & 1)
    detail = _required_text(body, "a problem's detail")
    # Fields of a later version follow: skipped (``body`` is this problem alone).
    return VerifyProblemInfo(
        kind, node_id, range_id, None if range_id is None else base_offset, files, detail
    )


def decode_verify(payload: bytes) -> VerifyInfo:
    """Read a ``verify_cluster`` payload of version 1 or later; ``ProtocolViolation`` for
    version 0 or a payload cut short."""
    reader = Reader(payload)
    try:
        version = reader.u8()
        if version < 1:
            raise Truncated(f"verify_cluster payload version {version}; versions start at 1")
        node_id = _required_text(reader, "the answering node")
        checked, copies, unchecked, total = (reader.u32() for _ in range(4))
        count = reader.u32()
        # A problem takes at least its 4-byte length.
        if count * 4 > reader.remaining:
            raise Truncated(f"{count} problems cannot fit in {reader.remaining} bytes")
        problems = tuple(_problem(reader) for _ in range(count))
        if version == VERIFY_PAYLOAD_VERSION:
            reader.end()
    except (Truncated, ValueError) as error:
        raise ProtocolViolation(str(error)) from None
    return VerifyInfo(node_id, checked, copies, unchecked, total, problems)
