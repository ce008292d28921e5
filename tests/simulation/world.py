"""A simulated 3-node cluster running the real replication, failover and catch-up code.

Each node is what ``logbroker.cluster.assembly`` assembles for a running broker, over simulated
parts (``fabric``): an in-memory file system that a crash cuts back to what was fsynced, a disk
that takes time, an etcd double reached with delays (the real ``EtcdControlPlane`` and
``Membership`` on it), and a lossy network. Producers send unique values through random nodes,
each stamped, and retry the same stamp through other nodes when a try fails; consumers read
the ranges through random nodes as they go; meanwhile nodes crash and restart, stall and resume
with their queued work, are cut from each other or from etcd, etcd fails requests, loses
answers and compacts its history. Then the faults stop, every node comes back, and the
checker (``checks``) holds the cluster to its guarantees, on every node.
"""

from __future__ import annotations

import gc
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.python.failure import Failure

from logbroker.broker.ranges import RangeRead
from logbroker.cluster.assembly import RangeParts, Replication, assemble_ranges
from logbroker.cluster.membership import Membership, NodeRecord
from logbroker.config import SpreadPolicy
from logbroker.controlplane import EtcdControlPlane, Range, RangeState, Topic
from logbroker.controlplane._memory_kv import MemoryKeyValueStore
from logbroker.maintenance.periodic import PeriodicTask
from logbroker.placement import PlacementNode, PlacementRule
from logbroker.records import ProducerStamp, Record
from logbroker.replication.core.actions import ReplicationSettings
from logbroker.storage import DataDirectory, LogConfig, OpenOnce, RangeLog, SharedFlush
from logbroker.testing import MemoryFileSystem
from logbroker.wire.primitives import Reader
from tests.simulation.fabric import (
    EtcdFaults,
    EtcdLink,
    Network,
    NodeClock,
    SimClock,
    SlowDisk,
)

NODES = ("n1", "n2", "n3")
TOPIC = "sim"
RANGES = ("sim.0", "sim.1")
PREFIX = "/logbroker/sim/"
LEASE_MS = 2000
ROLL_BYTES = 2048
#: A replica dead this long is replaced (``SVC_REPLICA_REPLACE_AFTER_MS``): short, so that runs
#: replace some.
REPLACE_AFTER = 5.0
#: How often a producer tries a value (the first try and its retries through other nodes).
TRIES = 6
#: How long a client waits for an answer before it counts the try as failed.
CLIENT_TIMEOUT = 10.0
#: The faults a run draws from (see ``World._fault``).
FAULTS = (
    "crash",
    "crash",
    "stall",
    "partition",
    "etcd_cut",
    "etcd_flaky",
    "compaction",
    "lossy",
    "slow",
    "clock_step",
    "stale_leader",
    "lease_flap",
    "heal",
)


class _Storage:
    """``OpenLogs`` for one node incarnation."""

    def __init__(self, fs: MemoryFileSystem, clock: NodeClock, rng: random.Random) -> None:
        self._data = DataDirectory.open("/data", fs)
        self._fs = fs
        self._clock = clock
        self._disk = SlowDisk(clock, rng)
        self._reader = SlowDisk(clock, rng, slowest=0.001)
        # As on a broker (SVC_FSYNC_SCOPE=filesystem): appends, markers and sidecars are made
        # durable by shared flush rounds, on a disk queue of their own.
        self._flush = SharedFlush(fs, SlowDisk(clock, rng), clock)
        self._config = LogConfig(roll_bytes=ROLL_BYTES, replicated=True, auto_roll=False)
        self.logs: dict[str, RangeLog] = {
            name: RangeLog.recover(self._data.range_path(name), **self._arguments())
            for name in self._data.range_names()
        }
        self._opener = OpenOnce(self.logs, self._open)

    def _arguments(self) -> dict[str, Any]:
        return {
            "fs": self._fs,
            "clock": self._clock,
            "executor": self._disk,
            "reader": self._reader,
            "config": self._config,
            "shared_flush": self._flush,
        }

    def open_range(self, name: str) -> Deferred[RangeLog]:
        return self._opener.open_range(name)

    def _open(self, name: str) -> Deferred[RangeLog]:
        return RangeLog.open(self._data.range_path(name), **self._arguments())


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

    @property
    def replication(self) -> Replication:
        assert self.parts is not None
        assert self.parts.replication is not None
        return self.parts.replication

    def start(self) -> None:
        world = self.world
        self.clock = clock = NodeClock(world.clock)
        self.link = link = EtcdLink(world.etcd, clock, world.rng, world.etcd_faults)
        self.storage = _Storage(self.fs, clock, world.rng)
        self.control = control = EtcdControlPlane(link, prefix=PREFIX + "state/", clock=clock)
        record = NodeRecord(self.node_id, "sim", 1, 2, 3, {}, "sim")
        self.membership = membership = Membership(
            link, (PREFIX + "cluster/").encode(), record, clock, LEASE_MS
        )

        def live_nodes() -> list[PlacementNode]:
            return [PlacementNode(r.node_id, r.attributes, True) for r in membership.live_nodes()]

        peers = world.network.requester(self.node_id, clock)
        self.parts = parts = assemble_ranges(
            node_id=self.node_id,
            control=control,
            storage=self.storage,
            peers=peers,
            clock=clock,
            rule=world.rule,
            live_nodes=live_nodes,
            holds_lease=lambda: membership.holds_lease,
            replication=world.settings,
            roll_bytes=ROLL_BYTES,
            is_live=membership.is_alive,
            repair_metrics=world,
            holds_chores=lambda: membership.holds_chores,
            replace_after_seconds=REPLACE_AFTER,
            heard_at=peers.heard_at,
            control_follows=lambda: control.following,
            on_lead=world.leadership_began,
            on_commit=world.committed,
        )
        world.network.attach(self.node_id, clock, parts.serve)
        self.up = True
        self.ready = False
        replication = self.replication
        membership.on_lease_lost.append(replication.lead.stop)
        self.chores = [
            PeriodicTask("sweep", 0.5, lambda: replication.sweep(RANGES), clock, now=False),
            PeriodicTask("healing", 0.5, lambda: replication.heal(RANGES), clock, now=False),
        ]

        def started(_: object) -> Deferred[None]:
            membership.startService()  # type: ignore[no-untyped-call]
            return membership.registered()

        def registered(_: object) -> None:
            self.ready = True
            for chore in self.chores:
                chore.startService()  # type: ignore[no-untyped-call]

        def failed(failure: Failure) -> None:
            # etcd did not answer the start: the process exits, its supervisor starts it anew.
            if self.clock.alive:
                self.clock.callLater(1.0, self._start_again)

        control.start().addCallback(started).addCallbacks(registered, failed)

    def _start_again(self) -> None:
        """The process exited (its disk keeps everything it wrote: the page cache survives a
        process), and starts again."""
        if self.up and not self.ready:
            self.clock.kill()
            self.link.kill()
            self.fs = self.fs.crash(keep=lambda path, unsynced: unsynced)
            self.start()

    def crash(self) -> None:
        """A power cut: the process is gone, the disk keeps what was fsynced and maybe more."""
        self.up = self.ready = False
        self.clock.kill()
        self.link.kill()
        rng = self.world.rng
        self.fs = self.fs.crash(keep=lambda path, unsynced: rng.randint(0, unsynced))
        self.parts = None


@attrs.define
class Produced:
    """One value a producer sends, with its stamp, and what became of its tries."""

    range_id: str
    value: bytes
    stamp: ProducerStamp
    sent_at: float
    acked_at: float | None = None
    tries: int = 0


@attrs.define
class History:
    produced: list[Produced] = attrs.field(factory=list)
    #: What consumers read while the faults went on: ``(range id, offset) -> value``.
    read: dict[tuple[str, int], bytes] = attrs.field(factory=dict)
    #: Reads of one offset that saw two different values.
    conflicts: list[str] = attrs.field(factory=list)
    #: Why tries failed, for reading a failing seed.
    errors: list[str] = attrs.field(factory=list)
    #: Every leadership begun: ``(range id, segment, epoch) -> nodes``.
    leaders: dict[tuple[str, int, int], set[str]] = attrs.field(factory=dict)
    #: The highest commit index any leader of each range reached so far.
    commits: dict[str, int] = attrs.field(factory=dict)
    #: Reads past every commit index a leader had reached when they were made.
    uncommitted_reads: list[str] = attrs.field(factory=list)

    def acked(self, range_id: str) -> list[Produced]:
        return [p for p in self.produced if p.range_id == range_id and p.acked_at is not None]


class World:
    def __init__(self, seed: int, *, settings: ReplicationSettings | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.clock = SimClock()
        self.etcd = MemoryKeyValueStore(self.clock)
        self.etcd_faults = EtcdFaults()
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
        #: Until when producers retry and consumers read (the end of the faulty period).
        self.busy_until = 0.0
        #: The later steps of faults (``_fault_later``), cancelled by ``calm``.
        self._fault_steps: list[IDelayedCall] = []
        #: The outcomes of the nodes' repairs of damaged copies, by result.
        self.repairs: Counter[str] = Counter()

    def scrub_checked(self, result: str) -> None:
        """A node's repair of a damaged copy ended (``RepairMetrics``)."""
        self.repairs[result] += 1

    # -- running -----------------------------------------------------------------------------

    def run(self, seconds: float) -> None:
        """Advance the simulated time by ``seconds``, running every call due on the way."""
        self.clock.advance(seconds)

    def note_failure(self, failure: Failure) -> None:
        self.failures.append(failure.getTraceback())

    def leadership_began(self, range_id: str, segment: int, epoch: int, node_id: str) -> None:
        self.history.leaders.setdefault((range_id, segment, epoch), set()).add(node_id)

    def committed(self, range_id: str, offset: int) -> None:
        commits = self.history.commits
        commits[range_id] = max(commits.get(range_id, 0), offset)

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

    def live(self) -> list[SimNode]:
        return [
            node
            for node in self.nodes.values()
            if node.ready and node.parts is not None and not node.clock.frozen
        ]

    # -- producers ---------------------------------------------------------------------------

    def produce(self, range_id: str, on_done: Callable[[bool], None] | None = None) -> Produced:
        """A fresh value, stamped, sent through a random live node and retried with the same
        stamp through another node after each failed try (up to ``TRIES``)."""
        self._sequence += 1
        value = f"{range_id}/{self._sequence}".encode()
        produced = Produced(range_id, value, ProducerStamp(self._sequence, 0), self.clock.seconds())
        self.history.produced.append(produced)
        self._try(produced, None, on_done)
        return produced

    def _try(
        self, produced: Produced, last: SimNode | None, on_done: Callable[[bool], None] | None
    ) -> None:
        nodes = [node for node in self.live() if node is not last] or self.live()
        if not nodes:
            self._failed(produced, last, "no live node", on_done)
            return
        node = self.rng.choice(nodes)
        assert node.parts is not None
        produced.tries += 1
        answered: dict[str, Any] = {"done": False, "timeout": None}

        def settled() -> None:
            answered["done"] = True
            timeout = answered["timeout"]
            if timeout is not None and timeout.active():
                timeout.cancel()

        def acked(_: object) -> None:
            if not answered["done"]:
                settled()
                if produced.acked_at is None:
                    produced.acked_at = self.clock.seconds()
                if on_done is not None:
                    on_done(True)

        def failed(why: object) -> None:
            if not answered["done"]:
                settled()
                reason = why.getErrorMessage() if isinstance(why, Failure) else "no answer"
                self._failed(produced, node, reason, on_done)

        try:
            handle = node.parts.ranges.handle(produced.range_id)
            record = Record(key=produced.range_id.encode(), value=produced.value, timestamp_ms=0)
            handle.append([record], produced.stamp).addCallbacks(acked, failed)
        except Exception:
            failed(Failure())
            return
        # A node that dies never answers: the client gives up on its own clock.
        if not answered["done"]:
            answered["timeout"] = self.clock.callLater(CLIENT_TIMEOUT, failed, None)

    def _failed(
        self,
        produced: Produced,
        node: SimNode | None,
        reason: str,
        on_done: Callable[[bool], None] | None,
    ) -> None:
        where = node.node_id if node is not None else "-"
        self.history.errors.append(f"{where} {produced.range_id} try {produced.tries}: {reason}")
        if produced.tries < TRIES and self.clock.seconds() < self.busy_until:
            # The same stamp, through another node: stored once, whatever became of this try.
            self.clock.callLater(self.rng.uniform(0.2, 1.0), self._try, produced, node, on_done)
        elif on_done is not None:
            on_done(False)

    def workload(self, seconds: float, rate: float) -> None:
        """Produces at about ``rate`` per simulated second for ``seconds``, and consumers that
        read every range as they go."""
        at = 0.0
        self.busy_until = self.clock.seconds() + seconds + 5.0
        while at < seconds:
            at += self.rng.expovariate(rate)
            self.clock.callLater(at, self.produce, self.rng.choice(RANGES))
        for range_id in RANGES:
            self.clock.callLater(0.3, self._consume, range_id, 0)

    # -- consumers ---------------------------------------------------------------------------

    def _consume(self, range_id: str, offset: int) -> None:
        """Read ``range_id`` from ``offset`` through a random live node, note what was read, and
        go on from where it ended (or the same offset after a failure)."""
        if self.clock.seconds() > self.busy_until:
            return
        nodes = self.live()
        if not nodes:
            self.clock.callLater(0.5, self._consume, range_id, offset)
            return
        node = self.rng.choice(nodes)
        assert node.parts is not None
        # As the broker reads: through the range's primary, or (as it does when the primary
        # cannot serve) from the copies; either must show only committed records.
        from_copies = self.rng.random() < 0.3

        def read(result: RangeRead) -> None:
            reader = Reader(b"".join(result.data))
            at = result.next_offset - result.count
            committed = self.history.commits.get(range_id, 0)
            if result.next_offset > committed:
                path = "its copies" if from_copies else "its primary"
                self.history.uncommitted_reads.append(
                    f"{range_id}: a read through {node.node_id} from {path} ended at "
                    f"{result.next_offset}, past the highest commit index, {committed}"
                )
            for index in range(result.count):
                self._saw(range_id, at + index, reader.record().value)
            self.clock.callLater(0.5, self._consume, range_id, result.next_offset)

        def failed(_: object) -> None:
            self.clock.callLater(0.5, self._consume, range_id, offset)

        try:
            if from_copies:
                reading = node.replication.copies.read(range_id, offset, 50, 1 << 20)
            else:
                reading = node.parts.ranges.handle(range_id).read(offset, 50, 1 << 20)
        except Exception:
            failed(None)
            return
        reading.addCallbacks(read, failed)

    def _saw(self, range_id: str, offset: int, value: bytes) -> None:
        seen = self.history.read.setdefault((range_id, offset), value)
        if seen != value:
            self.history.conflicts.append(
                f"{range_id}@{offset} was read as {seen!r} and as {value!r}"
            )

    # -- faults ------------------------------------------------------------------------------

    def faults(self, seconds: float, kinds: Sequence[str] = FAULTS) -> None:
        """Schedule random faults of ``kinds`` (some kinds twice, to come twice as often)
        over the next ``seconds``."""
        at = 0.0
        while True:
            at += self.rng.uniform(1.0, 4.0)
            if at >= seconds:
                break
            kind = self.rng.choice(kinds)
            node = self.rng.choice(NODES)
            self.clock.callLater(at, self._fault, kind, node)

    def _fault(self, kind: str, node_id: str) -> None:
        node = self.nodes[node_id]
        up = [n for n in self.nodes.values() if n.up and not n.clock.frozen]
        if kind == "crash":
            if node.up and len(up) > 1:
                node.crash()
                self._fault_later(self.rng.uniform(0.5, 6.0), self._restart, node_id)
        elif kind == "stall":
            if node.up and not node.clock.frozen and len(up) > 1:
                # Sometimes past the lease: it resumes with its queued work, and no lease.
                node.clock.freeze()
                self._fault_later(self.rng.uniform(0.3, 5.0), self._resume, node_id)
        elif kind == "partition":
            other = self.rng.choice([n for n in NODES if n != node_id])
            self.network.cut(node_id, other)
        elif kind == "etcd_cut":
            if node.up:
                link = node.link
                link.sever()
                self._fault_later(self.rng.uniform(0.5, 5.0), link.mend)
        elif kind == "etcd_flaky":
            self.etcd_faults.errors = self.rng.uniform(0.0, 0.1)
            self.etcd_faults.lost_answers = self.rng.uniform(0.0, 0.05)
        elif kind == "lease_flap":
            # etcd under load loses a node's lease (cut from it just past a TTL, all answers
            # slow): the others take its ranges over while it registers again and claims
            # them back; only the claims' compare-and-swap makes one of each pair win.
            if node.up:
                link = node.link
                link.sever()
                self.etcd_faults.slowest = self.rng.uniform(0.02, 0.2)

                def mend() -> None:
                    link.mend()
                    self._fault_later(2.0, self._etcd_fast)

                self._fault_later(LEASE_MS / 1000 + self.rng.uniform(0.0, 1.0), mend)
        elif kind == "compaction":
            # etcd refuses a compaction to the revision it is compacted to already.
            if self.etcd.revision > self.etcd.compact_revision:
                self.etcd.compact(self.etcd.revision)
        elif kind == "lossy":
            self.network.loss = self.rng.uniform(0.0, 0.2)
            self.network.duplication = self.rng.uniform(0.0, 0.2)
        elif kind == "slow":
            self.network.slow = self.rng.uniform(0.0, 0.2)
        elif kind == "clock_step":
            if node.up:
                node.clock.step_back(self.rng.uniform(0.5, 3.0))
        elif kind == "stale_leader":
            # A node whose clock runs slow (its timers fire late) is cut from etcd under load
            # (slow for everyone): it believes in its lease for a while after etcd expired it
            # and another node took its ranges over. Only fencing keeps what it writes
            # meanwhile from being acknowledged.
            if node.up:
                clock = node.clock
                clock.run_at(self.rng.uniform(0.3, 0.6))
                link = node.link

                def cut() -> None:
                    link.sever()
                    self.etcd_faults.slowest = self.rng.uniform(0.02, 0.2)

                def over() -> None:
                    link.mend()
                    clock.run_at(1.0)
                    self.etcd_faults.slowest = 0.003

                # Cut once it has renewed its lease at its slow pace.
                self._fault_later(2.5, cut)
                self._fault_later(2.5 + self.rng.uniform(3.0, 6.0), over)
        else:
            self.network.heal()
            self.network.calm()
            self.etcd_faults.calm()

    def _fault_later(self, delay: float, action: Callable[..., object], *args: object) -> None:
        """A fault's later step (a restart, a mend, a cut), which ``calm`` cancels: once the
        faults are over, none goes on."""
        self._fault_steps = [step for step in self._fault_steps if step.active()]
        self._fault_steps.append(self.clock.callLater(delay, action, *args))

    def _etcd_fast(self) -> None:
        self.etcd_faults.slowest = 0.003

    def _restart(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if not node.up:
            node.start()

    def _resume(self, node_id: str) -> None:
        node = self.nodes[node_id]
        if node.up and node.clock.frozen:
            node.clock.resume()

    def calm(self) -> None:
        """Every fault ends: the network and etcd heal, every node is up and running at the
        others' pace, and no fault's later step is left to come."""
        for step in self._fault_steps:
            if step.active():
                step.cancel()
        self._fault_steps = []
        self.network.heal()
        self.network.calm()
        self.etcd_faults.calm()
        for node in self.nodes.values():
            if node.up:
                node.link.mend()
                node.clock.run_at(1.0)
                if node.clock.frozen:
                    node.clock.resume()
            else:
                node.start()


def simulate(
    seed: int, *, settings: ReplicationSettings | None = None, faults: Sequence[str] = FAULTS
) -> list[str]:
    """One seeded run: boot, load with ``faults``, calm, check. The problems found, with every
    error the nodes logged (an unhandled failure included) on the way."""
    from tests.simulation.checks import check

    logged: list[str] = []

    def observe(event: dict[str, Any]) -> None:
        if event.get("log_level") in (LogLevel.error, LogLevel.critical):
            failure = event.get("log_failure")
            text = formatEvent(event)
            if isinstance(failure, Failure):
                text += "\n" + failure.getTraceback()
            logged.append(f"logged: {text}")

    globalLogPublisher.addObserver(observe)
    try:
        world = World(seed, settings=settings)
        world.boot()
        world.workload(20.0, rate=15.0)
        world.faults(20.0, faults)
        world.run(20.0)
        world.calm()
        world.run(5.0)
        problems = check(world)
        del world
        gc.collect()
    finally:
        globalLogPublisher.removeObserver(observe)
    return problems + logged
