"""The error of a request the broker core refuses."""

from __future__ import annotations

from logbroker.errors import LogbrokerError, Reason


class BrokerError(LogbrokerError):
    """A request the broker refuses, for ``reason``; ``detail`` says why in words."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail, reason)
