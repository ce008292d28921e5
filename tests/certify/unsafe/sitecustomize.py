"""A broken broker build, for the certification's negative control only (``python -m
tests.certify --unsafe-acks``): a primary counts its own durable copy as a quorum when it
commits, so a produce is acknowledged before a quorum holds it (claims still need a real
quorum). Under a power-kill of a primary cut from its peers the certification must find
acknowledged writes lost; if it does not, the checker cannot be trusted.

Put on ``PYTHONPATH`` of a broker (only by the harness), Python imports it at start-up.
"""

import sys

from logbroker.replication.core import leader
from logbroker.replication.core.quorum import CommitTracker


class _OwnCopyIsAQuorum(CommitTracker):
    def __init__(self, durable: object, quorum: int) -> None:
        super().__init__(durable, 1)  # type: ignore[arg-type]


leader.CommitTracker = _OwnCopyIsAQuorum  # type: ignore[attr-defined]
print(
    "UNSAFE BUILD (certification negative control): acknowledging before a quorum holds writes",
    file=sys.stderr,
    flush=True,
)
