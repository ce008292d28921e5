"""Durable produce throughput of a three-node cluster at replication factor 3, with the range
logs' group commit off and on, next to one node at replication factor 1, in the same run.

What it measures: ``--connections`` TCP connections, each keeping ``--in-flight`` requests of
``--batch`` keyed records of ``--record-bytes`` bytes outstanding for ``--seconds``, against
each setup in turn. ``--keys`` sets how many distinct keys the records take in turn (default:
one for each record of a request); ``--keys 0`` sends keyless records, each request whole to
one range (through forwarding, the receiving node picks the range in turn; to the leaders,
each request is stamped as the project's cluster clients stamp their produces, and goes to the
leader of the range its stamp picks). The setups:

* ``single``: one node, replication factor 1, ``SVC_GROUP_COMMIT=true`` (the baseline), all
  connections to it;
* ``rf3-gc-off`` and ``rf3-gc-on``: two clusters of three nodes with
  ``SVC_LOG_REPLICATION_FACTOR=3`` and ``SVC_REPLICATION_GROUP_COMMIT`` off or on (the range
  logs' group commit at replication factor above 1, which replaces ``SVC_GROUP_COMMIT`` there;
  ``--replication-group-commit-interval-ms`` sets its period, else the broker's default), the
  connections split evenly over the three nodes (``--connections`` must be a multiple of 3;
  the default 6 x 8 in flight is ``cluster_produce.py``'s load, two connections per node);
* ``rf3-gc-off-leaders`` and ``rf3-gc-on-leaders``: the same clusters driven as the project's
  cluster clients (``ClusterClient``, ``BlockingClusterClient``) produce: ``--connections``
  producers, each with a connection to every leader of the topic, each request's records cut
  into one share per leader with the clients' own ``LeaderMap`` (from ``topic_leaders``) and
  the shares sent together, the request answered once every share is (``--routing`` picks
  ``forwarded``, ``leaders`` or both);
* ``rf1x3-mirrored`` (with ``--mirrored``): what three copies cost on this machine without
  any replication protocol, the ceiling of replication built from the same storage path.
  Three more nodes at replication factor 1, each on its own (no etcd, no peer links), and
  ``--connections`` producers as for ``-leaders``, each sending every request whole to all
  three and answered once all three have acknowledged it: three fsynced copies of every
  record, made by the same storage code on the same cores and disk, with no replication
  protocol at all (no leader, no forwarding, no commit index, no replica answers). A
  replication factor 3 cluster makes the same copies and does the protocol's work on top.

Targets, as ratios to the single node in the same round: at least 0.6x with the project's
clients (``-leaders``) and 0.5x through forwarding (``TARGET_RATIO``). Measure the ceiling next
to them with ``--mirrored``: no replication design makes more than ``rf1x3-mirrored`` on the same
machine (on two cores it makes about half of the single node; ``bench/RESULTS.md``).

At replication factor 3 on three nodes every segment has a copy on every node: its primary
(the first replica) assigns offsets, appends, fsyncs and streams the stored bytes to the other
two, and a produce is acknowledged once two of the three copies have it fsynced
(``docs/decisions/0008-quorum-replication-by-claims.md``). A request sent to a node that does
not lead a range is forwarded to the range's primary first.

Per round and as medians over ``--repeat`` rounds: acknowledged records/s, MB/s (record values
only), latency p50/p99/p99.9 per request (a request is one batch), errors, and CPU as cores busy
on average: the load generator (``client``), the brokers of the setup under load (``server``,
all threads, summed; for a cluster also each node), etcd (all three members), and the brokers of
the setups not under load (``idle``: they stay up, and share the two cores). Also the brokers'
CPU per acknowledged record, the ratio to the single node of the same round, and whether each
replication factor 3 setup reaches the target of ``TARGET_RECORDS_PER_S``.

As a check that replication happened, after each round the records each node stores for the
round's topic are counted (every ``.log`` segment file of the topic's ranges in the node's data
directory, verified batch by batch with ``scan_batches``), with their bytes on disk; ``copies``
is the records stored over all nodes divided by the distinct records (per range, the most any
node holds). At replication factor 3 every node must hold at least every acknowledged record and
``copies`` must be 3.00; the third copy may trail the acknowledgement, so the count waits (up to
``_SETTLE_SECONDS``) until every node's segment files of the topic have the same sizes. A copy
short of the acknowledged records is printed as such and flagged ``complete: false`` in the
``--json`` output. Stored records exceed acknowledged ones by the readiness probes (one request
per node) and the requests still in flight when the window closed. For the cluster, as in
``cluster_produce.py``, the **forwarded fraction** (acknowledged records whose range another node
leads than the one their producer is connected to) and the share of each request's records each
node leads are computed from the topic's ranges and their primaries read from etcd; with
``-leaders``, the forwarded fraction is that of the records sent to a node that by etcd does not
lead their range (0 unless ``topic_leaders`` and etcd disagree).

How: everything is ``cluster_produce.py``'s machinery (``bench/_cluster.py``): a three-member
etcd (the ``etcd`` on ``PATH``; its data in ``/dev/shm`` when there is one), shared by both
clusters, each with its setup's name as its cluster id; ``twistd -n logbroker`` processes in env
mode ``test`` on free loopback ports, each with its own data directory in the temporary directory
``--dir`` names (default under ``bench/.work``, the disk of the working tree), and the same
``--ranges`` when given (else the broker's default ranges per topic). All seven brokers run for
the whole run; the order of the setups rotates from round to round (so with 3 rounds each setup
runs once first, once second, once last). Each round produces into a fresh topic, created
through the single node or a cluster's ``n1``; before the window opens every node of the setup
must have acknowledged one request of the round's frame on it (the topic, its segments' claims
and the peer links are in place). The load is ``logbroker.benchmark``'s closed loop, one per
node, started together, latency from the moment a request was due, only requests answered
inside the window counted.

Where the time goes: ``--profile DIR`` runs every broker under cProfile, which profiles its
reactor (main) thread and writes ``DIR/<setup>-<node>.prof`` (``single.prof``,
``rf3-gc-on-n1.prof``...) when the broker stops; cProfile slows the brokers down about twofold,
so such a run's figures only say where the time goes, for instance::

    .venv/bin/python bench/replicated_produce.py --repeat 1 --profile bench/.work/profiles
    .venv/bin/python -m pstats bench/.work/profiles/rf3-gc-on-n2.prof  # sort tottime, stats 20

Everything it starts is stopped, and the temporary directories are removed, at the end, also
after an error, SIGTERM or Ctrl-C. Loopback only. Run it from the repository root with the
project's virtualenv (about two and a half minutes with the defaults)::

    .venv/bin/python bench/replicated_produce.py
    .venv/bin/python bench/replicated_produce.py --repeat 5 --json
    .venv/bin/python bench/replicated_produce.py --replication-group-commit on --in-flight 16

Do not point ``--dir`` at tmpfs, where fsync costs nothing. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import attrs
from _cluster import (
    NODES,
    Etcd,
    KeylessToLeaders,
    LeaderShares,
    combined,
    drive,
    drive_to_leaders,
    forwarded_fraction,
    keyless_forwarded_fraction,
    keyless_led,
    leader_shares,
    read_placement,
    request_records,
    running_cluster,
    running_etcd,
    shares_forwarded,
    wait_until_produces,
)
from _common import (
    HOST,
    MAX_FRAME,
    Node,
    add_load_options,
    add_work_directory_option,
    announce_start,
    emit,
    loadavg,
    non_negative_int,
    positive_int,
    produce_line,
    produce_result,
    running_node,
    tail,
    unwind_on_sigterm,
    work_directory,
)
from twisted.internet import task
from twisted.internet.defer import Deferred, ensureDeferred

from logbroker.benchmark import ProduceLoad, produce_frame
from logbroker.storage._format import scan_batches
from logbroker.storage._segment import LOG_SUFFIX, is_segment_file

SINGLE = "single"
RF3_GC_OFF = "rf3-gc-off"
RF3_GC_ON = "rf3-gc-on"
MIRRORED_SETUP = "rf1x3-mirrored"
FORWARDED = "forwarded"
LEADERS = "leaders"
#: Each request sent whole to three independent nodes (``MIRRORED_SETUP``).
MIRRORED = "mirrored"
REPLICATION_FACTOR = 3
#: Acknowledged records/s the replication factor 3 setups should reach on a 2-core machine.
TARGET_RECORDS_PER_S = 100_000.0
#: The least share of the single node's records/s each way of reaching a replication factor 3
#: cluster should reach, in the same round: with the project's cluster clients (each share to
#: its leader), and through forwarding (a client that knows one address).
TARGET_RATIO = {LEADERS: 0.6, FORWARDED: 0.5}
#: How long the copies of a round's topic may take to reach the same size on every node.
_SETTLE_SECONDS = 15.0
_RANGES_DIR = "ranges"
#: The CPU meter's groups that are not one node.
_GROUPS = frozenset({"server", "etcd", "idle"})

_T = TypeVar("_T")


# -- what each node stores ----------------------------------------------------------------


@attrs.frozen
class Stored:
    """Records (in whole, checksummed batches) and bytes of segment files."""

    records: int = 0
    size: int = 0

    def __add__(self, other: Stored) -> Stored:
        return Stored(self.records + other.records, self.size + other.size)


def topic_ranges(data: str, topic: str) -> list[str]:
    """The ranges of ``topic`` that have a directory in the data directory ``data`` (a range
    id is the topic's name, a dot and the range's own part)."""
    try:
        names = os.listdir(os.path.join(data, _RANGES_DIR))
    except FileNotFoundError:
        return []
    return sorted(name for name in names if name.startswith(f"{topic}."))


def _segment_logs(data: str, range_id: str) -> list[str]:
    directory = os.path.join(data, _RANGES_DIR, range_id)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(
        os.path.join(directory, name)
        for name in names
        if is_segment_file(name) and name.endswith(LOG_SUFFIX)
    )


def log_sizes(data: str, topic: str) -> dict[str, int]:
    """Range id -> bytes of its segment files in ``data``, for ``topic``'s ranges."""
    return {
        range_id: sum(os.path.getsize(path) for path in _segment_logs(data, range_id))
        for range_id in topic_ranges(data, topic)
    }


def stored(data: str, topic: str) -> dict[str, Stored]:
    """Range id -> what the node with data directory ``data`` stores of ``topic``: the
    records of the verified batches of its segment files, and the files' bytes."""
    result = {}
    for range_id in topic_ranges(data, topic):
        total = Stored()
        for path in _segment_logs(data, range_id):
            with open(path, "rb") as f:
                content = f.read()
            scan = scan_batches(content)
            total += Stored(sum(batch.record_count for batch in scan.batches), len(content))
        result[range_id] = total
    return result


def copies(by_node: Mapping[str, Mapping[str, Stored]], *, by_range: bool = True) -> float:
    """Records stored over all nodes, divided by the distinct records: for each range, the
    most records any node holds of it; without ``by_range`` (independent nodes, each putting
    keyless records in its own ranges), the most records any node holds."""
    ranges = {range_id for held in by_node.values() for range_id in held}
    distinct = (
        sum(
            max(held.get(range_id, Stored()).records for held in by_node.values())
            for range_id in ranges
        )
        if by_range
        else max((sum(s.records for s in held.values()) for held in by_node.values()), default=0)
    )
    total = sum(s.records for held in by_node.values() for s in held.values())
    return total / distinct if distinct else float("nan")


def settle(
    nodes: Sequence[Node], topic: str, seconds: float = _SETTLE_SECONDS, *, by_range: bool = True
) -> bool:
    """Wait until the segment files of ``topic`` have the same sizes on every node (the copies
    trailing the acknowledgement have caught up), at most ``seconds``; whether they do.
    Without ``by_range``, the same size in all on every node (independent nodes, each putting
    keyless records in its own ranges)."""
    deadline = time.monotonic() + seconds
    while True:
        by_node = [log_sizes(node.data, topic) for node in nodes]
        sizes = by_node if by_range else [sum(size.values()) for size in by_node]
        if all(size == sizes[0] for size in sizes[1:]):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def round_order(setups: Sequence[_T], number: int) -> list[_T]:
    """The setups' order in round ``number`` (from 1): rotated by one each round, so over
    ``len(setups)`` rounds each setup runs once in each position."""
    shift = (number - 1) % len(setups)
    return [*setups[shift:], *setups[:shift]]


# -- the run ------------------------------------------------------------------------------


@attrs.frozen
class Setup:
    name: str
    nodes: tuple[Node, ...]
    #: The cluster's id in etcd; None for the single node (its own control plane).
    cluster_id: str | None = None
    #: How the load reaches a cluster: ``forwarded`` (each connection to one node in turn,
    #: which forwards the shares other nodes lead) or ``leaders`` (each request cut into one
    #: share per leader, as the project's cluster clients send it); ``mirrored``: each
    #: request whole to every node, which are independent (``MIRRORED_SETUP``).
    routing: str = FORWARDED


class Run:
    def __init__(self, args: argparse.Namespace, setups: Sequence[Setup], etcd: Etcd) -> None:
        self.args = args
        self.setups = list(setups)
        self.etcd = etcd
        self.rounds: dict[str, list[dict[str, Any]]] = {setup.name: [] for setup in setups}
        self.finished = False
        self.load = ProduceLoad(
            topic="",
            connections=args.connections,
            in_flight=args.in_flight,
            batch=args.batch,
            size=args.record_bytes,
            seconds=args.seconds,
            keys=args.batch if args.keys is None else args.keys,
        )

    async def produce(
        self, reactor: Any, setup: Setup, topic: str, seconds: float
    ) -> dict[str, Any]:
        nodes = setup.nodes
        load = attrs.evolve(self.load, topic=topic, seconds=seconds)
        frame = produce_frame(load)
        records = request_records(frame)
        keys = [record.key for record in records if record.key is not None]
        if len(keys) != (len(records) if load.keys else 0):
            raise RuntimeError(f"the load's records are not all {_keying(load.keys)}")
        for node in nodes if setup.routing == MIRRORED else nodes[:1]:
            with node.client() as client:
                client.create_topic(topic)
        wait_until_produces(nodes, topic, records)
        groups: dict[str, Sequence[int]] = {
            "server": [node.process.pid for node in nodes],
            "etcd": self.etcd.pids,
            "idle": sorted(
                {node.process.pid for other in self.setups for node in other.nodes}
                - {node.process.pid for node in nodes}
            ),
        }
        if len(nodes) > 1:
            groups.update({node.name: [node.process.pid] for node in nodes})
        refusals: Counter[str] = Counter()
        to_leaders: LeaderShares | KeylessToLeaders | None = None
        if setup.routing == LEADERS:
            to_leaders = (
                leader_shares(nodes[0], topic, frame)
                if load.keys
                else KeylessToLeaders.of(nodes[0], topic, frame)
            )
            reports, cpu = await drive_to_leaders(
                reactor, to_leaders.addresses, to_leaders.producer, load, groups, refusals
            )
        elif setup.routing == MIRRORED:
            mirrored = LeaderShares(
                {node.name: (HOST, node.port) for node in nodes},
                {node.name: frame for node in nodes},
                {node.name: records for node in nodes},
            )
            reports, cpu = await drive_to_leaders(
                reactor, mirrored.addresses, mirrored.producer, load, groups, refusals
            )
        else:
            reports, cpu = await drive(reactor, nodes, frame, load, groups, refusals)
        report = combined(list(reports.values()))
        node_cpu = {name: cpu.pop(f"{name}_cpu") for name in groups.keys() - _GROUPS}
        result: dict[str, Any] = {**produce_result(setup.name, report), **cpu}
        result["us_per_record"] = (
            result["server_cpu"] / result["records_per_s"] * 1e6
            if result["records_per_s"]
            else float("nan")
        )
        result["refusals"] = dict(refusals)
        result["records_by_node"] = {name: r.records for name, r in reports.items()}
        # Independent nodes put keyless records in ranges of their own choosing.
        by_range = bool(load.keys) or setup.routing != MIRRORED
        result["settled"] = settle(nodes, topic, by_range=by_range)
        held = {node.name: stored(node.data, topic) for node in nodes}
        totals = {name: sum(ranges.values(), Stored()) for name, ranges in held.items()}
        result["stored_records"] = {name: total.records for name, total in totals.items()}
        result["stored_mb"] = {name: total.size / 1e6 for name, total in totals.items()}
        result["copies"] = copies(held, by_range=by_range)
        result["complete"] = all(total.records >= report.records for total in totals.values())
        names = [node.name for node in nodes]
        if len(nodes) > 1:
            result["node_cpu"] = {name: node_cpu[name] for name in names}
        if setup.cluster_id is None:
            return result
        placement = read_placement(self.etcd, setup.cluster_id, names, topic, keys)
        acknowledged = result["records_by_node"]
        if isinstance(to_leaders, LeaderShares):
            result["forwarded"] = shares_forwarded(placement, to_leaders)
        elif isinstance(to_leaders, KeylessToLeaders):
            result["forwarded"] = to_leaders.forwarded(placement)
        elif keys:
            result["forwarded"] = forwarded_fraction(placement, acknowledged, load.batch, len(keys))
        else:
            result["forwarded"] = keyless_forwarded_fraction(placement, acknowledged)
        result["records_led"] = (
            {name: count / len(keys) for name, count in placement.per_request.items()}
            if keys
            else keyless_led(placement, names)
        )
        return result

    async def rounds_of(self, reactor: Any) -> None:
        args = self.args
        for setup in self.setups:
            await self.produce(reactor, setup, f"warmup-{setup.name}", args.warmup)
        for number in range(1, args.repeat + 1):
            for setup in round_order(self.setups, number):
                result = await self.produce(
                    reactor, setup, f"round{number}-{setup.name}", args.seconds
                )
                self.rounds[setup.name].append(result)
                emit(args.json, "produce", {"round": number, **result}, _line(number, result))

    def summarise(self) -> None:
        args = self.args
        if not args.json:
            print(
                f"\nmedians of {args.repeat} round(s) of {args.seconds:g} s, "
                f"{args.connections} connections x {args.in_flight} in flight x "
                f"{args.batch} {_keying(self.load.keys)} records of {args.record_bytes} B "
                f"(load average now: {loadavg()}):",
                flush=True,
            )
        singles = self.rounds[SINGLE]
        for setup in self.setups:
            runs = self.rounds[setup.name]
            summary: dict[str, Any] = {"system": setup.name, "rounds": len(runs)}
            keys = [
                "records_per_s",
                "mb_per_s",
                "p50_ms",
                "p99_ms",
                "p999_ms",
                "client_cpu",
                "server_cpu",
                "etcd_cpu",
                "idle_cpu",
                "us_per_record",
                "copies",
            ]
            if setup.cluster_id is not None:
                keys.append("forwarded")
            for key in keys:
                summary[key] = statistics.median(run[key] for run in runs)
            if len(setup.nodes) > 1:
                summary["node_cpu"] = {
                    node.name: statistics.median(run["node_cpu"][node.name] for run in runs)
                    for node in setup.nodes
                }
            summary["errors"] = sum(run["errors"] for run in runs)
            summary["refusals"] = dict(sum((Counter(run["refusals"]) for run in runs), Counter()))
            summary["complete"] = all(run["complete"] for run in runs)
            line = _median_line(summary)
            if setup.name != SINGLE:
                paired = [
                    run["records_per_s"] / single["records_per_s"]
                    for run, single in zip(runs, singles, strict=True)
                    if single["records_per_s"]
                ]
                summary["ratio_to_single"] = statistics.median(paired) if paired else float("nan")
                line += f"  {setup.name}/single={summary['ratio_to_single']:.2f}x"
            if setup.cluster_id is not None:
                wanted = TARGET_RATIO[setup.routing]
                summary["target_ratio"] = wanted
                ratio_met = summary["ratio_to_single"] >= wanted
                summary["ratio_target"] = "met" if ratio_met else "missed"
                line += f"  target >= {wanted:.1f}x: {'met' if ratio_met else 'MISSED'}"
                met = summary["records_per_s"] >= TARGET_RECORDS_PER_S
                summary["target_records_per_s"] = TARGET_RECORDS_PER_S
                summary["target"] = "met" if met else "missed"
                line += (
                    f"  target >= {TARGET_RECORDS_PER_S:,.0f} records/s: "
                    f"{'met' if met else 'MISSED'}"
                )
            line += _refusals_part(summary["refusals"])
            emit(args.json, "produce_summary", summary, line)


def _keying(keys: int) -> str:
    return "keyed" if keys else "keyless"


def _cpu_part(result: Mapping[str, Any]) -> str:
    return (
        f" etcd={result['etcd_cpu']:.2f} idle={result['idle_cpu']:.2f}"
        f"  ({result['us_per_record']:.1f} us of broker CPU per record)"
    )


def _line(number: int, result: Mapping[str, Any]) -> str:
    line = produce_line(f"round {number}", dict(result)) + _cpu_part(result)
    names = list(result["stored_records"])
    stored_records = "/".join(f"{result['stored_records'][name]:,}" for name in names)
    stored_mb = "/".join(f"{result['stored_mb'][name]:.1f}" for name in names)
    line += (
        f"\n         stored ({'/'.join(names)}): {stored_records} records, {stored_mb} MB,"
        f" {result['copies']:.2f} copies"
    )
    if not result["complete"]:
        line += " -- a copy holds fewer records than were acknowledged"
    elif not result["settled"]:
        line += " -- the copies had not reached the same size"
    if "node_cpu" in result:
        line += "\n         cpu per node " + "/".join(
            f"{result['node_cpu'][name]:.2f}" for name in names
        )
    if "forwarded" in result:
        led = "/".join(f"{result['records_led'][name]:.0%}" for name in names)
        line += f", records led {led}, forwarded={result['forwarded']:.1%}"
    return line + _refusals_part(result["refusals"])


def _refusals_part(refusals: Mapping[str, int]) -> str:
    if not refusals:
        return ""
    counted = ", ".join(f"{reason} x{count:,}" for reason, count in sorted(refusals.items()))
    return f"\n         error answers (also those after the window): {counted}"


def _median_line(summary: Mapping[str, Any]) -> str:
    line = produce_line("median ", dict(summary)) + _cpu_part(summary)
    line += f"\n         copies={summary['copies']:.2f}"
    if not summary["complete"]:
        line += " (a copy was short in some round)"
    if "node_cpu" in summary:
        line += "  cpu per node " + "/".join(f"{v:.2f}" for v in summary["node_cpu"].values())
    if "forwarded" in summary:
        line += f"  forwarded={summary['forwarded']:.1%}"
    return line


async def _measure(reactor: Any, run: Run) -> None:
    await run.rounds_of(reactor)
    run.summarise()
    run.finished = True


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Durable produce throughput of a three-node logbroker cluster at "
        "replication factor 3 (replication group commit off and on) next to one node at "
        "replication factor 1, under the same keyed (or keyless) load."
    )
    add_work_directory_option(parser, "write the brokers' data on")
    add_load_options(
        parser,
        connections=6,
        connections_help=f"connections in all, a multiple of {NODES} (6)",
        warmup=2.0,
        warmed="setup",
    )
    parser.add_argument(
        "--keys",
        type=non_negative_int,
        help="distinct record keys, taken in turn (default: --batch, a key for each record of "
        "a request); 0: keyless records, each request whole to one range (the project's "
        "cluster clients stamp each request and send it to the leader of its stamp's range)",
    )
    parser.add_argument(
        "--replication-group-commit",
        choices=("both", "off", "on"),
        default="both",
        help="which replication factor 3 clusters to run: SVC_REPLICATION_GROUP_COMMIT "
        "off, on, or both (both)",
    )
    parser.add_argument(
        "--replication-group-commit-interval-ms",
        type=positive_int,
        help="SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS of the clusters (default: the broker's)",
    )
    parser.add_argument(
        "--routing",
        choices=("both", FORWARDED, LEADERS),
        default="both",
        help="how the load reaches each cluster: forwarded (each connection to one node, "
        "which forwards what other nodes lead), leaders (each request cut into one share per "
        "leader, as the project's cluster clients send it; setup <cluster>-leaders), or both",
    )
    parser.add_argument(
        "--ranges",
        type=positive_int,
        help="SVC_TOPIC_RANGES of every broker: ranges per topic (default: the broker's)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="run every broker under cProfile (its reactor thread), writing <setup>-<node>.prof "
        "into DIR when it stops; the figures of such a run only say where the time goes",
    )
    parser.add_argument(
        "--mirrored",
        action="store_true",
        help=f"also run {MIRRORED_SETUP}: three independent nodes at replication factor 1, "
        "each request sent whole to all three (three copies without any replication protocol)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    args = parser.parse_args(argv)
    if args.connections % NODES:
        parser.error(f"--connections must be a multiple of {NODES}, to split over the nodes")
    if args.batch * (args.record_bytes + 64) > MAX_FRAME:
        parser.error(f"--batch x the record size must fit in one {MAX_FRAME}-byte frame")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    unwind_on_sigterm()
    announce_start(args.json)
    settings = {"SVC_GROUP_COMMIT": "true"}
    if args.ranges is not None:
        settings["SVC_TOPIC_RANGES"] = str(args.ranges)
    replicated = {**settings, "SVC_LOG_REPLICATION_FACTOR": str(REPLICATION_FACTOR)}
    if args.replication_group_commit_interval_ms is not None:
        interval = str(args.replication_group_commit_interval_ms)
        replicated["SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS"] = interval
    clusters = {
        "both": [RF3_GC_OFF, RF3_GC_ON],
        "off": [RF3_GC_OFF],
        "on": [RF3_GC_ON],
    }[args.replication_group_commit]
    routings = [FORWARDED, LEADERS] if args.routing == "both" else [args.routing]
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(work_directory(args.dir, "bench-replicated-"))
        if args.profile is not None:
            os.makedirs(args.profile, exist_ok=True)
        single = stack.enter_context(
            running_node(
                SINGLE,
                os.path.join(workdir, SINGLE),
                settings,
                None if args.profile is None else os.path.join(args.profile, f"{SINGLE}.prof"),
            )
        )
        setups = [Setup(SINGLE, (single,))]
        if args.mirrored:
            mirrors = tuple(
                stack.enter_context(
                    running_node(
                        f"m{number}",
                        os.path.join(workdir, MIRRORED_SETUP, f"m{number}"),
                        settings,
                        None
                        if args.profile is None
                        else os.path.join(args.profile, f"{MIRRORED_SETUP}-m{number}.prof"),
                    )
                )
                for number in range(1, NODES + 1)
            )
            setups.append(Setup(MIRRORED_SETUP, mirrors, routing=MIRRORED))
        etcd = stack.enter_context(running_etcd())
        for name in clusters:
            # etcd is this run's own: the setup's name is its cluster's id.
            cluster_id = name
            group_commit = "true" if name == RF3_GC_ON else "false"
            nodes = stack.enter_context(
                running_cluster(
                    etcd,
                    cluster_id,
                    os.path.join(workdir, name),
                    {**replicated, "SVC_REPLICATION_GROUP_COMMIT": group_commit},
                    profiles=args.profile,
                )
            )
            for routing in routings:
                setup_name = name if routing == FORWARDED else f"{name}-{LEADERS}"
                setups.append(Setup(setup_name, tuple(nodes), cluster_id, routing))
        run = Run(args, setups, etcd)

        def measure(reactor: Any) -> Deferred[None]:
            return ensureDeferred(_measure(reactor, run))

        try:
            task.react(measure)
        except SystemExit as exit:
            if exit.code:
                for setup in setups:
                    for node in setup.nodes:
                        print(f"--- {node.log}:\n{tail(node.log)}", file=sys.stderr)
                raise
            if not run.finished:
                raise SystemExit("interrupted before the measurement finished") from None
            raise


if __name__ == "__main__":
    main()
