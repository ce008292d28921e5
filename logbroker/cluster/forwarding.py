"""A range reached over the peer link: the forwarding side and the serving side.

With replication factor 1 each range's active segment lives on one node, its primary; any other
node serves clients by forwarding. ``ForwardedRange`` is the ``RangeHandle`` of such a range on a
node that is not its primary: every call becomes one peer request (``PeerOp.APPEND``, ``READ``,
``BOUNDS``) to the primary; a share of a ``produce_idempotent`` goes as ``STAMPED_APPEND``, so
that the primary's handle, which knows what the range stored, keeps a retry from being stored
twice whichever node it came through. ``RangeServer`` is the primary's side, the
``RequestHandler`` of its peer listener: it decodes the request, calls its own handle of the
range and encodes the answer.

A forwarded append fires once the primary has answered, and the primary answers once the records
are durable by its own handle's rule, so a forwarded produce is as durable as a local one. A
forwarded read returns the records in the client protocol's encoding exactly as the primary's
handle read them, within the same record limit and byte budget, with the same ``size``.

Failures reach the broker core as ``BrokerError`` with the reason the client is told
(``FORWARDED_REASONS``); every other reason (a bug, a peer of another version, an internal error)
becomes ``unreachable`` and is logged. A primary of a version without ``STAMPED_APPEND`` answers
it ``unknown_op``: the share is sent again as a plain ``APPEND``, stored as that node stores any
produce (at-least-once). With no established link to the primary a request fails
at once (``PeerConnections.request``); a link that drops fails the requests waiting on it at
once; a silent peer is dropped after the peer settings' ``dead_after_s``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import attrs
from twisted.internet.defer import CancelledError, Deferred, fail, maybeDeferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker import wire
from logbroker._deferreds import detached
from logbroker.broker.errors import BrokerError
from logbroker.broker.ranges import Bounds, RangeDirectory, RangeHandle, RangeRead
from logbroker.cluster.remote_waits import MAX_REMOTE_WAIT_MS, RemoteWaits
from logbroker.errors import CLIENT_REASON, Reason
from logbroker.peer.frames import MalformedPeerMessage, PeerCodecError, PeerOp, PeerReason
from logbroker.peer.range_ops import (
    AppendRequest,
    AppendResult,
    BoundsRequest,
    BoundsResult,
    ReadRequest,
    ReadResult,
    decode_append_request,
    decode_append_result,
    decode_bounds_request,
    decode_bounds_result,
    decode_read_request,
    decode_read_result,
    decode_stamped_append_request,
    encode_append_request,
    encode_append_result,
    encode_bounds_request,
    encode_bounds_result,
    encode_read_request,
    encode_read_result,
    read_records,
)
from logbroker.peer.requester import PeerRequester
from logbroker.peer.window import PeerError
from logbroker.records import MAX_U64, ProducerStamp, Records

log = Logger()

_T = TypeVar("_T")
_MAX_U32 = 0xFFFFFFFF

#: The reasons a peer's failure keeps on its way to the client: each tells the client to retry
#: (later, or elsewhere), or (``sequence_too_old``) that a retry came too late to be told apart
#: from its first try. Any other reason is this cluster's own trouble: ``unreachable``, logged.
FORWARDED_REASONS: frozenset[Reason] = frozenset(
    {
        Reason.OVERLOADED,
        Reason.UNREACHABLE,
        Reason.NO_QUORUM,
        Reason.NOT_PRIMARY,
        Reason.TIMEOUT,
        Reason.SEQUENCE_TOO_OLD,
    }
)


class ForwardedRange:
    """A range whose primary is node ``primary_node_id``, reached through ``requester``."""

    def __init__(
        self,
        range_id: str,
        primary_node_id: str,
        requester: PeerRequester,
        waits: RemoteWaits | None = None,
        on_forwarded: Callable[[int], None] = lambda records: None,
    ) -> None:
        self._range_id = range_id
        self._primary = primary_node_id
        self._requester = requester
        self._waits = waits if waits is not None else RemoteWaits(requester)
        #: Told the record count of each append the primary acknowledged.
        self._on_forwarded = on_forwarded

    @property
    def range_id(self) -> str:
        return self._range_id

    @property
    def primary_node_id(self) -> str:
        return self._primary

    def refusal(self, count: int) -> BrokerError | None:
        """None: this node does not know the primary's limits. The primary asks its own handle
        before it appends, and its refusal comes back as the append's failure (nothing stored)."""
        return None

    def append(self, records: Records, stamp: ProducerStamp | None = None) -> Deferred[None]:
        # The share goes on as the wire bytes it came in: the primary checks them once more,
        # but nothing re-encodes them.
        share = wire.wire_records(records)
        count = share.count
        request = AppendRequest(self._range_id, count, share.data, stamp)

        def appended(answer: bytes) -> None:
            result = decode_append_result(answer)
            if result.count != count:
                raise MalformedPeerMessage(f"{result.count} records appended of {count} sent")
            self._on_forwarded(count)

        sent = self._requester.request(self._primary, request.op, encode_append_request(request))
        if stamp is not None:
            sent.addErrback(self._unstamped, request)
        return sent.addCallback(appended).addErrback(self._failed, request.op)

    def _unstamped(self, failure: Failure, request: AppendRequest) -> Failure | Deferred[bytes]:
        """A primary of a version without stamped appends: send it the share as a plain one."""
        error = failure.value
        if not (isinstance(error, PeerError) and error.reason == PeerReason.UNKNOWN_OP):
            return failure
        plain = attrs.evolve(request, stamp=None)
        return self._requester.request(self._primary, plain.op, encode_append_request(plain))

    def bounds(self) -> Deferred[Bounds]:
        payload = encode_bounds_request(BoundsRequest(self._range_id))

        def bounds(result: BoundsResult) -> Bounds:
            return Bounds(result.start_offset, result.end_offset)

        return self._request(PeerOp.BOUNDS, payload, decode_bounds_result).addCallback(bounds)

    def read(self, offset: int, max_records: int, max_bytes: int) -> Deferred[RangeRead]:
        # Clamped into the codec's fields without changing the answer: an offset below the
        # start reads from the start, no room for records reads none, any budget of 0 or less
        # takes one record, and a frame could not hold more than 4 GiB anyway.
        request = ReadRequest(
            self._range_id,
            min(max(offset, 0), MAX_U64),
            min(max(max_records, 0), _MAX_U32),
            min(max(max_bytes, 0), _MAX_U32),
            wait_ms=0,
        )

        def read(result: ReadResult) -> RangeRead:
            # Checked, and their size counted exactly as the primary's handle did (keys and
            # values); the bytes themselves go on as they are.
            records = read_records(result.record_count, result.records)
            data = (result.records,) if result.record_count else ()
            return RangeRead(data, result.record_count, result.next_offset, records.size)

        payload = encode_read_request(request)
        return self._request(PeerOp.READ, payload, decode_read_result).addCallback(read)

    def wait(self, offset: int, wait_ms: int) -> Deferred[None]:
        """A long poll on the primary, shared by every fetch of this node waiting on the same
        offset of the range (``RemoteWaits``)."""
        return self._waits.wait(self._primary, self._range_id, offset, wait_ms)

    def _request(self, op: PeerOp, payload: bytes, decode: Callable[[bytes], _T]) -> Deferred[_T]:
        sent = self._requester.request(self._primary, op, payload)
        return sent.addCallback(decode).addErrback(self._failed, op)

    def _failed(self, failure: Failure, op: PeerOp) -> Failure:
        error = failure.value
        if isinstance(error, CancelledError):
            return failure  # the caller cancelled its own request
        passed_on = _passed_on(error) if isinstance(error, PeerError) else None
        if passed_on is not None:
            raise BrokerError(
                passed_on,
                f"{op.name.lower()} of range {self._range_id} on node {self._primary}: {error}",
            )
        name = op.name.lower()
        if isinstance(error, PeerError | PeerCodecError):
            # The peer answered what this node cannot pass on: a bug, or nodes of two versions.
            log.error(
                "A forwarded {op} of range {range_id} to node {primary} failed: {error};"
                " the client is told unreachable",
                op=name,
                range_id=self._range_id,
                primary=self._primary,
                error=str(error),
            )
        else:
            log.failure(
                "A forwarded {op} of range {range_id} to node {primary} failed unexpectedly;"
                " the client is told unreachable",
                failure,
                op=name,
                range_id=self._range_id,
                primary=self._primary,
            )
        raise BrokerError(
            Reason.UNREACHABLE,
            f"{op.name.lower()} of range {self._range_id} on node {self._primary} failed",
        )


def _passed_on(error: PeerError) -> Reason | None:
    """The reason to tell the client for what the primary answered, if it is one a client can
    act on: the forwarded reasons as they are, and the primary's passing conditions (its
    control plane not loaded yet, etcd contended) as the client port folds them, into
    ``unreachable``. An internal error is a bug, never passed on quietly."""
    try:
        reason = Reason(error.reason)
    except ValueError:
        return None
    if reason is Reason.INTERNAL_ERROR:
        return None
    folded = CLIENT_REASON[reason]
    return folded if folded in FORWARDED_REASONS else None


class RangeServer:
    """Serves this node's ranges to its peers' ``ForwardedRange``s: the ``RequestHandler`` of
    the node's peer listener, over ``directory``'s handles.

    Give it the ranges this node leads: a range it hands out as a ``ForwardedRange`` is refused
    ``not_primary`` rather than forwarded on, so two nodes that disagree for a moment about a
    primary cannot bounce a request between them. A range that is not open on this node yet
    (``BrokerError`` ``unreachable`` from ``directory.handle``) is opened first, once however
    many requests ask for it at the same time.

    A handle's ``BrokerError`` is answered with its reason (the peer protocol answers an error's
    ``reason`` attribute); a payload that does not decode is ``malformed_request``; anything
    else is logged by the peer protocol and answered ``internal_error``.

    A read with ``wait_ms`` that finds nothing at its offset waits, up to ``wait_ms`` on
    ``clock``, for a record there (the forwarding node's long poll), then reads again.
    """

    def __init__(self, directory: RangeDirectory, clock: IReactorTime) -> None:
        self._directory = directory
        self._clock = clock
        #: Ranges being opened for a request, and the requests waiting for each.
        self._opening: dict[str, list[Deferred[RangeHandle]]] = {}
        self._ops: dict[PeerOp, Callable[[bytes], Deferred[bytes]]] = {
            PeerOp.APPEND: lambda payload: self._append(decode_append_request(payload)),
            PeerOp.STAMPED_APPEND: lambda payload: self._append(
                decode_stamped_append_request(payload)
            ),
            PeerOp.READ: lambda payload: self._read(decode_read_request(payload)),
            PeerOp.BOUNDS: lambda payload: self._bounds(decode_bounds_request(payload)),
        }

    def __call__(self, peer_node_id: str, op: PeerOp, payload: bytes) -> Deferred[bytes]:
        serve = self._ops.get(op)
        if serve is None:
            # The node's peer handler sends other ops (if any) elsewhere.
            return fail(PeerError(PeerReason.UNKNOWN_OP, f"op {op} is not a range op"))
        try:
            return serve(payload)
        except MalformedPeerMessage as error:
            return fail(BrokerError(Reason.MALFORMED_REQUEST, str(error)))
        except BrokerError as error:
            return fail(error)

    def _append(self, request: AppendRequest) -> Deferred[bytes]:
        records = read_records(request.record_count, request.records)
        if not records:
            raise MalformedPeerMessage("an append carries at least one record")

        def append(handle: RangeHandle) -> Deferred[bytes]:
            # As the broker core does: a refusal stores nothing.
            refusal = handle.refusal(len(records))
            if refusal is not None:
                raise refusal
            # Once asked, the append finishes even if the peer's connection goes (a stop, a
            # drop): it is stored, and the long polls waiting on the range are woken.
            appended = detached(handle.append(records, request.stamp))
            return appended.addCallback(lambda _: encode_append_result(AppendResult(len(records))))

        return self._handle(request.range_id).addCallback(append)

    def _read(self, request: ReadRequest) -> Deferred[bytes]:
        def read(handle: RangeHandle) -> Deferred[bytes]:
            def answer(read: RangeRead) -> Deferred[bytes]:
                def encode(bounds: Bounds) -> bytes:
                    data = b"".join(read.data)
                    return encode_read_result(
                        ReadResult(read.count, data, read.next_offset, bounds.end)
                    )

                return handle.bounds().addCallback(encode)

            def read_now(_: object = None) -> Deferred[bytes]:
                reading = handle.read(request.from_offset, request.max_records, request.max_bytes)
                return reading.addCallback(answer)

            if request.wait_ms == 0:
                return read_now()
            wait_ms = min(request.wait_ms, MAX_REMOTE_WAIT_MS)
            waiting = handle.wait(request.from_offset, wait_ms)
            waiting.addTimeout(wait_ms / 1000.0, self._clock)
            # A timeout is the long poll's ordinary end: answer with what there is.
            return waiting.addBoth(read_now)

        return self._handle(request.range_id).addCallback(read)

    def _bounds(self, request: BoundsRequest) -> Deferred[bytes]:
        def answer(found: Bounds) -> bytes:
            if not found.end_known:
                # The asking node takes these bounds as the range's own. A handle here that
                # cannot know the end (its leader stopped, and this node's view of etcd has
                # not caught up) sends it to the copies instead, as a primary that moved does.
                raise BrokerError(
                    Reason.NOT_PRIMARY,
                    f"range {request.range_id} is not led by this node now (its leader stopped)",
                )
            return encode_bounds_result(BoundsResult(found.start, found.end))

        def bounds(handle: RangeHandle) -> Deferred[bytes]:
            return handle.bounds().addCallback(answer)

        return self._handle(request.range_id).addCallback(bounds)

    def _handle(self, range_id: str) -> Deferred[RangeHandle]:
        """The range's handle here, opening the range first if it is not open yet."""
        try:
            return succeed(self._served(range_id))
        except BrokerError as error:
            if error.reason is not Reason.UNREACHABLE:
                raise
        waiting: Deferred[RangeHandle] = Deferred()
        waiters = self._opening.get(range_id)
        if waiters is not None:
            waiters.append(waiting)
            return waiting
        # Listed before opening starts: an open that is done at once answers it too.
        self._opening[range_id] = [waiting]
        opening: Deferred[None] = maybeDeferred(self._directory.open, [range_id])
        opening.addCallback(lambda _: self._served(range_id)).addCallbacks(
            self._opened, self._opened, callbackArgs=(range_id,), errbackArgs=(range_id,)
        )
        return waiting

    def _served(self, range_id: str) -> RangeHandle:
        handle = self._directory.handle(range_id)
        if isinstance(handle, ForwardedRange):
            raise BrokerError(
                Reason.NOT_PRIMARY,
                f"range {range_id} is led by node {handle.primary_node_id}, not this node",
            )
        return handle

    def _opened(self, outcome: RangeHandle | Failure, range_id: str) -> None:
        for waiting in self._opening.pop(range_id):
            if isinstance(outcome, Failure):
                waiting.errback(outcome)
            else:
                waiting.callback(outcome)


def _nothing(_: object) -> None:
    return None
