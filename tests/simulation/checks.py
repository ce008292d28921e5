"""What the simulation holds the cluster to, checked over every node once the faults stop.

- **One leader per segment epoch**: no two nodes ever began to lead the same (segment, epoch).
- **The replication factor is restored**: within ``HEALING_BOUND`` simulated seconds, with no
  produce to help, every sealed segment that holds records is on at least the factor's number
  of replicas, all alive, each holding it whole and sealed, with the recorded size; every
  node counts 0 under-replicated segments; and no other node still holds any of its bytes.
- **Every sealed file identical**: the log, index, seal and epoch files of a sealed segment are
  byte-identical on every replica.
- **Availability returns**: a clean produce succeeds within ``RECOVERY_BOUND``.
- **Nothing acknowledged is lost, nothing stored twice**: read back through random nodes,
  every acknowledged value is there once, and no value (acknowledged, refused or unanswered,
  each retried with its stamp through other nodes) is there twice.
- **Only committed records are read**: no read, through a range's primary or from its
  copies, goes past the highest commit index a leader of the range had reached; and every
  record a consumer read during the faults is in the final log, at the offset it was read at.
- **Per-key order**: a value acknowledged before another was sent sits at a lower offset.
"""

from __future__ import annotations

from twisted.python.failure import Failure

from logbroker.broker.ranges import RangeRead
from logbroker.controlplane import SegmentMeta, SegmentState
from logbroker.wire.primitives import Reader
from tests.simulation.world import NODES, RANGES, History, World

#: Simulated seconds a clean produce may take once the faults stop (a lease TTL to notice a
#: dead primary, then a takeover), before liveness counts as broken.
RECOVERY_BOUND = 20.0
#: Simulated seconds healing may take once the faults stop, before a copy a replica set names
#: and lacks, or a replica set short of the factor, counts as not restored.
HEALING_BOUND = 20.0
#: The files of a sealed segment, each of which must be identical on every replica.
SEALED_FILES = (".log", ".index", ".sealed", ".epoch")


def check(world: World) -> list[str]:
    """What is wrong after the faults: empty when every guarantee held."""
    problems = list(world.failures)
    problems.extend(one_leader_per_epoch(world.history))
    waited = 0.0
    while replication_problems(world) and waited < HEALING_BOUND:
        world.run(1.0)
        waited += 1.0
    problems.extend(replication_problems(world))
    for range_id in RANGES:
        if clean_produce(world, range_id) is None:
            problems.append(f"{range_id}: no clean produce within {RECOVERY_BOUND} s")
    world.run(3.0)
    for range_id in RANGES:
        values, found = read_back(world, range_id)
        problems.extend(found)
        problems.extend(stored_exactly_once(world.history, range_id, values))
        problems.extend(nothing_read_is_absent(world.history, range_id, values))
        problems.extend(per_key_order(world.history, range_id, values))
    problems.extend(world.history.conflicts)
    problems.extend(world.history.uncommitted_reads[:10])
    return problems


def one_leader_per_epoch(history: History) -> list[str]:
    return [
        f"{range_id}@{segment} had {len(nodes)} leaders at epoch {epoch}: {sorted(nodes)}"
        for (range_id, segment, epoch), nodes in sorted(history.leaders.items())
        if len(nodes) > 1
    ]


def replication_problems(world: World) -> list[str]:
    """Sealed segments short of the factor, not held whole by a member, held by a node that
    should not hold them, or whose files differ between members; and nodes that count any
    segment under-replicated."""
    problems = []
    node = world.live()[0]
    factor = world.settings.replication_factor
    for range_id in RANGES:
        for meta in node.control.segments(range_id):
            if meta.state is SegmentState.SEALED and meta.record_count:
                problems.extend(_sealed_problems(world, meta, factor))
    for live in world.live():
        count = live.replication.health.count
        if count is None:
            problems.append(f"{live.node_id} has not counted under-replicated segments")
        elif count:
            problems.append(f"{live.node_id} counts {count} under-replicated segments")
    return problems


def _sealed_problems(world: World, meta: SegmentMeta, factor: int) -> list[str]:
    where = f"{meta.range_id}@{meta.base_offset}"
    problems = []
    if len(meta.replicas) < factor:
        problems.append(f"{where} is on {len(meta.replicas)} replicas, fewer than {factor}")
    stem = f"/data/ranges/{meta.range_id}/{meta.base_offset:020d}"
    files: dict[str, dict[str, bytes]] = {}
    for node_id in NODES:
        fs = world.nodes[node_id].fs
        if node_id not in meta.replicas:
            if fs.exists(stem + ".log") and fs.read_file(stem + ".log"):
                problems.append(f"{node_id} holds a stale copy of {where}, not in its replica set")
            continue
        if not all(fs.exists(stem + suffix) for suffix in (".log", ".sealed")):
            problems.append(f"{node_id} lacks a sealed copy of {where}")
            continue
        files[node_id] = {
            suffix: fs.read_file(stem + suffix)
            for suffix in SEALED_FILES
            if fs.exists(stem + suffix)
        }
        size = len(files[node_id][".log"])
        if size != meta.byte_size:
            problems.append(
                f"{node_id}'s copy of {where} is {size} bytes, sealed at {meta.byte_size}"
            )
    for suffix in SEALED_FILES:
        versions = {node_id: found.get(suffix) for node_id, found in files.items()}
        if len(set(versions.values())) > 1:
            problems.append(f"{where}: the {suffix} files differ on {sorted(versions)}")
    return problems


def clean_produce(world: World, range_id: str) -> float | None:
    """Simulated seconds until a produce to ``range_id`` succeeds, retrying; ``None`` past the
    bound."""
    started = world.clock.seconds()
    succeeded: list[float] = []
    world.busy_until = started + RECOVERY_BOUND

    def attempt() -> None:
        if succeeded or world.clock.seconds() - started > RECOVERY_BOUND:
            return

        def answered(ok: bool) -> None:
            if ok:
                succeeded.append(world.clock.seconds() - started)
            else:
                world.clock.callLater(0.2, attempt)

        world.produce(range_id, answered)

    attempt()
    while not succeeded and world.clock.seconds() - started <= RECOVERY_BOUND:
        world.run(0.1)
    return succeeded[0] if succeeded else None


def read_back(world: World, range_id: str) -> tuple[list[bytes], list[str]]:
    """Every record of the range, read through random nodes as a consumer would; and what was
    wrong on the way (gaps between reads)."""
    problems: list[str] = []
    values: list[bytes] = []
    offset = 0
    for _ in range(10_000):
        node = world.rng.choice(world.live())
        assert node.parts is not None
        outcome: list[object] = []
        node.parts.ranges.handle(range_id).read(offset, 100, 1 << 20).addBoth(outcome.append)
        world.run(0.5)
        read = outcome[0] if outcome else "no answer"
        if not isinstance(read, RangeRead):
            if len(problems) >= 30:
                problems.append(f"{range_id}: reads keep failing at offset {offset}")
                break
            why = read.getErrorMessage() if isinstance(read, Failure) else read
            problems.append(f"read of {range_id} at {offset} through {node.node_id}: {why}")
            world.run(1.0)
            continue
        if read.count == 0:
            break
        reader = Reader(b"".join(read.data))
        for _ in range(read.count):
            values.append(reader.record().value)
        if read.next_offset - offset != read.count:
            problems.append(
                f"{range_id}: {read.count} records between {offset} and {read.next_offset}"
            )
        offset = read.next_offset
    return values, problems


def stored_exactly_once(history: History, range_id: str, values: list[bytes]) -> list[str]:
    problems = []
    seen: set[bytes] = set()
    for value in values:
        if value in seen:
            problems.append(f"{range_id}: {value!r} is stored twice")
        seen.add(value)
    for produced in history.acked(range_id):
        if produced.value not in seen:
            problems.append(f"{range_id}: acknowledged {produced.value!r} is lost")
    return problems


def nothing_read_is_absent(history: History, range_id: str, values: list[bytes]) -> list[str]:
    return [
        f"{range_id}@{offset}: {value!r} was read during the faults, but the log holds "
        f"{values[offset] if offset < len(values) else 'nothing'!r} there"
        for (read_range, offset), value in sorted(history.read.items())
        if read_range == range_id and (offset >= len(values) or values[offset] != value)
    ]


def per_key_order(history: History, range_id: str, values: list[bytes]) -> list[str]:
    """Every value of a range has the same key: one acknowledged before another was sent must
    come first."""
    produced = {p.value: p for p in history.produced if p.range_id == range_id}
    placed = [produced[value] for value in values if value in produced]
    problems = []
    # The earliest acknowledgement among the values placed after each one.
    earliest_after = float("inf")
    for later in reversed(placed):
        if earliest_after < later.sent_at:
            problems.append(
                f"{range_id}: {later.value!r} was sent after a value placed after it was "
                "acknowledged"
            )
        if later.acked_at is not None:
            earliest_after = min(earliest_after, later.acked_at)
    return problems[:10]
