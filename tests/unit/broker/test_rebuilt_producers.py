"""A range's dedupe table read back from its log: a stamped produce retried after the broker
restarted is answered as stored, and stored once; appends wait for the table while it is read."""

from __future__ import annotations

import errno
from typing import Any

from twisted.internet.task import Clock

from logbroker.broker.core import Broker
from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import Bounds, LocalRange, LocalRanges
from logbroker.controlplane import LocalControlPlane
from logbroker.errors import Reason
from logbroker.metrics import Metrics
from logbroker.records import ProducerStamp, Record
from logbroker.storage import RangeLog
from logbroker.testing import ManualExecutor, MemoryFileSystem
from tests.unit.broker.helpers import MemoryRangeLogs
from tests.unit.controlplane.helpers import started
from tests.unit.storage.helpers import failure_of, result_of

DIRECTORY = "/data/ranges/r.0"
STAMP = ProducerStamp(0x5EED, 4)


def open_range(fs: MemoryFileSystem, executor: ManualExecutor) -> tuple[LocalRange, RangeLog]:
    """A ``LocalRange`` over the log in ``fs``, with no table given: it reads its own back."""
    opening = RangeLog.open(DIRECTORY, fs=fs, clock=Clock(), executor=executor)
    executor.run_all()
    range_log = result_of(opening)
    return LocalRange("r.0", range_log, None), range_log


def values(range_log: RangeLog) -> list[bytes]:
    return [stored.record.value for stored in range_log.read(0)]


def test_a_stamped_append_retried_after_a_restart_is_answered_and_stored_once() -> None:
    fs, executor = MemoryFileSystem(), ManualExecutor()
    local, range_log = open_range(fs, executor)
    first = local.append([Record(b"a"), Record(b"b")], STAMP)
    executor.run_all()
    assert result_of(first) is None
    closing = range_log.close()
    executor.run_all()
    result_of(closing)

    local, range_log = open_range(fs, executor)
    retry = local.append([Record(b"a"), Record(b"b")], STAMP)
    executor.run_all()

    assert result_of(retry) is None
    assert values(range_log) == [b"a", b"b"]
    assert result_of(local.bounds()) == Bounds(0, 2)
    # A new produce of the same producer is stored, and one too old for the window is refused.
    later = local.append([Record(b"c")], ProducerStamp(STAMP.producer_id, STAMP.sequence + 40))
    too_old = local.append([Record(b"d")], STAMP)
    executor.run_all()
    assert result_of(later) is None
    assert failure_of(too_old).value.reason is Reason.SEQUENCE_TOO_OLD
    assert values(range_log) == [b"a", b"b", b"c"]


def test_appends_wait_in_order_while_the_table_is_read_back() -> None:
    fs, executor = MemoryFileSystem(), ManualExecutor()
    local, range_log = open_range(fs, executor)
    stored = local.append([Record(b"a")], STAMP)
    executor.run_all()
    result_of(stored)
    local, range_log = open_range(fs, executor)

    retry = local.append([Record(b"a")], STAMP)
    plain = local.append([Record(b"x")])
    new = local.append([Record(b"b")], ProducerStamp(STAMP.producer_id, STAMP.sequence + 1))
    again = local.append([Record(b"b")], ProducerStamp(STAMP.producer_id, STAMP.sequence + 1))

    # Nothing is written before the table knows what the log holds.
    assert [job.__name__ for job, _, _ in executor.pending] == ["recent_stamps_job"]
    assert not any(d.called for d in (retry, plain, new, again))
    executor.run_all()
    assert [result_of(d) for d in (retry, plain, new, again)] == [None] * 4
    assert values(range_log) == [b"a", b"x", b"b"]
    # Read back once: later stamped appends go straight to the log.
    local.append([Record(b"c")], ProducerStamp(STAMP.producer_id, STAMP.sequence + 2))
    assert [job.__name__ for job, _, _ in executor.pending] == ["_write_job"]
    executor.run_all()


def test_a_failed_read_back_fails_the_stamped_appends_that_waited_and_is_tried_again(
    logged_errors: list[dict[str, Any]],
) -> None:
    fs, executor = MemoryFileSystem(), ManualExecutor()
    local, range_log = open_range(fs, executor)
    stamped = local.append([Record(b"a")], STAMP)
    plain = local.append([Record(b"x")])
    _, _, reading = executor.pending.pop(0)

    reading.errback(OSError(errno.EIO, "Input/output error (injected)"))
    executor.run_all()

    error = failure_of(stamped).value
    assert isinstance(error, BrokerError)
    assert error.reason is Reason.UNREACHABLE
    assert "r.0 could not read back which stamped produces it stored" in str(error)
    assert result_of(plain) is None
    assert [e["log_format"] for e in logged_errors] == [
        "Reading back the producer stamps stored in {range_id} failed: {error}"
    ]
    logged_errors.clear()
    retried = local.append([Record(b"a")], STAMP)
    assert [job.__name__ for job, _, _ in executor.pending] == ["recent_stamps_job"]
    executor.run_all()
    assert result_of(retried) is None
    assert values(range_log) == [b"x", b"a"]


def test_a_broker_restarted_on_the_same_storage_stores_a_retried_produce_once() -> None:
    fs, clock = MemoryFileSystem(), Clock()
    records = [Record(b"k%d" % i, key=b"k%d" % i) for i in range(8)] + [Record(b"keyless")]

    def start() -> tuple[Broker, MemoryRangeLogs, LocalControlPlane]:
        storage = MemoryRangeLogs(fs, clock, Metrics(clock))
        for name in fs.list_dir("/data/ranges") if fs.exists("/data/ranges") else []:
            result_of(storage.open_range(name))
        control = started(fs)
        return Broker(control, LocalRanges(storage), clock), storage, control

    broker, storage, control = start()
    result_of(broker.create_topic("t", 0))
    assert result_of(broker.produce("t", records, STAMP)) == 9
    for range_log in storage.logs.values():
        result_of(range_log.close())
    result_of(control.close())

    broker, storage, control = start()

    assert result_of(broker.produce("t", records, STAMP)) == 9
    assert sum(range_log.end_offset for range_log in storage.logs.values()) == 9
    result_of(control.close())
