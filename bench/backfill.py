"""Backfill (catch-up) speed of a node that returns to a three-node cluster at replication
factor 3 after missing the writes of a while.

What it measures, in each of ``--repeat`` rounds, on a fresh cluster of three nodes
(``SVC_LOG_REPLICATION_FACTOR=3``, ``SVC_SEGMENT_MAX_BYTES`` from ``--segment-bytes``, 1 MiB by
default, so that the data makes many segments; ``SVC_TOPIC_RANGES`` from ``--ranges``):

1. A topic is created, and every node acknowledges one request on it.
2. ``n3`` is killed (SIGKILL); once ``n1`` and ``n2`` both see it dead and acknowledge a request
   again (its ranges taken over), ``--megabytes`` of record values (keyed records of
   ``--record-bytes``, ``--batch`` per request, ``--connections`` split over ``n1`` and ``n2``,
   ``--in-flight`` requests outstanding on each) are produced through them. Segments sealed
   meanwhile are placed on the two live nodes (``docs/cluster.md``, "Keeping three copies").
   Then the script waits until ``n1``'s and ``n2``'s copies have the same size.
3. ``n3`` is started again on its own data directory. From the moment it listens for clients
   ("ready") until the catch-up is done, the script polls, every ``_POLL_SECONDS``: the
   topic's segments in etcd, ``describe_cluster`` of every node (its ``under_replicated``) and
   the three nodes' segment files of the topic. The catch-up is **done** when both hold:

   a. every node reports 0 under-replicated segments (each node counts for the whole cluster,
      refreshed every two seconds);
   b. ``n3`` holds every sealed segment of the topic whole: for every segment etcd records as
      sealed (with records), ``n3``'s ``.log`` file of it has the size etcd records, and its
      ``.log`` bytes of each of the topic's ranges equal ``n1``'s and ``n2``'s.

Per round and as medians over the rounds: the **bytes ``n3`` fetched** (the ``.log`` files of
the topic that are new or of another size than before the restart: every one is a whole
segment fetched from a peer), the **segments** fetched, the **seconds** from ready to done,
**MB/s** (fetched bytes over those seconds), and the CPU of each broker, of etcd and of the
script (which polls) from ready to done, as cores busy on average. Also the whole copies
``n3``'s log says healing put in place ("Fetched <range>@<base> whole") and could not put in
place ("cannot be put in place"), which exceed the segments when some are fetched more than
once, and the bytes ``n3`` wrote to storage meanwhile (``write_bytes`` of ``/proc/<pid>/io``).
And, to see where the time goes, the seconds from ready to: the others seeing ``n3`` alive
(``alive``), every sealed segment's replica set naming ``n3`` (``sets``: the chores holder adds
it, one compare-and-swap in etcd per segment), the first fetched segment on disk (``first``),
``n3`` whole (``whole``), and the count at 0 on every node (``count``); each the moment from
which it held until done.
The start-up itself (from the process's start to listening: opening its ranges) is
``startup``. After the timed window, ``verify_cluster`` (``logbroker cluster verify``) checks
that every sealed segment's copies are complete and identical on every node; its problem count
is reported (0 expected).

How: ``bench/_cluster.py``'s machinery, as ``replicated_produce.py`` uses it: one three-member
etcd for the whole run (the ``etcd`` on ``PATH``, its data in ``/dev/shm`` when there is one),
each round's cluster under its own cluster id, ``twistd -n logbroker`` processes in env mode
``test`` on free loopback ports with their data in the temporary directory ``--dir`` names
(default under ``bench/.work``, the disk of the working tree); each round's directories are
removed after it. The produce is ``logbroker.benchmark``'s request frame (``produce_frame``
with ``keys=batch``: keys ``key-0`` to ``key-<batch - 1>``, one per record) sent by a closed
loop until the requests that make ``--megabytes`` are acknowledged; a refused request is sent
again. The brokers run with their defaults otherwise. With large segments (``--segment-bytes``
near the broker's 64 MiB) most of what was written stays in the ranges' active segments, which
``n3`` catches up by replication from their primaries rather than by healing.

``--profile DIR`` runs every broker under cProfile (its reactor thread) and leaves
``DIR/backfill-<round>-<node>.prof`` when it stops (``...-n3-restarted.prof`` for the
returning node's second life; the killed first one leaves none); cProfile slows the brokers
down, so such a run's figures only say where the time goes. ``--logs DIR`` keeps the brokers'
logs of each round (in ``DIR/backfill-<round>/<node>/``): when the chores holder changed each
replica set ("The replica set of ... is now"), and when the returning node installed each copy.

Everything it starts is stopped, and the temporary directories are removed, at the end, also
after an error, SIGTERM or Ctrl-C; every wait is bounded. Loopback only. Run it from the
repository root with the project's virtualenv (about two and a half minutes with the defaults)::

    .venv/bin/python bench/backfill.py
    .venv/bin/python bench/backfill.py --megabytes 500 --ranges 8 --json

Do not point ``--dir`` at tmpfs, where fsync costs nothing. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
from _cluster import (
    Etcd,
    cluster_run,
    request_records,
    running_cluster,
    wait_until_produces,
)
from _common import (
    APP,
    HOST,
    MAX_FRAME,
    READY_SECONDS,
    CpuMeter,
    Node,
    add_work_directory_option,
    emit,
    positive_float,
    positive_int,
    restarted,
    tail,
)
from replicated_produce import settle, topic_ranges
from twisted.internet import task
from twisted.internet.defer import Deferred, ensureDeferred

from logbroker.benchmark import ProduceLoad, connect, produce_frame
from logbroker.storage._segment import LOG_SUFFIX, is_segment_file

REPLICATION_FACTOR = 3
TOPIC = "backfill"
#: The node that is killed and comes back.
RETURNING = "n3"
#: How often the catch-up is looked at.
_POLL_SECONDS = 0.1
_RANGES_DIR = "ranges"

#: ``(range id, base offset)``: a segment.
SegmentKey = tuple[str, int]


# -- what a node holds, what etcd records -------------------------------------------------


def segment_sizes(data: str, topic: str) -> dict[SegmentKey, int]:
    """Bytes of each ``.log`` segment file of ``topic``'s ranges in the data directory
    ``data``, by segment."""
    sizes = {}
    for range_id in topic_ranges(data, topic):
        directory = os.path.join(data, _RANGES_DIR, range_id)
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(directory):
                if is_segment_file(name) and name.endswith(LOG_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        size = os.path.getsize(os.path.join(directory, name))
                        sizes[(range_id, int(name.removesuffix(LOG_SUFFIX)))] = size
    return sizes


def range_totals(sizes: Mapping[SegmentKey, int]) -> dict[str, int]:
    """Bytes of segment files by range."""
    totals: Counter[str] = Counter()
    for (range_id, _), size in sizes.items():
        totals[range_id] += size
    return dict(totals)


@attrs.frozen
class Fetched:
    segments: int
    size: int


def fetched(before: Mapping[SegmentKey, int], after: Mapping[SegmentKey, int]) -> Fetched:
    """What a node fetched between ``before`` and ``after`` (its segment file sizes): the
    segments whose file is new or changed size, and is not empty (a segment is installed
    whole; an empty one is a new active segment, or a copy emptied to make room)."""
    sizes = [size for key, size in after.items() if size and before.get(key) != size]
    return Fetched(len(sizes), sum(sizes))


@attrs.frozen
class SealedSegment:
    range_id: str
    base_offset: int
    byte_size: int
    replicas: tuple[str, ...]


def sealed_segments(records: Iterable[Mapping[str, Any]]) -> list[SealedSegment]:
    """The sealed segments that hold records, from etcd's segment records."""
    return [
        SealedSegment(
            record["range_id"],
            int(record["base_offset"]),
            int(record["byte_size"]),
            tuple(record["replicas"]),
        )
        for record in records
        if record["state"] == "sealed" and record["record_count"]
    ]


def topic_segments(etcd: Etcd, cluster_id: str, topic: str) -> list[SealedSegment]:
    """The sealed segments of ``topic``'s ranges recorded in etcd."""
    prefix = f"/logbroker/{cluster_id}/state/segments/{topic}."
    return sealed_segments(etcd.prefix(prefix).values())


def sets_complete(segments: Iterable[SealedSegment], node: str, factor: int) -> bool:
    """Whether every segment's replica set has ``factor`` members, ``node`` among them."""
    return all(len(s.replicas) >= factor and node in s.replicas for s in segments)


def holds_whole(
    segments: Iterable[SealedSegment],
    sizes: Mapping[SegmentKey, int],
    others: Iterable[Mapping[SegmentKey, int]],
) -> bool:
    """Whether a node whose segment files have ``sizes`` holds every sealed segment whole (its
    file has the recorded size), with as many bytes in each range as each of ``others``."""
    if any(sizes.get((s.range_id, s.base_offset)) != s.byte_size for s in segments):
        return False
    totals = range_totals(sizes)
    return all(range_totals(other) == totals for other in others)


@attrs.frozen
class Installs:
    """What a node's log says its healing did to a topic's segments."""

    #: Whole copies fetched and put in place ("Fetched <range>@<base> whole (<n> bytes)").
    installed: int
    installed_bytes: int
    #: Segments whose fetched copy could not be put in place (logged once per segment).
    refused: int


_INSTALLED = re.compile(r"Fetched (\S+)@\d+ whole \((\d+) bytes\)")
_REFUSED = re.compile(
    r"copy of (\S+)@\d+ cannot be healed yet: the whole copy cannot be put in place"
)


def installs(log_text: str, topic: str) -> Installs:
    """Count, in a broker's log, the whole copies of ``topic``'s segments it installed and
    the segments whose install was refused (``logbroker/replication/healing.py``'s lines)."""
    installed = [
        int(match.group(2))
        for match in _INSTALLED.finditer(log_text)
        if match.group(1).startswith(f"{topic}.")
    ]
    refused = sum(
        1 for match in _REFUSED.finditer(log_text) if match.group(1).startswith(f"{topic}.")
    )
    return Installs(len(installed), sum(installed), refused)


def write_bytes(pid: int) -> int:
    """Bytes process ``pid`` has caused to be written to storage (``/proc/<pid>/io``)."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == "write_bytes":
                return int(value)
    raise RuntimeError(f"no write_bytes in /proc/{pid}/io")


# -- the catch-up's milestones --------------------------------------------------------------


class Milestones:
    """When each condition of a catch-up came to hold for good: fed what was seen at each
    poll, it keeps for each condition the time of the poll from which it held at every poll
    since (None while it does not hold)."""

    def __init__(self) -> None:
        self.since: dict[str, float | None] = {}

    def observe(self, at: float, conditions: Mapping[str, bool]) -> None:
        for name, holds in conditions.items():
            if not holds:
                self.since[name] = None
            elif self.since.get(name) is None:
                self.since[name] = at

    def holding(self, *names: str) -> bool:
        return all(self.since.get(name) is not None for name in names)


def requests_for(megabytes: float, batch: int, record_bytes: int) -> int:
    """Requests of ``batch`` records of ``record_bytes`` that make ``megabytes`` (1e6 bytes) of
    record values, rounded up."""
    return math.ceil(megabytes * 1e6 / (batch * record_bytes))


# -- producing ------------------------------------------------------------------------------


@attrs.frozen
class Produced:
    requests: int
    seconds: float
    refusals: dict[str, int]


class _UntilAcknowledged:
    """A closed loop that keeps ``frame`` in flight on each connection until ``requests`` of
    them are acknowledged; a refused one is sent again a moment later."""

    def __init__(self, reactor: Any, frame: bytes, requests: int) -> None:
        self._reactor = reactor
        self._frame = frame
        self._requests = requests
        self.acknowledged = 0
        self._sent = 0
        self._outstanding = 0
        self.refusals: Counter[str] = Counter()
        self.done: Deferred[None] = Deferred()

    def send(self, connection: Any) -> None:
        if self._sent >= self._requests:
            if not self._outstanding and not self.done.called:
                self.done.callback(None)
            return
        self._sent += 1
        self._outstanding += 1
        connection.send(
            self._frame,
            time.perf_counter(),
            lambda response, due: self._answered(connection, response),
        )

    def _answered(self, connection: Any, response: Any) -> None:
        self._outstanding -= 1
        if response.reason is None:
            self.acknowledged += 1
            self.send(connection)
            return
        self.refusals[response.reason] += 1
        self._sent -= 1
        self._reactor.callLater(0.05, self.send, connection)


async def produce_requests(
    reactor: Any,
    nodes: Sequence[Node],
    frame: bytes,
    requests: int,
    connections: int,
    in_flight: int,
    timeout: float,
) -> Produced:
    """Send ``frame`` over ``connections`` split evenly over ``nodes``, ``in_flight`` at a time
    on each, until ``requests`` of them are acknowledged."""
    ready: list[Any] = [
        await connect(reactor, HOST, node.port, *APP)
        for node in nodes
        for _ in range(connections // len(nodes))
    ]
    loop = _UntilAcknowledged(reactor, frame, requests)
    started = time.perf_counter()
    try:
        for connection in ready:
            for _ in range(in_flight):
                loop.send(connection)
        await loop.done.addTimeout(timeout, reactor)
    finally:
        for connection in ready:
            connection.transport.loseConnection()
    return Produced(loop.acknowledged, time.perf_counter() - started, dict(loop.refusals))


# -- one round ------------------------------------------------------------------------------


def wait_until_dead(nodes: Sequence[Node], name: str) -> None:
    """Until every one of ``nodes`` sees ``name`` dead (its lease ran out)."""
    deadline = time.monotonic() + READY_SECONDS
    for node in nodes:
        with node.client() as client:
            while any(m.node_id == name and m.alive for m in client.describe_cluster().nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node.name} still sees {name} alive")
                time.sleep(0.1)


@attrs.frozen
class Catchup:
    seconds: float
    milestones: Milestones
    #: What each node's describe_cluster said at the first poll.
    under_replicated_at_ready: dict[str, int | None]
    cpu: dict[str, float]
    chores_holder: str | None
    #: Bytes the returning node wrote to storage meanwhile.
    written: int


def watch_catchup(
    etcd: Etcd,
    cluster_id: str,
    nodes: Sequence[Node],
    returning: Node,
    before: Mapping[SegmentKey, int],
    ready_at: float,
    timeout: float,
) -> Catchup:
    """Poll until the catch-up of ``returning`` is done (see the module's docstring);
    ``before`` is its segment files' sizes before it started again."""
    others = [node for node in nodes if node.name != returning.name]
    milestones = Milestones()
    with contextlib.ExitStack() as stack:
        clients = {node.name: stack.enter_context(node.client()) for node in nodes}
        cpu = CpuMeter({**{node.name: [node.process.pid] for node in nodes}, "etcd": etcd.pids})
        first_counts: dict[str, int | None] | None = None
        written_before = write_bytes(returning.process.pid)
        while True:
            segments = topic_segments(etcd, cluster_id, TOPIC)
            infos = {name: client.describe_cluster() for name, client in clients.items()}
            sizes = segment_sizes(returning.data, TOPIC)
            other_sizes = [segment_sizes(node.data, TOPIC) for node in others]
            at = time.perf_counter() - ready_at
            counts = [info.under_replicated for info in infos.values()]
            if first_counts is None:
                first_counts = {name: info.under_replicated for name, info in infos.items()}
            seen_alive = all(
                any(m.node_id == returning.name and m.alive for m in infos[node.name].nodes)
                for node in others
            )
            milestones.observe(
                at,
                {
                    "alive": seen_alive,
                    "sets": sets_complete(segments, returning.name, REPLICATION_FACTOR),
                    "first": fetched(before, sizes).segments > 0,
                    "whole": holds_whole(segments, sizes, other_sizes),
                    "count": all(count == 0 for count in counts),
                },
            )
            if milestones.holding("whole", "count"):
                return Catchup(
                    at,
                    milestones,
                    first_counts,
                    cpu.read(),
                    infos[returning.name].chores_holder,
                    write_bytes(returning.process.pid) - written_before,
                )
            if at > timeout:
                raise RuntimeError(
                    f"{returning.name} had not caught up after {timeout:g} s: under-replicated"
                    f" {counts}, milestones {milestones.since}"
                )
            time.sleep(_POLL_SECONDS)


class Run:
    def __init__(self, args: argparse.Namespace, etcd: Etcd, workdir: str) -> None:
        self.args = args
        self.etcd = etcd
        self.workdir = workdir
        self.rounds: list[dict[str, Any]] = []
        self.finished = False
        self.nodes: list[Node] = []
        self.settings = {
            "SVC_LOG_REPLICATION_FACTOR": str(REPLICATION_FACTOR),
            "SVC_SEGMENT_MAX_BYTES": str(args.segment_bytes),
            "SVC_TOPIC_RANGES": str(args.ranges),
        }

    def _profile(self, cluster_id: str, suffix: str) -> str | None:
        if self.args.profile is None:
            return None
        return os.path.join(self.args.profile, f"{cluster_id}-{suffix}.prof")

    async def round(self, reactor: Any, number: int) -> dict[str, Any]:
        args = self.args
        cluster_id = f"backfill-{number}"
        directory = os.path.join(self.workdir, cluster_id)
        load = ProduceLoad(topic=TOPIC, batch=args.batch, size=args.record_bytes, keys=args.batch)
        frame = produce_frame(load)
        records = request_records(frame)
        with contextlib.ExitStack() as stack:
            nodes = stack.enter_context(
                running_cluster(
                    self.etcd, cluster_id, directory, self.settings, profiles=args.profile
                )
            )
            self.nodes = list(nodes)
            returning = next(node for node in nodes if node.name == RETURNING)
            live = [node for node in nodes if node is not returning]
            with nodes[0].client() as client:
                client.create_topic(TOPIC)
            wait_until_produces(nodes, TOPIC, records)

            returning.process.kill()
            returning.process.wait()
            wait_until_dead(live, returning.name)
            wait_until_produces(live, TOPIC, records)
            produced = await produce_requests(
                reactor,
                live,
                frame,
                requests_for(args.megabytes, args.batch, args.record_bytes),
                args.connections,
                args.in_flight,
                args.timeout,
            )
            if not settle(live, TOPIC):
                raise RuntimeError("the live nodes' copies did not reach the same size")
            before = segment_sizes(returning.data, TOPIC)
            at_restart = topic_segments(self.etcd, cluster_id, TOPIC)

            started = time.perf_counter()
            back = stack.enter_context(
                restarted(returning, self._profile(cluster_id, f"{RETURNING}-restarted"))
            )
            ready_at = time.perf_counter()
            nodes = [back if node is returning else node for node in nodes]
            self.nodes = list(nodes)
            catchup = watch_catchup(
                self.etcd, cluster_id, nodes, back, before, ready_at, args.timeout
            )
            after = segment_sizes(back.data, TOPIC)
            sealed = topic_segments(self.etcd, cluster_id, TOPIC)
            with back.client() as client:
                verified = client.verify_cluster(timeout=READY_SECONDS)
            with open(back.log, errors="replace") as f:
                done = installs(f.read(), TOPIC)
        if args.logs is not None:
            _keep_logs(directory, os.path.join(args.logs, cluster_id))
        # Kept after an error, for the nodes' logs; else 600 MB a round would pile up.
        shutil.rmtree(directory, ignore_errors=True)
        got = fetched(before, after)
        cpu = catchup.cpu
        result: dict[str, Any] = {
            "round": number,
            "bytes_fetched": got.size,
            "segments_fetched": got.segments,
            "seconds": catchup.seconds,
            "mb_per_s": got.size / catchup.seconds / 1e6 if catchup.seconds else float("nan"),
            "installs": done.installed,
            "installed_bytes": done.installed_bytes,
            "install_refusals": done.refused,
            "written_bytes": catchup.written,
            "startup_s": ready_at - started,
            **{f"{name}_s": catchup.milestones.since.get(name) for name in _MILESTONES},
            "cpu": {node.name: cpu[f"{node.name}_cpu"] for node in nodes},
            "etcd_cpu": cpu["etcd_cpu"],
            "client_cpu": cpu["client_cpu"],
            "segments_sealed": len(sealed),
            "segments_short_at_restart": sum(RETURNING not in s.replicas for s in at_restart),
            "under_replicated_at_ready": catchup.under_replicated_at_ready,
            "chores_holder": catchup.chores_holder,
            "produced_mb": produced.requests * args.batch * args.record_bytes / 1e6,
            "produce_s": produced.seconds,
            "produce_refusals": produced.refusals,
            "verify_problems": verified.problem_count,
        }
        return result

    async def rounds_of(self, reactor: Any) -> None:
        for number in range(1, self.args.repeat + 1):
            result = await self.round(reactor, number)
            self.rounds.append(result)
            emit(self.args.json, "backfill", result, _line(result))

    def summarise(self) -> None:
        runs = self.rounds
        summary: dict[str, Any] = {"rounds": len(runs)}
        for key in _MEDIANS:
            values = [run[key] for run in runs if run[key] is not None]
            summary[key] = statistics.median(values) if values else None
        summary["cpu"] = {
            name: statistics.median(run["cpu"][name] for run in runs) for name in runs[0]["cpu"]
        }
        summary["verify_problems"] = sum(run["verify_problems"] for run in runs)
        if not self.args.json:
            print(f"\nmedians of {len(runs)} round(s):", flush=True)
        emit(self.args.json, "backfill_summary", summary, _line(summary, "median "))


_MILESTONES = ("alive", "sets", "first", "whole", "count")
_MEDIANS = (
    "bytes_fetched",
    "segments_fetched",
    "seconds",
    "mb_per_s",
    "installs",
    "installed_bytes",
    "install_refusals",
    "written_bytes",
    "startup_s",
    *(f"{name}_s" for name in _MILESTONES),
    "etcd_cpu",
    "client_cpu",
)


def _counts(by_node: Mapping[str, int | None]) -> str:
    return f"({'/'.join(by_node)}) " + "/".join(str(count) for count in by_node.values())


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _line(result: Mapping[str, Any], prefix: str | None = None) -> str:
    head = prefix or f"round {result['round']}"
    cpu = "/".join(f"{value:.2f}" for value in result["cpu"].values())
    line = (
        f"{head}  fetched {result['bytes_fetched'] / 1e6:,.1f} MB in"
        f" {result['segments_fetched']:.0f} segments, {result['seconds']:.2f} s:"
        f" {result['mb_per_s']:.1f} MB/s  cpu {'/'.join(result['cpu'])}={cpu}"
        f" etcd={result['etcd_cpu']:.2f} script={result['client_cpu']:.2f}"
        f"\n         {RETURNING} installed {result['installs']:.0f} whole copies"
        f" ({result['installed_bytes'] / 1e6:,.1f} MB), {result['install_refusals']:.0f}"
        f" refused; wrote {result['written_bytes'] / 1e6:,.1f} MB to storage"
        f"\n         from ready (startup {result['startup_s']:.2f} s) to: "
        + ", ".join(f"{name} {_seconds(result[f'{name}_s'])}" for name in _MILESTONES)
        + f"  verify problems={result['verify_problems']}"
    )
    if prefix is None:
        line += (
            f"\n         produced {result['produced_mb']:,.0f} MB through 2 nodes in"
            f" {result['produce_s']:.1f} s; {result['segments_sealed']} sealed segments,"
            f" {result['segments_short_at_restart']} without {RETURNING} at its restart;"
            f" under-replicated at ready {_counts(result['under_replicated_at_ready'])};"
            f" chores held by {result['chores_holder']}"
        )
        if result["produce_refusals"]:
            refused = ", ".join(f"{k} x{v}" for k, v in sorted(result["produce_refusals"].items()))
            line += f"; refused (sent again): {refused}"
    return line


def _keep_logs(directory: str, into: str) -> None:
    """Copy the brokers' logs of a round's ``directory`` (``<node>/twistd*.log``) into ``into``."""
    for node in sorted(os.listdir(directory)):
        for name in os.listdir(os.path.join(directory, node)):
            if name.startswith("twistd") and name.endswith(".log"):
                os.makedirs(os.path.join(into, node), exist_ok=True)
                shutil.copy(os.path.join(directory, node, name), os.path.join(into, node, name))


async def _measure(reactor: Any, run: Run) -> None:
    await run.rounds_of(reactor)
    run.summarise()
    run.finished = True


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Backfill speed of a node returning to a three-node logbroker cluster at "
        "replication factor 3: how fast it fetches the segments sealed while it was down."
    )
    add_work_directory_option(parser, "write the brokers' data on")
    parser.add_argument(
        "--megabytes",
        type=positive_float,
        default=200.0,
        help="record values produced while the node is down, MB (200)",
    )
    parser.add_argument(
        "--record-bytes", type=positive_int, default=1024, help="value bytes per record (1024)"
    )
    parser.add_argument("--batch", type=positive_int, default=100, help="records per request (100)")
    parser.add_argument(
        "--connections",
        type=positive_int,
        default=4,
        help="producing connections, split over the two live nodes (4)",
    )
    parser.add_argument(
        "--in-flight", type=positive_int, default=8, help="requests in flight per connection (8)"
    )
    parser.add_argument(
        "--segment-bytes",
        type=positive_int,
        default=1024 * 1024,
        help="SVC_SEGMENT_MAX_BYTES of every broker (1048576)",
    )
    parser.add_argument(
        "--ranges",
        type=positive_int,
        default=4,
        help="SVC_TOPIC_RANGES of every broker: ranges of the topic (4)",
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=3, help="rounds; the summary takes medians (3)"
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        help="the longest the produce, and then the catch-up, may take, seconds (600)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="run every broker under cProfile (its reactor thread), writing "
        "<cluster id>-<node>.prof into DIR when it stops",
    )
    parser.add_argument(
        "--logs",
        metavar="DIR",
        help="copy the brokers' logs of each round into DIR/<cluster id>/<node>/ (the "
        "returning node's second life logs to twistd-2.log)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    args = parser.parse_args(argv)
    if args.connections % 2:
        parser.error("--connections must be even, to split over the two live nodes")
    if args.batch * (args.record_bytes + 64) > MAX_FRAME:
        parser.error(f"--batch x the record size must fit in one {MAX_FRAME}-byte frame")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    with cluster_run(args, "bench-backfill-") as (workdir, etcd):
        run = Run(args, etcd, workdir)

        def measure(reactor: Any) -> Deferred[None]:
            return ensureDeferred(_measure(reactor, run))

        try:
            task.react(measure)
        except SystemExit as exit:
            if exit.code:
                for node in run.nodes:
                    print(f"--- {node.log}:\n{tail(node.log)}", file=sys.stderr)
                raise
            if not run.finished:
                raise SystemExit("interrupted before the measurement finished") from None
            raise


if __name__ == "__main__":
    main()
