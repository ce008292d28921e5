"""``python -m tests.certify``: certify the spec's guarantees on three nodes in network
namespaces (docs/certification.md). ``make certify`` runs the full form; ``--short`` is the one
every CI run takes.

Exit status 0 when no guarantee failed, 1 when one did, 2 when the run could not start (not
root, no ``ip netns``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import attrs

from tests.certify.drills import DRILLS, conclude, run
from tests.certify.harness import (
    FULL,
    SHORT,
    Certification,
    add_directory_arguments,
    tear_down_on_signals,
)
from tests.certify.network import NetworkUnavailable, require_network_tools
from tests.certify.report import Report


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.certify",
        description="certify logbroker's guarantees on three nodes in network namespaces",
    )
    parser.add_argument(
        "--short", action="store_true", help="short fault windows (the form CI runs)"
    )
    parser.add_argument(
        "--drills",
        help="comma-separated drill names to run, in order (default: every drill); one of: "
        + ", ".join(drill.name for drill in DRILLS),
    )
    add_directory_arguments(parser)
    parser.add_argument(
        "--unsafe-acks",
        action="store_true",
        help="negative control: brokers that acknowledge before a quorum holds a write (the"
        " run must fail guarantee 1)",
    )
    parser.add_argument(
        "--scrub-off",
        action="store_true",
        help="negative control: the scrub off, so damage stays (the storage drill must fail"
        " guarantee 4; copies are given 5 s to be identical, as nothing mends them)",
    )
    return parser.parse_args(argv)


#: How long the negative control with the scrub off waits for every sealed copy to be identical.
UNMENDED_IDENTICAL_BOUND = 5.0


def main(argv: list[str] | None = None) -> int:
    arguments = _arguments(argv)
    drills = list(DRILLS)
    if arguments.drills:
        # A name may repeat: each is one more run of that drill.
        wanted = [name.strip() for name in arguments.drills.split(",")]
        known = {drill.name: drill for drill in DRILLS}
        unknown = [name for name in wanted if name not in known]
        if unknown:
            print(f"unknown drill {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
            return 2
        drills = [known[name] for name in wanted]
    try:
        require_network_tools()
    except NetworkUnavailable as unavailable:
        print(f"cannot certify here: {unavailable}", file=sys.stderr)
        return 2
    tear_down_on_signals()
    timing = SHORT if arguments.short else FULL
    if arguments.scrub_off:
        # Nothing mends a damaged copy with the scrub off: waiting out the whole bound for it
        # (45 s short, twice a run) would only make the control slower. A copy still being
        # sealed when it is compared settles within this one.
        timing = attrs.evolve(timing, identical_bound=UNMENDED_IDENTICAL_BOUND)
    report = Report()
    print(f"logbroker certification ({'short' if arguments.short else 'full'} form)", flush=True)
    settings = {}
    if arguments.unsafe_acks:
        settings["PYTHONPATH"] = str(Path(__file__).with_name("unsafe"))
        # Segments that never roll during the run: an unsafe primary that sealed a segment at
        # an end only it holds would leave the range waiting for it (no copy to claim from),
        # and the loss would never show.
        settings["SVC_SEGMENT_MAX_BYTES"] = str(64 * 1024 * 1024)
    if os.environ.get("CERTIFY_BROKER_PYTHONPATH"):
        settings["PYTHONPATH"] = os.environ["CERTIFY_BROKER_PYTHONPATH"]
    if arguments.scrub_off:
        settings["SVC_SCRUB_ENABLED"] = "false"
    if settings:
        _say(f"negative control: {', '.join(f'{k}={v}' for k, v in settings.items())}")
    try:
        cert = Certification(timing, arguments.directory, settings, say=_say)
    except (ValueError, NetworkUnavailable) as refused:
        print(f"cannot certify: {refused}", file=sys.stderr)
        return 2
    with cert:
        for number, drill in enumerate(drills, 1):
            _say(f"\n== drill {number}/{len(drills)}: {drill.name}: {drill.description}")
            report.drills.append(run(cert, drill, _say))
            cert.settle()
        conclude(cert, report, _say)
        cert.keep = arguments.keep
    _say("")
    for line in report.table():
        _say(line)
    return 0 if report.passed else 1


def _say(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
