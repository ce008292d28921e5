"""An etcd-shaped key-value store: what ``EtcdControlPlane`` needs of etcd, and nothing more.

Two implementations: ``EtcdGatewayStore`` (etcd 3.4's v3 JSON gateway over HTTP) and
``MemoryKeyValueStore`` (a deterministic double for tests). The store contract tests hold the
double to real etcd's behaviour, so what is written here is etcd's semantics:

* Every change increments the store's ``revision``; a key remembers the revision that created it
  (``create_revision``) and the one that last changed it (``mod_revision``).
* A transaction checks its ``compares`` and then runs either its success or its failure
  operations, atomically, as one revision. A missing key compares as revision 0 and value ``b""``.
* A watch reports every change under a prefix from a start revision on, including changes made
  before it was created; a start revision below the compacted one fails with ``CompactedError``.
* A lease expires unless kept alive; the keys put under it are then deleted (and watchers see
  the deletes).

Errors are ``ControlPlaneError`` subclasses: ``ControlPlaneUnavailableError`` when no member
answered (the request did not take effect), ``OutcomeUnknownError`` when one may have received it
but no answer came back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import Enum
from typing import Protocol

import attrs
from twisted.internet.defer import Deferred


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key starting with ``prefix`` (etcd's ``range_end``)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        del end[-1]
    # Every key: etcd spells this "\0".
    return b"\0"


@attrs.frozen
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    #: The lease the key lives under; 0 for none.
    lease: int = 0


class Target(Enum):
    MOD = "MOD"
    CREATE = "CREATE"
    VALUE = "VALUE"


class Result(Enum):
    EQUAL = "EQUAL"
    NOT_EQUAL = "NOT_EQUAL"
    GREATER = "GREATER"
    LESS = "LESS"


@attrs.frozen
class Compare:
    """``key``'s ``target`` compared with ``operand`` (a revision, or bytes for ``VALUE``)."""

    key: bytes
    target: Target
    result: Result
    operand: int | bytes

    @classmethod
    def absent(cls, key: bytes) -> Compare:
        """True while ``key`` does not exist."""
        return cls(key, Target.CREATE, Result.EQUAL, 0)

    @classmethod
    def present(cls, key: bytes) -> Compare:
        return cls(key, Target.CREATE, Result.GREATER, 0)

    @classmethod
    def unchanged(cls, key: bytes, mod_revision: int) -> Compare:
        """True while ``key`` is as it was at ``mod_revision`` (and exists)."""
        return cls(key, Target.MOD, Result.EQUAL, mod_revision)

    def holds(self, kv: KeyValue | None) -> bool:
        """Evaluate the comparison against ``kv`` (``None``: the key is missing), as etcd does."""
        actual: int | bytes
        if self.target is Target.VALUE:
            if kv is None:
                # etcd: a value compare on a missing key is false, whatever the result asked.
                return False
            actual = kv.value
        elif self.target is Target.MOD:
            actual = 0 if kv is None else kv.mod_revision
        else:
            actual = 0 if kv is None else kv.create_revision
        operand = self.operand
        if self.result is Result.EQUAL:
            return actual == operand
        if self.result is Result.NOT_EQUAL:
            return actual != operand
        assert type(actual) is type(operand)
        if self.result is Result.GREATER:
            return actual > operand  # type: ignore[operator]
        return actual < operand  # type: ignore[operator]


@attrs.frozen
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@attrs.frozen
class Delete:
    key: bytes


@attrs.frozen
class DeletePrefix:
    prefix: bytes


@attrs.frozen
class Get:
    """Read one key inside a transaction (its result is in ``TxnResult.gets``)."""

    key: bytes


Operation = Put | Delete | DeletePrefix | Get


@attrs.frozen
class TxnResult:
    succeeded: bool
    #: The store's revision after the transaction (the transaction's own if it wrote).
    revision: int
    #: What each ``Get`` of the branch that ran found, in order (``None``: missing).
    gets: tuple[KeyValue | None, ...] = ()


@attrs.frozen
class RangeResult:
    kvs: tuple[KeyValue, ...]
    #: The store's revision the kvs were read at.
    revision: int


class EventType(Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@attrs.frozen
class WatchEvent:
    type: EventType
    #: For a delete: the key, empty value, ``mod_revision`` the revision of the delete.
    kv: KeyValue


class WatchHandle(Protocol):
    def cancel(self) -> None:
        """Stop the watch; neither callback is called after this."""


#: Called with the events of one or more revisions, in revision order; all of one revision's
#: events come in one call.
OnEvents = Callable[[Sequence[WatchEvent]], None]
#: Called once when the watch ends other than by ``cancel``: ``CompactedError`` if the start
#: revision was compacted, ``ControlPlaneUnavailableError`` if the member went away.
OnLost = Callable[[Exception], None]


class KeyValueStore(Protocol):
    def range_prefix(self, prefix: bytes) -> Deferred[RangeResult]:
        """Every key under ``prefix``, sorted, and the revision they were read at."""

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Operation],
        failure: Sequence[Operation] = (),
    ) -> Deferred[TxnResult]: ...

    def put(self, key: bytes, value: bytes, lease: int = 0) -> Deferred[int]:
        """Fire with the new revision."""

    def delete(self, key: bytes) -> Deferred[int]:
        """Fire with the number of keys deleted."""

    def delete_prefix(self, prefix: bytes) -> Deferred[int]:
        """Fire with the number of keys deleted."""

    def watch(
        self, prefix: bytes, start_revision: int, on_events: OnEvents, on_lost: OnLost
    ) -> WatchHandle:
        """Report every change under ``prefix`` from ``start_revision`` on.

        Failures (including a compacted start revision) come through ``on_lost``, which may be
        called before this returns.
        """

    def grant(self, ttl_seconds: int) -> Deferred[int]:
        """Fire with a new lease's id."""

    def keepalive(self, lease: int) -> Deferred[int]:
        """Renew ``lease``; fire with its remaining TTL in seconds, 0 if it is gone."""

    def revoke(self, lease: int) -> Deferred[None]:
        """End ``lease`` now, deleting its keys; ``LeaseNotFoundError`` if it is gone."""

    def close(self) -> Deferred[None]:
        """Release connections; watches end."""
