"""The storage drills: damage to a stopped follower's copies (guarantees 4 and 6), and a full
data volume under load.

Guarantee 6 holds by construction and is checked as the damage is done: every damaged copy is
one whose segment's first replica (its primary) is another node, as the control plane records
it at that moment. Primary damage is outside the certification.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from tests.certify.harness import Certification, Outcome
from tests.certify.nodes import Broker
from tests.certify.view import TOPIC, CheckFailed


def _copy(broker: Broker, segment: dict[str, Any], suffix: str) -> Path:
    base: int = segment["base_offset"]
    range_id: str = segment["range_id"]
    return broker.data / "ranges" / range_id / f"{base:020d}{suffix}"


def _name(segment: dict[str, Any]) -> str:
    return f"{segment['range_id']}@{segment['base_offset']}"


def _flip(path: Path, position: int) -> None:
    with path.open("r+b") as file:
        file.seek(position)
        byte = file.read(1)
        file.seek(position)
        file.write(bytes([byte[0] ^ 0xFF]))


#: Every kind of damage the drill does; a run that could not do one of them fails the drill.
KINDS = ("torn tail", "truncated", "rotted index", "bit rot", "deleted")
#: Sealed copies the drill needs on its follower (the index's, the rot's and the deletion's).
SEALED_NEEDED = 3


def damaged_follower(cert: Certification) -> Outcome:
    follower = cert.view.quietest()
    cert.wait_for(
        lambda: len(_sealed_followed(cert, follower)) >= SEALED_NEEDED,
        cert.timing.health_bound,
        f"{SEALED_NEEDED} sealed segments with {follower.node_id} as a follower",
    )
    started = cert.mark(f"SIGTERM {follower.node_id}, the node leading the fewest ranges")
    follower.stop()
    try:
        cert.wait_for(
            lambda: not cert.view.led_by(follower),
            cert.timing.recovery_bound,
            f"no active segment led by the stopped {follower.node_id}",
        )
        damage = _damage(cert, follower)
    finally:
        follower.release()
    ended = cert.mark(f"{follower.node_id} started on its damaged copies")
    outcome = cert.after_fault(started, ended)
    outcome.exercised |= {4, 6}
    missing = [kind for kind in KINDS if not any(text.startswith(kind) for text in damage)]
    if missing:
        outcome.problems.append((0, f"could not damage {follower.node_id}: {', '.join(missing)}"))
    outcome.notes[6] = (
        f"{len(damage)} copies of {follower.node_id} damaged, each where another node is"
        " the primary (primary damage is not covered)"
    )
    try:
        took, _ = cert.wait_identical(cert.timing.identical_bound)
        cert.mark(f"`cluster verify`: every sealed copy identical again, {took:.1f} s after")
    except CheckFailed as failed:
        outcome.problems.append((4, str(failed)))
    return outcome


def _sealed_followed(cert: Certification, follower: Broker) -> list[dict[str, Any]]:
    """The load's sealed segments with records that ``follower`` holds as a follower."""
    return [
        s
        for s in cert.view.segments()
        if s["range_id"].startswith(TOPIC + ".")
        and s["state"] == "sealed"
        and s["record_count"]
        and follower.node_id in s["replicas"][1:]
        and _copy(follower, s, ".log").exists()
        and _copy(follower, s, ".sealed").exists()
    ]


def _damage(cert: Certification, follower: Broker) -> list[str]:
    """Damage the stopped ``follower``'s copies, only where another node is the segment's
    primary; return what was done."""
    segments = [s for s in cert.view.segments() if s["range_id"].startswith(TOPIC + ".")]
    followed = [
        s for s in segments if follower.node_id in s["replicas"][1:] and s["record_count"] != 0
    ]
    # Copies active here when the node stopped: also those whose segment the others have sealed
    # since (a segment with a dead replica rolls onto the live nodes), which this copy has not.
    active = [
        s
        for s in followed
        if _copy(follower, s, ".log").exists() and not _copy(follower, s, ".sealed").exists()
    ]
    sealed = _sealed_followed(cert, follower)
    done: list[str] = []

    def did(segment: dict[str, Any], what: str) -> None:
        text = f"{follower.node_id}'s copy of {_name(segment)} (primary {segment['replicas'][0]})"
        done.append(f"{what}: {text}")
        cert.mark(f"{what}: {text}")

    for segment, fault in zip(active, ("torn tail", "truncated"), strict=False):
        log = _copy(follower, segment, ".log")
        size = log.stat().st_size
        if fault == "torn tail":
            with log.open("ab") as file:
                file.write(os.urandom(37))
            did(segment, f"torn tail (37 bytes of a frame never finished, after {size})")
        else:
            os.truncate(log, size * 2 // 3)
            did(segment, f"truncated active copy (from {size} to {size * 2 // 3} bytes)")
    with_index = [s for s in sealed if _size(_copy(follower, s, ".index")) > 0]
    if with_index:
        segment = with_index[0]
        index = _copy(follower, segment, ".index")
        _flip(index, _size(index) // 2)
        did(segment, f"rotted index (byte {_size(index) // 2} of {_size(index)} flipped)")
        sealed = [s for s in sealed if s is not segment]
    for segment, fault in zip(sealed, ("bit rot", "deleted"), strict=False):
        log = _copy(follower, segment, ".log")
        if fault == "bit rot":
            position = _size(log) // 2
            _flip(log, position)
            did(segment, f"bit rot (byte {position} of {_size(log)} flipped)")
        else:
            log.unlink()
            did(segment, "deleted sealed copy")
    return done


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def full_volume(cert: Certification) -> Outcome:
    """The small-volume node's data volume filled up while the load runs: the node must stay
    up, refuse (``/ready`` 503, produces refused with a reason), and come back once space
    returns."""
    broker = cert.small_volume
    if broker is None:
        raise CheckFailed("no node of this run has a small data volume")
    exits = broker.unexpected_exits
    filler = broker.data / "filler"
    started = cert.mark(f"{broker.node_id}'s data volume filled")
    _fill(filler)
    problems: list[tuple[int, str]] = []
    try:
        try:
            cert.wait_for(
                lambda: not broker.ready(),
                cert.timing.recovery_bound,
                f"{broker.node_id} not ready on a full volume",
            )
            cert.mark(f"{broker.node_id} answers /ready 503, its process still up")
        except CheckFailed as failed:
            problems.append((0, str(failed)))
        time.sleep(cert.timing.fault)
    finally:
        filler.unlink()
    ended = cert.mark(f"space freed on {broker.node_id}")
    outcome = cert.after_fault(started, ended)
    if broker.unexpected_exits != exits:
        outcome.problems.append((2, f"{broker.node_id} exited on a full volume"))
    outcome.problems[:0] = problems
    return outcome


def _fill(path: Path) -> None:
    """Take every free byte of ``path``'s file system."""
    stats = os.statvfs(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, stats.f_bavail * stats.f_frsize)
        os.lseek(fd, 0, os.SEEK_END)
        chunk = b"\0" * 4096
        with contextlib.suppress(OSError):
            while os.write(fd, chunk):
                pass
    finally:
        os.close(fd)
