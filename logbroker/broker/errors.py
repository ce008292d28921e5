"""The errors of requests the broker core refuses."""

from __future__ import annotations

from twisted.internet.defer import Deferred

from logbroker.errors import LogbrokerError, Reason


class BrokerError(LogbrokerError):
    """A request the broker refuses, for ``reason``; ``detail`` says why in words."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail, reason)


class InDoubtError(BrokerError):
    """An append refused while its records may still be committed (``no_quorum`` past the ack
    deadline): ``fate`` fires with ``True`` once they are, or ``False`` once the node that
    stored them stops leading the range without knowing (the next leader knows). A retry with
    the same producer stamp waits for it instead of storing the records again."""

    def __init__(self, reason: Reason, detail: str, fate: Deferred[bool]) -> None:
        super().__init__(reason, detail)
        self.fate = fate
