"""What a segment's primary is told to do, and the settings it leads by.

``LeaderCore`` (``logbroker.replication.core.leader``) hands these actions back from every
event; ``logbroker.replication.primary.SegmentLeader`` carries them out. Kept apart from the
core so that drivers and tests name the actions without the state machine's rules.
"""

from __future__ import annotations

import attrs

from logbroker.errors import Reason
from logbroker.replication.core.quorum import quorum_size
from logbroker.replication.replica_codec import ReplicateRequest


@attrs.frozen
class ReplicationSettings:
    """How a primary streams to its replicas; built from ``SVC_*`` settings."""

    replication_factor: int = attrs.field(validator=attrs.validators.ge(1))
    #: Bytes in flight to one replica before the primary waits for its answers.
    window_bytes: int = 8 * 1024 * 1024
    #: The most bytes one replicate message carries.
    max_message_bytes: int = 1024 * 1024
    #: Recent bytes kept in memory for replicas that lag; older ones are read from disk.
    backlog_bytes: int = 64 * 1024 * 1024
    #: How long a produce waits for a quorum before it is answered ``no_quorum`` (a lease
    #: TTL); also how long a leader may go without hearing from a quorum before it resigns.
    ack_timeout_seconds: float = 5.0
    #: How long after the commit index moves a replica that was sent nothing since is told
    #: where it is (a commit notice).
    commit_notice_seconds: float = 0.02
    #: Back-off after a replica's link failed, doubling up to ``retry_max_seconds``.
    retry_seconds: float = 0.05
    retry_max_seconds: float = 1.0

    @property
    def quorum(self) -> int:
        return quorum_size(self.replication_factor)


# -- actions ---------------------------------------------------------------------------------


@attrs.frozen
class Send:
    """Send ``request`` to ``node``; its answer goes to ``answered`` (or, for a commit notice,
    ``notice_answered``) with ``generation``."""

    node: str
    generation: int
    request: ReplicateRequest
    notice: bool = False


@attrs.frozen
class ReadBack:
    """Read the local log from ``offset`` (byte ``position``) for ``node``: about
    ``max_bytes`` of whole batches, to ``read_back``."""

    node: str
    generation: int
    offset: int
    position: int
    max_bytes: int


@attrs.frozen
class Commit:
    """The commit index is ``index``: readers may see up to it, as far as the primary's own copy
    holds it durably. Told when the index moves, and again when that copy catches up with it
    (a quorum of replicas can commit records before the primary's copy is durable)."""

    index: int


@attrs.frozen
class Acknowledge:
    tickets: tuple[int, ...]


@attrs.frozen
class Refuse:
    """Answer the waiting appends ``tickets`` with ``reason``. ``in_doubt``: their records are
    in the log and may still be committed; a ``Settle`` of the same tickets follows."""

    tickets: tuple[int, ...]
    reason: Reason
    message: str
    in_doubt: bool = False


@attrs.frozen
class Settle:
    """What became of appends refused in doubt: ``committed``, or not known on this node (it
    stopped leading; the node that leads next knows)."""

    tickets: tuple[int, ...]
    committed: bool


@attrs.frozen
class StepDown:
    """This leader stopped; with ``resign``, the driver asks another replica to take over."""

    reason: Reason
    message: str
    resign: bool = False


@attrs.frozen
class Park:
    """``node`` is dead in the membership: it is sent nothing more until the driver says it is
    back (``LeaderCore.member_back``), instead of being retried on a timer."""

    node: str


Action = Send | ReadBack | Commit | Acknowledge | Refuse | Settle | StepDown | Park
