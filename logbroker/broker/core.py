"""The broker core: topics and their ranges, produce, fetch with long poll, commit, groups.

Transport-free: ``logbroker.server`` turns requests into these calls and their results (or
``BrokerError``'s reason) into response frames. Topics and ranges live in the control plane;
the core reaches each range's records through its ``RangeHandle`` (``logbroker.broker.ranges``),
whether they live in this process or on another node.

Routing: a keyed record goes to the range owning its key's slot (``key_routing.key_slot``), so
records with one key stay in order. The keyless records of one produce go together to the
topic's next active range in turn: one append (one write and fsync) per produce rather than one
per range, spread over the ranges across produces. Those of a stamped produce
(``produce_idempotent``) go to the range owning the slot of the stamp's 16 bytes instead, so
that a retry, through whichever node, reaches the same ranges with the same records, and each
range knows its share again by the stamp.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
from twisted.internet.defer import (
    Deferred,
    ensureDeferred,
    fail,
    succeed,
)
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from logbroker import wire
from logbroker._deferreds import detached, gather
from logbroker.broker.cursor import Cursor, InvalidCursorError
from logbroker.broker.errors import BrokerError
from logbroker.broker.groups import GroupCoordinator, LocalGroups
from logbroker.broker.keyspace import keyspace_bits, split_keyspace, valid_topic_name
from logbroker.broker.ranges import Bounds, RangeDirectory, RangeHandle
from logbroker.controlplane import AlreadyExistsError, ControlPlane, Range, RangeState, Topic
from logbroker.errors import Reason
from logbroker.key_routing import split_records, stamp_range
from logbroker.metrics import Metrics
from logbroker.records import ProducerStamp, Record, Records, WireRecords

log = Logger()

DEFAULT_FETCH_MAX = 100
MAX_FETCH_RECORDS = 1000
MAX_WAIT_MS = 30_000
#: About how many bytes of keys and values one fetch returns at most (at least one record).
MAX_FETCH_BYTES = 4 * 1024 * 1024
#: Longest consumer group or member name.
MAX_NAME_LENGTH = 249


@attrs.frozen
class BrokerSettings:
    #: Ranges a new topic's keyspace is cut into (fewer if the keyspace has fewer slots).
    initial_ranges: int = 4
    #: A group member not seen for this long loses its share of the ranges.
    group_session_timeout_ms: int = 30_000


@attrs.frozen
class FetchResult:
    """Records in the client protocol's encoding, ready to send, and where to go on from."""

    #: ``count`` records, each encoded as the protocol's ``record``, in pieces to send as
    #: they are (not copied into one string).
    data: tuple[bytes, ...]
    count: int
    next_cursor: str

    @property
    def records(self) -> tuple[Record, ...]:
        """The records decoded (for callers that want objects, not bytes to send)."""
        payload = b"".join(wire.records_payload_parts(self.count, self.data, ""))
        return wire.decode_records(payload).records


def fetch_limit(requested: int) -> int:
    """Records one fetch or push may carry: 0 means 100, at most 1000."""
    return DEFAULT_FETCH_MAX if requested == 0 else min(requested, MAX_FETCH_RECORDS)


class Broker:
    def __init__(
        self,
        control_plane: ControlPlane,
        ranges: RangeDirectory,
        clock: IReactorTime,
        settings: BrokerSettings | None = None,
        metrics: Metrics | None = None,
        groups: GroupCoordinator | None = None,
    ) -> None:
        self._control = control_plane
        self._ranges = ranges
        self._clock = clock
        self._settings = settings or BrokerSettings()
        self._metrics = metrics or Metrics(clock)
        self._keyless_turn: dict[str, itertools.count[int]] = {}
        self._read_turn: dict[str, itertools.count[int]] = {}
        #: Each topic's active ranges in slot order and their first slots, with the ranges they
        #: were chosen from.
        self._active: dict[str, tuple[Sequence[Range], list[Range], list[int]]] = {}
        self._sleepers: set[_Wakeup] = set()
        #: Set by ``wake_all``: long polls answer with what they have rather than wait again.
        self._stopping = False
        self._groups = groups or LocalGroups(clock, self._settings.group_session_timeout_ms)

    # -- topics --------------------------------------------------------------------------

    def open(self) -> Deferred[None]:
        """Make every range the control plane knows reachable (its storage created if new)."""
        return self._ranges.open(
            [
                range_.range_id
                for topic in self._control.topics()
                for range_ in self._control.ranges(topic.name)
            ]
        )

    def create_topic(self, name: str | None, requested_bits: int) -> Deferred[None]:
        if not valid_topic_name(name):
            return _fail(Reason.INVALID_TOPIC_NAME, f"invalid topic name {name!r}")
        assert name is not None
        bits = keyspace_bits(requested_bits)
        if bits is None:
            return _fail(
                Reason.INVALID_KEYSPACE_BITS,
                f"keyspace_bits {requested_bits} is not 0 (default 8) or 1 to 32",
            )
        if self._control.topic(name) is not None:
            return _fail(Reason.ALREADY_EXISTS, f"topic {name!r} exists")
        bounds = split_keyspace(bits, self._settings.initial_ranges)
        ranges = [
            Range(f"{name}.{index}", name, start, end, RangeState.ACTIVE)
            for index, (start, end) in enumerate(bounds)
        ]
        topic = Topic(
            name, bits, round(self._clock.seconds() * 1000), tuple(r.range_id for r in ranges)
        )

        def open_ranges(_: object) -> Deferred[None]:
            return self._ranges.open([range_.range_id for range_ in ranges])

        # The ranges are opened once the topic is durable in the control plane: a crash between
        # the two leaves a topic whose ranges ``open`` creates at the next start.
        created = self._control.create_topic(topic, ranges).addCallback(open_ranges)
        return created.addErrback(_translate_exists, name)

    def topics(self) -> list[Topic]:
        """Every topic, by name (``list_topics``)."""
        return self._control.topics()

    def _topic(self, name: str | None) -> Topic:
        topic = self._control.topic(name) if name is not None else None
        if topic is None:
            raise BrokerError(Reason.NO_SUCH_TOPIC, f"no topic {name!r}")
        return topic

    def _handles(self, range_ids: Iterable[str]) -> dict[str, RangeHandle]:
        return {range_id: self._ranges.handle(range_id) for range_id in range_ids}

    # -- produce -------------------------------------------------------------------------

    def produce(
        self,
        topic_name: str | None,
        records: Records,
        stamp: ProducerStamp | None = None,
    ) -> Deferred[int]:
        """Append ``records``; fires with their count once every one of them is durable.

        Every range the records go to must take its share before any is written, so a refusal
        (``overloaded``, a range out of service) stores nothing. A failure during the writes
        themselves (a disk error) can leave some ranges' records stored: without ``stamp`` a
        produce is at-least-once, and a client that retries after an error may store records
        twice. With ``stamp``, each range's share carries it, and a range that has stored it
        already does not store it again: a retry with the same stamp and records stores what
        its first try did not, and is answered the same count.

        Records as a request carried them (``WireRecords``) stay those bytes all the way to
        the log; records given as objects are encoded first.
        """
        produced = wire.wire_records(records)
        try:
            topic = self._topic(topic_name)
            routed = self._route(topic, produced, stamp)
            handles = self._handles(routed)
            for range_id, share in routed.items():
                refusal = handles[range_id].refusal(len(share))
                if refusal is not None:
                    raise refusal
        except BrokerError as error:
            return fail(error)
        if not routed:
            return succeed(0)
        appends = [
            self._append(handles[range_id], share, stamp) for range_id, share in routed.items()
        ]
        # Most requests go to one range (one record, or one key's): nothing to gather.
        waiting: Deferred[Any] = appends[0] if len(appends) == 1 else gather(appends)
        stored = waiting.addCallback(lambda _: self._produced(topic.name, produced))
        # The caller may cancel its wait (its connection went away); the writes go on, and
        # their completion must still wake long polls, so cancelling stops here.
        return detached(stored)

    def _produced(self, topic: str, records: WireRecords) -> int:
        """Count an acknowledged produce; its record count is the reply."""
        self._metrics.produced(topic, records.count, records.size)
        return records.count

    def active_ranges(self, topic_name: str | None) -> tuple[Topic, list[Range]]:
        """The topic and its active ranges, in slot order: the ranges its records go to.
        Raises ``BrokerError`` for a topic that does not exist or has no active range."""
        topic = self._topic(topic_name)
        active, _ = self._active_of(topic)
        return topic, active

    def _active_of(self, topic: Topic) -> tuple[list[Range], list[int]]:
        """The topic's active ranges in slot order and their first slots; ``BrokerError`` if
        it has none."""
        ranges = self._control.ranges(topic.name)
        # Asked at every produce; the control plane hands back the same ranges until one of
        # them changes, so they are sorted once per change.
        found = self._active.get(topic.name)
        if found is None or found[0] is not ranges:
            active = sorted(
                (r for r in ranges if r.state is RangeState.ACTIVE), key=lambda r: r.start
            )
            found = self._active[topic.name] = (ranges, active, [r.start for r in active])
        if not found[1]:
            raise BrokerError(Reason.UNREACHABLE, f"topic {topic.name!r} has no active range")
        return found[1], found[2]

    def _route(
        self, topic: Topic, records: WireRecords, stamp: ProducerStamp | None
    ) -> dict[str, WireRecords]:
        active, starts = self._active_of(topic)
        bits = topic.keyspace_bits
        if stamp is None:
            turn = next(self._keyless_turn.setdefault(topic.name, itertools.count()))
            keyless = turn % len(active)
        else:
            keyless = stamp_range(stamp, bits, starts)
        shares = split_records(records, bits, starts, keyless)
        return {active[index].range_id: share for index, share in shares}

    def _append(
        self, handle: RangeHandle, batch: WireRecords, stamp: ProducerStamp | None
    ) -> Deferred[None]:
        # The handle wakes the long polls waiting on its range, wherever they were made.
        return handle.append(batch, stamp)

    # -- fetch ---------------------------------------------------------------------------

    def fetch(
        self,
        topic_name: str | None,
        cursor: str | None,
        group: str | None,
        member: str | None,
        max_records: int,
        wait_ms: int,
    ) -> Deferred[FetchResult]:
        """Records after ``cursor``, at most ``max_records`` (0 means 100, at most 1000). A
        range the cursor does not name starts at the group's committed position, else at the
        range's start. With a group and a member, only the member's share of the ranges is
        read, and ``next_cursor`` names only those. With nothing to return, waits up to
        ``wait_ms`` (at most 30 s) for a produce to one of the ranges read."""
        try:
            topic = self._topic(topic_name)
            _check_name("group", group)
            _check_name("member", member)
            start = self._decode_cursor(topic, cursor) if cursor is not None else {}
        except BrokerError as error:
            return fail(error)
        limit = fetch_limit(max_records)
        wait_ms = min(wait_ms, MAX_WAIT_MS)
        return ensureDeferred(self._fetch(topic, start, group, member, limit, wait_ms))

    async def _fetch(
        self,
        topic_meta: Topic,
        start: dict[str, int],
        group: str | None,
        member: str | None,
        limit: int,
        wait_ms: int,
    ) -> FetchResult:
        topic = topic_meta.name
        if group is None or member is None:
            range_ids = list(topic_meta.range_ids)
        else:
            range_ids = await self._groups.share(topic, group, member, topic_meta.range_ids)
        handles = self._handles([*start, *range_ids])
        bounds = await self._bounds(handles)
        _check_positions(start, bounds)
        positions = self._positions(topic, start, group, range_ids, bounds)
        deadline = self._clock.seconds() + wait_ms / 1000.0
        while True:
            result = await self._read(topic, positions, handles, limit)
            remaining_ms = round((deadline - self._clock.seconds()) * 1000)
            if result.count or remaining_ms <= 0 or self._stopping:
                return result
            # Nothing was read, so the positions are where the next read starts, over the same
            # share. A wait may end without a record (a remote one gives up after a few
            # seconds): read again, and wait on while the poll has time left.
            await self._wait(handles, positions, remaining_ms)

    def _decode_cursor(self, topic: Topic, text: str) -> dict[str, int]:
        try:
            cursor = Cursor.decode(text)
        except InvalidCursorError as error:
            raise BrokerError(Reason.INVALID_CURSOR, str(error)) from None
        foreign = set(cursor.positions) - set(topic.range_ids)
        if foreign:
            raise BrokerError(
                Reason.INVALID_CURSOR,
                f"cursor names ranges of another topic: {', '.join(sorted(foreign))}",
            )
        return dict(cursor.positions)

    async def _bounds(self, handles: Mapping[str, RangeHandle]) -> dict[str, Bounds]:
        """Every range's bounds, asked of all at once."""
        range_ids = list(handles)
        found = await gather([handles[range_id].bounds() for range_id in range_ids])
        return dict(zip(range_ids, found, strict=True))

    def _positions(
        self,
        topic: str,
        start: dict[str, int],
        group: str | None,
        range_ids: list[str],
        bounds: Mapping[str, Bounds],
    ) -> dict[str, int]:
        committed = self._committed(topic, group) if group is not None else {}
        positions = {}
        for range_id in range_ids:
            first = bounds[range_id].start
            offset = start.get(range_id, committed.get(range_id, first))
            # Records below the start were removed by retention: go on from the oldest kept.
            positions[range_id] = max(offset, first)
        return positions

    def _committed(self, topic: str, group: str) -> dict[str, int]:
        """The group's committed position per range, as the control plane holds it (commits
        made through any node)."""
        text = self._control.group_position(topic, group)
        return _positions_of(text)

    async def _read(
        self,
        topic: str,
        positions: Mapping[str, int],
        handles: Mapping[str, RangeHandle],
        limit: int,
    ) -> FetchResult:
        """Read from the ranges of ``positions``, starting with a different range each time so
        that a busy range cannot starve the others."""
        range_ids = list(positions)
        if range_ids:
            turn = next(self._read_turn.setdefault(topic, itertools.count())) % len(range_ids)
            range_ids = range_ids[turn:] + range_ids[:turn]
        next_positions = dict(positions)
        parts: list[bytes] = []
        count = 0
        budget = MAX_FETCH_BYTES
        for range_id in range_ids:
            if count >= limit or budget <= 0:
                break
            read = await handles[range_id].read(next_positions[range_id], limit - count, budget)
            parts.extend(read.data)
            count += read.count
            budget -= read.size
            next_positions[range_id] = read.next_offset
        if count:
            self._metrics.consumed(topic, count, MAX_FETCH_BYTES - budget)
        return FetchResult(tuple(parts), count, Cursor(next_positions).encode())

    # -- long poll -----------------------------------------------------------------------

    def _wait(
        self, handles: Mapping[str, RangeHandle], positions: Mapping[str, int], wait_ms: int
    ) -> Deferred[None]:
        """Fires when one of the ranges gets a record at its position, or after ``wait_ms``."""
        wakeup = _Wakeup(self)
        self._sleepers.add(wakeup)
        wakeup.timer = self._clock.callLater(wait_ms / 1000.0, wakeup.fire)
        for range_id, offset in positions.items():
            wakeup.watch(handles[range_id].wait(offset, wait_ms))
        return wakeup.deferred

    def wake_all(self) -> None:
        """End every long poll now (each answers with what it has): the broker is stopping."""
        self._stopping = True
        for wakeup in list(self._sleepers):
            wakeup.fire()

    def _forget(self, wakeup: _Wakeup) -> None:
        self._sleepers.discard(wakeup)

    # -- groups --------------------------------------------------------------------------

    def commit(
        self, topic_name: str | None, group: str | None, cursor: str | None
    ) -> Deferred[None]:
        """Record the positions ``cursor`` names as ``group``'s (durable when this fires).
        Ranges the cursor does not name keep their committed positions, so members committing
        their own shares never undo each other."""
        try:
            topic = self._topic(topic_name)
            if group is None:
                raise BrokerError(Reason.INVALID_OPERATION, "commit needs a group")
            _check_name("group", group)
            if cursor is None:
                raise BrokerError(Reason.INVALID_CURSOR, "commit needs a cursor")
            positions = self._decode_cursor(topic, cursor)
            handles = self._handles(positions)
        except BrokerError as error:
            return fail(error)
        return ensureDeferred(self._commit(topic.name, group, positions, handles))

    async def _commit(
        self,
        topic: str,
        group: str,
        positions: dict[str, int],
        handles: Mapping[str, RangeHandle],
    ) -> None:
        _check_positions(positions, await self._bounds(handles))
        # The control plane merges the ranges named into the stored position as the change
        # takes effect, so members committing their shares through different nodes at once
        # never undo each other.
        await self._control.commit_group_position(
            topic, group, Cursor(positions).encode(), merge=_merge_positions
        )

    def touch_member(self, topic: str, group: str, member: str) -> None:
        """``member`` is alive (it holds a subscription), whether or not it is fetching."""
        self._groups.touch(topic, group, member)

    def leave_group(self, topic_name: str | None, group: str | None, member: str | None) -> None:
        topic = self._topic(topic_name)
        if group is None or member is None:
            raise BrokerError(Reason.INVALID_OPERATION, "leave_group needs a group and a member")
        self._groups.leave(topic.name, group, member)

    def _now(self) -> int:
        return round(self._clock.seconds() * 1000)


class _Wakeup:
    """One long poll waiting for a record in any of its ranges, or for its timer."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self.timer: IDelayedCall | None = None
        self.deferred: Deferred[None] = Deferred(self._cancel)
        #: The ranges' waits still outstanding, cancelled once the poll is over.
        self._watching: list[Deferred[None]] = []

    def watch(self, waiting: Deferred[None]) -> None:
        if self.deferred.called:
            # An earlier range's wait ended the poll already: nothing awaits this one's outcome
            # (a cancelled wait fails with CancelledError, which must not go unhandled).
            waiting.addErrback(lambda _: None)
            waiting.cancel()
            return
        self._watching.append(waiting)
        # A wait that fails (a range that cannot be reached) ends the poll too: the read that
        # follows answers with what there is, or with the error.
        waiting.addBoth(self._woken, waiting)

    def _woken(self, outcome: object, waiting: Deferred[None]) -> None:
        if waiting in self._watching:
            self._watching.remove(waiting)
            self.fire()

    def fire(self) -> None:
        if self.deferred.called:
            return
        self._settle()
        self.deferred.callback(None)

    def _cancel(self, _: Deferred[None]) -> None:
        # The connection went away: stop waiting; the Deferred fails with CancelledError.
        self._settle()

    def _settle(self) -> None:
        self._broker._forget(self)
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None
        watching, self._watching = self._watching, []
        for waiting in watching:
            waiting.cancel()


def _fail(reason: Reason, detail: str) -> Deferred[None]:
    return fail(BrokerError(reason, detail))


def _translate_exists(failure: Failure, name: str) -> Failure:
    if isinstance(failure.value, AlreadyExistsError):
        raise BrokerError(Reason.ALREADY_EXISTS, f"topic {name!r} exists")
    return failure


def _check_name(what: str, name: str | None) -> None:
    if name is not None and not 1 <= len(name) <= MAX_NAME_LENGTH:
        raise BrokerError(
            Reason.INVALID_OPERATION, f"a {what} name takes 1 to {MAX_NAME_LENGTH} characters"
        )


def _positions_of(text: str | None) -> dict[str, int]:
    """The positions a stored cursor names; none for none, or for one that does not decode
    (it was written by this broker, so that would be damage: start over from the ranges'
    starts rather than fail every fetch of the group)."""
    if text is None:
        return {}
    try:
        return dict(Cursor.decode(text).positions)
    except InvalidCursorError:
        log.error("A stored group position does not decode: {cursor!r}", cursor=text)
        return {}


def _merge_positions(stored: str | None, committed: str) -> str:
    """The stored position with the ranges ``committed`` names moved to where it says."""
    return Cursor({**_positions_of(stored), **_positions_of(committed)}).encode()


def _check_positions(positions: Mapping[str, int], bounds: Mapping[str, Bounds]) -> None:
    """A cursor may name a range's end, never past it (where the end is known)."""
    for range_id, offset in positions.items():
        end = bounds[range_id].end
        if offset > end and bounds[range_id].end_known:
            raise BrokerError(
                Reason.INVALID_CURSOR,
                f"cursor is past the end of {range_id} ({offset} > {end})",
            )
