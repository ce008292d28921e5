"""Shared set-up for control plane tests: values to record and a started LocalControlPlane."""

from __future__ import annotations

from logbroker.controlplane import (
    LocalControlPlane,
    Range,
    RangeState,
    SegmentMeta,
    SegmentState,
    Topic,
    User,
)
from logbroker.testing import ImmediateExecutor, ManualExecutor, MemoryFileSystem
from tests.unit.storage.helpers import result_of

CONTROL_DIR = "/data/control"
STATE_PATH = f"{CONTROL_DIR}/state.json"


def make_topic(name: str = "orders", ranges: int = 1, bits: int = 8) -> tuple[Topic, list[Range]]:
    """A topic whose ranges split its keyspace evenly."""
    size = 1 << bits
    step = size // ranges
    made = [
        Range(
            f"{name}.{i}",
            name,
            i * step,
            size if i == ranges - 1 else (i + 1) * step,
            RangeState.ACTIVE,
        )
        for i in range(ranges)
    ]
    return Topic(name, bits, 1_700_000_000_000, tuple(r.range_id for r in made)), made


def active(range_id: str = "orders.0", base: int = 0, epoch: int = 0) -> SegmentMeta:
    return SegmentMeta(range_id, base, SegmentState.ACTIVE, None, None, ("node-1",), epoch)


def sealed(range_id: str, base: int, count: int, size: int, epoch: int = 0) -> SegmentMeta:
    return SegmentMeta(range_id, base, SegmentState.SEALED, count, size, ("node-1",), epoch)


def make_user(name: str = "alice", *permissions: str) -> User:
    return User(name, f"$argon2id$not-a-real-hash-of-{name}", frozenset(permissions or ["produce"]))


def started(
    fs: MemoryFileSystem, executor: ImmediateExecutor | ManualExecutor | None = None
) -> LocalControlPlane:
    """A loaded control plane on ``fs`` (with a ManualExecutor, its load job is run here)."""
    control = LocalControlPlane(CONTROL_DIR, fs=fs, executor=executor or ImmediateExecutor())
    loading = control.start()
    if isinstance(executor, ManualExecutor):
        executor.run_all()
    result_of(loading)
    return control
