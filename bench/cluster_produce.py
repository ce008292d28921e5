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
  (``produce_frame`` with ``keyed=True``: keys ``key-0`` to ``key-<batch - 1>``, one per record,
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
import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import attrs
from _common import (
    add_work_directory_option,
    emit,
    positive_float,
    positive_int,
    work_directory,
)
from produce_vs_redis import (
    _LISTENING,
    _MAX_FRAME,
    _RUN_GRACE_SECONDS,
    ADMIN,
    APP,
    HOST,
    TWISTD,
    _loadavg,
    _own_cpu,
    _process_cpu,
    _produce_line,
    _produce_result,
    _stop,
    _tail,
)
from twisted.internet import task
from twisted.internet.defer import Deferred, ensureDeferred, gatherResults

from logbroker import wire
from logbroker.benchmark import ProduceLoad, ProduceReport, _ProduceDriver, connect, produce_frame
from logbroker.broker.keyspace import key_slot
from logbroker.client import BrokerRefused
from logbroker.client.blocking import BlockingClient
from logbroker.records import Record

SINGLE = "single"
CLUSTER = "cluster"
NODES = 3
#: How long a process, the cluster or a topic may take to be ready.
_READY_SECONDS = 60.0


def _free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind((HOST, 0))
        return [int(probe.getsockname()[1]) for probe in probes]


# -- etcd ---------------------------------------------------------------------------------


@attrs.frozen
class Etcd:
    endpoints: tuple[str, ...]  # host:port
    pids: tuple[int, ...]

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for endpoint in self.endpoints:
            request = urllib.request.Request(
                f"http://{endpoint}{path}", data=json.dumps(body).encode(), method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    answer: dict[str, Any] = json.loads(response.read())
                    return answer
            except (OSError, ValueError):
                continue
        raise RuntimeError(f"no etcd member answered {path}")

    def prefix(self, prefix: str) -> dict[str, Any]:
        """Every key under ``prefix``, its value parsed as JSON (the control plane's records)."""
        start = prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        answer = self._post(
            "/v3/kv/range",
            {"key": base64.b64encode(start).decode(), "range_end": base64.b64encode(end).decode()},
        )
        if answer.get("more"):
            raise RuntimeError(f"etcd did not return all of {prefix} in one answer")
        return {
            base64.b64decode(kv["key"]).decode(): json.loads(base64.b64decode(kv["value"]))
            for kv in answer.get("kvs", ())
        }


def _etcd_healthy(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/health", timeout=1) as response:
            return bool(json.loads(response.read()).get("health") == "true")
    except (OSError, ValueError, urllib.error.URLError):
        return False


@contextlib.contextmanager
def running_etcd(size: int = NODES) -> Iterator[Etcd]:
    """``size`` etcd members on free loopback ports, their data in a temporary directory (in
    /dev/shm when there is one: etcd fsyncs every write and is not what is measured)."""
    executable = shutil.which("etcd")
    if executable is None:
        raise SystemExit("etcd is not on PATH (scripts/install --cluster installs it)")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = tempfile.mkdtemp(prefix="bench-etcd-", dir=base)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        ports = _free_ports(2 * size)
        names = [f"e{index}" for index in range(1, size + 1)]
        clients = [f"{HOST}:{ports[2 * index]}" for index in range(size)]
        peers = [f"http://{HOST}:{ports[2 * index + 1]}" for index in range(size)]
        initial = ",".join(f"{name}={peer}" for name, peer in zip(names, peers, strict=True))
        token = f"bench-{secrets.token_hex(6)}"
        for name, client, peer in zip(names, clients, peers, strict=True):
            command = [
                executable,
                "--name", name,
                "--data-dir", os.path.join(directory, name),
                "--listen-client-urls", f"http://{client}",
                "--advertise-client-urls", f"http://{client}",
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", initial,
                "--initial-cluster-token", token,
                "--initial-cluster-state", "new",
                "--logger", "zap",
                "--log-outputs", "stderr",
            ]  # fmt: skip
            with open(os.path.join(directory, f"{name}.log"), "wb") as log:
                processes.append(
                    subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
                )
        deadline = time.monotonic() + _READY_SECONDS
        for name, client, process in zip(names, clients, processes, strict=True):
            while not _etcd_healthy(client):
                if process.poll() is not None or time.monotonic() > deadline:
                    log_path = os.path.join(directory, f"{name}.log")
                    raise RuntimeError(f"etcd member {name} did not start:\n{_tail(log_path)}")
                time.sleep(0.05)
        yield Etcd(tuple(clients), tuple(process.pid for process in processes))
    finally:
        for process in processes:
            _stop(process, 10)
        shutil.rmtree(directory, ignore_errors=True)


# -- brokers ------------------------------------------------------------------------------


@attrs.frozen
class Node:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: str
    data: str

    def client(self, account: tuple[str, str] = ADMIN) -> BlockingClient:
        return BlockingClient.connect(HOST, self.port, *account, timeout=30)


@contextlib.contextmanager
def running_node(name: str, directory: str, settings: dict[str, str]) -> Iterator[Node]:
    """``twistd -n logbroker`` in env mode test on free loopback ports, its output in a file;
    only ``settings`` of this process's ``SVC_`` variables reach it."""
    os.makedirs(directory)
    log = os.path.join(directory, "twistd.log")
    data = os.path.join(directory, "data")
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.upper().startswith("SVC_") and key != "MIX_ENV"
    }
    env.update(
        SVC_ENV="test",
        SVC_DATA_DIR=data,
        SVC_BIND_HOST=HOST,
        SVC_TCP_PORT="0",
        SVC_DASHBOARD_PORT="0",
        **settings,
    )
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [TWISTD, "-n", "--pidfile=", "--logfile=-", "logbroker"],
            cwd=directory,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + _READY_SECONDS
        while True:
            match = _LISTENING.search(_tail(log, 400))
            if match is not None:
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{_tail(log)}")
            time.sleep(0.05)
        yield Node(name, process, int(match.group(2)), log, data)
    finally:
        _stop(process, 30)


def _wait_for_members(nodes: Sequence[Node]) -> None:
    """Until every node sees every node alive."""
    deadline = time.monotonic() + _READY_SECONDS
    names = {node.name for node in nodes}
    for node in nodes:
        while True:
            with node.client() as client:
                alive = {
                    member.node_id for member in client.describe_cluster().nodes if member.alive
                }
            if alive >= names:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node.name} sees only {sorted(alive)} alive")
            time.sleep(0.2)


def _wait_until_produces(nodes: Sequence[Node], topic: str, records: Sequence[Record]) -> None:
    """Until each node has acknowledged ``records`` (the round's frame) on ``topic``."""
    deadline = time.monotonic() + _READY_SECONDS
    for node in nodes:
        with node.client(APP) as client:
            while True:
                try:
                    client.produce(topic, records)
                    break
                except BrokerRefused as refused:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{node.name} refuses {topic}: {refused}") from None
                    time.sleep(0.1)


# -- where the records went ---------------------------------------------------------------


@attrs.frozen
class Placement:
    """Which node leads each range of a topic, and where one request's records go."""

    #: range id -> leading node
    leaders: dict[str, str]
    #: node -> records of one request whose range that node leads
    per_request: dict[str, int]


def cluster_placement(
    etcd: Etcd, cluster_id: str, nodes: Sequence[Node], topic: str, keys: Sequence[bytes]
) -> Placement:
    """The topic's ranges and their leaders from etcd, checked against the data directories."""
    prefix = f"/logbroker/{cluster_id}/state/"
    state = etcd.prefix(prefix)
    topic_record = state[f"{prefix}topics/{topic}"]
    bits = int(topic_record["keyspace_bits"])
    ranges = [state[f"{prefix}ranges/{range_id}"] for range_id in topic_record["range_ids"]]
    leaders: dict[str, str] = {}
    for range_record in ranges:
        range_id = range_record["range_id"]
        active = [
            record
            for key, record in state.items()
            if key.startswith(f"{prefix}segments/{range_id}/") and record["state"] == "active"
        ]
        if len(active) != 1:
            raise RuntimeError(f"range {range_id} has {len(active)} active segments in etcd")
        leaders[range_id] = active[0]["replicas"][0]
    # Replication factor 1: a range's directory exists on its leader, and only there.
    for node in nodes:
        held = {
            range_id
            for range_id in leaders
            if os.path.isdir(os.path.join(node.data, "ranges", range_id))
        }
        led = {range_id for range_id, leader in leaders.items() if leader == node.name}
        if held != led:
            raise RuntimeError(
                f"{node.name}'s data directory holds {sorted(held)}, etcd says it leads "
                f"{sorted(led)}"
            )
    per_request = dict.fromkeys((node.name for node in nodes), 0)
    for key in keys:
        slot = key_slot(key, bits)
        (range_id,) = (r["range_id"] for r in ranges if r["start"] <= slot < r["end"])
        per_request[leaders[range_id]] += 1
    return Placement(leaders, per_request)


# -- load ---------------------------------------------------------------------------------


class CpuMeter:
    """CPU time of this process and of groups of processes (all threads) since the meter was
    made, as cores busy on average over the wall time."""

    def __init__(self, groups: dict[str, Sequence[int]]) -> None:
        self._groups = groups
        self._started = time.perf_counter()
        self._own = _own_cpu()
        self._before = {name: self._cpu(pids) for name, pids in groups.items()}

    @staticmethod
    def _cpu(pids: Sequence[int]) -> float:
        return sum(_process_cpu(pid) for pid in pids)

    def read(self) -> dict[str, float]:
        wall = time.perf_counter() - self._started
        result = {"client_cpu": (_own_cpu() - self._own) / wall}
        for name, pids in self._groups.items():
            result[f"{name}_cpu"] = (self._cpu(pids) - self._before[name]) / wall
        return result


async def drive(
    reactor: Any,
    nodes: Sequence[Node],
    frame: bytes,
    load: ProduceLoad,
    cpu_groups: dict[str, Sequence[int]],
) -> tuple[dict[str, ProduceReport], dict[str, float]]:
    """``load`` split evenly over ``nodes``: one closed loop per node, started together."""
    per_node = attrs.evolve(load, connections=load.connections // len(nodes))
    connections = {
        node.name: [
            await connect(reactor, HOST, node.port, *APP) for _ in range(per_node.connections)
        ]
        for node in nodes
    }
    drivers = {
        name: _ProduceDriver(reactor, ready, frame, per_node) for name, ready in connections.items()
    }
    cpu = CpuMeter(cpu_groups)
    running = []
    for driver in drivers.values():
        run = driver.run()
        run.addTimeout(load.seconds + _RUN_GRACE_SECONDS, reactor)
        running.append(run)
    reports = await gatherResults(running, consumeErrors=True)
    return dict(zip(drivers, reports, strict=True)), cpu.read()


def combined(reports: Sequence[ProduceReport]) -> ProduceReport:
    first = reports[0]
    return ProduceReport(
        sum(report.records for report in reports),
        sum(report.requests for report in reports),
        sum(report.errors for report in reports),
        first.seconds,
        first.record_bytes,
        tuple(latency for report in reports for latency in report.latencies_ms),
    )


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
            keyed=True,
        )

    def nodes(self, setup: str) -> list[Node]:
        return [self.single] if setup == SINGLE else list(self.cluster)

    async def produce(self, reactor: Any, setup: str, topic: str, seconds: float) -> dict[str, Any]:
        nodes = self.nodes(setup)
        load = attrs.evolve(self.load, topic=topic, seconds=seconds)
        frame = produce_frame(load)
        request = wire.decode_request(frame[4:]).request
        assert isinstance(request, wire.Produce), request
        keys = [record.key for record in request.records if record.key is not None]
        if len(keys) != len(request.records):
            raise RuntimeError("the load's records are not all keyed")
        with nodes[0].client() as client:
            client.create_topic(topic)
        _wait_until_produces(nodes, topic, request.records)
        groups: dict[str, Sequence[int]] = {
            "server": [node.process.pid for node in nodes],
            "etcd": self.etcd.pids,
        }
        if setup == CLUSTER:
            groups.update({node.name: [node.process.pid] for node in nodes})
        reports, cpu = await drive(reactor, nodes, frame, load, groups)
        report = combined(list(reports.values()))
        result: dict[str, Any] = {**_produce_result(setup, report), **cpu}
        result["records_by_node"] = {name: r.records for name, r in reports.items()}
        if setup == SINGLE:
            result["forwarded"] = 0.0
            return result
        placement = cluster_placement(self.etcd, self.cluster_id, nodes, topic, keys)
        forwarded = sum(
            reports[node.name].records
            // load.batch
            * (len(keys) - placement.per_request[node.name])
            for node in nodes
        )
        result["forwarded"] = forwarded / report.records if report.records else float("nan")
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
                f"(load average now: {_loadavg()}):",
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
            line = _produce_line("median ", summary) + f" etcd={summary['etcd_cpu']:.2f}"
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
    line = _produce_line(f"round {number}", result) + f" etcd={result['etcd_cpu']:.2f}"
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
    parser.add_argument(
        "--connections",
        type=positive_int,
        default=6,
        help=f"connections in all, a multiple of {NODES} (6)",
    )
    parser.add_argument(
        "--in-flight", type=positive_int, default=8, help="requests in flight per connection (8)"
    )
    parser.add_argument("--batch", type=positive_int, default=100, help="records per request (100)")
    parser.add_argument(
        "--record-bytes", type=positive_int, default=100, help="value bytes per record (100)"
    )
    parser.add_argument(
        "--seconds", type=positive_float, default=10.0, help="length of each round (10)"
    )
    parser.add_argument(
        "--warmup",
        type=positive_float,
        default=2.0,
        help="unrecorded run per setup before the rounds, seconds (2)",
    )
    parser.add_argument(
        "--repeat", type=positive_int, default=3, help="rounds; the summary takes medians (3)"
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
    if args.batch * (args.record_bytes + 64) > _MAX_FRAME:
        parser.error(f"--batch x the record size must fit in one {_MAX_FRAME}-byte frame")
    return args


def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    # Outside the reactor (setup, teardown) a SIGTERM unwinds through the cleanup below; while
    # the reactor runs, its own handler stops it, which unwinds the same way.
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    started = datetime.now(UTC)
    if not args.json:
        print(f"{started:%Y-%m-%d %H:%M:%S} UTC, load average at start: {_loadavg()}", flush=True)
    settings = {"SVC_GROUP_COMMIT": "true" if args.group_commit == "on" else "false"}
    if args.ranges is not None:
        settings["SVC_TOPIC_RANGES"] = str(args.ranges)
    cluster_id = f"bench-{secrets.token_hex(4)}"
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(work_directory(args.dir, "bench-cluster-"))
        single = stack.enter_context(running_node(SINGLE, os.path.join(workdir, SINGLE), settings))
        etcd = stack.enter_context(running_etcd())
        cluster_settings = {
            **settings,
            "SVC_CONTROL_PLANE": "etcd://" + ",".join(etcd.endpoints),
            "SVC_CLUSTER_ID": cluster_id,
            "SVC_ADVERTISE_HOST": HOST,
            "SVC_PEER_PORT": "0",
            "SVC_CLUSTER_SECRET": secrets.token_hex(16),
        }
        cluster = [
            stack.enter_context(
                running_node(
                    f"n{index}",
                    os.path.join(workdir, f"n{index}"),
                    {**cluster_settings, "SVC_NODE_ID": f"n{index}"},
                )
            )
            for index in range(1, NODES + 1)
        ]
        _wait_for_members(cluster)
        run = Run(args, single, cluster, etcd, cluster_id)

        def measure(reactor: Any) -> Deferred[None]:
            return ensureDeferred(_measure(reactor, run))

        try:
            task.react(measure)
        except SystemExit as exit:
            if exit.code:
                for node in (single, *cluster):
                    print(f"--- {node.log}:\n{_tail(node.log)}", file=sys.stderr)
                raise
            if not run.finished:
                raise SystemExit("interrupted before the measurement finished") from None
            raise


if __name__ == "__main__":
    main()
