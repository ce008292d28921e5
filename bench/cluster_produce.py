"""Durable produce throughput of one broker and of a three-node cluster (replication factor 1)
under the same load, in the same run.

What it measures: ``--connections`` TCP connections, each keeping ``--in-flight`` requests of
``--batch`` keyed records of ``--record-bytes`` bytes outstanding for ``--seconds``, first against
one node (all connections to it), then against a cluster of three nodes with the same
connections split evenly over the nodes (``--connections`` must be a multiple of 3: the standard
4 connections are not, so the default here is 6 x 8 in flight, two connections per node in the
cluster). Per round and as medians over ``--repeat`` rounds: acknowledged records/s, MB/s (record
values only), latency p50/p99/p99.9 per request (a request is one batch), errors, the CPU of the
load generator, of the brokers (all their threads, summed over the nodes) and of etcd, and for
the cluster the **forwarded fraction**: the share of acknowledged records whose range is led by
a node other than the one their producer is connected to; per cluster round also how many ranges
each node leads, the share of the records it stores, and its CPU.

How:

* One node: the project's ``twistd -n logbroker``, env mode ``test``, with its own (local)
  control plane, listening on a free loopback port.
* The cluster: a three-member etcd (the ``etcd`` on ``PATH``, 3.4) on free loopback ports with
  its data in a temporary directory under ``/dev/shm`` when there is one (etcd is only the
  control plane here: topics, placement, membership leases; no produce goes through it), and
  three ``twistd -n logbroker`` with ``SVC_CONTROL_PLANE=etcd://...``, node ids ``n1`` to ``n3``,
  a cluster id and secret of this run, and free client, dashboard and peer ports. Before the
  rounds the script waits until every node sees all three alive.
* Every broker has its own data directory in the temporary directory ``--dir`` names (default
  under ``bench/.work``, the disk of the working tree), with the same settings
  (``--group-commit``, and ``--ranges`` when given, else the broker's default number of ranges
  per topic). The single node and the cluster run side by side for the whole run; rounds
  alternate their order (single first, then last, ...) so that drift on a shared machine
  favours neither.
* Each round produces into a fresh topic, created through the single node or through ``n1``.
  The cluster places a topic's ranges over the live nodes by rendezvous hashing, so which node
  leads which range, and thus how the records are shared between the nodes, changes from round
  to round (with the producers split evenly, the forwarded fraction stays near 2/3 whatever the
  placement). Before a round starts, every node it loads must have acknowledged one request of
  the round's frame on the round's topic: the topic and its placement have reached every node,
  and the peer links that request needs are up.
* The load is ``logbroker.benchmark``'s (the generator behind ``logbroker bench``), driven as
  ``bench/produce_vs_redis.py`` drives it: one request frame of keyed records
  (``produce_frame`` with ``keys=batch``: keys ``key-0`` to ``key-<batch - 1>``, one per record,
  the same in every request) reused with fresh correlation ids, a closed loop per node in one
  process and one reactor, latency from the moment a request was due, and only requests answered
  inside the window counted. In the cluster one driver runs per node, all started together.
* The forwarded fraction is computed after each cluster round, not assumed: the keys are decoded
  from the request frame that was sent, each key's slot is ``key_slot(key, keyspace_bits)``, and
  the topic, its ranges (``[start, end)`` slots) and each range's active segment (whose first
  replica is its primary) are read from etcd. Each node's data directory is checked to hold
  exactly the ranges etcd says it leads (with replication factor 1 a range's directory exists
  only on its leader). A node's acknowledged requests times the records of one request whose
  range another node leads, summed over the nodes, over all acknowledged records, is the
  fraction.

Everything it starts is stopped, and the temporary directories are removed, at the end, also
after an error, SIGTERM or Ctrl-C; every wait is bounded. Loopback only. Run it from the
repository root with the project's virtualenv (about two minutes with the defaults)::

    .venv/bin/python bench/cluster_produce.py
    .venv/bin/python bench/cluster_produce.py --repeat 5 --json
    .venv/bin/python bench/cluster_produce.py --seconds 5 --ranges 12

Do not point ``--dir`` at tmpfs, where fsync costs nothing. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import attrs
from _cluster import (
    NODES,
    Etcd,
    Placement,
    combined,
    drive,
    forwarded_fraction,
    read_placement,
    request_records,
    running_cluster,
    running_etcd,
    wait_until_produces,
)
from _common import (
    MAX_FRAME,
    Node,
    add_load_options,
    add_work_directory_option,
    announce_start,
    emit,
    loadavg,
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

SINGLE = "single"
CLUSTER = "cluster"


def cluster_placement(
    etcd: Etcd, cluster_id: str, nodes: Sequence[Node], topic: str, keys: Sequence[bytes]
) -> Placement:
    """The topic's ranges and their leaders from etcd, checked against the data directories."""
    placement = read_placement(etcd, cluster_id, [node.name for node in nodes], topic, keys)
    # Replication factor 1: a range's directory exists on its leader, and only there.
    for node in nodes:
        held = {
            range_id
            for range_id in placement.leaders
            if os.path.isdir(os.path.join(node.data, "ranges", range_id))
        }
        led = {range_id for range_id, leader in placement.leaders.items() if leader == node.name}
        if held != led:
            raise RuntimeError(
                f"{node.name}'s data directory holds {sorted(held)}, etcd says it leads "
                f"{sorted(led)}"
            )
    return placement


class Run:
    def __init__(
        self,
        args: argparse.Namespace,
        single: Node,
        cluster: Sequence[Node],
        etcd: Etcd,
        cluster_id: str,
    ) -> None:
        self.args = args
        self.single = single
        self.cluster = cluster
        self.etcd = etcd
        self.cluster_id = cluster_id
        self.rounds: dict[str, list[dict[str, Any]]] = {SINGLE: [], CLUSTER: []}
        self.finished = False
        self.load = ProduceLoad(
            topic="",
            connections=args.connections,
            in_flight=args.in_flight,
            batch=args.batch,
            size=args.record_bytes,
            seconds=args.seconds,
            keys=args.batch,
        )

    def nodes(self, setup: str) -> list[Node]:
        return [self.single] if setup == SINGLE else list(self.cluster)

    async def produce(self, reactor: Any, setup: str, topic: str, seconds: float) -> dict[str, Any]:
        nodes = self.nodes(setup)
        load = attrs.evolve(self.load, topic=topic, seconds=seconds)
        frame = produce_frame(load)
        records = request_records(frame)
        keys = [record.key for record in records if record.key is not None]
        if len(keys) != len(records):
            raise RuntimeError("the load's records are not all keyed")
        with nodes[0].client() as client:
            client.create_topic(topic)
        wait_until_produces(nodes, topic, records)
        groups: dict[str, Sequence[int]] = {
            "server": [node.process.pid for node in nodes],
            "etcd": self.etcd.pids,
        }
        if setup == CLUSTER:
            groups.update({node.name: [node.process.pid] for node in nodes})
        reports, cpu = await drive(reactor, nodes, frame, load, groups)
        report = combined(list(reports.values()))
        result: dict[str, Any] = {**produce_result(setup, report), **cpu}
        result["records_by_node"] = {name: r.records for name, r in reports.items()}
        if setup == SINGLE:
            result["forwarded"] = 0.0
            return result
        placement = cluster_placement(self.etcd, self.cluster_id, nodes, topic, keys)
        result["forwarded"] = forwarded_fraction(
            placement, result["records_by_node"], load.batch, len(keys)
        )
        result["ranges_led"] = {
            node.name: sum(1 for leader in placement.leaders.values() if leader == node.name)
            for node in nodes
        }
        # The share of every request's records (so of all records) each node stores.
        result["records_led"] = {
            name: count / len(keys) for name, count in placement.per_request.items()
        }
        return result

    async def rounds_of(self, reactor: Any) -> None:
        args = self.args
        for setup in (SINGLE, CLUSTER):
            await self.produce(reactor, setup, f"warmup{setup}", args.warmup)
        for number in range(1, args.repeat + 1):
            order = [SINGLE, CLUSTER] if number % 2 else [CLUSTER, SINGLE]
            for setup in order:
                result = await self.produce(reactor, setup, f"round{number}{setup}", args.seconds)
                self.rounds[setup].append(result)
                emit(args.json, "produce", {"round": number, **result}, _line(number, result))

    def summarise(self) -> None:
        args = self.args
        if not args.json:
            print(
                f"\nmedians of {args.repeat} round(s) of {args.seconds:g} s, "
                f"{args.connections} connections x {args.in_flight} in flight x "
                f"{args.batch} keyed records of {args.record_bytes} B "
                f"(load average now: {loadavg()}):",
                flush=True,
            )
        singles = self.rounds[SINGLE]
        for setup in (SINGLE, CLUSTER):
            runs = self.rounds[setup]
            summary: dict[str, Any] = {"system": setup, "rounds": len(runs)}
            for key in (
                "records_per_s",
                "mb_per_s",
                "p50_ms",
                "p99_ms",
                "p999_ms",
                "client_cpu",
                "server_cpu",
                "etcd_cpu",
                "forwarded",
            ):
                summary[key] = statistics.median(run[key] for run in runs)
            summary["errors"] = sum(run["errors"] for run in runs)
            line = produce_line("median ", summary) + f" etcd={summary['etcd_cpu']:.2f}"
            if setup == CLUSTER:
                paired = [
                    run["records_per_s"] / single["records_per_s"]
                    for run, single in zip(runs, singles, strict=True)
                    if single["records_per_s"]
                ]
                summary["ratio_to_single"] = statistics.median(paired) if paired else float("nan")
                summary["forwarded_min"] = min(run["forwarded"] for run in runs)
                summary["forwarded_max"] = max(run["forwarded"] for run in runs)
                line += (
                    f"\n         forwarded={summary['forwarded']:.1%}"
                    f" (rounds {summary['forwarded_min']:.1%}-{summary['forwarded_max']:.1%})"
                    f"  cluster/single={summary['ratio_to_single']:.2f}x"
                )
            emit(args.json, "produce_summary", summary, line)


def _line(number: int, result: dict[str, Any]) -> str:
    line = produce_line(f"round {number}", result) + f" etcd={result['etcd_cpu']:.2f}"
    if result["system"] == CLUSTER:
        led = " ".join(
            f"{name}:{result['ranges_led'][name]}r/{share:.0%}/{result[f'{name}_cpu']:.2f}"
            for name, share in result["records_led"].items()
        )
        line += (
            f"\n         forwarded={result['forwarded']:.1%}"
            f"  led (ranges/records/cpu of each node): {led}"
        )
    return line


async def _measure(reactor: Any, run: Run) -> None:
    await run.rounds_of(reactor)
    run.summarise()
    run.finished = True


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Durable produce throughput of one logbroker node and of a three-node "
        "cluster (replication factor 1) under the same keyed load, and the forwarded fraction."
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
        "--group-commit",
        choices=("on", "off"),
        default="on",
        help="SVC_GROUP_COMMIT of every broker (on)",
    )
    parser.add_argument(
        "--ranges",
        type=positive_int,
        help="SVC_TOPIC_RANGES of every broker: ranges per topic (default: the broker's)",
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
    settings = {"SVC_GROUP_COMMIT": "true" if args.group_commit == "on" else "false"}
    if args.ranges is not None:
        settings["SVC_TOPIC_RANGES"] = str(args.ranges)
    cluster_id = f"bench-{secrets.token_hex(4)}"
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(work_directory(args.dir, "bench-cluster-"))
        single = stack.enter_context(running_node(SINGLE, os.path.join(workdir, SINGLE), settings))
        etcd = stack.enter_context(running_etcd())
        cluster = stack.enter_context(running_cluster(etcd, cluster_id, workdir, settings))
        run = Run(args, single, cluster, etcd, cluster_id)

        def measure(reactor: Any) -> Deferred[None]:
            return ensureDeferred(_measure(reactor, run))

        try:
            task.react(measure)
        except SystemExit as exit:
            if exit.code:
                for node in (single, *cluster):
                    print(f"--- {node.log}:\n{tail(node.log)}", file=sys.stderr)
                raise
            if not run.finished:
                raise SystemExit("interrupted before the measurement finished") from None
            raise


if __name__ == "__main__":
    main()
