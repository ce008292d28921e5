"""Produce latency of a real ``twistd logbroker`` while its integrity scrub runs hard, next to
the same broker with the scrub off.

What it measures: one broker whose data directory holds ``--prefill-mb`` MB of sealed segments
of ``--segment-mb`` MB each, restarted between rounds with the scrub off
(``SVC_SCRUB_ENABLED=false``) and on at ``--per-tick`` sealed segments per
``--interval-ms`` (200 segments a second by default: every sealed segment read back and
checked about once a second, far beyond the spec's default of one a minute). Each round drives
the usual closed-loop keyed load (``--connections`` x ``--in-flight`` requests of ``--batch``
keyed records of ``--record-bytes`` bytes) for ``--seconds``: acknowledged records/s and the
latency p50/p99/p99.9 per request, and for the rounds with the scrub on, how many segments and
bytes it checked during the round (from ``/metrics``), which shows it ran.

Why: the scrub must not disturb clients (issue "Integrity scrub and repair"): it reads and
checks sealed segments on the storage's reader threads, beside the range's writes rather than
between them, and the reactor only hands the work over.

How: the rounds alternate off and on (``--repeat`` of each), so that drift on a shared machine
favours neither; the summary takes medians. Every record of every round is fsynced before it is
acknowledged (group commit on, the spec's setting for throughput). The broker and its data are
removed at the end, also after an error or Ctrl-C. From the repository root, with the project's
virtualenv (about 3 minutes with the defaults)::

    .venv/bin/python bench/scrub_latency.py
    .venv/bin/python bench/scrub_latency.py --repeat 5 --json

``--dir`` names a directory on the disk to measure (default under ``bench/.work``). Do not point
it at tmpfs. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
from _common import (
    APP,
    RUN_GRACE_SECONDS,
    CpuMeter,
    Node,
    add_load_options,
    add_work_directory_option,
    announce_start,
    emit,
    positive_int,
    produce_line,
    produce_result,
    running_node,
    tail,
    unwind_on_sigterm,
    work_directory,
)
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import task
from twisted.internet.defer import ensureDeferred

from logbroker.benchmark import ProduceLoad, ProduceReport, run_produce

DASHBOARD = re.compile(r"Dashboard listening on (\S+):(\d+)")
MB = 1024 * 1024


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Produce latency with the integrity scrub running hard, next to it off."
    )
    add_load_options(
        parser,
        connections=4,
        connections_help="client connections (4)",
        warmup=3.0,
        warmed="broker start",
    )
    parser.add_argument(
        "--prefill-mb", type=positive_int, default=800, help="sealed data to scrub, MB (800)"
    )
    parser.add_argument(
        "--segment-mb", type=positive_int, default=4, help="segment roll size, MB (4)"
    )
    parser.add_argument(
        "--per-tick", type=positive_int, default=200, help="segments checked per tick (200)"
    )
    parser.add_argument(
        "--interval-ms", type=positive_int, default=1000, help="scrub tick period, ms (1000)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per line")
    add_work_directory_option(parser)
    return parser.parse_args(argv)


def _settings(args: argparse.Namespace, scrub: bool) -> dict[str, str]:
    return {
        "SVC_GROUP_COMMIT": "true",
        "SVC_SEGMENT_MAX_BYTES": str(args.segment_mb * MB),
        "SVC_SCRUB_ENABLED": "true" if scrub else "false",
        "SVC_SCRUB_INTERVAL_MS": str(args.interval_ms),
        "SVC_SCRUB_SEGMENTS_PER_TICK": str(args.per_tick),
    }


@contextlib.contextmanager
def _broker(directory: str, args: argparse.Namespace, scrub: bool, first: bool) -> Iterator[Node]:
    with running_node(
        "scrub-on" if scrub else "scrub-off",
        directory,
        _settings(args, scrub),
        restart=not first,
    ) as node:
        yield node


def _scrubbed(node: Node) -> tuple[float, float]:
    """The sealed segments the node's scrub verified so far, and their bytes' worth as the
    storage reads them (``svc_storage_scrub_segments_total`` of every result)."""
    match = DASHBOARD.search(tail(node.log, 400))
    assert match is not None, tail(node.log)
    url = f"http://127.0.0.1:{match.group(2)}/metrics"
    with urllib.request.urlopen(
        urllib.request.Request(url, headers={"Accept": "text/plain"}), timeout=30
    ) as answer:
        text = answer.read().decode()
    checked = sealed = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "svc_storage_scrub_segments_total":
                checked += sample.value
            elif sample.name == "svc_storage_segments" and sample.labels.get("state") == "sealed":
                sealed += sample.value
    return checked, sealed


async def _produce(
    reactor: Any, node: Node, load: ProduceLoad
) -> tuple[ProduceReport, dict[str, float]]:
    cpu = CpuMeter({"server": [node.process.pid]})
    running = ensureDeferred(run_produce(reactor, "127.0.0.1", node.port, *APP, load))
    running.addTimeout(load.seconds + RUN_GRACE_SECONDS, reactor)
    report = await running
    return report, cpu.read()


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    unwind_on_sigterm()
    announce_start(args.json)
    finished: list[bool] = []

    async def measure(reactor: Any) -> None:
        await _measure(reactor, args)
        finished.append(True)

    try:
        task.react(lambda reactor: ensureDeferred(measure(reactor)))
    except SystemExit as exit:
        if exit.code or not finished:
            raise


async def _measure(reactor: Any, args: argparse.Namespace) -> None:
    """The whole run, in the one reactor run a process gets (the brokers' starts and stops
    block it while no load is in flight)."""
    load = ProduceLoad(
        topic="latency",
        connections=args.connections,
        in_flight=args.in_flight,
        batch=args.batch,
        size=args.record_bytes,
        seconds=args.seconds,
        keys=args.batch,
    )
    rounds: dict[str, list[dict[str, Any]]] = {"scrub-off": [], "scrub-on": []}
    with work_directory(args.dir, "bench-scrub-") as workdir:
        directory = os.path.join(workdir, "broker")
        with _broker(directory, args, scrub=False, first=True) as node:
            with node.client() as client:
                client.create_topic("prefill")
                client.create_topic("latency")
            # The sealed data the scrub reads back: keyed records, at full speed.
            fill = attrs.evolve(load, topic="prefill", seconds=5.0)
            written = 0
            while written < args.prefill_mb * MB:
                report, _ = await _produce(reactor, node, fill)
                written += report.records * args.record_bytes
            _, sealed = _scrubbed(node)
            emit(
                args.json,
                "prefill",
                {"mb": written / MB, "sealed_segments": sealed},
                f"prefill: {written / MB:.0f} MB of values, {sealed:.0f} sealed segments",
            )
        for number in range(1, args.repeat + 1):
            for scrub in (False, True):
                name = "scrub-on" if scrub else "scrub-off"
                with _broker(directory, args, scrub=scrub, first=False) as node:
                    await _produce(reactor, node, attrs.evolve(load, seconds=args.warmup))
                    before = _scrubbed(node)[0]
                    report, cpu = await _produce(reactor, node, load)
                    checked = _scrubbed(node)[0] - before
                result = produce_result(name, report)
                result.update(
                    **cpu,
                    scrubbed_segments=checked,
                    scrubbed_mb=checked * args.segment_mb,
                )
                rounds[name].append(result)
                line = produce_line(f"round {number}", result)
                if scrub:
                    line += (
                        f"  scrubbed={checked:.0f} segments (~{checked * args.segment_mb:.0f} MB)"
                    )
                emit(args.json, "round", result, line)
    for name, results in rounds.items():
        summary = {
            "system": name,
            **{
                key: statistics.median(r[key] for r in results)
                for key in ("records_per_s", "p50_ms", "p99_ms", "p999_ms", "scrubbed_segments")
            },
        }
        emit(
            args.json,
            "summary",
            summary,
            f"median {name:<10} records/s={summary['records_per_s']:>9,.0f}"
            f"  p50_ms={summary['p50_ms']:.2f}  p99_ms={summary['p99_ms']:.2f}"
            f"  p99.9_ms={summary['p999_ms']:.2f}"
            f"  scrubbed={summary['scrubbed_segments']:.0f} segments per round",
        )


if __name__ == "__main__":
    main()
