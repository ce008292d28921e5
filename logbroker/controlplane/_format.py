"""The bytes of the local control plane's state file. CHANGING THIS BREAKS STORED DATA.

``<control dir>/state.json`` is one JSON document on one line (wrapped here), ending in a
newline::

    {"format":1,"crc32c":<int>,"state":{
        "acls":[{"operation":"produce","pattern":"orders.*","user":"app"}],
        "group_positions":[{"cursor":"AQ...","group":"billing","topic":"orders"}],
        "ranges":[{"end":256,"parent":null,"range_id":"orders.0","start":0,
                   "state":"active","topic":"orders"}],
        "segments":[{"base_offset":0,"byte_size":null,"epoch":0,"range_id":"orders.0",
                     "record_count":null,"replicas":["node-1"],"state":"active"}],
        "topics":[{"created_ms":1700000000000,"keyspace_bits":8,"name":"orders",
                   "range_ids":["orders.0"]}],
        "users":[{"name":"admin","password_hash":"$argon2id$...","permissions":["admin"]}]}}

``crc32c`` is the CRC32C of ``state`` serialized canonically (sorted keys, no spaces, ASCII
with ``\\u`` escapes), which is also how it is written; a reader re-serializes the parsed
``state`` to check it, so the check does not depend on the file's whitespace. Lists are sorted
by their key fields, so equal states give equal bytes. Every string round-trips exactly,
including characters outside ASCII.

A segment a claim sealed also holds ``"data_epoch"`` (the epoch of the primary whose records it
holds); other segments' records have no such key, as before it existed.

Each entry is one entity's record (``topic_record`` and ``topic_from_record``, and so on); the
etcd control plane stores the same records, canonically serialized, as the values of its keys.

A format newer than ``FORMAT_VERSION`` is refused (``StateFormatTooNewError``): a newer build
may record things this one would drop on its next write. The golden file
``tests/unit/controlplane/golden/state-v1.json`` pins these bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from crc32c import crc32c

from logbroker.controlplane._model import (
    AclGrant,
    Range,
    RangeState,
    SegmentMeta,
    SegmentState,
    Topic,
    User,
)
from logbroker.controlplane._state import ControlState
from logbroker.controlplane.errors import StateFileError, StateFormatTooNewError

FORMAT_VERSION = 1

_T = TypeVar("_T")


def canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode(
        "ascii"
    )


def topic_record(t: Topic) -> dict[str, Any]:
    return {
        "name": t.name,
        "keyspace_bits": t.keyspace_bits,
        "created_ms": t.created_ms,
        "range_ids": list(t.range_ids),
    }


def range_record(r: Range) -> dict[str, Any]:
    return {
        "range_id": r.range_id,
        "topic": r.topic,
        "start": r.start,
        "end": r.end,
        "state": r.state.value,
        "parent": r.parent,
    }


def segment_record(s: SegmentMeta) -> dict[str, Any]:
    return {
        "range_id": s.range_id,
        "base_offset": s.base_offset,
        "state": s.state.value,
        "record_count": s.record_count,
        "byte_size": s.byte_size,
        "replicas": list(s.replicas),
        "epoch": s.epoch,
    } | ({} if s.data_epoch is None else {"data_epoch": s.data_epoch})


def user_record(u: User) -> dict[str, Any]:
    return {"name": u.name, "password_hash": u.password_hash, "permissions": sorted(u.permissions)}


def grant_record(g: AclGrant) -> dict[str, Any]:
    return {"user": g.user, "operation": g.operation, "pattern": g.pattern}


def position_record(topic: str, group: str, cursor: str) -> dict[str, Any]:
    return {"topic": topic, "group": group, "cursor": cursor}


def _state_document(state: ControlState) -> dict[str, list[dict[str, Any]]]:
    return {
        "topics": [topic_record(t) for _, t in sorted(state.topics.items())],
        "ranges": [range_record(r) for _, r in sorted(state.ranges.items())],
        "segments": [
            segment_record(s)
            for _, segments in sorted(state.segments.items())
            for _, s in sorted(segments.items())
        ],
        "users": [user_record(u) for _, u in sorted(state.users.items())],
        "acls": [
            grant_record(g)
            for _, grants in sorted(state.acls.items())
            for g in sorted(grants, key=lambda g: (g.operation, g.pattern))
        ],
        "group_positions": [
            position_record(topic, group, cursor)
            for (topic, group), cursor in sorted(state.positions.items())
        ],
    }


def encode_state(state: ControlState) -> bytes:
    body = canonical(_state_document(state))
    return b'{"format":%d,"crc32c":%d,"state":%s}\n' % (FORMAT_VERSION, crc32c(body), body)


def _get(record: dict[str, Any], key: str, kind: type[_T] | tuple[type, ...]) -> Any:
    value = record[key]
    # bool is an int in Python, never in this format.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{key!r} is {value!r}")
    return value


def _optional_int(record: dict[str, Any], key: str) -> int | None:
    return None if record[key] is None else _get(record, key, int)


def _strings(record: dict[str, Any], key: str) -> list[str]:
    values: list[str] = _get(record, key, list)
    if not all(isinstance(value, str) for value in values):
        raise TypeError(f"{key!r} is {values!r}")
    return values


def topic_from_record(r: dict[str, Any]) -> Topic:
    return Topic(
        _get(r, "name", str),
        _get(r, "keyspace_bits", int),
        _get(r, "created_ms", int),
        tuple(_strings(r, "range_ids")),
    )


def range_from_record(r: dict[str, Any]) -> Range:
    parent = r["parent"]
    return Range(
        _get(r, "range_id", str),
        _get(r, "topic", str),
        _get(r, "start", int),
        _get(r, "end", int),
        RangeState(_get(r, "state", str)),
        None if parent is None else _get(r, "parent", str),
    )


def segment_from_record(r: dict[str, Any]) -> SegmentMeta:
    return SegmentMeta(
        _get(r, "range_id", str),
        _get(r, "base_offset", int),
        SegmentState(_get(r, "state", str)),
        _optional_int(r, "record_count"),
        _optional_int(r, "byte_size"),
        tuple(_strings(r, "replicas")),
        _get(r, "epoch", int),
        data_epoch=None if r.get("data_epoch") is None else _get(r, "data_epoch", int),
    )


def user_from_record(r: dict[str, Any]) -> User:
    return User(
        _get(r, "name", str),
        _get(r, "password_hash", str),
        frozenset(_strings(r, "permissions")),
    )


def grant_from_record(r: dict[str, Any]) -> AclGrant:
    return AclGrant(_get(r, "user", str), _get(r, "operation", str), _get(r, "pattern", str))


def position_from_record(r: dict[str, Any]) -> tuple[tuple[str, str], str]:
    """``((topic, group), cursor)``."""
    return (_get(r, "topic", str), _get(r, "group", str)), _get(r, "cursor", str)


def _records(document: dict[str, Any], key: str, build: Callable[[Any], _T]) -> list[_T]:
    records = _get(document, key, list)
    if not all(isinstance(record, dict) for record in records):
        raise TypeError(f"{key!r} holds a value that is not an object")
    return [build(record) for record in records]


def _build_state(document: dict[str, Any]) -> ControlState:
    topics = _records(document, "topics", topic_from_record)
    ranges = _records(document, "ranges", range_from_record)
    segments: dict[str, dict[int, SegmentMeta]] = {}
    for segment in _records(document, "segments", segment_from_record):
        segments.setdefault(segment.range_id, {})[segment.base_offset] = segment
    acls: dict[str, frozenset[AclGrant]] = {}
    for grant in _records(document, "acls", grant_from_record):
        acls[grant.user] = acls.get(grant.user, frozenset()) | {grant}
    positions = dict(_records(document, "group_positions", position_from_record))
    return ControlState(
        topics={t.name: t for t in topics},
        ranges={r.range_id: r for r in ranges},
        segments=segments,
        users={u.name: u for u in _records(document, "users", user_from_record)},
        acls=acls,
        positions=positions,
    )


def decode_state(data: bytes, path: str) -> ControlState:
    """Parse and check a state file's bytes; ``path`` is for the error messages."""
    damaged = "restore it from a backup; the broker keeps no other copy of the control state"
    try:
        document = json.loads(data)
    except ValueError as e:
        raise StateFileError(f"{path} is not a JSON document ({e}); {damaged}") from None
    version = document.get("format") if isinstance(document, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise StateFileError(f"{path} is not a logbroker control state file; {damaged}")
    if version > FORMAT_VERSION:
        raise StateFormatTooNewError(path, version, FORMAT_VERSION)
    state = document.get("state")
    if document.get("crc32c") != crc32c(canonical(state)):
        raise StateFileError(f"{path} fails its checksum: it was damaged at rest; {damaged}")
    try:
        return _build_state(state)
    except (KeyError, TypeError, ValueError) as e:
        # Only a writer bug gets here: the checksum matched.
        raise StateFileError(f"{path} holds an invalid control state ({e!r}); {damaged}") from e
