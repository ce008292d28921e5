"""Durable produce throughput of a real ``twistd logbroker`` next to Redis Streams, and the speed
of one consumer draining a topic.

What it measures: the same closed-loop load against both systems, in the same run, on the same
disk: ``--connections`` TCP connections, each keeping ``--in-flight`` requests of ``--batch``
records of ``--record-bytes`` bytes outstanding for ``--seconds``. Per round and as medians over
``--repeat`` rounds: acknowledged records/s, MB/s (record values only), latency p50/p99/p99.9 per
request, errors, the ratio logbroker/Redis, and the CPU the load generator and the server used
(``cpu client=... server=...``: cores busy on average, all threads of the server included), which
shows which side was the limit. Then one consumer drains logbroker topics from the page cache at
each of ``--consume-sizes`` record sizes: records/s and MB/s.

Why: the target is logbroker's durable records/s, keyed, at least 1.5x Redis Streams' with every
write fsynced before it is acknowledged (100-byte records, batch 100, 4 connections x 8 in
flight; keyless at least the same ratio), and one consumer draining a topic at at least
250 MB/s from page cache. (The first target, 4x, was measured out of reach on this disk: Redis
covers every command of an event-loop pass with one fsync, about 400 k XADDs/s here.)

How:

* Redis: Debian's ``redis-server``, installed with ``apt-get`` when it is not on ``PATH`` (that
  needs root, which is how this project's machines run the benchmarks), started by the script on
  a free loopback port in a temporary directory with ``--appendonly yes --appendfsync always
  --save ""``: every write is in the append-only file and fsynced before its reply, and there
  are no RDB snapshots. Redis' automatic rewrites of the append-only file stay on, as in its
  default configuration (``--no-aof-rewrite`` turns them off); the number per round is in the
  ``--json`` output. A request is ``--batch`` ``XADD stream * v <value>`` commands written
  together (pipelined) on one connection; it completes when all its replies have arrived, and
  every reply must be a stream id (anything else makes the request an error). The client is a
  small Twisted protocol speaking RESP (``bench/_redis.py``), with the commands encoded once.
  Each round writes a fresh stream; afterwards its ``XLEN`` is checked against the records
  acknowledged, and it is deleted (outside the measured window).
* logbroker: the project's ``twistd -n logbroker`` (the virtualenv's ``twistd``), env mode
  ``test``, listening on a free loopback port, with its data directory next to Redis' on the
  same disk. Two brokers run side by side: one with ``SVC_GROUP_COMMIT=true`` (the spec's
  setting for throughput, which the target is judged on) and one with it off. Each round
  produces into a fresh topic created with the blocking client (``SVC_TOPIC_RANGES`` ranges);
  the requests are ``logbroker.benchmark``'s. The records are keyed, as users produce them:
  ``--keys`` distinct keys (64) taken in turn, spread over the ranges by their hash; Redis'
  entries carry the same key as a field (``XADD stream * k key-<i> v <value>``). The
  group-commit-on broker is also measured with keyless records (``logbroker-gc-on-keyless``,
  spread over the ranges by the broker), the variant; ``--keys 0`` measures keyless only.
* Both loads run on the same closed-loop driver, ``logbroker.benchmark``'s (the generator behind
  ``logbroker bench``): a request's latency runs from the moment it was due (when the previous
  request in its slot was answered), and only requests answered inside the window count. The
  value bytes are random and the same in every record of both systems. Before the rounds, each
  system gets an unrecorded ``--warmup``. Rounds alternate the order of the systems (Redis
  first, then last, ...) so that drift on a shared machine favours neither; the ratio is the
  median of the per-round paired ratios, and also best against best, and the verdict says
  "unclear" when the two disagree about the target.
* Consume: after the rounds, one consumer (``logbroker.benchmark.run_consume``: one fetch of up
  to 1000 records at a time, from the start to the end) drains the topic of each group-commit-on
  round. Then, for each of ``--consume-sizes``, about ``--consume-mb`` MB of records of that size
  are produced into a topic of their own on the group-commit-on broker and drained ``--repeat``
  times. The data were just written, so they are read from the page cache. The consumer and the
  broker share the machine's cores, and the figure includes the consumer decoding every record.

The two servers and their temporary directories are removed at the end, also after an error or
Ctrl-C. Run it from the repository root with the project's virtualenv (about 4 minutes with the
defaults, plus about half a minute when Redis has to be installed)::

    .venv/bin/python bench/produce_vs_redis.py
    .venv/bin/python bench/produce_vs_redis.py --repeat 5 --json
    .venv/bin/python bench/produce_vs_redis.py --seconds 5 --group-commit on --consume-sizes 1024

``--dir`` names a directory on the disk to measure (a temporary directory is created in it and
removed afterwards); the default is under ``bench/.work``, on the file system of the working
tree. Do not point it at tmpfs, where fsync costs nothing. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import _redis
import attrs
from _common import (
    APP,
    HOST,
    MAX_FRAME,
    RUN_GRACE_SECONDS,
    CpuMeter,
    Node,
    add_load_options,
    add_work_directory_option,
    announce_start,
    batch_sizes,
    emit,
    free_ports,
    loadavg,
    non_negative_int,
    positive_float,
    produce_line,
    produce_result,
    running_node,
    stop,
    tail,
    unwind_on_sigterm,
    work_directory,
)
from twisted.internet import task
from twisted.internet.defer import Deferred, ensureDeferred

from logbroker.benchmark import (
    DEFAULT_KEYS,
    ConsumeReport,
    ProduceLoad,
    ProduceReport,
    _ProduceDriver,
    connect,
    produce_frame,
    run_consume,
)

TARGET_RATIO = 1.5
TARGET_CONSUME_MB_S = 250.0
REDIS = "redis"
GC_ON = "logbroker-gc-on"
GC_OFF = "logbroker-gc-off"
#: The group-commit-on broker under the same load with keyless records: the variant.
KEYLESS = "logbroker-gc-on-keyless"


# -- servers ------------------------------------------------------------------------------


def ensure_redis_server(path: str | None) -> str:
    """The ``redis-server`` to run: ``path``, else the one on PATH, else Debian's, installed."""
    if path is not None:
        return path
    found = shutil.which("redis-server")
    if found is not None:
        return found
    if os.geteuid() != 0:
        raise SystemExit("redis-server is not installed and installing it needs root")
    print("redis-server not found: installing Debian's redis-server", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    apt = ["apt-get", "-q", "-o", "DPkg::Lock::Timeout=300"]
    subprocess.run([*apt, "update"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(
        [*apt, "install", "-y", "--no-install-recommends", "redis-server"],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    found = shutil.which("redis-server")
    if found is None:
        raise SystemExit("apt-get installed redis-server, but it is not on PATH")
    return found


class Redis:
    """A ``redis-server`` with every write fsynced before its reply, and a blocking connection
    for setup calls."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, log: str) -> None:
        self.process = process
        self.port = port
        self.log = log

    def call(self, *arguments: bytes | str | int) -> _redis.Reply:
        with socket.create_connection((HOST, self.port), timeout=60) as connection:
            connection.sendall(_redis.encode_command(*arguments))
            parser = _redis.ReplyParser()
            while True:
                data = connection.recv(1 << 16)
                if not data:
                    raise ConnectionError("redis closed the connection")
                replies = parser.feed(data)
                if replies:
                    return replies[0]

    def info(self, section: str) -> dict[str, str]:
        reply = self.call("INFO", section)
        assert isinstance(reply, bytes), reply
        fields = {}
        for line in reply.decode().splitlines():
            name, sep, value = line.partition(":")
            if sep:
                fields[name] = value
        return fields


@contextlib.contextmanager
def running_redis(executable: str, directory: str, aof_rewrite: bool = True) -> Iterator[Redis]:
    os.makedirs(directory)
    log = os.path.join(directory, "redis.log")
    for _attempt in range(3):
        (port,) = free_ports(1)
        command = [
            executable,
            "--bind", HOST,
            "--port", str(port),
            "--dir", directory,
            "--daemonize", "no",
            "--logfile", log,
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
        ]  # fmt: skip
        if not aof_rewrite:
            command += ["--auto-aof-rewrite-percentage", "0"]
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        try:
            redis = Redis(process, port, log)
            deadline = time.monotonic() + 30
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    if redis.call("PING") == b"PONG":
                        break
                except OSError:
                    time.sleep(0.05)
            else:
                if process.poll() is None:
                    raise RuntimeError(f"redis-server did not answer PING:\n{tail(log)}")
                continue  # exited: most likely the port was taken meanwhile; try another
            _check_durability(redis)
            yield redis
            return
        finally:
            stop(process)
    raise RuntimeError(f"redis-server did not start:\n{tail(log)}")


def _check_durability(redis: Redis) -> None:
    """Refuse to measure a Redis that does not fsync every write or that takes snapshots."""
    expected = {b"appendonly": b"yes", b"appendfsync": b"always", b"save": b""}
    for name, value in expected.items():
        reply = redis.call("CONFIG", "GET", name)
        if reply != [name, value]:
            raise RuntimeError(f"redis-server runs with {reply!r}, expected {name!r} {value!r}")


@contextlib.contextmanager
def running_broker(name: str, directory: str, group_commit: bool) -> Iterator[Node]:
    """One broker (``running_node``) with group commit on or off."""
    settings = {"SVC_PEER_PORT": "0", "SVC_GROUP_COMMIT": "true" if group_commit else "false"}
    with running_node(name, directory, settings) as node:
        yield node


def create_topic(broker: Node, topic: str) -> None:
    with broker.client() as client:
        client.create_topic(topic)


# -- load ---------------------------------------------------------------------------------


async def redis_produce(
    reactor: Any, redis: Redis, stream: str, load: ProduceLoad
) -> tuple[ProduceReport, dict[str, float]]:
    """``load`` against Redis: requests of ``load.batch`` pipelined XADDs to ``stream``."""
    connections = [
        await _redis.connect(reactor, HOST, redis.port, load.batch) for _ in range(load.connections)
    ]
    pipeline = _redis.xadd_pipeline(stream, os.urandom(load.size), load.batch, load.keys)
    return await _drive(reactor, connections, pipeline, load, redis.process.pid)


async def broker_produce(
    reactor: Any, broker: Node, load: ProduceLoad
) -> tuple[ProduceReport, dict[str, float]]:
    """``load`` against logbroker: what ``logbroker.benchmark.run_produce`` does, with the CPU
    meter started once the connections are authenticated."""
    connections = [await connect(reactor, HOST, broker.port, *APP) for _ in range(load.connections)]
    return await _drive(reactor, connections, produce_frame(load), load, broker.process.pid)


async def _drive(
    reactor: Any, connections: list[Any], frame: bytes, load: ProduceLoad, server_pid: int
) -> tuple[ProduceReport, dict[str, float]]:
    """The closed loop of ``logbroker.benchmark`` over ready connections of either system."""
    driver = _ProduceDriver(reactor, connections, frame, load)
    cpu = CpuMeter({"server": [server_pid]})
    running = driver.run()
    running.addTimeout(load.seconds + RUN_GRACE_SECONDS, reactor)
    report = await running
    return report, cpu.read()


class Run:
    def __init__(
        self,
        args: argparse.Namespace,
        redis: Redis,
        brokers: dict[str, Node],
    ) -> None:
        self.args = args
        self.redis = redis
        self.brokers = brokers
        self.rounds: dict[str, list[dict[str, Any]]] = {}
        self.round_topics: list[str] = []
        self.finished = False
        self.load = ProduceLoad(
            topic="",
            connections=args.connections,
            in_flight=args.in_flight,
            batch=args.batch,
            size=args.record_bytes,
            seconds=args.seconds,
            keys=args.keys,
        )

    def systems(self) -> list[str]:
        keyless = [KEYLESS] if GC_ON in self.brokers and self.args.keys else []
        return [REDIS, *self.brokers, *keyless]

    async def produce(
        self, reactor: Any, system: str, name: str, seconds: float
    ) -> tuple[ProduceReport, dict[str, float]]:
        load = attrs.evolve(self.load, topic=name, seconds=seconds)
        if system == REDIS:
            report, cpu = await redis_produce(reactor, self.redis, name, load)
            stored = self.redis.call("XLEN", name)
            if not isinstance(stored, int) or stored < report.records:
                raise RuntimeError(
                    f"redis acknowledged {report.records} records of {name}, "
                    f"but XLEN says {stored!r}"
                )
            # Each round starts on an empty data set (the append-only file keeps growing).
            self.redis.call("DEL", name)
            return report, cpu
        if system == KEYLESS:
            # On the group-commit-on broker, into a topic of its own.
            broker = self.brokers[GC_ON]
            load = attrs.evolve(load, topic=f"{name}-keyless", keys=0)
        else:
            broker = self.brokers[system]
        create_topic(broker, load.topic)
        return await broker_produce(reactor, broker, load)

    async def produce_rounds(self, reactor: Any) -> None:
        args = self.args
        for system in self.systems():
            await self.produce(reactor, system, "warmup", args.warmup)
        for number in range(1, args.repeat + 1):
            order = self.systems() if number % 2 else self.systems()[::-1]
            for system in order:
                name = f"round{number}"
                rewrites_before = self._aof_rewrites() if system == REDIS else 0
                report, cpu = await self.produce(reactor, system, name, args.seconds)
                result = {**produce_result(system, report), **cpu}
                if system == REDIS:
                    result["aof_rewrites"] = self._aof_rewrites() - rewrites_before
                elif system == GC_ON:
                    self.round_topics.append(name)
                self.rounds.setdefault(system, []).append(result)
                emit(
                    args.json,
                    "produce",
                    {"round": number, **result},
                    produce_line(f"round {number}", result),
                )

    def _aof_rewrites(self) -> int:
        return int(self.redis.info("persistence").get("aof_rewrites", "0"))

    def summarise_produce(self) -> dict[str, Any]:
        args = self.args
        if not args.json:
            print(
                f"\nmedians of {args.repeat} round(s) of {args.seconds:g} s, "
                f"{args.connections} connections x {args.in_flight} in flight x "
                f"{args.batch} records of {args.record_bytes} B "
                f"(load average now: {loadavg()}):",
                flush=True,
            )
        summaries: dict[str, dict[str, Any]] = {}
        redis_runs = self.rounds[REDIS]
        for system in self.systems():
            runs = self.rounds[system]
            summary: dict[str, Any] = {"system": system, "rounds": len(runs)}
            for key in (
                "records_per_s",
                "mb_per_s",
                "p50_ms",
                "p99_ms",
                "p999_ms",
                "client_cpu",
                "server_cpu",
            ):
                summary[key] = statistics.median(run[key] for run in runs)
            summary["best_records_per_s"] = max(run["records_per_s"] for run in runs)
            summary["errors"] = sum(run["errors"] for run in runs)
            line = produce_line("median ", summary)
            if system != REDIS:
                paired = [
                    run["records_per_s"] / redis["records_per_s"]
                    if redis["records_per_s"]
                    else float("inf")
                    for run, redis in zip(runs, redis_runs, strict=True)
                ]
                ratio = statistics.median(paired)
                best = summary["best_records_per_s"] / max(
                    run["records_per_s"] for run in redis_runs
                )
                if ratio >= TARGET_RATIO and best >= TARGET_RATIO:
                    outcome = "met"
                elif ratio < TARGET_RATIO and best < TARGET_RATIO:
                    outcome = "MISSED"
                else:
                    outcome = "unclear"
                summary.update(
                    ratio=ratio,
                    best_ratio=best,
                    ratio_min=min(paired),
                    ratio_max=max(paired),
                    target_ratio=TARGET_RATIO,
                    target=outcome.lower(),
                )
                line += (
                    f"\n         ratio to redis={ratio:.2f}x (rounds {min(paired):.2f}x-"
                    f"{max(paired):.2f}x, best/best {best:.2f}x)"
                    f"  target >= {TARGET_RATIO:g}x: {outcome}"
                )
            else:
                summary["aof_rewrites"] = sum(run.get("aof_rewrites", 0) for run in runs)
            summaries[system] = summary
            emit(args.json, "produce_summary", summary, line)
        return summaries

    async def consume_rounds(self, reactor: Any) -> dict[str, Any]:
        args = self.args
        broker = self.brokers[GC_ON]
        results: dict[str, Any] = {"rounds": [], "sizes": []}
        if not args.json and self.round_topics:
            print(f"\none consumer draining each {GC_ON} round's topic:", flush=True)
        for topic in self.round_topics:
            cpu = CpuMeter({"server": [broker.process.pid]})
            report = await run_consume(reactor, HOST, broker.port, *APP, topic)
            result = {
                "topic": topic,
                "record_bytes": args.record_bytes,
                **_consume(report),
                **cpu.read(),
            }
            results["rounds"].append(result)
            emit(args.json, "consume", result, _consume_line(topic, result))
        for size in args.consume_sizes:
            topic = f"consume{size}"
            produced = await self.fill(reactor, broker, topic, size)
            runs = []
            for number in range(1, args.repeat + 1):
                cpu = CpuMeter({"server": [broker.process.pid]})
                report = await run_consume(reactor, HOST, broker.port, *APP, topic)
                result = {
                    "topic": topic,
                    "record_bytes": size,
                    "round": number,
                    **_consume(report),
                    **cpu.read(),
                }
                runs.append(result)
                emit(args.json, "consume", result, _consume_line(f"{topic} #{number}", result))
            mb_per_s = statistics.median(run["mb_per_s"] for run in runs)
            summary = {
                "record_bytes": size,
                "rounds": len(runs),
                "records": runs[0]["records"],
                "produce_mb_per_s": produced.megabytes_per_second,
                "records_per_s": statistics.median(run["records_per_s"] for run in runs),
                "mb_per_s": mb_per_s,
                "client_cpu": statistics.median(run["client_cpu"] for run in runs),
                "server_cpu": statistics.median(run["server_cpu"] for run in runs),
                "target_mb_per_s": TARGET_CONSUME_MB_S,
                "target": "met" if mb_per_s >= TARGET_CONSUME_MB_S else "missed",
            }
            results["sizes"].append(summary)
            emit(
                args.json,
                "consume_summary",
                summary,
                f"median   {size:>5} B records: records/s={summary['records_per_s']:>9,.0f}"
                f"  MB/s={mb_per_s:>6.1f}  ({summary['records']:,} records, produced at "
                f"{produced.megabytes_per_second:.1f} MB/s)"
                f"  cpu client={summary['client_cpu']:.2f} server={summary['server_cpu']:.2f}"
                f"  target >= {TARGET_CONSUME_MB_S:g} MB/s: "
                f"{'met' if mb_per_s >= TARGET_CONSUME_MB_S else 'MISSED'}",
            )
        return results

    async def fill(self, reactor: Any, broker: Node, topic: str, size: int) -> ProduceReport:
        """Produce about ``--consume-mb`` MB of ``size``-byte values into a new ``topic``."""
        create_topic(broker, topic)
        target = self.args.consume_mb * 1e6
        written = 0.0
        records = 0
        seconds = 0.0
        chunk = 0.2
        while written < target:
            load = attrs.evolve(self.load, topic=topic, size=size, seconds=chunk)
            report, _ = await broker_produce(reactor, broker, load)
            if report.errors or not report.records:
                raise RuntimeError(f"filling {topic}: {report.errors} errors")
            # Requests still in flight when the window closed are stored too.
            in_flight = load.connections * load.in_flight * load.batch
            written += (report.records + in_flight) * size
            records += report.records
            seconds += report.seconds
            # Aim the next run at what is left, at the rate seen so far.
            chunk = max(0.2, (target - written) / (records * size / seconds))
        return ProduceReport(records, 0, 0, seconds, size, ())


def _consume(report: ConsumeReport) -> dict[str, Any]:
    return {
        "records": report.records,
        "value_bytes": report.value_bytes,
        "seconds": report.seconds,
        "records_per_s": report.records_per_second,
        "mb_per_s": report.megabytes_per_second,
    }


def _consume_line(label: str, result: dict[str, Any]) -> str:
    return (
        f"consume  {label:<16}  records={result['records']:>9,}"
        f"  records/s={result['records_per_s']:>9,.0f}  MB/s={result['mb_per_s']:>6.1f}"
        f"  seconds={result['seconds']:.2f}"
        f"  cpu client={result['client_cpu']:.2f} server={result['server_cpu']:.2f}"
    )


async def _measure(reactor: Any, run: Run) -> None:
    await run.produce_rounds(reactor)
    run.summarise_produce()
    if run.args.consume:
        await run.consume_rounds(reactor)
    run.finished = True


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Durable produce throughput of logbroker next to Redis Streams "
        "(appendfsync always), and one consumer's drain speed."
    )
    add_work_directory_option(parser)
    add_load_options(
        parser, connections=4, connections_help="connections (4)", warmup=1.0, warmed="system"
    )
    parser.add_argument(
        "--keys",
        type=non_negative_int,
        default=DEFAULT_KEYS,
        help=f"distinct record keys, taken in turn; 0: keyless records only ({DEFAULT_KEYS})",
    )
    parser.add_argument(
        "--group-commit",
        choices=("both", "on", "off"),
        default="both",
        help="which logbroker configurations to measure (both)",
    )
    parser.add_argument(
        "--consume-sizes",
        type=batch_sizes,
        default=[100, 1024, 8192],
        help="record sizes of the drain measurement, comma-separated (100,1024,8192)",
    )
    parser.add_argument(
        "--consume-mb",
        type=positive_float,
        default=200.0,
        help="MB of record values produced for each drain size (200)",
    )
    parser.add_argument(
        "--no-consume", dest="consume", action="store_false", help="skip the consume part"
    )
    parser.add_argument(
        "--no-aof-rewrite",
        dest="aof_rewrite",
        action="store_false",
        help="turn off Redis' automatic rewrites of its append-only file (on by default, as in "
        "Redis' own default configuration; each rewrite forks and writes the data set again)",
    )
    parser.add_argument(
        "--redis-server", help="redis-server executable (default: from PATH, else installed)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    args = parser.parse_args(argv)
    largest = max([args.record_bytes, *(args.consume_sizes if args.consume else [])])
    if args.batch * (largest + 64) > MAX_FRAME:
        parser.error(f"--batch x the record size must fit in one {MAX_FRAME}-byte frame")
    if args.consume and args.group_commit == "off":
        parser.error("the consume part runs on the group-commit-on broker: add --no-consume")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    unwind_on_sigterm()
    executable = ensure_redis_server(args.redis_server)
    announce_start(args.json)
    modes = {"both": [GC_ON, GC_OFF], "on": [GC_ON], "off": [GC_OFF]}[args.group_commit]
    with contextlib.ExitStack() as stack:
        workdir = stack.enter_context(work_directory(args.dir, "bench-redis-"))
        redis = stack.enter_context(
            running_redis(executable, os.path.join(workdir, "redis"), args.aof_rewrite)
        )
        brokers = {
            name: stack.enter_context(
                running_broker(name, os.path.join(workdir, name), group_commit=name == GC_ON)
            )
            for name in modes
        }
        run = Run(args, redis, brokers)

        def measure(reactor: Any) -> Deferred[None]:
            return ensureDeferred(_measure(reactor, run))

        try:
            task.react(measure)
        except SystemExit as exit:
            if exit.code:
                for log in (redis.log, *(broker.log for broker in brokers.values())):
                    print(f"--- {log}:\n{tail(log)}", file=sys.stderr)
                raise
            if not run.finished:
                # The reactor was stopped by a signal: what was printed is all there is.
                raise SystemExit("interrupted before the measurement finished") from None
            raise


if __name__ == "__main__":
    main()
