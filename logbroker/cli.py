"""The ``logbroker`` command: a client of the broker (topics, produce, consume, users, ACLs, the
cluster's status and a check of its copies) and an offline check of a data directory
(``storage verify``). docs/clients.md shows every subcommand.

Exit statuses (``logbroker.exitcodes``): 0 success; 1 the broker refused a request (its reason
is on stderr), the broker cannot be reached, or damage (or, for ``cluster verify``, a copy
missing, differing or stale, or a node not checked) was found; 2 bad usage, including no
credentials; 3 a data directory from a newer storage format.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import attrs

from logbroker import exitcodes
from logbroker.benchmark import DEFAULT_KEYS
from logbroker.client.blocking import BlockingClient, BrokerRefused
from logbroker.controlplane import ControlPlaneError
from logbroker.controlplane.local import SINGLE_NODE_CONTROL, STATE_FILE, forget_segments
from logbroker.records import Record
from logbroker.storage import DataDirectory, FormatTooNewError, OsFileSystem, StorageError
from logbroker.storage.inspect import SegmentReport, verify_data_directory
from logbroker.storage.salvage import Salvaged, salvage_range
from logbroker.wire import (
    ClusterInfo,
    ClusterNodeInfo,
    ProtocolViolation,
    VerifyInfo,
    VerifyProblemInfo,
)

if TYPE_CHECKING:
    from twisted.internet.interfaces import IOpenSSLClientConnectionCreator

DEFAULT_PORT = 4040
DEFAULT_SERVER = f"localhost:{DEFAULT_PORT}"
USER_VARIABLE = "SVC_CLIENT_USER"
PASSWORD_VARIABLE = "SVC_CLIENT_PASSWORD"
#: ``produce`` sends stdin in batches of at most this many records and about this many bytes.
PRODUCE_BATCH_RECORDS = 1000
PRODUCE_BATCH_BYTES = 1024 * 1024
#: The most records one fetch returns (the broker's cap).
FETCH_RECORDS = 1000
#: ``consume --follow`` long-polls this long (the broker's cap) per fetch.
FOLLOW_WAIT_MS = 30_000


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


def _storage_salvage(args: argparse.Namespace) -> int:
    fs = OsFileSystem()
    try:
        # Checked first, so that a path that is no data directory is not made one.
        DataDirectory.open(args.data_dir, fs, create=False)
        # Its lock: the broker must be stopped.
        data_dir = DataDirectory.open(args.data_dir, fs)
    except FormatTooNewError as error:
        print(f"logbroker: {error}", file=sys.stderr)
        return exitcodes.FORMAT_TOO_NEW
    except (StorageError, OSError) as error:
        print(f"logbroker: {error}", file=sys.stderr)
        return exitcodes.FAILURE
    control = f"{data_dir.path}/{SINGLE_NODE_CONTROL}"
    if not fs.exists(f"{control}/{STATE_FILE}"):
        print(
            f"logbroker: {data_dir.path} holds no single node's control plane: a cluster node's"
            " damaged copies are repaired from its replicas by the scrub, not salvaged",
            file=sys.stderr,
        )
        return exitcodes.FAILURE
    names = data_dir.range_names()
    if args.range is not None:
        if args.range not in names:
            print(f"logbroker: no range {args.range!r} in {data_dir.path}", file=sys.stderr)
            return exitcodes.FAILURE
        names = [args.range]
    try:
        salvaged = [found for name in names for found in salvage_range(fs, data_dir.path, name)]
        forget_segments(fs, control, [(s.range_name, s.plan.base_offset) for s in salvaged])
    except (StorageError, ControlPlaneError, OSError) as error:
        print(f"logbroker: {error}", file=sys.stderr)
        return exitcodes.FAILURE
    for found in salvaged:
        print(_salvage_json(found) if args.json else _describe_salvage(found))
    if not args.json:
        print(f"{len(salvaged)} damaged segments salvaged", file=sys.stderr)
    return exitcodes.OK


def _describe_salvage(found: Salvaged) -> str:
    plan = found.plan
    kept = ", ".join(
        f"offsets {run.base_offset}-{run.next_offset - 1}" for run in plan.runs if run.record_count
    )
    line = (
        f"{found.range_name}@{plan.base_offset}: damaged at byte {plan.damage.position}"
        f" ({plan.damage.reason.value}); kept {sum(run.record_count for run in plan.runs)} records"
        f" ({kept or 'none'}); its files are in {found.kept_in}"
    )
    if found.started is not None:
        line += f"; the range goes on at offset {found.started}"
    return line


def _salvage_json(found: Salvaged) -> str:
    plan = found.plan
    return json.dumps(
        {
            "range": found.range_name,
            "base_offset": plan.base_offset,
            "damage": {"position": plan.damage.position, "reason": plan.damage.reason.value},
            "kept": [[run.base_offset, run.next_offset] for run in plan.runs],
            "set_aside_in": found.kept_in,
            "resumes_at": found.started,
        }
    )


# -- arguments -----------------------------------------------------------------------------


@attrs.frozen
class Server:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_server(text: str) -> Server:
    """``HOST:PORT``, ``HOST`` (port 4040) or ``[IPv6]:PORT``."""
    host, colon, port_text = text.rpartition(":")
    if not colon or (host.count(":") and not host.startswith("[")):
        host, port_text = text, str(DEFAULT_PORT)
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {text!r}")
    return Server(host, int(port_text))


def _arg_bytes(text: str) -> bytes:
    """An argument's bytes exactly as given (argv that is not UTF-8 included)."""
    return os.fsencode(text)


def _looks_like_option(text: str) -> bool:
    return text.startswith("-") and not text[1:2].isdigit()


def _header(text: str) -> tuple[bytes, bytes]:
    name, equals, value = text.partition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    return _arg_bytes(name), _arg_bytes(value)


def _bounded(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            upper = "" if high is None else f" to {high}"
            raise argparse.ArgumentTypeError(f"expected an integer {low}{upper}, not {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def _cafile(path: str) -> str:
    """A file of PEM CA certificates, loaded once here so that a bad one is a usage error."""
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ValueError) as error:
        detail = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise argparse.ArgumentTypeError(
            f"cannot load CA certificates from {path}: {detail}"
        ) from None
    return path


def _permissions(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


# -- output --------------------------------------------------------------------------------


def _text_or_base64(data: bytes) -> tuple[str, bool]:
    """``data`` as text if it is UTF-8, else as base64 (and ``True``)."""
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), True


def record_json(record: Record) -> dict[str, object]:
    """A record as ``consume --json`` prints it (docs/clients.md, "JSON records").

    ``key``, ``value`` and the header names and values are text when they are UTF-8. A key or
    value that is not is base64, marked by ``"key_encoding": "base64"`` or
    ``"encoding": "base64"``; if any header name or value is not UTF-8, every header name and
    value of the record is base64, marked by ``"headers_encoding": "base64"``. A null key,
    header name or header value is ``null``. Without a marker, the field is text.
    """
    result: dict[str, object] = {}
    if record.key is None:
        result["key"] = None
    else:
        result["key"], key_base64 = _text_or_base64(record.key)
        if key_base64:
            result["key_encoding"] = "base64"
    result["value"], value_base64 = _text_or_base64(record.value)
    if value_base64:
        result["encoding"] = "base64"
    result["timestamp"] = record.timestamp_ms
    parts = [part for header in record.headers for part in header if part is not None]
    headers_base64 = any(_text_or_base64(part)[1] for part in parts)

    def show(part: bytes | None) -> str | None:
        if part is None:
            return None
        if headers_base64:
            return base64.b64encode(part).decode("ascii")
        return part.decode("utf-8")

    result["headers"] = [[show(name), show(value)] for name, value in record.headers]
    if headers_base64:
        result["headers_encoding"] = "base64"
    return result


def _print_records(records: Iterable[Record], as_json: bool, out: BinaryIO) -> None:
    for record in records:
        if as_json:
            line = json.dumps(record_json(record), ensure_ascii=False).encode("utf-8")
        else:
            line = record.value
        out.write(line + b"\n")
    out.flush()


# -- client commands -----------------------------------------------------------------------


def _topic_create(args: argparse.Namespace, client: BlockingClient) -> int:
    client.create_topic(args.name, args.keyspace_bits)
    print(f"created topic {args.name}")
    return exitcodes.OK


def _topic_list(args: argparse.Namespace, client: BlockingClient) -> int:
    for topic in client.list_topics():
        print(f"{topic.name} keyspace_bits={topic.keyspace_bits} ranges={topic.range_count}")
    return exitcodes.OK


def _lines(stream: BinaryIO) -> Iterator[bytes]:
    """Each line without its newline (a last line without one included)."""
    for line in stream:
        yield line[:-1] if line.endswith(b"\n") else line


def _batches(records: Iterable[Record]) -> Iterator[list[Record]]:
    batch: list[Record] = []
    size = 0
    for record in records:
        batch.append(record)
        size += len(record.value) + len(record.key or b"")
        if len(batch) >= PRODUCE_BATCH_RECORDS or size >= PRODUCE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _produce(args: argparse.Namespace, client: BlockingClient) -> int:
    key = None if args.key is None else _arg_bytes(args.key)
    headers = tuple(args.header)
    values = (
        (_arg_bytes(value) for value in args.values) if args.values else _lines(sys.stdin.buffer)
    )

    def stamped(value: bytes) -> Record:
        timestamp = round(time.time() * 1000) if args.timestamp is None else args.timestamp
        return Record(value, key, timestamp, headers)

    appended = 0
    try:
        for batch in _batches(stamped(value) for value in values):
            appended += client.produce(args.topic, batch)
    except (BrokerRefused, OSError):
        if appended:
            print(
                f"logbroker: {appended} records were appended before the error below",
                file=sys.stderr,
            )
        raise
    print(appended)
    return exitcodes.OK


def _consume(args: argparse.Namespace, client: BlockingClient) -> int:
    out = sys.stdout.buffer
    cursor: str | None = args.cursor
    # The first fetch, with no cursor, starts at the group's committed position when given a
    # group (else at the start); each later one carries the cursor the previous one returned.
    start_group = None if args.from_start else args.group
    remaining: int | None = args.max
    wait_ms = FOLLOW_WAIT_MS if args.follow else 0
    consumed = 0
    try:
        while remaining is None or remaining > 0:
            limit = FETCH_RECORDS if remaining is None else min(remaining, FETCH_RECORDS)
            group = start_group if cursor is None else None
            batch = client.fetch(args.topic, cursor, group, None, limit, wait_ms)
            cursor = batch.next_cursor
            if batch.records:
                _print_records(batch.records, args.json, out)
                consumed += len(batch.records)
                if remaining is not None:
                    remaining -= len(batch.records)
                if args.group is not None and cursor is not None:
                    client.commit(args.topic, args.group, cursor)
            elif not args.follow:
                break
    except KeyboardInterrupt:
        return exitcodes.OK  # Ctrl-C is how --follow ends
    noun = "record" if consumed == 1 else "records"
    print(f"consumed {consumed} {noun}; next cursor: {cursor}", file=sys.stderr)
    return exitcodes.OK


def _user_add(args: argparse.Namespace, client: BlockingClient) -> int:
    client.create_user(args.name, args.new_password, args.permissions)
    print(f"created user {args.name}")
    return exitcodes.OK


def _user_list(args: argparse.Namespace, client: BlockingClient) -> int:
    for name, permissions in client.list_users():
        print(f"{name} permissions={','.join(p or '' for p in permissions)}")
    return exitcodes.OK


def _user_delete(args: argparse.Namespace, client: BlockingClient) -> int:
    client.delete_user(args.name)
    print(f"deleted user {args.name}")
    return exitcodes.OK


def _user_passwd(args: argparse.Namespace, client: BlockingClient) -> int:
    client.change_password(args.name, args.new_password)
    print(f"changed the password of {args.name}")
    return exitcodes.OK


def _acl_grant(args: argparse.Namespace, client: BlockingClient) -> int:
    client.grant_acl(args.user_name, args.operation, args.pattern)
    print(f"granted {args.operation} on {args.pattern} to {args.user_name}")
    return exitcodes.OK


def _acl_revoke(args: argparse.Namespace, client: BlockingClient) -> int:
    client.revoke_acl(args.user_name, args.operation, args.pattern)
    print(f"revoked {args.operation} on {args.pattern} from {args.user_name}")
    return exitcodes.OK


def _acl_list(args: argparse.Namespace, client: BlockingClient) -> int:
    for operation, pattern in client.list_acls(args.user_name):
        print(f"{operation} {pattern}")
    return exitcodes.OK


def node_address(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _marks(cluster: ClusterInfo, node: ClusterNodeInfo) -> list[str]:
    marks = []
    if node.node_id == cluster.node_id:
        marks.append("answering")
    if node.node_id == cluster.chores_holder:
        marks.append("chores")
    return marks


def cluster_json(cluster: ClusterInfo) -> dict[str, object]:
    """The cluster as ``cluster status --json`` prints it (docs/clients.md)."""
    lease = cluster.lease_age_ms
    return {
        "cluster_id": cluster.cluster_id,
        "node_id": cluster.node_id,
        "control_plane": cluster.control_plane,
        "chores_holder": cluster.chores_holder,
        "domain_violations": cluster.domain_violations,
        "under_replicated_segments": cluster.under_replicated,
        "unavailable_ranges": cluster.unavailable_ranges,
        "lease_age_seconds": None if lease is None else lease / 1000,
        "nodes": [
            {
                "node_id": node.node_id,
                "state": "alive" if node.alive else "dead",
                "address": node_address(node.host, node.client_port),
                "host": node.host,
                "client_port": node.client_port,
                "dashboard_port": node.dashboard_port,
                "peer_port": node.peer_port,
                "attributes": dict(node.attributes),
                "segments_led": node.segments_led,
                "version": node.version,
                "answering": node.node_id == cluster.node_id,
                "chores": node.node_id == cluster.chores_holder,
            }
            for node in cluster.nodes
        ],
    }


def cluster_table(cluster: ClusterInfo) -> list[str]:
    """The cluster as ``cluster status`` prints it: a few facts, then one row per node."""
    lease = cluster.lease_age_ms
    facts = [
        ("cluster", cluster.cluster_id),
        ("control plane", cluster.control_plane),
        ("chores holder", cluster.chores_holder or "none"),
        ("domain violations", str(cluster.domain_violations)),
    ]
    under_replicated = cluster.under_replicated
    facts.append(
        (
            "under-replicated",
            "not counted yet" if under_replicated is None else f"{under_replicated} segments",
        )
    )
    unavailable = cluster.unavailable_ranges
    facts.append(
        (
            "unavailable",
            "not counted yet" if unavailable is None else f"{unavailable} ranges",
        )
    )
    if lease is not None:
        facts.append(("lease age", f"{lease / 1000:.1f} s"))
    lines = [f"{name + ':':<19}{value}" for name, value in facts]
    rows = [["NODE", "STATE", "ADDRESS", "PEER PORT", "ATTRIBUTES", "SEGMENTS LED", ""]]
    for node in cluster.nodes:
        rows.append(
            [
                node.node_id,
                "alive" if node.alive else "dead",
                node_address(node.host, node.client_port),
                str(node.peer_port) if node.peer_port else "-",
                ",".join(f"{name}={value}" for name, value in node.attributes) or "-",
                str(node.segments_led),
                " ".join(_marks(cluster, node)),
            ]
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines.append("")
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    return [line.rstrip() for line in lines]


def _cluster_status(args: argparse.Namespace, client: BlockingClient) -> int:
    try:
        cluster = client.describe_cluster()
    except BrokerRefused as refused:
        if refused.reason != "invalid_operation":
            raise
        return _fail(
            f"invalid_operation (describe the cluster on {args.server}): this broker was built"
            " without a view of its cluster, so it cannot describe it"
        )
    if args.json:
        print(json.dumps(cluster_json(cluster), ensure_ascii=False))
    else:
        print("\n".join(cluster_table(cluster)))
    return exitcodes.OK


def _where(problem: VerifyProblemInfo) -> str:
    if problem.range_id is None:
        return problem.node_id
    return f"{problem.range_id}@{problem.base_offset} on {problem.node_id}"


def verify_lines(report: VerifyInfo) -> list[str]:
    """The report as ``cluster verify`` prints it: a line per problem, then the summary."""
    lines = []
    for problem in report.problems:
        line = f"{_where(problem)}: {problem.kind}"
        if problem.files:
            line += ": " + ", ".join(f".{name}" for name in problem.files)
        if problem.detail:
            line += f" ({problem.detail})"
        lines.append(line)
    unlisted = report.problem_count - len(report.problems)
    if unlisted:
        lines.append(f"... and {unlisted} more problems, not listed")
    checked = f"checked {report.segments_checked} sealed segments, {report.copies_checked} copies"
    if report.copies_unchecked:
        checked += f" ({report.copies_unchecked} more on nodes not checked)"
    if report.problem_count:
        lines.append(f"{checked}: {report.problem_count} problems")
    else:
        lines.append(f"{checked}: every copy complete and identical")
    return lines


def verify_json(report: VerifyInfo) -> dict[str, object]:
    """The report as ``cluster verify --json`` prints it (docs/clients.md)."""
    return {
        "node_id": report.node_id,
        "ok": report.problem_count == 0,
        "segments_checked": report.segments_checked,
        "copies_checked": report.copies_checked,
        "copies_unchecked": report.copies_unchecked,
        "problem_count": report.problem_count,
        "problems": [
            {
                "kind": problem.kind,
                "node_id": problem.node_id,
                "range_id": problem.range_id,
                "base_offset": problem.base_offset,
                "files": list(problem.files),
                "detail": problem.detail,
            }
            for problem in report.problems
        ],
    }


def _cluster_verify(args: argparse.Namespace, client: BlockingClient) -> int:
    try:
        report = client.verify_cluster(timeout=args.timeout)
    except BrokerRefused as refused:
        if refused.reason != "invalid_operation":
            raise
        return _fail(
            f"invalid_operation (verify the cluster on {args.server}): this broker is not a node"
            " of a cluster; check a single node's data with `logbroker storage verify`"
        )
    except TimeoutError:
        return _fail(
            f"{args.server} did not finish verifying within {args.timeout:g} s; pass a longer"
            " --timeout"
        )
    if args.json:
        print(json.dumps(verify_json(report), ensure_ascii=False))
    else:
        print("\n".join(verify_lines(report)))
    return exitcodes.OK if report.problem_count == 0 else exitcodes.FAILURE


#: What to suggest after a refusal with this reason.
_HINTS = {
    "invalid_credentials": f"check --user and --password (or {USER_VARIABLE} and "
    f"{PASSWORD_VARIABLE})",
    "permission_denied": "an admin can grant it with `logbroker user` or `logbroker acl`",
    "no_such_topic": "create it with `logbroker topic create`",
    "tls_required": "the broker takes TLS only: pass --tls (and --cafile PEM unless its"
    " certificate's CA is one this system trusts)",
    "unknown_api_key": "the broker is older than this command and lacks the operation",
}


def _bench_produce(args: argparse.Namespace, client: BlockingClient) -> int:
    from logbroker.benchmark import ProduceLoad, run_produce

    _ensure_topic(client, args.topic)
    load = ProduceLoad(
        args.topic,
        connections=args.connections,
        in_flight=args.in_flight,
        batch=args.batch,
        size=args.size,
        seconds=args.seconds,
        rate=args.rate,
        keys=args.keys,
    )
    live = sys.stderr.isatty()

    def progress(elapsed: float, records: int) -> None:
        rate = records / elapsed if elapsed else 0.0
        print(
            f"\r{elapsed:5.1f} s  {records:>12,} records  {rate:>12,.0f} records/s",
            end="",
            file=sys.stderr,
            flush=True,
        )

    reports = []

    async def run(reactor: Any) -> None:
        server: Server = args.server
        reports.append(
            await run_produce(
                reactor,
                server.host,
                server.port,
                args.bench_user,
                args.bench_password,
                load,
                progress if live else None,
                tls=_bench_tls(args),
            )
        )

    _react(run)
    if live:
        print(file=sys.stderr)
    report = reports[0]
    print(
        f"produce {args.topic}: {args.connections} connections x {args.in_flight} in flight x "
        f"{args.batch} records of {args.size} bytes, {args.seconds:g} s"
        + (f", {args.rate:g} requests/s" if args.rate else "")
    )
    print(
        f"records/s {report.records_per_second:,.0f}  MB/s {report.megabytes_per_second:.1f}  "
        f"requests {report.requests:,}  errors {report.errors:,}"
    )
    print(
        f"latency per request (ms, from when it was due): p50 {report.percentile(50):.2f}  "
        f"p99 {report.percentile(99):.2f}  p99.9 {report.percentile(99.9):.2f}"
    )
    return exitcodes.OK if report.errors == 0 else exitcodes.FAILURE


def _bench_consume(args: argparse.Namespace, client: BlockingClient) -> int:
    from logbroker.benchmark import run_consume

    client.fetch(args.topic, max_records=1)  # an unknown topic fails here, with its reason
    reports = []

    async def run(reactor: Any) -> None:
        server: Server = args.server
        reports.append(
            await run_consume(
                reactor,
                server.host,
                server.port,
                args.bench_user,
                args.bench_password,
                args.topic,
                tls=_bench_tls(args),
            )
        )

    _react(run)
    report = reports[0]
    print(
        f"consume {args.topic}: {report.records:,} records in {report.seconds:.2f} s  "
        f"records/s {report.records_per_second:,.0f}  MB/s {report.megabytes_per_second:.1f}"
    )
    return exitcodes.OK


def _bench_tls(args: argparse.Namespace) -> IOpenSSLClientConnectionCreator | None:
    """The benchmark connections' TLS: the same as the command's own connection."""
    from logbroker.client import client_tls_options

    server: Server = args.server
    return client_tls_options(server.host, args.cafile) if args.tls else None


def _ensure_topic(client: BlockingClient, topic: str) -> None:
    try:
        client.create_topic(topic)
    except BrokerRefused as refused:
        if refused.reason != "already_exists":
            raise


def _react(run: Callable[[Any], Coroutine[Any, Any, None]]) -> None:
    """Run ``run(reactor)`` on the global reactor (the CLI is a composition root), then
    return instead of exiting as ``task.react`` does."""
    from twisted.internet import task
    from twisted.internet.defer import ensureDeferred

    try:
        task.react(lambda reactor: ensureDeferred(run(reactor)))
    except SystemExit as exit:
        if exit.code not in (0, None):
            raise


def _fail(message: str) -> int:
    print(f"logbroker: {message}", file=sys.stderr)
    return exitcodes.FAILURE


def _credentials(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, str]:
    """The user and password from the options, else the environment; a usage error naming
    the option and the variable of each one missing."""
    user = args.user or os.environ.get(USER_VARIABLE)
    password = args.password or os.environ.get(PASSWORD_VARIABLE)
    if user and password:
        return user, password
    missing = []
    if not user:
        missing.append(("user", "--user USER", USER_VARIABLE))
    if not password:
        missing.append(("password", "--password PASSWORD", PASSWORD_VARIABLE))
    what, options, variables = (list(column) for column in zip(*missing, strict=True))
    parser.error(
        f"no {' or '.join(what)} given: pass {' and '.join(options)}, "
        f"or set {' and '.join(variables)}"
    )


def _run_client_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    user, password = _credentials(args, parser)
    if args.cafile is not None and not args.tls:
        parser.error("--cafile is only used with --tls: pass --tls too")
    # The benchmarks open connections of their own with the same credentials.
    args.bench_user, args.bench_password = user, password
    server: Server = args.server
    action = args.action.format(**vars(args))
    try:
        client = BlockingClient.connect(
            server.host, server.port, user, password, tls=args.tls, cafile=args.cafile
        )
    except BrokerRefused as refused:
        return _refused(refused, f"log in as {user!r} on {server}")
    except ssl.SSLError as error:
        if isinstance(error, ssl.SSLCertVerificationError):
            detail = f"its certificate did not verify: {error.verify_message}"
        else:
            detail = str(error.reason or error)
        return _fail(
            f"TLS with {server} failed, {detail} (does the broker offer TLS? is its certificate"
            f" for {server.host}, signed by a CA of --cafile?)"
        )
    except OSError as error:
        return _fail(
            f"cannot connect to {server}: {error.strerror or error} "
            "(is the broker running there? pass --server HOST:PORT)"
        )
    try:
        with client:
            status: int = args.run(args, client)
            return status
    except BrokerRefused as refused:
        return _refused(refused, f"{action} on {server} as {user!r}")
    except BrokenPipeError:
        raise
    except OSError as error:
        return _fail(f"lost the connection to {server} during {action}: {error}")
    except ProtocolViolation as error:
        return _fail(f"{server} broke the protocol during {action}: {error}")


def _refused(refused: BrokerRefused, context: str) -> int:
    hint = _HINTS.get(refused.reason)
    return _fail(f"{refused.reason} ({context})" + (f"; {hint}" if hint else ""))


# -- the parser ----------------------------------------------------------------------------


def _connection_options(
    parser: argparse.ArgumentParser, *, trailing: bool, password: bool = True
) -> None:
    """``--server``, ``--user`` and ``--password``: before the subcommand with their defaults,
    or after it (``trailing``) overriding what was given before."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if trailing else value

    parser.add_argument(
        "--server",
        type=parse_server,
        default=default(DEFAULT_SERVER),
        metavar="HOST:PORT",
        help=f"the broker's client port (default {DEFAULT_SERVER})",
    )
    parser.add_argument(
        "--user", default=default(None), help=f"log in as USER (default ${USER_VARIABLE})"
    )
    if password:
        parser.add_argument(
            "--password",
            default=default(None),
            help=f"the user's password (default ${PASSWORD_VARIABLE})",
        )
    parser.add_argument(
        "--tls",
        action="store_true",
        default=default(False),
        help="connect over TLS, checking that the broker's certificate names HOST",
    )
    parser.add_argument(
        "--cafile",
        type=_cafile,
        default=default(None),
        metavar="PEM",
        help="with --tls, trust the CA certificates in PEM (default: the system's)",
    )


def _client_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    run: Callable[[argparse.Namespace, BlockingClient], int],
    action: str,
    help: str,
    *,
    own_password: bool = False,
) -> argparse.ArgumentParser:
    """A subcommand that talks to the broker; ``action`` (formatted with the arguments) says
    what it was doing in error messages."""
    parser = commands.add_parser(name, help=help, description=help)
    # In ``user add`` and ``user passwd``, --password after the subcommand is the new one.
    _connection_options(parser, trailing=True, password=not own_password)
    parser.set_defaults(run=run, action=action, client=True)
    return parser


def _add_client_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    topic = commands.add_parser("topic", help="create and list topics").add_subparsers(
        dest="topic_command", required=True
    )
    create = _client_command(
        topic, "create", _topic_create, "create topic {name!r}", "create a topic"
    )
    create.add_argument("name")
    create.add_argument(
        "--keyspace-bits",
        type=_bounded(0, 255),
        default=0,
        metavar="N",
        help="the keyspace's size in bits, 1 to 32 (default 0: the broker's default, 8)",
    )
    _client_command(topic, "list", _topic_list, "list topics", "list every topic")

    produce = _client_command(
        commands,
        "produce",
        _produce,
        "produce to topic {topic!r}",
        "append records: one per VALUE, else one per line of stdin; prints the count appended",
    )
    produce.add_argument("topic")
    produce.add_argument("values", nargs="*", metavar="VALUE")
    produce.add_argument("--key", help="every record's key (default: none)")
    produce.add_argument(
        "--header",
        type=_header,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a header of every record (repeatable)",
    )
    produce.add_argument(
        "--timestamp",
        type=_bounded(0, 2**64 - 1),
        metavar="MS",
        help="every record's timestamp in ms since the epoch (default: when it is read)",
    )

    consume = _client_command(
        commands,
        "consume",
        _consume,
        "consume from topic {topic!r}",
        "print records, one per line, until caught up (or forever with --follow)",
    )
    consume.add_argument("topic")
    consume.add_argument("--group", help="start at the group's position; commit after each batch")
    start = consume.add_mutually_exclusive_group()
    start.add_argument(
        "--from-start", action="store_true", help="start at the beginning, whatever the group"
    )
    start.add_argument("--cursor", help="start at this cursor")
    consume.add_argument("--max", type=_bounded(1), metavar="N", help="stop after N records")
    consume.add_argument(
        "--follow", action="store_true", help="wait for new records until interrupted (Ctrl-C)"
    )
    consume.add_argument("--json", action="store_true", help="one JSON object per record")

    user = commands.add_parser("user", help="manage users (admin)").add_subparsers(
        dest="user_command", required=True
    )
    add = _client_command(
        user, "add", _user_add, "create user {name!r}", "create a user", own_password=True
    )
    add.add_argument("name")
    add.add_argument(
        "--password", dest="new_password", required=True, help="the new user's password"
    )
    add.add_argument(
        "--permissions",
        type=_permissions,
        default=(),
        metavar="P,P",
        help="comma-separated: admin, produce, consume",
    )
    _client_command(user, "list", _user_list, "list users", "list users and their permissions")
    delete = _client_command(user, "delete", _user_delete, "delete user {name!r}", "delete a user")
    delete.add_argument("name")
    passwd = _client_command(
        user,
        "passwd",
        _user_passwd,
        "change the password of {name!r}",
        "change a user's password",
        own_password=True,
    )
    passwd.add_argument("name")
    passwd.add_argument(
        "--password", dest="new_password", required=True, help="the user's new password"
    )

    acl = commands.add_parser("acl", help="manage ACL grants (admin)").add_subparsers(
        dest="acl_command", required=True
    )
    for name, run, verb in (
        ("grant", _acl_grant, "grant"),
        ("revoke", _acl_revoke, "revoke"),
    ):
        command = _client_command(
            acl,
            name,
            run,
            verb + " {operation} on {pattern!r} for {user_name!r}",
            f"{verb} USER the right to OP (produce or consume) topics matching PATTERN",
        )
        command.add_argument("user_name", metavar="USER")
        command.add_argument("operation", metavar="OP", choices=("produce", "consume"))
        command.add_argument("pattern", metavar="PATTERN", help="a topic, or prefix.*")
    listing = _client_command(
        acl, "list", _acl_list, "list the grants of {user_name!r}", "list a user's ACL grants"
    )
    listing.add_argument("user_name", metavar="USER")


def _add_cluster_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cluster = commands.add_parser("cluster", help="the cluster's nodes (admin)").add_subparsers(
        dest="cluster_command", required=True
    )
    status = _client_command(
        cluster,
        "status",
        _cluster_status,
        "describe the cluster",
        "every node of the cluster, alive or dead, and who holds the chores lease",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    verify = _client_command(
        cluster,
        "verify",
        _cluster_verify,
        "verify the cluster's copies",
        "check that every sealed segment's copies are complete and byte-identical on every"
        " node of its replica set, and held nowhere else (exit status 1 if not)",
    )
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    verify.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="give up after SECONDS (default 3600: the nodes read every sealed byte they hold)",
    )


def _add_bench_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = commands.add_parser("bench", help="measure the broker").add_subparsers(
        dest="bench_command", required=True
    )
    produce = _client_command(
        bench,
        "produce",
        _bench_produce,
        "bench produce to {topic!r}",
        "durable produce throughput and latency (the topic is created if missing)",
    )
    produce.add_argument("topic", nargs="?", default="bench")
    produce.add_argument("--connections", "-c", type=_bounded(1, 1024), default=4)
    produce.add_argument("--in-flight", "-w", type=_bounded(1, 1024), default=8)
    produce.add_argument("--batch", "-b", type=_bounded(1, 100_000), default=100)
    produce.add_argument("--size", "-s", type=_bounded(0, 16 * 1024 * 1024), default=100)
    produce.add_argument("--seconds", "-t", type=float, default=10.0)
    produce.add_argument(
        "--rate", type=float, default=None, help="requests/s over all connections (open loop)"
    )
    produce.add_argument(
        "--keys",
        type=_bounded(0, 1_000_000),
        default=DEFAULT_KEYS,
        help=f"distinct keys the records take in turn; 0 for keyless records ({DEFAULT_KEYS})",
    )
    consume = _client_command(
        bench,
        "consume",
        _bench_consume,
        "bench consume of {topic!r}",
        "one consumer draining a topic from the start",
    )
    consume.add_argument("topic", nargs="?", default="bench")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="logbroker",
        description="logbroker command line. --server, --user and --password go before or "
        "after the subcommand; in `user add` and `user passwd`, --password after the "
        "subcommand is the new password.",
    )
    _connection_options(parser, trailing=False)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_client_commands(commands)
    _add_cluster_commands(commands)
    _add_bench_commands(commands)
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
    verify.set_defaults(run=_storage_verify, client=False)
    salvage = storage_commands.add_parser(
        "salvage",
        help="set a single node's damaged segments aside and keep what of them verifies",
        description="With the broker stopped: copy each damaged segment's files into"
        " <data dir>/salvage/, remove them, and write back as sealed segments the whole"
        " batches before the damage and each run of whole batches after it, so that the"
        " range's later records read again (docs/operations.md, 'Salvaging a damaged"
        " segment'). Exit 0 once done (also with nothing to salvage), 1 on an error.",
    )
    salvage.add_argument("data_dir", help="the stopped broker's data directory (SVC_DATA_DIR)")
    salvage.add_argument("--range", help="only this range (its name, as storage verify shows)")
    salvage.add_argument("--json", action="store_true", help="one JSON object per segment")
    salvage.set_defaults(run=_storage_salvage, client=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse leaves positionals that follow an option unmatched once it has filled
        # ``produce``'s ``VALUE...`` (``produce TOPIC --key K V1 V2``): they are values too.
        if getattr(args, "values", None) is None or any(map(_looks_like_option, extra)):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.values += extra
    try:
        if args.client:
            return _run_client_command(args, parser)
        status: int = args.run(args)
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of our output went away (``| head``): stop without a traceback, and keep
        # the interpreter from failing again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exitcodes.FAILURE


if __name__ == "__main__":
    sys.exit(main())
