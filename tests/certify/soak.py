"""``python -m tests.certify.soak``: the certification's drills in a loop, at random, with
random fault windows, for a given duration, on a cluster of realistic size (``make soak``;
docs/certification.md).

Besides the certification's load, the cluster holds ``--topics`` more topics (4 ranges each,
three taking writes all along, the rest idle), so that every fault meets thousands of ranges.
At least ``--primary-kills`` of the drills are SIGKILLs of a busy range's primary (the
power-kill drills). The run ends with the certification's table and a soak report: the faults
injected, the writes acknowledged, lost and read twice, the p99 produce latency outside and
during faults, and the time to recover after each fault; ``--report`` writes it into
docs/certification.md with the date, the commit and the machine.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

from tests.certify.drills import DRILLS, Drill, conclude, run
from tests.certify.harness import (
    FULL,
    Certification,
    Outcome,
    add_directory_arguments,
    tear_down_on_signals,
)
from tests.certify.load import ADMIN, PlainProducer, connect
from tests.certify.network import NetworkUnavailable, require_network_tools
from tests.certify.report import GUARANTEES, Report
from tests.history import History, Produce

ROOT = Path(__file__).resolve().parents[2]
#: The drills that SIGKILL a busy range's primary.
PRIMARY_KILLS = ("power-kill", "partitioned power-kill", "lagging power-kill")
#: How often each other drill comes up, against the kills' share.
OTHER_WEIGHT = 1.0
#: Topics beside the load's that take writes all along, and the pause between each one's.
BUSY_TOPICS = 3
BUSY_PACE = 0.1
#: docs/certification.md holds the last soak's report between these lines.
BEGIN = "<!-- soak report: written by python -m tests.certify.soak --report -->"
END = "<!-- end of soak report -->"


@attrs.define
class Fault:
    """One drill of the soak: when its fault began and ended, and what the checks found."""

    name: str
    started: float
    recovered: float
    outcome: Outcome


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.certify.soak", description=__doc__)
    parser.add_argument("--duration", type=float, default=3600, help="seconds of drills")
    parser.add_argument(
        "--topics", type=int, default=1000, help="topics beside the load's, 3 of them busy"
    )
    parser.add_argument(
        "--primary-kills",
        type=int,
        default=100,
        help="at least this many SIGKILLs of a primary (the run goes on past --duration until"
        " there were)",
    )
    parser.add_argument("--seed", type=int, default=None, help="the random schedule's seed")
    add_directory_arguments(parser)
    parser.add_argument(
        "--report", action="store_true", help="write the report into docs/certification.md"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    arguments = _arguments(argv)
    try:
        require_network_tools()
    except NetworkUnavailable as unavailable:
        print(f"cannot soak here: {unavailable}", file=sys.stderr)
        return 2
    tear_down_on_signals()
    seed = arguments.seed if arguments.seed is not None else random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    report = Report()
    faults: list[Fault] = []
    began = time.time()
    say(f"logbroker soak: {arguments.duration:g} s of drills, seed {seed}")
    try:
        cert = Certification(FULL, arguments.directory, say=say)
    except (ValueError, NetworkUnavailable) as refused:
        print(f"cannot soak: {refused}", file=sys.stderr)
        return 2
    with cert:
        busy = _more_topics(cert, arguments.topics)
        deadline = time.monotonic() + arguments.duration
        kills = 0
        while time.monotonic() < deadline or kills < arguments.primary_kills:
            drill = _pick(rng, kills, arguments.primary_kills, deadline)
            cert.timing = attrs.evolve(
                FULL, fault=rng.uniform(1.0, 8.0), settle=rng.uniform(0.5, 4.0)
            )
            number = len(faults) + 1
            say(f"\n== fault {number}: {drill.name}: {drill.description}")
            started = time.monotonic()
            record = run(cert, drill, say)
            report.drills.append(record)
            faults.append(Fault(drill.name, started, time.monotonic(), record.outcome))
            kills += drill.name in PRIMARY_KILLS
            if not record.passed:
                say("a drill failed: the soak stops here")
                break
            cert.settle()
        for producer in busy:
            producer.stop()
        verdict = conclude(cert, report, say)
        produces = cert.history.produces
        cert.keep = arguments.keep
    ended = time.time()
    say("")
    for line in report.table():
        say(line)
    lines = soak_report(
        faults, produces, report, verdict.acknowledged, seed, arguments, began, ended
    )
    say("")
    for line in lines:
        say(line)
    if arguments.report:
        _publish(lines)
        say("\nwritten into docs/certification.md")
    return 0 if report.passed else 1


def say(line: str) -> None:
    print(line, flush=True)


def _pick(rng: random.Random, kills: int, wanted: int, deadline: float) -> Drill:
    """The next drill: a primary kill often enough to reach ``wanted`` by ``deadline`` (past
    it, only kills), any other drill otherwise."""
    remaining = max(deadline - time.monotonic(), 1.0)
    # About 30 s a drill (its fault, its checks, the pause after): the share of kills that
    # reaches the number wanted in time.
    share = min(1.0, max(0.5, (wanted - kills) * 30.0 / remaining))
    names = PRIMARY_KILLS if rng.random() < share else None
    pool = [d for d in DRILLS if (d.name in PRIMARY_KILLS) == (names is not None)]
    if names is not None:
        # Mostly the plain power-kill: the other two need more set-up.
        return rng.choices(pool, weights=[4 if d.name == "power-kill" else 1 for d in pool])[0]
    return rng.choice(pool)


def _more_topics(cert: Certification, count: int) -> list[PlainProducer]:
    """``count`` topics besides the load's, each with the default ranges: the first
    ``BUSY_TOPICS`` take writes all along (a producer each, not checked), the rest stay idle.
    Returns those producers, started."""
    started = time.monotonic()
    with connect(cert.brokers[0].server, *ADMIN) as client:
        existing = {topic.name for topic in client.list_topics()}
        for number in range(count):
            name = f"idle-{number:04d}"
            if name not in existing:
                client.create_topic(name)
    cert.mark(f"{count} more topics present ({time.monotonic() - started:.0f} s to create)")
    servers = [broker.server for broker in cert.brokers]
    unchecked = History()
    busy = [
        PlainProducer(servers, index, f"idle-{index:04d}", unchecked, BUSY_PACE)
        for index in range(min(BUSY_TOPICS, count))
    ]
    for producer in busy:
        producer.start()
    cert.mark(f"{len(busy)} of them busy, the rest idle")
    return busy


def _percentile(values: Sequence[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def soak_report(
    faults: list[Fault],
    produces: list[Produce],
    report: Report,
    acknowledged: int,
    seed: int,
    arguments: argparse.Namespace,
    began: float,
    ended: float,
) -> list[str]:
    """The soak's report, as markdown."""
    # The faults come one after another, so their windows are disjoint and in order: a
    # produce overlaps one if the last window starting before it finished ends after it began.
    starts = [fault.started for fault in faults]
    ends = [fault.recovered for fault in faults]

    def during(produce: Produce) -> bool:
        index = bisect.bisect_right(starts, produce.finished) - 1
        return index >= 0 and ends[index] >= produce.started

    outside = [p.latency * 1000 for p in produces if p.acknowledged and not during(p)]
    inside = [p.latency * 1000 for p in produces if p.acknowledged and during(p)]
    kinds = collections.Counter(fault.name for fault in faults)
    kills = sum(kinds[name] for name in PRIMARY_KILLS)
    recovered = [f.outcome.recovered_after for f in faults if f.outcome.recovered_after is not None]
    healthy = [f.outcome.healthy_after for f in faults if f.outcome.healthy_after is not None]
    verdicts = report.verdicts()
    lost = _evidence_number(verdicts[1][1], "lost")
    twice = _evidence_number(verdicts[1][1], "read twice")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f} ms"

    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} s"

    described = ["git", "describe", "--always", "--dirty", "--abbrev=7"]
    commit = subprocess.run(described, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = [
        f"Soak of {time.strftime('%Y-%m-%d', time.gmtime(began))}, commit `{commit or 'unknown'}`,"
        f" on {platform.system()} {platform.machine()} with {os.cpu_count()} cores:"
        f" `python -m tests.certify.soak --duration {arguments.duration:g} --topics"
        f" {arguments.topics} --seed {seed}`, {((ended - began) / 60):.0f} minutes in all.",
        "",
        "| | |",
        "|---|---|",
        f"| faults injected | {len(faults)}: "
        + ", ".join(f"{name} {n}" for name, n in kinds.most_common())
        + " |",
        f"| SIGKILLs of a primary under load | {kills} |",
        f"| cluster | 3 nodes, replication factor 3; the load's topic and {arguments.topics} more"
        f" topics of 4 ranges, {min(BUSY_TOPICS, arguments.topics)} of them taking writes all"
        " along |",
        f"| acknowledged writes | {acknowledged} |",
        f"| lost | {lost} |",
        f"| read twice | {twice} |",
        f"| p99 produce latency outside faults | {ms(_percentile(outside, 0.99))}"
        f" ({len(outside)} produces) |",
        f"| p99 produce latency during faults | {ms(_percentile(inside, 0.99))}"
        f" ({len(inside)} produces) |",
        f"| clean produce and fetch after a fault ended | median {s(_percentile(recovered, 0.5))},"
        f" p99 {s(_percentile(recovered, 0.99))}, max {s(max(recovered, default=None))} |",
        f"| 3 of 3 healthy, none under-replicated | median {s(_percentile(healthy, 0.5))},"
        f" p99 {s(_percentile(healthy, 0.99))}, max {s(max(healthy, default=None))} |",
        "",
        "| | guarantee | verdict |",
        "|---|---|---|",
    ]
    for guarantee, (verdict, _) in verdicts.items():
        lines.append(f"| {guarantee} | {GUARANTEES[guarantee]} | {verdict} |")
    return lines


def _evidence_number(evidence: str, label: str) -> str:
    """The number before ``label`` in guarantee 1's evidence (``... 0 lost, 0 read twice``)."""
    for part in evidence.split(","):
        part = part.strip()
        if part.endswith(label):
            return part.removesuffix(label).strip()
    return "?"


def _publish(lines: list[str]) -> None:
    path = ROOT / "docs" / "certification.md"
    text = path.read_text()
    block = "\n".join([BEGIN, *lines, END])
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        _, after = rest.split(END, 1)
        text = before + block + after
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
