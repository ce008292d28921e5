"""``logbroker cluster verify``: are the copies of every sealed segment complete and
byte-identical on every node of its replica set, and held nowhere else?

The node asked (the client extension ``verify_cluster``) asks every live node for the digests
of the segment copies it holds (the peer op ``digests``, ``logbroker.cluster.digests``: its own
through the same op), then compares them with the control plane's segments in
``compare_copies``, a pure function:

- For every sealed segment holding records, every member of its replica set must hold a
  sealed copy with its ``.log``, ``.index`` and ``.sealed``, and the copies must agree file by
  file, the ``.epoch`` marker included (all copies hold the same one, or none does).
- Of the copies that disagree on a file, those outside the largest group of identical ones are
  reported as differing; without a largest group (a tie), every copy is.
- A copy held by a node outside the segment's replica set is stale: reported. So is a copy that
  is not active of a segment the control plane does not record at all. An active copy the
  control plane does not record is not (a range's last segment stays on a node, empty, to keep
  the range's end across restarts).
- A node that is dead, or does not answer, is reported once; its copies are not checked.

The check sees every node's files, not only those the replica sets name, so a missing copy and a
stale one are both seen (review of 2026-11-27: a checker that compares only what it expects to
be there cannot see a missing copy). It is a snapshot: a segment sealed, healed or deleted while
the nodes are asked may be reported; run it again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum

import attrs
from twisted.internet import defer
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.interfaces import IReactorTime

from logbroker.cluster.digests import NodeCopy, node_copies
from logbroker.controlplane import ControlPlane, SegmentMeta, SegmentState
from logbroker.peer.frames import PeerCodecError
from logbroker.peer.requester import PeerRequester
from logbroker.peer.window import PeerError
from logbroker.storage import CopyDigests, CopyState, SegmentFile

#: A node that takes longer than this to answer one page of digests is reported as not
#: answering (a page hashes at most 256 MiB).
PAGE_TIMEOUT_SECONDS = 120.0
#: The files every sealed copy must hold; the ``.epoch`` marker must only agree.
REQUIRED_FILES = (SegmentFile.LOG, SegmentFile.INDEX, SegmentFile.SEALED)


class ProblemKind(StrEnum):
    #: A member of the segment's replica set holds no copy of it.
    MISSING_COPY = "missing_copy"
    #: A member's copy lacks files (``files``).
    MISSING_FILES = "missing_files"
    #: A member's copy holds files (``files``) that differ from the other copies'.
    DIFFERS = "differs"
    #: A member's copy is still being appended to, though the segment is sealed.
    UNSEALED = "unsealed"
    #: A node outside the segment's replica set holds a copy.
    STALE_COPY = "stale_copy"
    #: A node that is dead or did not answer: its copies were not checked.
    UNAVAILABLE = "unavailable"


@attrs.frozen
class Problem:
    kind: ProblemKind
    node_id: str
    #: The segment, for every kind but ``unavailable``.
    range_id: str | None = None
    base_offset: int | None = None
    files: tuple[SegmentFile, ...] = ()
    detail: str = ""

    @property
    def order(self) -> tuple[str, int, str, str]:
        return (self.range_id or "", self.base_offset or 0, self.node_id, self.kind.value)


@attrs.frozen
class VerifyReport:
    #: Sealed segments holding records, whose copies were compared.
    segments_checked: int
    #: Copies the replica sets name on the nodes that answered.
    copies_checked: int
    #: Copies the replica sets name on nodes that are dead or did not answer.
    copies_unchecked: int
    #: Node problems first, then by segment and node.
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


#: Stands for "the copies do not agree" where a digest, or ``None`` for no file, would be.
_NO_AGREEMENT = object()


def _compare_files(
    copies: Mapping[str, CopyDigests],
) -> dict[str, dict[ProblemKind, list[SegmentFile]]]:
    """What is wrong with each copy's files, by node: files missing, and files that differ
    from the agreed ones (those of the largest group of identical copies; without one, every
    copy's are reported)."""
    found: dict[str, dict[ProblemKind, list[SegmentFile]]] = {}
    if not copies:
        return found
    for kind in SegmentFile:
        values = {node: copy.digests.get(kind) for node, copy in copies.items()}
        counts = Counter(values.values()).most_common(2)
        agreed = counts[0][0] if len(counts) == 1 or counts[0][1] > counts[1][1] else _NO_AGREEMENT
        for node, value in values.items():
            if value is None and (kind in REQUIRED_FILES or value != agreed):
                found.setdefault(node, {}).setdefault(ProblemKind.MISSING_FILES, []).append(kind)
            elif value is not None and value != agreed:
                found.setdefault(node, {}).setdefault(ProblemKind.DIFFERS, []).append(kind)
    return found


def _segment_problems(
    meta: SegmentMeta, held: Mapping[str, CopyDigests], answered: set[str]
) -> list[Problem]:
    segment = (meta.range_id, meta.base_offset)
    problems = []
    sealed: dict[str, CopyDigests] = {}
    for node in meta.replicas:
        if node not in answered:
            continue
        copy = held.get(node)
        if copy is None:
            problems.append(Problem(ProblemKind.MISSING_COPY, node, *segment))
        elif copy.state is CopyState.ACTIVE:
            problems.append(
                Problem(
                    ProblemKind.UNSEALED,
                    node,
                    *segment,
                    detail="its copy is still active, though the segment is sealed",
                )
            )
        else:
            sealed[node] = copy
    for node, wrong in _compare_files(sealed).items():
        for kind, files in wrong.items():
            others = sorted(set(sealed) - {node})
            detail = (
                "not on disk"
                if kind is ProblemKind.MISSING_FILES
                else f"from the copies on {', '.join(others)}"
            )
            problems.append(Problem(kind, node, *segment, tuple(files), detail))
    for node in sorted(set(held) - set(meta.replicas)):
        problems.append(
            Problem(
                ProblemKind.STALE_COPY,
                node,
                *segment,
                detail=f"not in the replica set {', '.join(meta.replicas)}",
            )
        )
    return problems


def compare_copies(
    segments: Iterable[SegmentMeta],
    copies: Mapping[str, Sequence[NodeCopy]],
    unavailable: Mapping[str, str],
) -> VerifyReport:
    """Check the copies each node that answered holds (``copies``, by node) against the control
    plane's ``segments`` (see the module docstring); ``unavailable`` gives why each other node
    that matters was not checked."""
    held: dict[tuple[str, int], dict[str, CopyDigests]] = {}
    for node, node_held in copies.items():
        for item in node_held:
            held.setdefault((item.range_id, item.copy.base_offset), {})[node] = item.copy
    answered = set(copies)
    problems = [
        Problem(ProblemKind.UNAVAILABLE, node, detail=why)
        for node, why in sorted(unavailable.items())
    ]
    recorded: set[tuple[str, int]] = set()
    checked = copies_checked = copies_unchecked = 0
    segment_problems: list[Problem] = []
    for meta in segments:
        key = (meta.range_id, meta.base_offset)
        recorded.add(key)
        if meta.state is not SegmentState.SEALED or not meta.record_count:
            continue
        checked += 1
        copies_checked += sum(1 for node in meta.replicas if node in answered)
        copies_unchecked += sum(1 for node in meta.replicas if node not in answered)
        segment_problems.extend(_segment_problems(meta, held.get(key, {}), answered))
    for key in sorted(set(held) - recorded):
        for node, copy in sorted(held[key].items()):
            if copy.state is not CopyState.ACTIVE:
                segment_problems.append(
                    Problem(
                        ProblemKind.STALE_COPY,
                        node,
                        *key,
                        detail="the control plane records no segment there",
                    )
                )
    segment_problems.sort(key=lambda problem: problem.order)
    return VerifyReport(checked, copies_checked, copies_unchecked, (*problems, *segment_problems))


def recorded_segments(control: ControlPlane) -> list[SegmentMeta]:
    """Every segment the control plane records, of every range of every topic."""
    return [
        meta
        for topic in control.topics()
        for range_ in control.ranges(topic.name)
        for meta in control.segments(range_.range_id)
    ]


class ClusterVerifier:
    """Runs the check from node ``node_id``: ``segments()`` lists every segment the control
    plane records (``recorded_segments``), ``nodes()`` every node the cluster knows, each with
    whether it is alive; ``requester`` reaches each live one (this one through a loopback)."""

    def __init__(
        self,
        node_id: str,
        segments: Callable[[], list[SegmentMeta]],
        nodes: Callable[[], Iterable[tuple[str, bool]]],
        requester: PeerRequester,
        clock: IReactorTime,
        page_timeout: float = PAGE_TIMEOUT_SECONDS,
    ) -> None:
        #: The node running the check.
        self.node_id = node_id
        self._segments = segments
        self._nodes = nodes
        self._requester = requester
        self._clock = clock
        self._page_timeout = page_timeout

    def verify(self) -> Deferred[VerifyReport]:
        return Deferred.fromCoroutine(self._verify())

    async def _verify(self) -> VerifyReport:
        # The segments first: one sealed while the nodes answer is then not checked, rather
        # than reported for the copies still active when their nodes were asked.
        segments = self._segments()
        known = dict(self._nodes())
        live = sorted(node for node, alive in known.items() if alive)
        answers = await gatherResults([Deferred.fromCoroutine(self._ask(node)) for node in live])
        copies: dict[str, Sequence[NodeCopy]] = {}
        unavailable = {
            node: "dead: its membership lease is gone" for node, alive in known.items() if not alive
        }
        for node, answer in zip(live, answers, strict=True):
            if isinstance(answer, str):
                unavailable[node] = answer
            else:
                copies[node] = answer
        named = {node for meta in segments for node in meta.replicas}
        for node in sorted(named - set(known)):
            unavailable[node] = "named in replica sets, but not a known member"
        return compare_copies(segments, copies, unavailable)

    async def _ask(self, node: str) -> list[NodeCopy] | str:
        """The copies ``node`` holds, or why it did not answer."""
        try:
            return await node_copies(self._requester, node, self._clock, self._page_timeout)
        except PeerError as error:
            return f"did not answer: {error}"
        except PeerCodecError as error:
            return f"answered what this node cannot read: {error}"
        except defer.TimeoutError:
            return f"did not answer a page of digests within {self._page_timeout:g} s"
