"""``OpenOnce``: a range's log is opened once, however many ask at the same time."""

from __future__ import annotations

from twisted.internet.defer import Deferred

from logbroker.storage import OpenOnce, RangeLog
from tests.unit.storage.helpers import MemoryLogs, result_of


class _Opens:
    """Opens that wait for the test to finish them, counted."""

    def __init__(self) -> None:
        self.pending: list[Deferred[RangeLog]] = []
        self.logs: dict[str, RangeLog] = {}
        self.opener = OpenOnce(self.logs, self._open)

    def _open(self, name: str) -> Deferred[RangeLog]:
        self.pending.append(Deferred())
        return self.pending[-1]


def test_opens_asked_for_at_once_share_one_log() -> None:
    opens = _Opens()
    first, second = opens.opener.open_range("r"), opens.opener.open_range("r")
    assert len(opens.pending) == 1, "one open for two asks"
    opened = result_of(MemoryLogs().open_range("r"))
    opens.pending[0].callback(opened)
    assert result_of(first) is result_of(second) is opened
    assert opens.logs == {"r": opened}
    assert result_of(opens.opener.open_range("r")) is opened
    assert len(opens.pending) == 1, "an open log is handed out, not opened again"


def test_a_failed_open_fails_every_waiter_and_may_be_tried_again() -> None:
    opens = _Opens()
    first, second = opens.opener.open_range("r"), opens.opener.open_range("r")
    opens.pending[0].errback(OSError("disk gone"))
    for waiter in (first, second):
        failures: list[object] = []
        waiter.addErrback(failures.append)
        assert len(failures) == 1
    opens.opener.open_range("r")
    assert len(opens.pending) == 2
    assert opens.logs == {}
