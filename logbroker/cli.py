"""The ``logbroker`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from logbroker import exitcodes
from logbroker.storage import FormatTooNewError, OsFileSystem, StorageError
from logbroker.storage.inspect import SegmentReport, verify_data_directory


def _describe(report: SegmentReport) -> str:
    verification = report.verification
    state = "sealed" if report.sealed else "unsealed"
    damage = verification.damage
    if damage is None:
        outcome = f"verified records={verification.record_count} bytes={verification.byte_size}"
    elif report.torn_tail:
        outcome = (
            f"torn tail at byte {damage.position} (never acknowledged; dropped when the range "
            f"opens) records={verification.record_count}"
        )
    else:
        outcome = f"DAMAGED at byte {damage.position} ({damage.reason.value})"
    return f"{report.path}  {state}  {outcome}"


def _as_json(report: SegmentReport) -> str:
    damage = report.verification.damage
    return json.dumps(
        {
            "range": report.range_name,
            "path": report.path,
            "sealed": report.sealed,
            "verified": damage is None,
            "torn_tail": report.torn_tail,
            "damage": None
            if damage is None
            else {"position": damage.position, "reason": damage.reason.value},
            "record_count": report.verification.record_count,
            "byte_size": report.verification.byte_size,
        }
    )


def _storage_verify(args: argparse.Namespace) -> int:
    try:
        reports = verify_data_directory(args.data_dir, OsFileSystem())
    except FormatTooNewError as error:
        print(f"logbroker: {error}", file=sys.stderr)
        return exitcodes.FORMAT_TOO_NEW
    except (StorageError, OSError) as error:
        print(f"logbroker: {error}", file=sys.stderr)
        return exitcodes.FAILURE
    for report in reports:
        print(_as_json(report) if args.json else _describe(report))
    damaged = sum(report.damaged for report in reports)
    if not args.json:
        print(f"{len(reports)} segments checked, {damaged} damaged", file=sys.stderr)
    return exitcodes.FAILURE if damaged else exitcodes.OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logbroker", description="logbroker command line")
    commands = parser.add_subparsers(dest="command", required=True)
    storage = commands.add_parser("storage", help="inspect a data directory on this machine")
    storage_commands = storage.add_subparsers(dest="storage_command", required=True)
    verify = storage_commands.add_parser(
        "verify",
        help="check every checksum of every segment, changing nothing",
        description="Exit 0 if every segment verifies, 1 if any is damaged, "
        "3 if the data directory was written by a newer logbroker.",
    )
    verify.add_argument("data_dir", help="the broker's data directory (SVC_DATA_DIR)")
    verify.add_argument("--json", action="store_true", help="one JSON object per segment")
    verify.set_defaults(run=_storage_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
