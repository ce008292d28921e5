"""A writer process for the crash tests: appends until killed, printing each acknowledgement.

Usage: python -m tests.integration.writer RANGE_DIR ROLL_BYTES GROUP_COMMIT(0|1) BATCH CONCURRENCY

Each record's value names its own offset-independent identity (writer sequence and index), so
the parent can check exactly what came back. A line ``ack BASE COUNT SEQ`` is printed and
flushed only after the append's Deferred fired, i.e. after its fsync returned.
"""

from __future__ import annotations

import sys
from typing import Any

from twisted.internet import task
from twisted.internet.defer import Deferred

from logbroker.storage import LogConfig, OsFileSystem, RangeLog, Record, ThreadPoolExecutor


def batch_records(sequence: int, size: int) -> list[Record]:
    return [
        Record(b"seq=%d idx=%d " % (sequence, index) + b"x" * 60, key=b"k%d" % (sequence % 7))
        for index in range(size)
    ]


async def _write(
    reactor: Any, directory: str, roll: int, group: bool, batch: int, width: int
) -> None:
    executor = ThreadPoolExecutor(reactor)
    executor.start()
    config = LogConfig(roll_bytes=roll, group_commit=group)
    log = await RangeLog.open(
        directory, fs=OsFileSystem(), clock=reactor, executor=executor, config=config
    )
    print("ready", flush=True)
    sequence = 0
    forever: Deferred[None] = Deferred()

    def issue() -> None:
        nonlocal sequence
        sequence += 1
        mine = sequence
        appended = log.append(batch_records(mine, batch))

        def acked(result: Any) -> None:
            sys.stdout.write(f"ack {result.base_offset} {result.record_count} {mine}\n")
            sys.stdout.flush()
            issue()

        appended.addCallback(acked)

    for _ in range(width):
        issue()
    await forever


def main() -> None:
    directory, roll, group, batch, width = sys.argv[1:6]
    task.react(
        lambda reactor: Deferred.fromCoroutine(
            _write(reactor, directory, int(roll), group == "1", int(batch), int(width))
        )
    )


if __name__ == "__main__":
    main()
