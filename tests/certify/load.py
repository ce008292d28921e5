"""The checker's clients: a keyed load kept running through every node for the whole window,
and a consumer that follows the topic through every fault.

- ``PlainProducer``: one keyed record per produce through its own node (the client's own
  retries with one stamp, on one connection), moving to the next node when its node stops
  answering.
- ``StampedProducer``: every produce stamped with the producer's id and sequence, and after
  any failure sent again with the same stamp through the next node, until acknowledged or given
  up: each value must be stored exactly once.
- ``Follower``: fetches the topic from its cursor, moving to the next node with the same
  cursor whenever a fetch fails; what it read must be, key by key, the start of the final log.

Every produce goes into one ``History`` (``tests.history``).
"""

from __future__ import annotations

import abc
import collections
import itertools
import threading
import time
from collections.abc import Sequence

from logbroker import wire
from logbroker.client.blocking import BlockingClient, BrokerRefused, ConnectionClosed
from logbroker.errors import Reason
from logbroker.records import ProducerStamp, Record
from tests.history import History

USER = "app"
PASSWORD = "app123"
ADMIN = ("admin", "admin123")
#: How long one try may wait for its answer before its connection counts as lost.
TRY_SECONDS = 8.0
#: A produce not acknowledged this long after its first try is given up.
GIVE_UP_AFTER = 30.0
#: Keys per producer: enough that each producer's keys fall in every range.
KEYS = 8
_LOST = (OSError, ConnectionClosed)


def connect(server: str, user: str = USER, password: str = PASSWORD) -> BlockingClient:
    host, port = server.rsplit(":", 1)
    return BlockingClient.connect(host, int(port), user, password, timeout=TRY_SECONDS)


class _Worker(abc.ABC):
    """A thread running ``_work`` until ``stop``; what it raised is raised by ``stop``."""

    name = "worker"

    def __init__(self, servers: Sequence[str], index: int) -> None:
        self.servers = list(servers)
        self.index = index
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-{index}")
        self._thread.daemon = True

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=GIVE_UP_AFTER + 2 * TRY_SECONDS)
        if self._thread.is_alive():
            raise RuntimeError(f"{self._thread.name} did not stop")
        if self._error is not None:
            raise self._error

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as error:
            self._error = error

    @abc.abstractmethod
    def _work(self) -> None:
        """What the thread does, until ``stopping``."""

    def _server(self, turn: int) -> str:
        return self.servers[turn % len(self.servers)]


class _KeyedProducer(_Worker):
    """A producer of its own ``KEYS`` keys (named after ``name``'s initial and its index) to
    ``topic``, a produce every ``pace`` seconds, each recorded in ``history``."""

    def __init__(
        self, servers: Sequence[str], index: int, topic: str, history: History, pace: float
    ) -> None:
        super().__init__(servers, index)
        self.topic = topic
        self.history = history
        self.pace = pace
        self.keys = [b"%s%d-k%d" % (self.name[:1].encode(), index, n) for n in range(KEYS)]


class PlainProducer(_KeyedProducer):
    name = "producer"

    def _connect(self, turn: int) -> tuple[BlockingClient | None, int]:
        while not self.stopping:
            try:
                return connect(self._server(turn)), turn
            except (*_LOST, BrokerRefused):
                turn += 1
                self._stopping.wait(0.1)
        return None, turn

    def _work(self) -> None:
        client, turn = self._connect(self.index)
        for count in itertools.count():
            if client is None or self.stopping:
                break
            key = self.keys[count % len(self.keys)]
            sequence, value = self.history.next_value(key)
            started = time.monotonic()
            failure = None
            try:
                client.produce(self.topic, [Record(value, key=key)], give_up_after=GIVE_UP_AFTER)
            except BrokerRefused as refused:
                failure = refused.reason
            except _LOST as error:
                failure = _lost_reason(error)
                client.close()
                client, turn = self._connect(turn + 1)
            self.history.record(key, value, sequence, started, time.monotonic(), failure)
            self._stopping.wait(self.pace)
        if client is not None:
            client.close()


class DirectProducer(_Worker):
    """Produces ``keys`` in turn through one node only, one record a produce, each given up
    after ``give_up_after``: the clients of one node, while a drill isolates it. Connects in
    ``connect``, or in ``start`` if not yet (a client logging in may need the node's peers), so
    that a drill can connect before a cut and begin producing during it; stops at its first
    lost connection."""

    name = "direct"

    def __init__(
        self,
        server: str,
        topic: str,
        keys: Sequence[bytes],
        history: History,
        give_up_after: float,
    ) -> None:
        super().__init__([server], 0)
        self.topic = topic
        self.keys = list(keys)
        self.history = history
        self.give_up_after = give_up_after
        self._client: BlockingClient | None = None

    def connect(self) -> None:
        self._client = connect(self.servers[0])

    def start(self) -> None:
        if self._client is None:
            self.connect()
        super().start()

    def _work(self) -> None:
        assert self._client is not None
        with self._client as client:
            for count in itertools.count():
                if self.stopping:
                    return
                key = self.keys[count % len(self.keys)]
                sequence, value = self.history.next_value(key)
                started = time.monotonic()
                failure = None
                lost = False
                try:
                    records = [Record(value, key=key)]
                    client.produce(self.topic, records, give_up_after=self.give_up_after)
                except BrokerRefused as refused:
                    failure = refused.reason
                except _LOST as error:
                    failure, lost = _lost_reason(error), True
                self.history.record(key, value, sequence, started, time.monotonic(), failure)
                if lost:
                    return


class StampedProducer(_KeyedProducer):
    name = "stamped"

    def __init__(
        self, servers: Sequence[str], index: int, topic: str, history: History, pace: float
    ) -> None:
        super().__init__(servers, index, topic, history, pace)
        self.producer_id = 0x5EED_0000_0000_0000 + index
        #: Retries through another node, by what made the try before fail.
        self.retried_after: collections.Counter[str] = collections.Counter()
        self._clients: dict[int, BlockingClient] = {}

    def _work(self) -> None:
        turn = self.index
        try:
            for sequence in itertools.count():
                if self.stopping:
                    return
                key = self.keys[sequence % len(self.keys)]
                number, value = self.history.next_value(key)
                request = wire.ProduceIdempotent(
                    self.topic, ProducerStamp(self.producer_id, sequence), (Record(value, key=key),)
                )
                started = time.monotonic()
                failure: str | None = "gave_up"
                while time.monotonic() - started < GIVE_UP_AFTER:
                    why = self._try(turn, request)
                    if why is None:
                        failure = None
                        break
                    self.retried_after[why] += 1
                    turn += 1
                    time.sleep(0.05)
                self.history.record(key, value, number, started, time.monotonic(), failure)
                self._stopping.wait(self.pace)
        finally:
            for client in self._clients.values():
                client.close()

    def _try(self, turn: int, request: wire.Request) -> str | None:
        """One try through the node of ``turn``: None when acknowledged, else why not."""
        slot = turn % len(self.servers)
        try:
            client = self._clients.get(slot)
            if client is None:
                client = self._clients[slot] = connect(self.servers[slot])
            wire.decode_count(client.call(request))
            return None
        except BrokerRefused as refused:
            return refused.reason
        except _LOST as error:
            dropped = self._clients.pop(slot, None)
            if dropped is not None:
                dropped.close()
            return _lost_reason(error)


class Follower(_Worker):
    """Reads the topic as it grows, from one cursor, through whichever node answers."""

    name = "follower"
    #: The follower moves to the next node this often even when nothing fails, so that its
    #: cursor crosses nodes through every fault.
    MOVE_EVERY = 2.0

    def __init__(self, servers: Sequence[str], index: int, topic: str) -> None:
        super().__init__(servers, index)
        self.topic = topic
        self.read: list[tuple[bytes | None, bytes]] = []
        #: Failed fetches by reason, and how often the follower moved to another node.
        self.failures: collections.Counter[str] = collections.Counter()
        self.moves = 0
        #: What the follower was told when refused its own cursor (``invalid_cursor``, which a
        #: consumer fetching from the cursors the broker gave it must never meet), and where.
        self.cursor_refusals: list[str] = []

    def _work(self) -> None:
        turn = self.index
        cursor: str | None = None
        client: BlockingClient | None = None
        moved = time.monotonic()
        while not self.stopping:
            if client is not None and time.monotonic() - moved > self.MOVE_EVERY:
                client.close()
                client = None
                turn += 1
                self.moves += 1
            try:
                if client is None:
                    client = connect(self._server(turn))
                    moved = time.monotonic()
                batch = client.fetch(self.topic, cursor, None, None, 500, 200)
            except (*_LOST, BrokerRefused) as error:
                reason = error.reason if isinstance(error, BrokerRefused) else _lost_reason(error)
                self.failures[reason] += 1
                if reason == Reason.INVALID_CURSOR:
                    at = time.strftime("%H:%M:%S")
                    self.cursor_refusals.append(f"at {at} through {self._server(turn)}")
                if client is not None:
                    client.close()
                    client = None
                turn += 1
                self.moves += 1
                self._stopping.wait(0.1)
                continue
            self.read.extend((record.key, record.value) for record in batch.records)
            if batch.next_cursor is not None:
                cursor = batch.next_cursor
        if client is not None:
            client.close()

    def problems(self, final: Sequence[tuple[bytes | None, bytes]]) -> list[str]:
        """What breaks guarantee 1 in what the follower read (``follower_problems``) and in
        how it was refused."""
        return follower_problems(self.read, final) + [
            f"a node refused the follower its own cursor (invalid_cursor) {refusal}"
            for refusal in self.cursor_refusals
        ]


def read_back(server: str, topic: str, seconds: float = 60) -> list[tuple[bytes | None, bytes]]:
    """Every record of ``topic``, ``(key, value)`` in the order read through ``server`` from
    the start; read again from the start while a range settles (a refusal for a moment)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with connect(server) as client:
                read: list[tuple[bytes | None, bytes]] = []
                cursor = None
                while True:
                    batch = client.fetch(topic, cursor, None, None, 1000, 0)
                    if not batch.records:
                        return read
                    read.extend((record.key, record.value) for record in batch.records)
                    cursor = batch.next_cursor
        except (*_LOST, BrokerRefused):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def follower_problems(
    followed: Sequence[tuple[bytes | None, bytes]], final: Sequence[tuple[bytes | None, bytes]]
) -> list[str]:
    """What the follower read that breaks the final log: per key, what it read must be the
    final log's first records of that key, in order (nothing absent from the final log,
    nothing skipped, nothing twice)."""
    wanted: dict[bytes | None, list[bytes]] = collections.defaultdict(list)
    for key, value in final:
        wanted[key].append(value)
    seen: dict[bytes | None, list[bytes]] = collections.defaultdict(list)
    for key, value in followed:
        seen[key].append(value)
    problems = []
    for key, values in seen.items():
        expected = wanted.get(key, [])[: len(values)]
        if values == expected:
            continue
        at = next(
            (i for i, (a, b) in enumerate(zip(values, expected, strict=False)) if a != b),
            len(expected),
        )
        got = values[at].decode(errors="replace")
        instead = expected[at].decode(errors="replace") if at < len(expected) else "nothing"
        problems.append(
            f"the follower's record {at} of key {_name(key)} was {got}, the final log has"
            f" {instead} there"
        )
    return problems


def _name(key: bytes | None) -> str:
    return "(none)" if key is None else key.decode(errors="replace")


def _lost_reason(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, ConnectionRefusedError):
        return "connection_refused"
    return "connection_lost"
