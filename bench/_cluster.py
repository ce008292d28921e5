"""Clusters for the benchmarks: a three-member etcd and ``twistd -n logbroker`` nodes on free
loopback ports, the waits before a measurement, where a topic's ranges are led, and the closed
load of ``logbroker.benchmark`` spread evenly over several nodes.

Used by ``cluster_produce.py`` (one node next to a cluster at replication factor 1) and
``replicated_produce.py`` (one node next to clusters at replication factor 3).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from _common import (
    APP,
    HOST,
    READY_SECONDS,
    RUN_GRACE_SECONDS,
    CpuMeter,
    Node,
    announce_start,
    free_ports,
    running_node,
    stop,
    tail,
    unwind_on_sigterm,
    work_directory,
)
from twisted.internet.defer import gatherResults

from logbroker import wire
from logbroker.benchmark import ProduceLoad, ProduceReport, _ProduceDriver, connect
from logbroker.client import BrokerRefused
from logbroker.client._leaders import LeaderMap
from logbroker.key_routing import key_slot
from logbroker.records import ProducerStamp, Record, WireRecords

NODES = 3


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
        ports = free_ports(2 * size)
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
        deadline = time.monotonic() + READY_SECONDS
        for name, client, process in zip(names, clients, processes, strict=True):
            while not _etcd_healthy(client):
                if process.poll() is not None or time.monotonic() > deadline:
                    log_path = os.path.join(directory, f"{name}.log")
                    raise RuntimeError(f"etcd member {name} did not start:\n{tail(log_path)}")
                time.sleep(0.05)
        yield Etcd(tuple(clients), tuple(process.pid for process in processes))
    finally:
        for process in processes:
            stop(process, 10)
        shutil.rmtree(directory, ignore_errors=True)


# -- brokers ------------------------------------------------------------------------------


@contextlib.contextmanager
def running_cluster(
    etcd: Etcd,
    cluster_id: str,
    directory: str,
    settings: Mapping[str, str],
    size: int = NODES,
    profiles: str | None = None,
) -> Iterator[list[Node]]:
    """``size`` nodes ``n1``, ``n2``... of cluster ``cluster_id`` on ``etcd``, each with
    ``settings`` and its own directory in ``directory``, once every node sees all alive. With
    ``profiles`` (a directory), each runs under cProfile, writing ``<cluster id>-<node>.prof``
    there (see ``running_node``)."""
    cluster_settings = {
        **settings,
        "SVC_CONTROL_PLANE": "etcd://" + ",".join(etcd.endpoints),
        "SVC_CLUSTER_ID": cluster_id,
        "SVC_ADVERTISE_HOST": HOST,
        "SVC_PEER_PORT": "0",
        "SVC_CLUSTER_SECRET": secrets.token_hex(16),
    }
    with contextlib.ExitStack() as stack:
        nodes = [
            stack.enter_context(
                running_node(
                    f"n{index}",
                    os.path.join(directory, f"n{index}"),
                    {**cluster_settings, "SVC_NODE_ID": f"n{index}"},
                    None
                    if profiles is None
                    else os.path.join(profiles, f"{cluster_id}-n{index}.prof"),
                )
            )
            for index in range(1, size + 1)
        ]
        wait_for_members(nodes)
        yield nodes


@contextlib.contextmanager
def cluster_run(args: Any, prefix: str) -> Iterator[tuple[str, Etcd]]:
    """A cluster benchmark's run: SIGTERM unwinds it, its start is announced, and it gets a
    scratch directory (``--dir``, named ``prefix``...), ``--profile``'s directory made, and
    the etcd every round uses; all removed or stopped at the end."""
    unwind_on_sigterm()
    announce_start(args.json)
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(work_directory(args.dir, prefix))
        if args.profile is not None:
            os.makedirs(args.profile, exist_ok=True)
        yield workdir, stack.enter_context(running_etcd())


def wait_for_members(nodes: Sequence[Node]) -> None:
    """Until every node sees every node alive."""
    deadline = time.monotonic() + READY_SECONDS
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


def wait_until_produces(nodes: Sequence[Node], topic: str, records: Sequence[Record]) -> None:
    """Until each node has acknowledged ``records`` (the round's frame) on ``topic``."""
    deadline = time.monotonic() + READY_SECONDS
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


def request_records(frame: bytes) -> tuple[Record, ...]:
    """The records of a produce request frame, as sent."""
    request = wire.decode_request(frame[4:]).request
    if not isinstance(request, wire.Produce):
        raise TypeError(f"not a produce request: {request!r}")
    return wire.decode_wire_records(request.records)


# -- where the records go -----------------------------------------------------------------


@attrs.frozen
class Placement:
    """Which node leads each range of a topic, and where one request's records go."""

    #: range id -> leading node (the first replica of its active segment)
    leaders: dict[str, str]
    #: node -> records of one request whose range that node leads
    per_request: dict[str, int]
    #: each key of a request -> the node leading its range
    key_leaders: dict[bytes, str] = attrs.field(factory=dict)
    #: each range's leader, the ranges in keyspace order
    range_leaders: tuple[str, ...] = ()


def read_placement(
    etcd: Etcd, cluster_id: str, node_names: Sequence[str], topic: str, keys: Sequence[bytes]
) -> Placement:
    """The topic's ranges and their leaders, read from etcd, and where ``keys`` go."""
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
    per_request = dict.fromkeys(node_names, 0)
    key_leaders = {}
    for key in keys:
        slot = key_slot(key, bits)
        (range_id,) = (r["range_id"] for r in ranges if r["start"] <= slot < r["end"])
        per_request[leaders[range_id]] += 1
        key_leaders[key] = leaders[range_id]
    in_order = sorted(ranges, key=lambda record: int(record["start"]))
    range_leaders = tuple(leaders[record["range_id"]] for record in in_order)
    return Placement(leaders, per_request, key_leaders, range_leaders)


def forwarded_fraction(
    placement: Placement, acknowledged: Mapping[str, int], batch: int, keys: int
) -> float:
    """The share of the records ``acknowledged`` by each node (its producers' records) whose
    range another node leads: each request of a node sends ``keys - per_request[node]`` of its
    ``keys`` records on."""
    total = sum(acknowledged.values())
    if not total:
        return float("nan")
    forwarded = sum(
        records // batch * (keys - placement.per_request[node])
        for node, records in acknowledged.items()
    )
    return forwarded / total


def keyless_led(placement: Placement, node_names: Sequence[str]) -> dict[str, float]:
    """The share of keyless requests each node leads the range of: a keyless request goes whole
    to one range, each range in turn (by the receiving node's turn, or the stamp's slot)."""
    ranges = len(placement.range_leaders)
    return {name: placement.range_leaders.count(name) / ranges for name in node_names}


def keyless_forwarded_fraction(placement: Placement, acknowledged: Mapping[str, int]) -> float:
    """The share of the keyless records ``acknowledged`` by each node (its producers' records)
    whose range another node leads: each range takes its turn of every node's requests."""
    total = sum(acknowledged.values())
    if not total:
        return float("nan")
    led = keyless_led(placement, list(acknowledged))
    return sum(records * (1 - led[node]) for node, records in acknowledged.items()) / total


def shares_forwarded(placement: Placement, shares: LeaderShares) -> float:
    """The share of a request's records cut by leaders (``leader_shares``) sent to a node
    that, by the placement read from etcd, does not lead their range: 0 unless
    ``topic_leaders`` and etcd disagree."""
    sent = [
        (leader, record.key) for leader, records in shares.records.items() for record in records
    ]
    astray = sum(placement.key_leaders[key] != leader for leader, key in sent if key is not None)
    return astray / len(sent) if sent else float("nan")


# -- load ---------------------------------------------------------------------------------


class _CountingRefusals:
    """A load connection that counts the reasons of the error answers it gets."""

    def __init__(self, connection: Any, reasons: Counter[str]) -> None:
        self._connection = connection
        self._reasons = reasons

    @property
    def transport(self) -> Any:
        return self._connection.transport

    def send(
        self, frame: bytes, due: float, answered: Callable[[wire.Response, float], None]
    ) -> None:
        def counted(response: wire.Response, due: float) -> None:
            if response.reason is not None:
                self._reasons[response.reason] += 1
            answered(response, due)

        self._connection.send(frame, due, counted)


async def drive(
    reactor: Any,
    nodes: Sequence[Node],
    frame: bytes,
    load: ProduceLoad,
    cpu_groups: Mapping[str, Sequence[int]],
    refusals: Counter[str] | None = None,
) -> tuple[dict[str, ProduceReport], dict[str, float]]:
    """``load`` split evenly over ``nodes``: one closed loop per node, started together;
    the reasons of the error answers are counted in ``refusals`` when given."""
    per_node = attrs.evolve(load, connections=load.connections // len(nodes))
    connections: dict[str, list[Any]] = {
        node.name: [
            await connect(reactor, HOST, node.port, *APP) for _ in range(per_node.connections)
        ]
        for node in nodes
    }
    if refusals is not None:
        connections = {
            name: [_CountingRefusals(connection, refusals) for connection in ready]
            for name, ready in connections.items()
        }
    drivers = {
        name: _ProduceDriver(reactor, ready, frame, per_node) for name, ready in connections.items()
    }
    cpu = CpuMeter(cpu_groups)
    running = []
    for driver in drivers.values():
        run = driver.run()
        run.addTimeout(load.seconds + RUN_GRACE_SECONDS, reactor)
        running.append(run)
    reports = await gatherResults(running, consumeErrors=True)
    return dict(zip(drivers, reports, strict=True)), cpu.read()


class _ConnectionsToNodes:
    """One producer with a connection to each of several nodes: closed as one."""

    def __init__(self, connections: Mapping[str, Any]) -> None:
        self._connections = connections

    @property
    def transport(self) -> Any:
        return self

    def loseConnection(self) -> None:
        for connection in self._connections.values():
            connection.transport.loseConnection()


class _SharesConnection(_ConnectionsToNodes):
    """One producer as the project's cluster clients produce: a connection to every leader of
    the topic, and each request its records cut into one share per leader
    (``logbroker.client._leaders.LeaderMap``), all sent at once; answered once every share is
    (the first error answer, if any), as ``ClusterClient.produce`` fires."""

    def __init__(self, connections: Mapping[str, Any], frames: Mapping[str, bytes]) -> None:
        super().__init__(connections)
        self._frames = frames

    def send(
        self, frame: bytes, due: float, answered: Callable[[wire.Response, float], None]
    ) -> None:
        waiting = len(self._frames)
        errors: list[wire.Response] = []

        def share_answered(response: wire.Response, _: float) -> None:
            nonlocal waiting
            waiting -= 1
            if response.reason is not None:
                errors.append(response)
            if not waiting:
                answered(errors[0] if errors else response, due)

        for leader, share in self._frames.items():
            self._connections[leader].send(share, due, share_answered)


@attrs.frozen
class LeaderShares:
    """One request's records cut by the topic's leaders as ``topic_leaders`` named them: each
    leader's client address and the produce frame of its share."""

    addresses: dict[str, tuple[str, int]]
    frames: dict[str, bytes]
    #: Each share's records, by leader.
    records: dict[str, tuple[Record, ...]]

    def producer(self, connections: Mapping[str, Any]) -> _SharesConnection:
        return _SharesConnection(connections, self.frames)


def leader_shares(node: Node, topic: str, frame: bytes) -> LeaderShares:
    """Ask ``node`` who leads ``topic``'s ranges and cut the records of ``frame`` (a produce
    request) into their shares, with the clients' own code."""
    leader_map = topic_leader_map(node, topic)
    records = request_records(frame)
    shares = leader_map.shares(wire.encode_wire_records(records), None)
    addresses = {leader: leader_map.addresses[leader] for leader, _ in shares if leader}
    if len(addresses) != len(shares):
        raise RuntimeError(f"a range of {topic} has no leader: {shares}")
    return LeaderShares(
        addresses,
        {leader: wire.encode_request(0, wire.Produce(topic, share)) for leader, share in shares},
        {leader: wire.decode_wire_records(share) for leader, share in shares},
    )


def topic_leader_map(node: Node, topic: str) -> LeaderMap:
    """Who leads ``topic``'s ranges, as ``node`` tells the project's cluster clients."""
    with node.client(APP) as client:
        return LeaderMap.of(client.topic_leaders(topic))


class _StampedKeylessConnection(_ConnectionsToNodes):
    """One producer of keyless records as the project's cluster clients produce them
    (``ClusterClient.produce``): each request stamped (the producer's id, its sequence from 0),
    its records cut with the clients' own code, which sends keyless records to the range of the
    stamp's slot, and sent to that range's leader. The broker finds the same range from the
    stamp, so no node forwards them."""

    def __init__(
        self, connections: Mapping[str, Any], to: KeylessToLeaders, producer_id: int
    ) -> None:
        super().__init__(connections)
        self._to = to
        self._producer_id = producer_id
        self._sequence = 0

    def send(
        self, frame: bytes, due: float, answered: Callable[[wire.Response, float], None]
    ) -> None:
        to = self._to
        stamp = ProducerStamp(self._producer_id, self._sequence)
        self._sequence += 1
        ((leader, share),) = to.leader_map.shares(to.records, stamp)
        request = wire.ProduceIdempotent(to.topic, stamp, share)
        self._connections[leader].send(wire.encode_request(0, request), due, answered)


@attrs.frozen
class KeylessToLeaders:
    """Keyless requests of ``records`` to ``topic``, each stamped and sent whole to the leader
    of the range its stamp picks (``_StampedKeylessConnection``)."""

    topic: str
    records: WireRecords
    leader_map: LeaderMap

    @classmethod
    def of(cls, node: Node, topic: str, frame: bytes) -> KeylessToLeaders:
        """Ask ``node`` who leads ``topic``'s ranges; the records are ``frame``'s (keyless)."""
        leader_map = topic_leader_map(node, topic)
        if None in leader_map.leaders:
            raise RuntimeError(f"a range of {topic} has no leader: {leader_map.leaders}")
        records = request_records(frame)
        if any(record.key is not None for record in records):
            raise ValueError("the records are not keyless")
        return cls(topic, wire.encode_wire_records(records), leader_map)

    @property
    def addresses(self) -> dict[str, tuple[str, int]]:
        return {
            leader: self.leader_map.addresses[leader]
            for leader in self.leader_map.leaders
            if leader is not None
        }

    def producer(self, connections: Mapping[str, Any]) -> _StampedKeylessConnection:
        return _StampedKeylessConnection(connections, self, secrets.randbits(64))

    def forwarded(self, placement: Placement) -> float:
        """The share of the requests sent to a node that, by the placement read from etcd,
        does not lead their range (each range takes its turn): 0 unless ``topic_leaders`` and
        etcd disagree."""
        pairs = list(zip(self.leader_map.leaders, placement.range_leaders, strict=True))
        return sum(told != led for told, led in pairs) / len(pairs)


async def drive_to_leaders(
    reactor: Any,
    addresses: Mapping[str, tuple[str, int]],
    producer_of: Callable[[Mapping[str, Any]], Any],
    load: ProduceLoad,
    cpu_groups: Mapping[str, Sequence[int]],
    refusals: Counter[str] | None = None,
) -> tuple[dict[str, ProduceReport], dict[str, float]]:
    """``load`` as ``load.connections`` producers, each with a connection to every node of
    ``addresses`` and made of them by ``producer_of`` (``LeaderShares.producer``,
    ``KeylessToLeaders.producer``), one closed loop; the report is under ``"leaders"``."""
    producers: list[Any] = []
    for _ in range(load.connections):
        connections = {
            leader: await connect(reactor, host, port, *APP)
            for leader, (host, port) in addresses.items()
        }
        producer = producer_of(connections)
        if refusals is not None:
            producer = _CountingRefusals(producer, refusals)
        producers.append(producer)
    driver = _ProduceDriver(reactor, producers, b"", load)
    cpu = CpuMeter(cpu_groups)
    run = driver.run()
    run.addTimeout(load.seconds + RUN_GRACE_SECONDS, reactor)
    report = await run
    return {"leaders": report}, cpu.read()


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
