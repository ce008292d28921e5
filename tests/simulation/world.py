"""A simulated 3-node cluster running the real replication, failover and catch-up code.

Each node is what ``logbroker.cluster.assembly`` assembles for a running broker, over simulated
parts (``fabric``): an in-memory file system that a crash cuts back to what was fsynced, a disk
that takes time, an etcd double reached with delays, the real ``EtcdControlPlane`` and
``Membership`` on it, and a lossy network. Clients produce unique values through random nodes
while faults come and go; then the faults stop, crashed nodes restart, and the checker reads
everything back.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from logbroker.broker.ranges import RangeRead
from logbroker.cluster.assembly import RangeParts, assemble_ranges
from logbroker.cluster.digests import NodeCopy
from logbroker.cluster.membership import Membership, NodeRecord
from logbroker.cluster.verify import ProblemKind, compare_copies
from logbroker.config import SpreadPolicy
from logbroker.controlplane import EtcdControlPlane, Range, RangeState, SegmentState, Topic
from logbroker.controlplane._memory_kv import MemoryKeyValueStore
from logbroker.maintenance.periodic import PeriodicTask
from logbroker.placement import PlacementNode, PlacementRule
from logbroker.records import ProducerStamp, Record
from logbroker.replication.primary import ReplicationSettings
from logbroker.storage import DataDirectory, LogConfig, RangeLog
from logbroker.storage._digests import CopyFiles, digest_copies
from logbroker.testing import MemoryFileSystem
from logbroker.wire.primitives import Reader
from tests.simulation.fabric import EtcdLink, Network, NodeClock, SimClock, SlowDisk

NODES = ("n1", "n2", "n3")
TOPIC = "sim"
RANGES = ("sim.0", "sim.1")
PREFIX = "/logbroker/sim/"
LEASE_MS = 2000
ROLL_BYTES = 2048
#: Simulated seconds a clean produce may take once the faults stop (a lease TTL to notice a
#: dead primary, then a takeover), before liveness counts as broken.
RECOVERY_BOUND = 20.0
#: A replica dead this long is replaced (``SVC_REPLICA_REPLACE_AFTER_MS``): short, so that runs
#: replace some.
REPLACE_AFTER = 5.0
#: Simulated seconds healing may take once the faults stop, before a copy a replica set names
#: and lacks counts as not restored.
HEALING_BOUND = 15.0


class _Storage:
    """``OpenLogs`` for one node incarnation."""

    def __init__(self, fs: MemoryFileSystem, clock: NodeClock, rng: random.Random) -> None:
        self._data = DataDirectory.open("/data", fs)
        self._fs = fs
        self._clock = clock
        self._disk = SlowDisk(clock, rng)
        self._reader = SlowDisk(clock, rng, slowest=0.001)
        self._config = LogConfig(roll_bytes=ROLL_BYTES, replicated=True, auto_roll=False)
        self.logs: dict[str, RangeLog] = {
            name: RangeLog.recover(self._data.range_path(name), **self._arguments())
            for name in self._data.range_names()
        }

    def _arguments(self) -> dict[str, Any]:
        return {
            "fs": self._fs,
            "clock": self._clock,
            "executor": self._disk,
            "reader": self._reader,
            "config": self._config,
        }

    def open_range(self, name: str) -> Deferred[RangeLog]:
        def opened(range_log: RangeLog) -> RangeLog:
            self.logs[name] = range_log
            return range_log

        return RangeLog.open(self._data.range_path(name), **self._arguments()).addCallback(opened)


class SimNode:
    """One node: its disk survives crashes, everything else is one incarnation."""

    def __init__(self, world: World, node_id: str) -> None:
        self.world = world
        self.node_id = node_id
        self.fs = MemoryFileSystem()
        self.up = False
        self.ready = False
        self.clock = NodeClock(world.clock)
        self.parts: RangeParts | None = None

    def start(self) -> None:
        world = self.world
        self.clock = clock = NodeClock(world.clock)
        self.link = link = EtcdLink(world.etcd, clock, world.rng)
        self.storage = _Storage(self.fs, clock, world.rng)
        self.control = control = EtcdControlPlane(link, prefix=PREFIX + "state/", clock=clock)
        record = NodeRecord(self.node_id, "sim", 1, 2, 3, {}, "sim")
        self.membership = membership = Membership(
            link, (PREFIX + "cluster/").encode(), record, clock, LEASE_MS
        )

        def live_nodes() -> list[PlacementNode]:
            return [PlacementNode(r.node_id, r.attributes, True) for r in membership.live_nodes()]

        self.parts = parts = assemble_ranges(
            node_id=self.node_id,
            control=control,
            storage=self.storage,
            peers=world.network.requester(self.node_id, clock),
            clock=clock,
            rule=world.rule,
            live_nodes=live_nodes,
            holds_lease=lambda: membership.holds_lease,
            replication=world.settings,
            roll_bytes=ROLL_BYTES,
            is_live=membership.is_alive,
            holds_chores=lambda: membership.holds_chores,
            replace_after_seconds=REPLACE_AFTER,
        )
        world.network.attach(self.node_id, clock, parts.serve)
        self.up = True
        self.ready = False
        lead, healer = parts.lead, parts.healer
        assert lead is not None
        assert healer is not None
        self.chores = [
            PeriodicTask("sweep", 0.5, lambda: lead.sweep(RANGES), clock, now=False),
            PeriodicTask("healing", 0.5, lambda: healer.tick(RANGES), clock, now=False),
        ]

        def started(_: object) -> Deferred[None]:
            membership.startService()  # type: ignore[no-untyped-call]
            return membership.registered()

        def registered(_: object) -> None:
            self.ready = True
            for chore in self.chores:
                chore.startService()  # type: ignore[no-untyped-call]

        control.start().addCallback(started).addCallbacks(registered, self.world.note_failure)

    def crash(self) -> None:
        """A power cut: the process is gone, the disk keeps what was fsynced and maybe more."""
        self.up = self.ready = False
        self.clock.kill()
        self.link.kill()
        rng = self.world.rng
        self.fs = self.fs.crash(keep=lambda path, unsynced: rng.randint(0, unsynced))
        self.parts = None


@attrs.define
class History:
    #: Values acknowledged, by range.
    acked: dict[str, list[bytes]] = attrs.field(factory=dict)
    #: Values whose produce failed or was never answered: they may or may not be stored.
    uncertain: set[bytes] = attrs.field(factory=set)
    #: Why produces failed, for reading a failing seed.
    errors: list[str] = attrs.field(factory=list)
    attempts: int = 0


class World:
    def __init__(self, seed: int, *, settings: ReplicationSettings | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.clock = SimClock()
        self.etcd = MemoryKeyValueStore(self.clock)
        self.network = Network(self.clock, self.rng)
        self.settings = settings or ReplicationSettings(
            replication_factor=3,
            window_bytes=4096,
            max_message_bytes=1024,
            backlog_bytes=3000,
            ack_timeout_seconds=3.0,
        )
        self.rule = PlacementRule(3, None, 1, SpreadPolicy.SOFT)
        self.nodes = {node_id: SimNode(self, node_id) for node_id in NODES}
        self.history = History()
        self.failures: list[str] = []
        self._sequence = 0

    # -- running -----------------------------------------------------------------------------

    def run(self, seconds: float) -> None:
        """Advance the simulated time by ``seconds``, running every call due on the way."""
        self.clock.advance(seconds)

    def note_failure(self, failure: Failure) -> None:
        self.failures.append(failure.getTraceback())

    def boot(self) -> None:
        for node in self.nodes.values():
            node.start()
        self.run(1.0)
        first = self.nodes["n1"]
        ranges = [
            Range(range_id, TOPIC, index * 128, (index + 1) * 128, RangeState.ACTIVE)
            for index, range_id in enumerate(RANGES)
        ]
        topic = Topic(TOPIC, 8, 0, RANGES)
        created = first.control.create_topic(topic, ranges)
        assert first.parts is not None
        parts = first.parts
        created.addCallback(lambda _: parts.ranges.open(list(RANGES)))
        created.addErrback(self.note_failure)
        self.run(2.0)

    # -- the workload ------------------------------------------------------------------------

    def live(self) -> list[SimNode]:
        return [node for node in self.nodes.values() if node.ready and node.parts is not None]

    def produce(self, range_id: str, on_done: Callable[[bool], None] | None = None) -> None:
        """One produce of a fresh value through a random live node."""
        nodes = self.live()
        if not nodes:
            return
        node = self.rng.choice(nodes)
        assert node.parts is not None
        self._sequence += 1
        value = f"{range_id}/{self._sequence}".encode()
        self.history.attempts += 1
        answered = {"done": False}

        def acked(_: object) -> None:
            if not answered["done"]:
                answered["done"] = True
                self.history.acked.setdefault(range_id, []).append(value)
                if on_done is not None:
                    on_done(True)

        def failed(why: object) -> None:
            if not answered["done"]:
                answered["done"] = True
                self.history.uncertain.add(value)
                reason = why.getErrorMessage() if isinstance(why, Failure) else "no answer"
                self.history.errors.append(f"{node.node_id} {range_id}: {reason}")
                if on_done is not None:
                    on_done(False)

        try:
            handle = node.parts.ranges.handle(range_id)
            # Stamped, as the clients send produces: a request the network delivers twice is
            # stored once.
            record = Record(key=range_id.encode(), value=value, timestamp_ms=0)
            stamp = ProducerStamp(self._sequence, 0)
            handle.append([record], stamp).addCallbacks(acked, failed)
        except Exception:
            failed(Failure())
            return
        # A node that dies never answers: the client gives up on its own clock.
        self.clock.callLater(10.0, failed, None)

    def workload(self, seconds: float, rate: float) -> None:
        """Produces at about ``rate`` per simulated second for ``seconds``."""
        at = 0.0
        while at < seconds:
            at += self.rng.expovariate(rate)
            self.clock.callLater(at, self.produce, self.rng.choice(RANGES))

    # -- faults ------------------------------------------------------------------------------

    def faults(self, seconds: float) -> None:
        """Schedule random faults over the next ``seconds``: crashes and restarts, partitions,
        a lossy, duplicating network."""
        at = 0.0
        while True:
            at += self.rng.uniform(1.0, 4.0)
            if at >= seconds:
                break
            kind = self.rng.choice(("crash", "crash", "partition", "lossy", "heal"))
            node = self.rng.choice(NODES)
            self.clock.callLater(at, self._fault, kind, node)

    def _fault(self, kind: str, node_id: str) -> None:
        node = self.nodes[node_id]
        if kind == "crash":
            if node.up and sum(n.up for n in self.nodes.values()) > 1:
                node.crash()
                self.clock.callLater(self.rng.uniform(0.5, 6.0), self._restart, node_id)
        elif kind == "partition":
            other = self.rng.choice([n for n in NODES if n != node_id])
            self.network.cut(node_id, other)
        elif kind == "lossy":
            self.network.loss = self.rng.uniform(0.0, 0.2)
            self.network.duplication = self.rng.uniform(0.0, 0.2)
        else:
            self.network.heal()
            self.network.calm()

    def _restart(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if not node.up:
            node.start()

    def calm(self) -> None:
        """Every fault ends: the network heals and every node is up."""
        self.network.heal()
        self.network.calm()
        for node in self.nodes.values():
            if not node.up:
                node.start()

    # -- checking ----------------------------------------------------------------------------

    def clean_produce(self, range_id: str) -> float | None:
        """Simulated seconds until a produce to ``range_id`` succeeds, retrying; ``None`` past
        the bound."""
        started = self.clock.seconds()
        succeeded: list[float] = []

        def attempt() -> None:
            if succeeded or self.clock.seconds() - started > RECOVERY_BOUND:
                return

            def answered(ok: bool) -> None:
                if ok:
                    succeeded.append(self.clock.seconds() - started)
                else:
                    self.clock.callLater(0.2, attempt)

            self.produce(range_id, answered)

        attempt()
        while not succeeded and self.clock.seconds() - started <= RECOVERY_BOUND:
            self.run(0.1)
        return succeeded[0] if succeeded else None

    def read_back(self, range_id: str) -> tuple[list[bytes], list[str]]:
        """Every record of the range, read through a node as a consumer would; and what was
        wrong on the way (gaps between reads)."""
        problems: list[str] = []
        values: list[bytes] = []
        offset = 0
        for _ in range(10_000):
            node = self.rng.choice(self.live())
            assert node.parts is not None
            outcome: list[object] = []
            node.parts.ranges.handle(range_id).read(offset, 100, 1 << 20).addBoth(outcome.append)
            self.run(0.5)
            read = outcome[0] if outcome else "no answer"
            if not isinstance(read, RangeRead):
                if len(problems) >= 30:
                    problems.append(f"{range_id}: reads keep failing at offset {offset}")
                    break
                why = read.getErrorMessage() if isinstance(read, Failure) else read
                problems.append(f"read of {range_id} at {offset} through {node.node_id}: {why}")
                self.run(1.0)
                continue
            if read.count == 0:
                break
            data = b"".join(read.data)
            reader = Reader(data)
            for _ in range(read.count):
                values.append(reader.record().value)
            if read.next_offset - offset < read.count:
                problems.append(
                    f"{range_id}: {read.count} records between {offset} and {read.next_offset}"
                )
            offset = read.next_offset
        return values, problems

    def sealed_copies(self) -> list[str]:
        """Sealed segments whose copies are not complete and byte-identical, every file of them,
        on every member of their replica set (``compare_copies``, the check ``logbroker cluster
        verify`` runs, over every live node's files); or whose copies' size is not the one
        recorded."""
        live = self.live()
        metas = [meta for range_id in RANGES for meta in live[0].control.segments(range_id)]
        report = compare_copies(metas, {node.node_id: _copies(node) for node in live}, {})
        # Not judged here: healing does not remove the copy a node keeps of a segment whose
        # replica set it was dropped from (replaced while dead, say); it is never read.
        problems = [
            f"{p.range_id}@{p.base_offset} on {p.node_id}: {p.kind.value}"
            f" {' '.join(kind.suffix for kind in p.files)} {p.detail}"
            for p in report.problems
            if p.kind is not ProblemKind.STALE_COPY
        ]
        for meta in metas:
            if meta.state is not SegmentState.SEALED or not meta.record_count:
                continue
            path = f"/data/ranges/{meta.range_id}/{meta.base_offset:020d}.log"
            sizes = {
                node.node_id: node.fs.size(path)
                for node in live
                if node.node_id in meta.replicas and node.fs.exists(path)
            }
            if any(size != meta.byte_size for size in sizes.values()):
                problems.append(
                    f"{meta.range_id}@{meta.base_offset}: sizes {sizes}, sealed at {meta.byte_size}"
                )
        return problems

    def check(self) -> list[str]:
        """What is wrong after the faults: empty when every guarantee held."""
        problems = list(self.failures)
        # Healing restores every copy the replica sets name, within a bound, with no produce
        # to help it along (a returning node must heal an idle range too).
        waited = 0.0
        while self.sealed_copies() and waited < HEALING_BOUND:
            self.run(1.0)
            waited += 1.0
        problems.extend(self.sealed_copies())
        for range_id in RANGES:
            took = self.clean_produce(range_id)
            if took is None:
                problems.append(
                    f"{range_id}: no clean produce within {RECOVERY_BOUND} s after the faults"
                )
        self.run(3.0)
        for range_id in RANGES:
            values, found = self.read_back(range_id)
            problems.extend(found)
            seen: set[bytes] = set()
            for value in values:
                if value in seen:
                    problems.append(f"{range_id}: {value!r} is stored twice")
                seen.add(value)
            for value in self.history.acked.get(range_id, []):
                if value not in seen:
                    problems.append(f"{range_id}: acknowledged {value!r} is lost")
        return problems

    def segments(self, range_id: str) -> list[Any]:
        node = self.live()[0]
        return [
            (m.base_offset, m.state is SegmentState.SEALED, m.replicas, m.epoch)
            for m in node.control.segments(range_id)
        ]


def _copies(node: SimNode) -> list[NodeCopy]:
    """The segment copies a node holds, with the digests of their files as its disk has them."""
    found = []
    for range_id, log in sorted(node.storage.logs.items()):
        files = [
            CopyFiles(
                info.base_offset, info.state, f"/data/ranges/{range_id}/{info.base_offset:020d}"
            )
            for info in log.segments()
        ]
        digests, _ = digest_copies(node.fs, files, 2**62, 2**31)
        found.extend(NodeCopy(range_id, copy) for copy in digests)
    return found


def simulate(seed: int, *, settings: ReplicationSettings | None = None) -> list[str]:
    """One seeded run: boot, load with faults, calm, check. The problems found."""
    world = World(seed, settings=settings)
    world.boot()
    world.workload(20.0, rate=15.0)
    world.faults(20.0)
    world.run(20.0)
    world.calm()
    world.run(5.0)
    return world.check()
