"""``OpenOnce``: a range's log is opened once, however many ask at the same time."""

from __future__ import annotations

from twisted.internet.defer import Deferred

from logbroker.storage import OpenOnce, RangeLog
from tests.unit.storage.helpers import MemoryLogs, result_of


def test_opens_asked_for_at_once_share_one_log() -> None:
    logs: dict[str, RangeLog] = {}
    pending: list[Deferred[RangeLog]] = []

    def open_log(name: str) -> Deferred[RangeLog]:
        pending.append(Deferred())
        return pending[-1]

    opener = OpenOnce(logs, open_log)
    first, second = opener.open_range("r"), opener.open_range("r")
    assert len(pending) == 1, "one open for two asks"
    opened = result_of(MemoryLogs().open_range("r"))
    pending[0].callback(opened)
    assert result_of(first) is result_of(second) is opened
    assert logs == {"r": opened}
    assert result_of(opener.open_range("r")) is opened
    assert len(pending) == 1, "an open log is handed out, not opened again"


def test_a_failed_open_fails_every_waiter_and_may_be_tried_again() -> None:
    logs: dict[str, RangeLog] = {}
    pending: list[Deferred[RangeLog]] = []

    def open_log(name: str) -> Deferred[RangeLog]:
        pending.append(Deferred())
        return pending[-1]

    opener = OpenOnce(logs, open_log)
    first, second = opener.open_range("r"), opener.open_range("r")
    pending[0].errback(OSError("disk gone"))
    for waiter in (first, second):
        failures: list[object] = []
        waiter.addErrback(failures.append)
        assert len(failures) == 1
    opener.open_range("r")
    assert len(pending) == 2
    assert logs == {}
