"""``with`` for the blocking clients: leaving the block closes the client."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class ClosedOnExit:
    """A client that ``with`` closes on the way out, however the block ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
