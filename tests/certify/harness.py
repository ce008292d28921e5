"""The certification run: the network, the cluster, the load and the checks between drills.

``Certification`` is a context manager. Entering it makes the namespaces (``network``), moves
the harness into the checker's namespace, starts a three-member etcd and three brokers at
replication factor 3 under their supervisors, creates the topic and starts the load
(``load``). Leaving it, whatever happened (a failed check, an exception, Ctrl-C), stops the load,
kills every process and removes every namespace; the run's directory (each node's log and data,
etcd's logs) is kept when anything failed, and the run says where.

Between drills (``drills``) the harness checks what the guarantees ask after a fault:

- guarantee 3: a clean produce and fetch through every node, timed from the fault's end;
- guarantee 2: every node ready (``/ready``) and seen alive by every node, with no segment
  under-replicated (``logbroker cluster status --json`` through each node);

and at the end guarantee 1 (``finish``): the load stopped, everything read back through every
node and checked against the history, and the follower's reads against the final log.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType

import attrs

from logbroker.broker.keyspace import split_keyspace
from logbroker.client.blocking import BrokerRefused
from logbroker.key_routing import key_slot
from logbroker.records import Record
from tests.certify.load import (
    Follower,
    PlainProducer,
    StampedProducer,
    connect,
    read_back,
)
from tests.certify.network import Network
from tests.certify.nodes import CLIENT_PORT, DASHBOARD_PORT, PEER_PORT, Broker, EtcdMember
from tests.certify.view import (
    CLUSTER_ID,
    PROBE_TOPIC,
    TOPIC,
    CheckFailed,
    ClusterView,
    Problem,
    wait_until,
)
from tests.history import History, Verdict

#: The size of the small-volume node's data directory, a tmpfs: room for a long soak's
#: data, yet quick to fill.
SMALL_VOLUME_BYTES = 512 * 1024 * 1024
#: The membership lease: a stall longer than this costs the node its ranges.
LEASE_SECONDS = 3.0
#: A recovery slower than this has its failed probes written in the timeline.
SLOW_RECOVERY_SECONDS = 3.0


@attrs.frozen
class Timing:
    """How long the run's phases last: the short form (CI) or the full one."""

    #: How long each fault lasts, the load running.
    fault: float
    #: Load between drills, before the next fault.
    settle: float
    #: The bound within which a clean produce and fetch must succeed after a fault ends.
    recovery_bound: float
    #: The bound within which 3 of 3 must be healthy, nothing under-replicated.
    health_bound: float
    #: Seconds between one producer's produces.
    pace: float
    #: The bound within which every sealed copy must be identical again after damage.
    identical_bound: float


SHORT = Timing(
    fault=4.0, settle=2.0, recovery_bound=30.0, health_bound=90.0, pace=0.02, identical_bound=45.0
)
FULL = Timing(
    fault=15.0,
    settle=10.0,
    recovery_bound=30.0,
    health_bound=120.0,
    pace=0.01,
    identical_bound=90.0,
)


def _probe_failures(said: Mapping[str, Sequence[tuple[float, str]]]) -> str:
    """Each node's failed probes, as their reason changed: ``n3: at 0.0 s unreachable
    (...); at 2.1 s not_primary (...)``."""
    return (
        "; ".join(
            f"{node}: " + ", then ".join(f"at {moment:.1f} s {why}" for moment, why in reasons)
            for node, reasons in sorted(said.items())
        )
        or "none (the probes were slow, not failing)"
    )


def tear_down_on_signals() -> None:
    """Ctrl-C and SIGTERM (a CI job cancelled) stop a run as an error does, removing what it
    made: both raise ``KeyboardInterrupt``, also in a run started with SIGINT ignored (as a
    shell starts its background jobs), where Python would leave Ctrl-C ignored."""
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, _interrupted)


def _interrupted(number: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(number).name}")


def broker_settings(network: Network, node: int, data: Path) -> dict[str, str]:
    """Node ``node``'s settings: a production-like node at replication factor 3, with small
    segments (so that they seal during a run) and a quick scrub (so that damage is found). It
    reaches its own etcd member on 127.0.0.1 (the others on their addresses), so that a drill
    can cut the broker from etcd without cutting its member from the other brokers."""
    etcd = ",".join(
        f"{'127.0.0.1' if n == node else network.address(n)}:2379"
        for n in range(1, network.size + 1)
    )
    return {
        "SVC_ENV": "test",
        "SVC_CONTROL_PLANE": f"etcd://{etcd}",
        "SVC_CLUSTER_ID": CLUSTER_ID,
        "SVC_NODE_ID": f"n{node}",
        "SVC_ADVERTISE_HOST": network.address(node),
        "SVC_TCP_PORT": str(CLIENT_PORT),
        "SVC_DASHBOARD_PORT": str(DASHBOARD_PORT),
        "SVC_PEER_PORT": str(PEER_PORT),
        "SVC_DATA_DIR": str(data),
        "SVC_CLUSTER_SECRET": "the certification's cluster secret",
        "SVC_LOG_REPLICATION_FACTOR": "3",
        "SVC_NODE_LEASE_MS": str(int(LEASE_SECONDS * 1000)),
        "SVC_SEGMENT_MAX_BYTES": "65536",
        "SVC_SCRUB_INTERVAL_MS": "1000",
        "SVC_SCRUB_SEGMENTS_PER_TICK": "20",
    }


def add_directory_arguments(parser: argparse.ArgumentParser) -> None:
    """``--directory`` and ``--keep``, as every run of the certification takes them."""
    parser.add_argument(
        "--directory",
        type=Path,
        help="where the run's logs and data go (default: a new temporary directory; kept"
        " only when something failed)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the run's directory even when nothing failed"
    )


@attrs.define
class Outcome:
    """What one drill's checks found, for its verdict and the report."""

    #: Seconds from the fault's end until a clean produce and fetch succeeded on every node.
    recovered_after: float | None = None
    #: Seconds from the fault's end until 3 of 3 were healthy, nothing under-replicated.
    healthy_after: float | None = None
    #: Failed produces while the fault lasted (until recovery), by reason.
    errors: dict[str, int] = attrs.Factory(dict)
    #: Problems found, each naming the guarantee it breaks: (guarantee, text).
    problems: list[Problem] = attrs.Factory(list)
    #: The guarantees this drill's checks speak for.
    exercised: set[int] = attrs.Factory(lambda: {2, 3})
    #: Evidence for the report, by guarantee.
    notes: dict[int, str] = attrs.Factory(dict)


class Certification:
    def __init__(
        self,
        timing: Timing,
        directory: Path | None = None,
        extra_settings: Mapping[str, str] | None = None,
        say: Callable[[str], object] = print,
        producers: int = 4,
        stamped: int = 2,
        small_volume: int | None = 3,
    ) -> None:
        self.timing = timing
        self.say = say
        self.network = Network()
        self.network.check_free()
        self.directory = directory or Path(tempfile.mkdtemp(prefix="logbroker-certify-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        if any(self.directory.iterdir()):
            # Brokers started on another run's data would meet a new etcd that knows none of it.
            raise ValueError(f"{self.directory} is not empty: give a new directory for the run")
        self._etcd_data = Path(
            tempfile.mkdtemp(prefix="logbroker-certify-etcd-", dir=_fast_directory())
        )
        self._extra = dict(extra_settings or {})
        self.history = History()
        self.etcd: list[EtcdMember] = []
        self.brokers: list[Broker] = []
        #: The cluster's state, read from etcd and through the brokers.
        self.view = ClusterView(self.etcd, self.brokers)
        self._producer_count = producers
        self._stamped_count = stamped
        self.producers: list[PlainProducer] = []
        self.stamped: list[StampedProducer] = []
        self.follower: Follower | None = None
        self.failed = False
        #: Keep the run's directory even when nothing failed.
        self.keep = False
        self._probe_keys: list[bytes] = []
        #: Where the last clean probe's read ended: the next reads on from there. Every fault
        #: rolls the probe topic's ranges (a claim seals what they hold), and a read stops at
        #: the end of a segment, so a probe that read the topic from its start made a fetch
        #: for every fault so far: 107 fetches and 2-4 s a node after 90 faults of a soak,
        #: counted as the cluster's time to recover.
        self._probe_cursor: str | None = None
        self._direct_keys = 0
        #: The node whose data directory is a small tmpfs of its own (the full-volume drill's).
        self._small_volume = small_volume
        self._mounted: list[Path] = []

    # -- set up and tear down -------------------------------------------------------------

    def __enter__(self) -> Certification:
        try:
            self._start()
        except BaseException:
            self.failed = True
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.failed = True
        self.close()

    def _start(self) -> None:
        self.network.create()
        self.network.enter_checker()
        self.mark(f"network: namespaces {', '.join(self.network.namespaces)}")
        for node in range(1, self.network.size + 1):
            member = EtcdMember(
                self.network,
                node,
                self._etcd_data / f"e{node}",
                self.directory / f"etcd{node}.log",
            )
            member.start()
            self.etcd.append(member)
        wait_until(lambda: all(m.healthy() for m in self.etcd), 60, "etcd: 3 members healthy")
        for node in range(1, self.network.size + 1):
            directory = self.directory / f"n{node}"
            settings = {
                **broker_settings(self.network, node, directory / "data"),
                **self._extra,
            }
            broker = Broker(self.network, node, directory, settings, self.mark)
            if node == self._small_volume:
                self._mount_small_volume(broker.data)
            broker.supervise()
            self.brokers.append(broker)
        self.wait_healthy(self.timing.health_bound, under_replicated=False)
        with connect(self.brokers[0].server) as client:
            client.create_topic(TOPIC)
            client.create_topic(PROBE_TOPIC)
        wait_until(self._topic_known, 30, "the topic known on every node")
        self._probe_keys = self._keys_of_each_range(PROBE_TOPIC)
        self.mark("cluster ready: 3 of 3, topic created")
        servers = [broker.server for broker in self.brokers]
        self.producers = [
            PlainProducer(servers, i, TOPIC, self.history, self.timing.pace)
            for i in range(self._producer_count)
        ]
        self.stamped = [
            StampedProducer(servers, i, TOPIC, self.history, self.timing.pace)
            for i in range(self._stamped_count)
        ]
        self.follower = Follower(servers, 0, TOPIC)
        for worker in [*self.producers, *self.stamped, self.follower]:
            worker.start()
        self.mark(
            f"load: {len(self.producers)} keyed producers, {len(self.stamped)} stamped"
            " producers retrying through other nodes, 1 follower"
        )
        # The load under way (every range led and written to) before the first fault.
        self.settle()

    def close(self) -> None:
        """Stop everything and remove the network; keep the run's directory if anything
        failed."""
        for worker in [*self.producers, *self.stamped, *filter(None, [self.follower])]:
            try:
                worker.stop()
            except BaseException as error:
                self.say(f"while stopping the load: {error!r}")
        for broker in self.brokers:
            broker.shutdown()
        for member in self.etcd:
            member.kill()
        for mount in self._mounted:
            if self.failed or self.keep:
                shutil.copytree(mount, mount.with_name(mount.name + "-kept"), dirs_exist_ok=True)
            subprocess.run(["umount", str(mount)], capture_output=True)
        self.network.destroy()
        shutil.rmtree(self._etcd_data, ignore_errors=True)
        if self.failed or self.keep:
            self.say(f"kept for inspection: each node's log and data under {self.directory}")
        else:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _mount_small_volume(self, data: Path) -> None:
        data.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={SMALL_VOLUME_BYTES}", "tmpfs", str(data)],
            check=True,
            capture_output=True,
        )
        self._mounted.append(data)

    @property
    def small_volume(self) -> Broker | None:
        return next((b for b in self.brokers if b.node == self._small_volume), None)

    # -- the timeline ----------------------------------------------------------------------

    def mark(self, event: str) -> float:
        moment = self.history.mark(event)
        self.say(f"  +{moment - self.history.origin:7.1f} s  {event}")
        return moment

    # -- what a drill asks ------------------------------------------------------------------

    def wait_for(self, condition: Callable[[], bool], seconds: float, what: str) -> float:
        """Wait until ``condition`` holds (CheckFailed after ``seconds``); how long it took."""
        started = time.monotonic()
        wait_until(condition, seconds, what)
        return time.monotonic() - started

    def wait_identical(self, seconds: float) -> tuple[float, str]:
        """Wait until ``cluster verify`` finds every sealed copy complete and identical; how
        long it took, and what that ``cluster verify`` printed."""
        started = time.monotonic()
        last = [""]

        def identical() -> bool:
            ok, printed = self.view.verify_copies()
            last[0] = printed
            return ok

        wait_until(
            identical, seconds, "every sealed copy identical", lambda: last[0].replace("\n", "; ")
        )
        return time.monotonic() - started, last[0]

    def wait_healthy(self, seconds: float, under_replicated: bool = True) -> float:
        """Wait until ``health`` finds nothing missing; return how long it took."""
        started = time.monotonic()
        last = [""]

        def healthy() -> bool:
            last[0] = self.view.health(under_replicated) or ""
            return not last[0]

        wait_until(healthy, seconds, "3 of 3 healthy", lambda: last[0])
        return time.monotonic() - started

    def probe(self, broker: Broker) -> str | None:
        """A clean produce and fetch through ``broker``, of a record in each of the probe
        topic's ranges: None when all were acknowledged and read back, else why not."""
        stamp = b"%s %f" % (broker.node_id.encode(), time.monotonic())
        records = [Record(b"probe %s %s" % (key, stamp), key=key) for key in self._probe_keys]
        try:
            with connect(broker.server) as client:
                client.produce(PROBE_TOPIC, records, give_up_after=2.0)
                missing = {record.value for record in records}
                cursor = self._probe_cursor
                while missing:
                    batch = client.fetch(PROBE_TOPIC, cursor, None, None, 1000, 0)
                    if not batch.records:
                        return f"{len(missing)} acknowledged probe records did not read back"
                    missing -= {record.value for record in batch.records}
                    cursor = batch.next_cursor
                self._probe_cursor = cursor
        except BrokerRefused as refused:
            return refused.reason
        except OSError as error:
            return type(error).__name__
        return None

    def wait_recovered(self, seconds: float, brokers: Sequence[Broker] | None = None) -> float:
        """Wait until a clean produce and fetch succeeds through every one of ``brokers``
        (every node by default); return how long it took."""
        started = time.monotonic()
        pending = list(brokers or self.brokers)
        last = [""]
        #: What each probe that failed said, as it changed: (seconds since the start, why).
        said: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)

        def recovered() -> bool:
            for broker in list(pending):
                why = self.probe(broker)
                if why is None:
                    pending.remove(broker)
                    continue
                last[0] = f"{broker.node_id}: {why}"
                if not said[broker.node_id] or said[broker.node_id][-1][1] != why:
                    said[broker.node_id].append((time.monotonic() - started, why))
            return not pending

        wait_until(
            recovered, seconds, "a clean produce and fetch through every node", lambda: last[0]
        )
        took = time.monotonic() - started
        if took > SLOW_RECOVERY_SECONDS:
            # Why a slow recovery was slow, for the timeline: each node's failed probes.
            self.say(f"  probes that failed meanwhile: {_probe_failures(said)}")
        return took

    def after_fault(self, started: float, ended: float) -> Outcome:
        """Guarantees 3 and 2 after a fault that began at ``started`` and ended at ``ended``
        (monotonic): the recovery and health times, and the errors the load met meanwhile."""
        outcome = Outcome()
        try:
            outcome.recovered_after = self.wait_recovered(self.timing.recovery_bound)
            self.mark(
                f"clean produce and fetch through every node, {outcome.recovered_after:.1f} s"
                " after the fault ended"
            )
        except CheckFailed as failed:
            outcome.problems.append((3, str(failed)))
        try:
            self.wait_healthy(self.timing.health_bound)
            outcome.healthy_after = time.monotonic() - ended
            self.mark(f"3 of 3 healthy, none under-replicated, {outcome.healthy_after:.1f} s after")
        except CheckFailed as failed:
            outcome.problems.append((2, str(failed)))
        recovered = time.monotonic()
        outcome.errors = dict(
            collections.Counter(
                p.failure
                for p in self.history.produces
                if p.failure is not None and p.finished >= started and p.started <= recovered
            )
        )
        return outcome

    def acknowledged_between(self, started: float, ended: float) -> int:
        """How many produces were acknowledged between two moments (monotonic)."""
        return sum(
            1 for p in self.history.produces if p.acknowledged and started <= p.finished <= ended
        )

    @staticmethod
    def outcome_of_failure(failed: CheckFailed) -> Outcome:
        """The outcome of a drill that could not do what it had to."""
        return Outcome(problems=[(0, str(failed))])

    def follower_summary(self) -> str:
        assert self.follower is not None
        failures = ", ".join(f"{r} {n}" for r, n in sorted(self.follower.failures.items()))
        return (
            f"the follower read {len(self.follower.read)} records, moving between nodes"
            f" {self.follower.moves} times ({failures or 'no failed fetch'})"
        )

    def settle(self) -> None:
        time.sleep(self.timing.settle)

    def _keys_of_each_range(self, topic: str, prefix: bytes = b"probe") -> list[bytes]:
        """A key in each of ``topic``'s ranges, in range order."""
        with connect(self.brokers[0].server) as client:
            info = next(t for t in client.list_topics() if t.name == topic)
        ranges = split_keyspace(info.keyspace_bits, info.range_count)
        found: dict[int, bytes] = {}
        for attempt in range(10_000):
            key = b"%s-%d" % (prefix, attempt)
            slot = key_slot(key, info.keyspace_bits)
            found.setdefault(next(i for i, (a, b) in enumerate(ranges) if a <= slot < b), key)
            if len(found) == len(ranges):
                break
        return [found[i] for i in sorted(found)]

    def keys_of_ranges(self, indexes: Sequence[int]) -> list[bytes]:
        """Keys of the load's topic in the ranges ``indexes`` name, new to the history."""
        self._direct_keys += 1
        keys = self._keys_of_each_range(TOPIC, b"d%d" % self._direct_keys)
        return [keys[index] for index in indexes]

    def _topic_known(self) -> bool:
        for broker in self.brokers:
            try:
                with connect(broker.server) as client:
                    names = {topic.name for topic in client.list_topics()}
            except (OSError, BrokerRefused):
                return False
            if TOPIC not in names:
                return False
        return True

    # -- the end ----------------------------------------------------------------------------

    def finish(self) -> tuple[Verdict, list[str]]:
        """Stop the load, read everything back through every node and check guarantee 1:
        the history's verdict (through the first node) and every other problem found."""
        for worker in [*self.producers, *self.stamped]:
            worker.stop()
        assert self.follower is not None
        self.follower.stop()
        self.mark("load stopped")
        reads = {broker.node_id: read_back(broker.server, TOPIC) for broker in self.brokers}
        first = self.brokers[0].node_id
        verdict = self.history.check(reads[first])
        problems = list(verdict.problems)
        for node_id, read in reads.items():
            if node_id != first and _by_key(read) != _by_key(reads[first]):
                problems.append(f"reading through {node_id} gives another log than through {first}")
        problems += self.follower.problems(reads[first])
        if verdict.acknowledged == 0:
            problems.append("nothing was acknowledged")
        return verdict, problems


def _by_key(read: Sequence[tuple[bytes | None, bytes]]) -> dict[bytes | None, list[bytes]]:
    found: dict[bytes | None, list[bytes]] = collections.defaultdict(list)
    for key, value in read:
        found[key].append(value)
    return dict(found)


def _fast_directory() -> str | None:
    """/dev/shm when there is one: etcd 3.4 fsyncs every write and cannot be told not to."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None
