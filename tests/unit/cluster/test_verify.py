"""``logbroker cluster verify``'s check (``logbroker.cluster.verify``): the comparison of every
node's copies with the control plane's sealed segments, a pure function, and the verifier
asking every live node through the ``digests`` op."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock

from logbroker.cluster.digests import DigestServer, NodeCopy
from logbroker.cluster.verify import ClusterVerifier, Problem, ProblemKind, compare_copies
from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.peer.frames import PeerOp, PeerReason
from logbroker.peer.window import PeerError
from logbroker.records import Record
from logbroker.storage import CopyDigests, CopyState, LogConfig, SegmentFile
from logbroker.storage._format import encode_batch
from tests.unit.storage.helpers import MemoryLogs, result_of

LOG, INDEX, SEALED, EPOCH = SegmentFile
NODES = ("n1", "n2", "n3")


def sealed(
    base: int = 0, replicas: tuple[str, ...] = NODES, range_id: str = "t-0", records: int = 5
) -> SegmentMeta:
    return SegmentMeta(range_id, base, SegmentState.SEALED, records, 300, replicas, 2)


def copy(
    base: int = 0,
    state: CopyState = CopyState.SEALED,
    range_id: str = "t-0",
    **changed: bytes | None,
) -> NodeCopy:
    """A copy whose files hold their names, unless ``changed`` (None: the file is missing)."""
    files = {kind: kind.value.encode() * 4 for kind in SegmentFile}
    for name, value in changed.items():
        files[SegmentFile(name)] = value  # type: ignore[assignment]
    digests = {kind: value for kind, value in files.items() if value is not None}
    if state is CopyState.ACTIVE:
        digests = {}
    return NodeCopy(range_id, CopyDigests(base, state, digests))


def check(
    segments: Sequence[SegmentMeta],
    copies: Mapping[str, Sequence[NodeCopy]],
    unavailable: Mapping[str, str] | None = None,
) -> list[tuple[ProblemKind, str, tuple[SegmentFile, ...]]]:
    report = compare_copies(segments, copies, unavailable or {})
    return [(p.kind, p.node_id, p.files) for p in report.problems]


def test_identical_complete_copies_on_every_member_are_no_problem() -> None:
    report = compare_copies(
        [sealed(0), sealed(5)], {node: [copy(0), copy(5)] for node in NODES}, {}
    )

    assert report.ok
    assert (report.segments_checked, report.copies_checked, report.copies_unchecked) == (2, 6, 0)


def test_a_member_without_a_copy_is_reported() -> None:
    found = check([sealed()], {"n1": [copy()], "n2": [copy()], "n3": []})

    assert found == [(ProblemKind.MISSING_COPY, "n3", ())]


def test_a_copy_missing_a_file_is_reported_with_the_file() -> None:
    found = check([sealed()], {"n1": [copy()], "n2": [copy(index=None)], "n3": [copy()]})

    assert found == [(ProblemKind.MISSING_FILES, "n2", (INDEX,))]


def test_the_copy_that_differs_from_the_others_is_named_with_its_files() -> None:
    found = check(
        [sealed()],
        {"n1": [copy()], "n2": [copy()], "n3": [copy(index=b"rotten", sealed=b"other")]},
    )

    assert found == [(ProblemKind.DIFFERS, "n3", (INDEX, SEALED))]


def test_without_a_majority_every_differing_copy_is_named() -> None:
    found = check(
        [sealed(replicas=("n1", "n2"))], {"n1": [copy(log=b"one")], "n2": [copy(log=b"two")]}
    )

    assert found == [(ProblemKind.DIFFERS, "n1", (LOG,)), (ProblemKind.DIFFERS, "n2", (LOG,))]


def test_an_epoch_marker_must_agree_but_may_be_absent_everywhere() -> None:
    none = {node: [copy(epoch=None)] for node in NODES}
    one_lacks = {"n1": [copy()], "n2": [copy()], "n3": [copy(epoch=None)]}
    one_has = {"n1": [copy(epoch=None)], "n2": [copy(epoch=None)], "n3": [copy()]}

    assert check([sealed()], none) == []
    assert check([sealed()], one_lacks) == [(ProblemKind.MISSING_FILES, "n3", (EPOCH,))]
    assert check([sealed()], one_has) == [(ProblemKind.DIFFERS, "n3", (EPOCH,))]


def test_required_files_missing_everywhere_are_reported_everywhere() -> None:
    found = check([sealed()], {node: [copy(sealed=None)] for node in NODES})

    assert found == [(ProblemKind.MISSING_FILES, node, (SEALED,)) for node in NODES]


def test_a_member_whose_copy_is_still_active_is_reported_unsealed() -> None:
    found = check(
        [sealed()], {"n1": [copy()], "n2": [copy()], "n3": [copy(state=CopyState.ACTIVE)]}
    )

    assert found == [(ProblemKind.UNSEALED, "n3", ())]


def test_a_closed_copy_without_its_marker_is_missing_it() -> None:
    found = check(
        [sealed()],
        {"n1": [copy()], "n2": [copy()], "n3": [copy(state=CopyState.CLOSED, sealed=None)]},
    )

    assert found == [(ProblemKind.MISSING_FILES, "n3", (SEALED,))]


def test_copies_outside_the_replica_set_are_stale() -> None:
    found = check(
        [sealed(replicas=("n1", "n2"))],
        {"n1": [copy()], "n2": [copy()], "n3": [copy(state=CopyState.ACTIVE)]},
    )

    assert found == [(ProblemKind.STALE_COPY, "n3", ())]


def test_a_sealed_or_closed_copy_of_an_unrecorded_segment_is_stale_an_active_one_is_not() -> None:
    found = check(
        [sealed(0)],
        {
            "n1": [copy(0), copy(5, CopyState.ACTIVE)],
            "n2": [copy(0), copy(5, CopyState.CLOSED)],
            "n3": [copy(0), copy(0, range_id="gone-0")],
        },
    )

    assert found == [(ProblemKind.STALE_COPY, "n3", ()), (ProblemKind.STALE_COPY, "n2", ())]


def test_only_sealed_segments_with_records_are_checked() -> None:
    active = SegmentMeta("t-0", 5, SegmentState.ACTIVE, None, None, NODES, 2)

    report = compare_copies(
        [sealed(0, records=0), active], {node: [copy(5, CopyState.ACTIVE)] for node in NODES}, {}
    )

    assert report.ok
    assert report.segments_checked == 0


def test_a_node_not_checked_is_reported_once_and_its_copies_are_not_counted() -> None:
    report = compare_copies(
        [sealed(0), sealed(5)],
        {"n1": [copy(0), copy(5)], "n2": [copy(0), copy(5)]},
        {"n3": "dead: its membership lease is gone"},
    )

    assert report.problems == (
        Problem(ProblemKind.UNAVAILABLE, "n3", detail="dead: its membership lease is gone"),
    )
    assert (report.copies_checked, report.copies_unchecked) == (4, 2)


# -- the verifier, over real range logs ----------------------------------------------------


class Peers:
    """Each node's ``digests`` op, served from its own logs; ``silent`` nodes fail."""

    def __init__(self, storages: Mapping[str, MemoryLogs], silent: set[str]) -> None:
        self._servers = {node: DigestServer(storage) for node, storage in storages.items()}
        self._silent = silent

    def request(self, node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        assert op is PeerOp.DIGESTS
        if node_id in self._silent:
            return fail(PeerError(PeerReason.UNREACHABLE, f"node {node_id!r}: no link"))
        return self._servers[node_id].serve(payload)


def batches(count: int) -> list[bytes]:
    """The batches a primary wrote: one of two records of about 300 bytes per pair."""
    return [
        encode_batch(n, [Record(b"r" * 300, timestamp_ms=100 - n), Record(b"s" * 300)])
        for n in range(0, count, 2)
    ]


def replica_copies(storage: MemoryLogs, chunks: Sequence[Sequence[bytes]]) -> None:
    """The copy of segment t-0@0, sealed at epoch 2, taking the batches of ``chunks`` from its
    primary, a chunk per replicated append."""
    log = result_of(storage.open_range("t-0"))
    result_of(log.start_segment(0, 2))
    for chunk in chunks:
        result_of(log.append_raw(log.next_offset, b"".join(chunk), epoch=2))
    result_of(log.seal_copy(0, log.next_offset, log.active_bytes, epoch=2))


def test_the_verifier_asks_every_live_node_and_finds_the_copy_that_differs() -> None:
    config = LogConfig(replicated=True, auto_roll=False)
    storages = {node: MemoryLogs(config=config) for node in ("n1", "n2", "n3", "n4")}
    written = batches(40)
    for node in ("n1", "n2", "n3"):
        replica_copies(storages[node], [written[:10], written[10:]])
    storages["n3"].fs.corrupt("/data/ranges/t-0/00000000000000000000.index", 30)
    meta = sealed(records=40)
    verifier = ClusterVerifier(
        "n1",
        lambda: [meta],
        lambda: [("n1", True), ("n2", True), ("n3", True), ("n4", True), ("n5", False)],
        Peers(storages, silent={"n4"}),
        Clock(),
    )

    report = result_of(verifier.verify())

    assert [(p.kind, p.node_id, p.files) for p in report.problems] == [
        (ProblemKind.UNAVAILABLE, "n4", ()),
        (ProblemKind.UNAVAILABLE, "n5", ()),
        (ProblemKind.DIFFERS, "n3", (INDEX,)),
    ]
    assert "unreachable" in report.problems[0].detail
    assert report.problems[2].detail == "from the copies on n1, n2"
    assert (report.segments_checked, report.copies_checked) == (1, 3)


def test_copies_sealed_from_differently_chunked_appends_verify_identical() -> None:
    # The negative control of the test above: three copies of the same batches, replicated in
    # different chunks, sealed on their own: nothing to report.
    config = LogConfig(replicated=True, auto_roll=False)
    storages = {node: MemoryLogs(config=config) for node in NODES}
    written = batches(30)
    replica_copies(storages["n1"], [written])
    replica_copies(storages["n2"], [written[:4], written[4:11], written[11:]])
    replica_copies(storages["n3"], [[batch] for batch in written])
    verifier = ClusterVerifier(
        "n2",
        lambda: [sealed(records=30)],
        lambda: [(node, True) for node in NODES],
        Peers(storages, silent=set()),
        Clock(),
    )

    report = result_of(verifier.verify())

    assert report.problems == ()
    assert report.copies_checked == 3
