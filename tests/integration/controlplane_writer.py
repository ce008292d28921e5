"""A control plane process for the crash tests: changes state until killed, printing each
acknowledgement.

Usage: python -m tests.integration.controlplane_writer CONTROL_DIR CONCURRENCY

CONCURRENCY chains each ask for one change at a time, the next one from the previous one's
acknowledgement, so changes queue behind running writes and go out together. Change number N
is, by N modulo 4: a new topic ``tN``, a new user ``uN``, or a commit of cursor ``cN`` for group
``g(N modulo 3)`` on topic ``orders``. A line ``ack topic tN``, ``ack user uN`` or
``ack position gK N`` is printed and flushed only after the change's Deferred fired, i.e.
after the write carrying it returned from its directory fsync.
"""

from __future__ import annotations

import sys
from typing import Any

from twisted.internet import task
from twisted.internet.defer import Deferred

from logbroker.controlplane import LocalControlPlane, Range, RangeState, Topic, User
from logbroker.storage import OsFileSystem, ThreadPoolExecutor


def topic(name: str) -> tuple[Topic, list[Range]]:
    return Topic(name, 8, 0, (f"{name}.0",)), [Range(f"{name}.0", name, 0, 256, RangeState.ACTIVE)]


def password_hash(sequence: int) -> str:
    # Not ASCII, to check that any string round-trips through the file.
    return f"$argon2id$h\u00e9\U0001f600{sequence}"


def cursor(sequence: int) -> str:
    return f"c{sequence:012d}"


async def _run(reactor: Any, directory: str, width: int) -> None:
    executor = ThreadPoolExecutor(reactor)
    executor.start()
    control = LocalControlPlane(directory, fs=OsFileSystem(), executor=executor)
    await control.start()
    if control.topic("orders") is None:
        await control.create_topic(*topic("orders"))
    print("ready", flush=True)
    sequence = 0
    forever: Deferred[None] = Deferred()

    def issue() -> None:
        nonlocal sequence
        sequence += 1
        mine = sequence
        kind = mine % 4
        if kind == 0:
            done: Deferred[Any] = control.create_topic(*topic(f"t{mine}"))
            line = f"ack topic t{mine}"
        elif kind == 1:
            done = control.create_user(User(f"u{mine}", password_hash(mine), frozenset()))
            line = f"ack user u{mine}"
        else:
            done = control.commit_group_position("orders", f"g{mine % 3}", cursor(mine))
            line = f"ack position g{mine % 3} {mine}"

        def acked(_: object) -> None:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
            issue()

        done.addCallback(acked)

    for _ in range(width):
        issue()
    await forever


def main() -> None:
    directory, width = sys.argv[1:3]
    task.react(lambda reactor: Deferred.fromCoroutine(_run(reactor, directory, int(width))))


if __name__ == "__main__":
    main()
