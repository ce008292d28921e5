"""Failover, restart and sign-in on a three-node cluster with thousands of ranges.

For each scale in ``--topics`` (100 and 1,000 by default; add 10000 for the largest), on a
fresh cluster of three nodes at replication factor 3 (``SVC_TOPIC_RANGES`` from ``--ranges``, 4
by default; the membership lease TTL ``SVC_NODE_LEASE_MS`` at its default unless ``--lease-ms``
says otherwise):

1. **Set-up.** The topics (``scale-00000``...) are created, pipelined over one connection to
   each node; ``--written`` of them (0.4 by default) get one keyed record in each of their
   ranges. Then one pass of the probe (below) over those written topics on the healthy
   cluster: its time is the probe's own floor. Then the cluster is left alone for
   ``--settle`` seconds (20 by default): the nodes claim a new topic's ranges after its
   creation is acknowledged, and at 1,000 topics they are still at it for seconds after the
   last one (``--settle 0`` kills in the middle of that, as the runs recorded before this
   option did).
2. **Kill.** ``n3`` is killed with SIGKILL. The probe then tries every topic through ``n1`` and
   ``n2`` until each has taken one produce of one keyed record per range (a key chosen for
   each range of the keyspace), acknowledged as a whole: the topic is **writable**. Reported:
   the seconds from the kill until half, nine in ten and every topic was writable.
3. **Restart.** ``n3`` is started again on its data. Reported: the seconds from its start
   until it listens for clients (**ready**: the broker accepts clients only once storage is
   recovered and its ranges are open), and until every node reports 0 under-replicated
   segments (``describe_cluster``, recounted every two seconds).

Throughout both events a thread signs in (connects and authenticates) every ``_SIGN_IN_EVERY``
seconds, through each live node in turn (``n3`` is left out just before it is killed, once the
sign-in under way ends, and put back once it listens again): the **longest sign-in** of each
event is reported (in the JSON also the longest through each node), with the count of sign-ins
that failed. For each event also the etcd **transactions** and the
**bytes** etcd's members received from clients (``etcd_mvcc_txn_total`` of one member, since
every member applies every transaction; ``etcd_network_client_grpc_received_bytes_total`` over
all members), and the brokers' resident memory (``VmRSS``) at the end of set-up.

The probe sends each topic's request through one of the nodes it tries (by the topic's index,
so each serves its share), with ``--probe-in-flight`` requests (8 by default) outstanding on
one connection to each: a pass over thousands of topics takes about what the brokers need to
take them, so a topic is seen writable within a moment of being so. A refused topic is tried
again ``_RETRY_SECONDS`` later.

How: ``bench/_cluster.py``'s machinery (as ``backfill.py`` uses it): one three-member etcd for
the whole run (its data in ``/dev/shm`` when there is one), each scale's cluster under its own
cluster id, ``twistd -n logbroker`` processes in env mode ``test`` on free loopback ports, their
data in ``--dir`` (default under ``bench/.work``). ``--profile DIR`` runs the brokers under
cProfile (``DIR/<cluster id>-<node>.prof``; the killed ``n3`` leaves none, its second life
``...-n3-restarted.prof``); such a run's figures only say where the time goes. ``--logs DIR``
keeps each scale's broker logs. Everything it starts is stopped at the end, also after an
error or Ctrl-C; every wait is bounded. Run it from the repository root::

    .venv/bin/python bench/cluster_scale.py
    .venv/bin/python bench/cluster_scale.py --topics 1000,10000 --json

1,000 topics take about two minutes; 10,000 about twenty (most of it creating the topics).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import secrets
import shutil
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from _cluster import Etcd, cluster_run, running_cluster
from _common import (
    ADMIN,
    APP,
    HOST,
    Node,
    add_work_directory_option,
    emit,
    positive_float,
    positive_int,
    restarted,
)

from logbroker import wire
from logbroker.broker.keyspace import DEFAULT_KEYSPACE_BITS, split_keyspace
from logbroker.client.blocking import BlockingClient, BrokerRefused, ConnectionClosed
from logbroker.key_routing import key_slot
from logbroker.records import Record

#: The node killed and started again.
VICTIM = "n3"
#: How often the sign-in thread signs in.
_SIGN_IN_EVERY = 0.1
#: Requests in flight on each connection while the topics are created and written.
_PIPELINE = 32
#: A refused topic is tried again this long after.
_RETRY_SECONDS = 0.2
#: The longest any event may take before the run gives up on it.
_EVENT_SECONDS = 600.0
_TRY_SECONDS = 30.0


def range_keys(ranges: int, bits: int = DEFAULT_KEYSPACE_BITS) -> list[bytes]:
    """One key in each of the ``ranges`` ranges a topic's keyspace is cut into."""
    cuts = split_keyspace(bits, ranges)
    keys: dict[int, bytes] = {}
    number = 0
    while len(keys) < len(cuts):
        key = f"key-{number}".encode()
        slot = key_slot(key, bits)
        index = next(i for i, (start, end) in enumerate(cuts) if start <= slot < end)
        keys.setdefault(index, key)
        number += 1
    return [keys[index] for index in range(len(cuts))]


def topic_name(index: int) -> str:
    return f"scale-{index:05d}"


def connect(port: int, account: tuple[str, str] = APP, timeout: float = _TRY_SECONDS) -> Any:
    return BlockingClient.connect(HOST, port, *account, timeout=timeout, produce_retry=None)


def pipelined(port: int, requests: Sequence[wire.Request], account: tuple[str, str]) -> None:
    """Send every request through one connection, ``_PIPELINE`` at a time; one refused is
    sent again (after a pause) until it is taken."""
    pending = collections.deque(requests)
    deadline = time.monotonic() + _EVENT_SECONDS
    with connect(port, account, timeout=120) as client:
        in_flight: dict[int, wire.Request] = {}
        while pending or in_flight:
            while pending and len(in_flight) < _PIPELINE:
                request = pending.popleft()
                in_flight[client.send(request)] = request
            response = client.receive()
            request = in_flight.pop(response.correlation_id)
            # A create retried after an unknown outcome (etcd did not answer in time) may
            # find the topic its first try made.
            if response.reason is not None and response.reason != "already_exists":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{request!r} refused: {response.reason}")
                pending.append(request)
                time.sleep(0.01)


# -- the probe and the sign-ins -----------------------------------------------------------


class Probe:
    """Produces to every topic through ``ports`` (each topic through one, by its index) until
    each has taken one request with a record in each of its ranges, and notes when each did.

    One thread per port keeps up to ``in_flight`` requests outstanding on one connection, so
    that a pass over thousands of topics takes about as long as the brokers need to take them,
    not a round trip each: a topic is known writable within a moment of being so. A refused
    topic is tried again after ``_RETRY_SECONDS``."""

    def __init__(self, topics: int, ports: Sequence[int], keys: Sequence[bytes], in_flight: int):
        self._ports = ports
        self._keys = keys
        self._in_flight = in_flight
        self._queues = [
            collections.deque(range(index, topics, len(ports))) for index in range(len(ports))
        ]
        self._lock = threading.Lock()
        self.writable_at: dict[int, float] = {}
        self.refusals: collections.Counter[str] = collections.Counter()

    def _request(self, index: int) -> wire.Produce:
        return wire.Produce(topic_name(index), tuple(Record(b"probe", key=k) for k in self._keys))

    def run(self, deadline: float) -> None:
        workers = [
            threading.Thread(target=self._work, args=(port, queue, deadline), daemon=True)
            for port, queue in zip(self._ports, self._queues, strict=True)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        left = sum(len(queue) for queue in self._queues)
        if left:
            raise RuntimeError(f"{left} topics not writable before the deadline")

    def _work(self, port: int, queue: collections.deque[int], deadline: float) -> None:
        #: Topics refused, and when each may be tried again.
        waiting: collections.deque[tuple[float, int]] = collections.deque()
        client = None
        in_flight: dict[int, int] = {}
        while (queue or waiting or in_flight) and time.monotonic() < deadline:
            try:
                if client is None:
                    client = connect(port)
                now = time.monotonic()
                while waiting and waiting[0][0] <= now:
                    queue.append(waiting.popleft()[1])
                while queue and len(in_flight) < self._in_flight:
                    index = queue.popleft()
                    in_flight[client.send(self._request(index))] = index
                if not in_flight:
                    time.sleep(0.005)
                    continue
                response = client.receive()
                index = in_flight.pop(response.correlation_id)
                if response.reason is None:
                    self.writable_at[index] = time.monotonic()
                else:
                    self._refused(response.reason)
                    waiting.append((time.monotonic() + _RETRY_SECONDS, index))
            except (OSError, ConnectionClosed, BrokerRefused):
                self._refused("connection lost")
                if client is not None:
                    client.close()
                client = None
                queue.extend(in_flight.values())
                in_flight.clear()
                time.sleep(_RETRY_SECONDS)
        if client is not None:
            client.close()
        queue.extend(index for _, index in waiting)
        queue.extend(in_flight.values())

    def _refused(self, reason: str) -> None:
        with self._lock:
            self.refusals[reason] += 1


class SignIns:
    """A thread signing in through the live nodes in turn: each sign-in's start, seconds,
    whether it succeeded, and the node it went through."""

    def __init__(self, ports: Mapping[str, int]) -> None:
        self.live = dict(ports)
        self.tries: list[tuple[float, float, bool, str]] = []
        #: Held through each sign-in: ``drop`` waits for the one under way.
        self._signing_in = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SignIns:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=_TRY_SECONDS + 5)

    def _run(self) -> None:
        turn = 0
        while not self._stop.is_set():
            with self._signing_in:
                nodes = list(self.live.items())
                node, port = nodes[turn % len(nodes)]
                turn += 1
                started = time.monotonic()
                try:
                    connect(port, timeout=_TRY_SECONDS).close()
                    ok = True
                except (OSError, ConnectionClosed, BrokerRefused):
                    ok = False
                self.tries.append((started, time.monotonic() - started, ok, node))
            self._stop.wait(_SIGN_IN_EVERY)

    def drop(self, name: str) -> None:
        """Sign in through ``name`` no more (it is about to be killed), once the sign-in under
        way is over: one through a node being killed would fail for that alone."""
        with self._signing_in:
            del self.live[name]

    def between(self, start: float, end: float) -> dict[str, Any]:
        inside = [t for t in self.tries if start <= t[0] <= end]
        longest: dict[str, float] = {}
        for _, seconds, _, node in inside:
            longest[node] = max(longest.get(node, 0.0), seconds)
        return {
            "sign_ins": len(inside),
            "sign_in_failed": sum(1 for t in inside if not t[2]),
            "sign_in_longest_s": max((t[1] for t in inside), default=None),
            "sign_in_longest_by_node_s": dict(sorted(longest.items())),
        }


# -- etcd and the brokers' processes ------------------------------------------------------


_METRIC = re.compile(r"^(\w+)(?:\{[^}]*\})? (\S+)$", re.MULTILINE)


def etcd_counters(etcd: Etcd) -> tuple[float, float]:
    """(transactions one member applied, bytes every member received from clients)."""
    txns = 0.0
    received = 0.0
    for number, endpoint in enumerate(etcd.endpoints):
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        for name, value in _METRIC.findall(text):
            if name == "etcd_mvcc_txn_total" and number == 0:
                txns += float(value)
            elif name == "etcd_network_client_grpc_received_bytes_total":
                received += float(value)
    return txns, received


_DASHBOARD = re.compile(r"Dashboard listening on (\S+):(\d+)")


def dashboard_of(node: Node) -> str:
    """The node's dashboard address, from its log."""
    with open(node.log) as log:
        found = _DASHBOARD.findall(log.read())
    if not found:
        raise RuntimeError(f"{node.name} logged no dashboard address")
    host, port = found[-1]
    return f"http://{host}:{port}"


def txn_seconds(dashboards: Sequence[str]) -> tuple[float, float]:
    """(etcd transactions the brokers made, seconds they took in all), from their
    ``svc_controlplane_request_seconds`` histograms."""
    total = count = 0.0
    for dashboard in dashboards:
        request = urllib.request.Request(f"{dashboard}/metrics", headers={"Accept": "text/plain"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            text = answer.read().decode()
        for line in text.splitlines():
            if line.startswith('svc_controlplane_request_seconds_sum{op="txn"}'):
                total += float(line.split()[-1])
            elif line.startswith('svc_controlplane_request_seconds_count{op="txn"}'):
                count += float(line.split()[-1])
    return count, total


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def under_replicated(nodes: Sequence[Node]) -> list[int | None]:
    counts = []
    for node in nodes:
        try:
            with connect(node.port, ADMIN, timeout=10) as admin:
                counts.append(admin.describe_cluster().under_replicated)
        except (OSError, ConnectionClosed, BrokerRefused):
            counts.append(None)
    return counts


# -- one scale ----------------------------------------------------------------------------


@attrs.frozen
class Event:
    started: float
    etcd_before: tuple[float, float]
    #: The dashboards of the nodes that live through the event, and their transactions so far.
    dashboards: Sequence[str]
    txns_before: tuple[float, float]

    @classmethod
    def now(cls, etcd: Etcd, dashboards: Sequence[str]) -> Event:
        return cls(time.monotonic(), etcd_counters(etcd), dashboards, txn_seconds(dashboards))


def _event_result(etcd: Etcd, event: Event, signins: SignIns, end: float) -> dict[str, Any]:
    txns, received = etcd_counters(etcd)
    count, seconds = txn_seconds(event.dashboards)
    count -= event.txns_before[0]
    seconds -= event.txns_before[1]
    return {
        **signins.between(event.started, end),
        "etcd_txns": txns - event.etcd_before[0],
        "etcd_received_mb": (received - event.etcd_before[1]) / 1e6,
        "broker_txn_mean_ms": 1000 * seconds / count if count else None,
    }


def _percentile_seconds(times: Sequence[float], started: float, fraction: float) -> float:
    ordered = sorted(t - started for t in times)
    return ordered[max(0, round(fraction * len(ordered)) - 1)]


def measure_scale(
    args: argparse.Namespace, etcd: Etcd, workdir: str, topics: int
) -> dict[str, Any]:
    keys = range_keys(args.ranges)
    cluster_id = f"scale-{topics}-{secrets.token_hex(3)}"
    directory = os.path.join(workdir, cluster_id)
    settings = {
        "SVC_LOG_REPLICATION_FACTOR": "3",
        "SVC_TOPIC_RANGES": str(args.ranges),
        "SVC_AUTH_RATE_LIMIT": "1000000",
    }
    if args.lease_ms is not None:
        settings["SVC_NODE_LEASE_MS"] = str(args.lease_ms)
    result: dict[str, Any] = {"topics": topics, "ranges": topics * args.ranges}
    with contextlib.ExitStack() as stack:
        nodes = stack.enter_context(
            running_cluster(etcd, cluster_id, directory, settings, profiles=args.profile)
        )
        if args.logs is not None:
            stack.callback(_keep_logs, directory, os.path.join(args.logs, cluster_id))
        ports = {node.name: node.port for node in nodes}

        started = time.monotonic()
        creates = [wire.CreateTopic(topic_name(index), 0) for index in range(topics)]
        split_over([node.port for node in nodes], creates, ADMIN)
        result["create_s"] = time.monotonic() - started
        written = int(topics * args.written)
        produces = [
            wire.Produce(topic_name(index), tuple(Record(b"first", key=key) for key in keys))
            for index in range(written)
        ]
        split_over([node.port for node in nodes], produces, APP)
        survivors = [node for node in nodes if node.name != VICTIM]
        started = time.monotonic()
        Probe(written, [n.port for n in survivors], keys, args.probe_in_flight).run(
            started + _EVENT_SECONDS
        )
        result["probe_floor_s"] = time.monotonic() - started
        result["rss_mb"] = {node.name: round(rss_mb(node.process.pid), 1) for node in nodes}
        _progress(args, f"{topics} topics: set up {result}")
        # The nodes claim a new topic's ranges after its creation is acknowledged: at 1,000
        # topics they are still at it for seconds after the last one.
        time.sleep(args.settle)

        with SignIns(ports) as signins:
            time.sleep(1)
            victim = next(node for node in nodes if node.name == VICTIM)
            signins.drop(VICTIM)
            kill = Event.now(etcd, [dashboard_of(node) for node in survivors])
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait()
            probe = Probe(topics, [n.port for n in survivors], keys, args.probe_in_flight)
            probe.run(kill.started + _EVENT_SECONDS)
            done = time.monotonic()
            times = list(probe.writable_at.values())
            result["kill"] = {
                "half_writable_s": _percentile_seconds(times, kill.started, 0.5),
                "most_writable_s": _percentile_seconds(times, kill.started, 0.9),
                "all_writable_s": done - kill.started,
                "refusals": dict(probe.refusals),
                **_event_result(etcd, kill, signins, done),
            }
            _progress(args, f"{topics} topics: kill {result['kill']}")

            profile = None
            if args.profile is not None:
                profile = os.path.join(args.profile, f"{cluster_id}-{VICTIM}-restarted.prof")
            restart = Event.now(etcd, [dashboard_of(node) for node in survivors])
            back = stack.enter_context(restarted(victim, profile))
            ready = time.monotonic()
            signins.live[VICTIM] = back.port
            deadline = ready + _EVENT_SECONDS
            while any(count != 0 for count in under_replicated([*survivors, back])):
                if time.monotonic() > deadline:
                    raise RuntimeError("the under-replicated count did not reach 0")
                time.sleep(0.5)
            whole = time.monotonic()
            time.sleep(1)
            result["restart"] = {
                "ready_s": ready - restart.started,
                "none_under_replicated_s": whole - restart.started,
                **_event_result(etcd, restart, signins, whole),
            }
            _progress(args, f"{topics} topics: restart {result['restart']}")
    return result


def split_over(ports: Sequence[int], requests: Sequence[wire.Request], account: Any) -> None:
    """Send ``requests`` pipelined, a share through each node's client port, at once."""
    shares = [requests[index :: len(ports)] for index in range(len(ports))]
    errors: list[BaseException] = []

    def send(port: int, share: Sequence[wire.Request]) -> None:
        try:
            pipelined(port, share, account)
        except BaseException as error:
            errors.append(error)

    threads = [
        threading.Thread(target=send, args=(port, share))
        for port, share in zip(ports, shares, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _keep_logs(directory: str, into: str) -> None:
    for node in sorted(os.listdir(directory)):
        source = os.path.join(directory, node)
        target = os.path.join(into, node)
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(source):
            if name.endswith(".log"):
                shutil.copy(os.path.join(source, name), target)


def _progress(args: argparse.Namespace, text: str) -> None:
    if not args.json:
        print(text, file=sys.stderr, flush=True)


def _line(result: Mapping[str, Any]) -> str:
    kill = result["kill"]
    restart = result["restart"]
    return (
        f"{result['topics']} topics ({result['ranges']} ranges): created in"
        f" {result['create_s']:.1f} s, probe floor {result['probe_floor_s']:.2f} s, RSS"
        f" {', '.join(f'{n} {mb:.0f} MB' for n, mb in result['rss_mb'].items())}\n"
        f"  SIGKILL {VICTIM}: writable half {kill['half_writable_s']:.2f} s, 90%"
        f" {kill['most_writable_s']:.2f} s, all {kill['all_writable_s']:.2f} s; sign-ins"
        f" {kill['sign_ins']} ({kill['sign_in_failed']} failed), longest"
        f" {_seconds(kill['sign_in_longest_s'])}; etcd {kill['etcd_txns']:.0f} txns,"
        f" {kill['etcd_received_mb']:.2f} MB, {_ms(kill['broker_txn_mean_ms'])} each\n"
        f"  restart {VICTIM}: ready {restart['ready_s']:.2f} s, none under-replicated"
        f" {restart['none_under_replicated_s']:.1f} s; sign-ins {restart['sign_ins']}"
        f" ({restart['sign_in_failed']} failed), longest {_seconds(restart['sign_in_longest_s'])};"
        f" etcd {restart['etcd_txns']:.0f} txns, {restart['etcd_received_mb']:.2f} MB,"
        f" {_ms(restart['broker_txn_mean_ms'])} each"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _scales(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",")]


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--topics", type=_scales, default=[100, 1000], help="scales, comma-separated"
    )
    parser.add_argument("--ranges", type=positive_int, default=4, help="ranges per topic")
    parser.add_argument(
        "--written", type=positive_float, default=0.4, help="share of topics with records"
    )
    parser.add_argument(
        "--probe-in-flight", type=positive_int, default=8, help="probe requests per node"
    )
    parser.add_argument(
        "--settle",
        type=_seconds,
        default=20.0,
        help="seconds the cluster is left alone between set-up and the kill (0: none)",
    )
    parser.add_argument("--lease-ms", type=positive_int, default=None)
    parser.add_argument("--profile", metavar="DIR", help="run the brokers under cProfile")
    parser.add_argument("--logs", metavar="DIR", help="keep the brokers' logs")
    parser.add_argument("--json", action="store_true", help="one JSON line per scale")
    add_work_directory_option(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    with cluster_run(args, "bench-scale-") as (workdir, etcd):
        for topics in args.topics:
            result = measure_scale(args, etcd, workdir, topics)
            emit(args.json, "cluster_scale", result, _line(result))


if __name__ == "__main__":
    main()
