"""``with`` for the blocking clients: leaving the block closes the client."""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Self


class ClosedOnExit(abc.ABC):
    """A client that ``with`` closes on the way out, however the block ends."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the client's connections."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
