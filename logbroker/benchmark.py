"""Load generation for ``logbroker bench produce|consume`` (and the peer comparisons in bench/).

Produce: ``connections`` TCP connections each keep ``in_flight`` produce requests of ``batch``
records of ``size`` bytes outstanding for ``seconds``. A request's latency runs from the moment
it was due, not from when it was written: in the closed loop a request is due the moment the
slot it takes was freed by the previous response, and with ``rate`` (requests per second, open
loop) it is due at its place on a fixed schedule, however late the generator gets to send it.
Measuring from the due time keeps the generator's own stalls in the figures instead of hiding
them (coordinated omission). Only acknowledged records count; requests answered with an error
are counted apart.

Consume: one consumer fetches a topic from the start, ``max`` 1000 records per fetch, until it
has read everything that was there when it started, and reports records/s and MB/s.

The request frames are encoded once and reused with fresh correlation ids, so the generator
spends its time on the network, not on encoding. That is why the connections here are a bare
framing layer rather than ``logbroker.client`` (which encodes every request): their
``send(frame, due, answered)`` has the shape of ``bench/_redis.py``'s connections, so one driver
loads both systems in the same way.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator, IReactorTime
from twisted.internet.protocol import ClientFactory, Protocol, connectionDone
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from logbroker import wire
from logbroker._tcp import no_delay
from logbroker.records import Record

_CORRELATION = struct.Struct(">I")
#: Byte offset of the correlation id in a request frame: length (4) and API key (2) first.
_CORRELATION_AT = 6


#: The distinct keys of the standard load's records.
DEFAULT_KEYS = 64


@attrs.frozen
class ProduceLoad:
    topic: str
    connections: int = 4
    in_flight: int = 8
    batch: int = 100
    size: int = 100
    seconds: float = 10.0
    #: Requests per second over all connections (open loop); ``None`` for a closed loop.
    rate: float | None = None
    #: How many distinct keys the records take, in turn (``key-0``, ``key-1``...: record ``i`` of
    #: a request takes ``key-<i mod keys>``, and connection ``c``'s records go on from where
    #: connection ``c - 1``'s stop, ``produce_frames``), spread over the keyspace as users' keys
    #: are; 0: keyless records. Keyed by default, as users produce.
    keys: int = attrs.field(default=DEFAULT_KEYS, validator=attrs.validators.ge(0))


@attrs.frozen
class ProduceReport:
    records: int
    requests: int
    errors: int
    seconds: float
    record_bytes: int
    latencies_ms: tuple[float, ...]

    @property
    def records_per_second(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    @property
    def megabytes_per_second(self) -> float:
        return self.records * self.record_bytes / self.seconds / 1e6 if self.seconds else 0.0

    def percentile(self, percent: float) -> float:
        """The latency (ms) at ``percent`` (nearest rank); NaN with no samples."""
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        rank = max(1, round(percent / 100 * len(ordered)))
        return ordered[min(rank, len(ordered)) - 1]


def produce_frame(load: ProduceLoad, first_key: int = 0) -> bytes:
    """One produce request frame (correlation id 0, patched per send), its records taking
    the keys in turn from ``key-<first_key mod keys>``."""
    payload = os.urandom(load.size)
    records = tuple(
        Record(
            payload, key=f"key-{(first_key + index) % load.keys}".encode() if load.keys else None
        )
        for index in range(load.batch)
    )
    return wire.encode_request(0, wire.Produce(load.topic, records))


def produce_frames(load: ProduceLoad) -> list[bytes]:
    """One frame for each of the load's connections, each connection's keys going on from the
    previous one's: with one record a request, 32 connections send 32 different keys, as 32
    producers each writing its own would, where one frame for all would send every record with
    the same key, to one range. A request of at least ``keys`` records carries every key."""
    return [produce_frame(load, number * load.batch) for number in range(load.connections)]


class _LoadConnection(Protocol):
    """Authenticates, then keeps sending the prepared frame as the driver says."""

    def __init__(self, user: str, password: str, ready: Deferred[_LoadConnection]) -> None:
        self._auth = wire.encode_request(0, wire.Auth(user, password))
        self._ready = ready
        self._decoder = wire.FrameDecoder(1 << 30)
        self._authenticated = False
        self._next_id = 1
        #: correlation id -> (due time, answered callback)
        self.outstanding: dict[int, tuple[float, Callable[[wire.Response, float], None]]] = {}
        self.lost: Failure | None = None

    def connectionMade(self) -> None:
        no_delay(self.transport)
        self.transport.write(self._auth)  # type: ignore[union-attr]

    def send(
        self, frame: bytes, due: float, answered: Callable[[wire.Response, float], None]
    ) -> None:
        correlation_id = self._next_id
        self._next_id += 1
        self.outstanding[correlation_id] = (due, answered)
        data = bytearray(frame)
        _CORRELATION.pack_into(data, _CORRELATION_AT, correlation_id)
        self.transport.write(bytes(data))  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        for body in self._decoder.feed(data):
            response = wire.decode_response(body)
            if not self._authenticated:
                self._authenticated = True
                if response.reason is not None:
                    self._ready.errback(ConnectionError(f"auth: {response.reason}"))
                else:
                    self._ready.callback(self)
                continue
            due, answered = self.outstanding.pop(response.correlation_id)
            answered(response, due)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost = reason
        if not self._ready.called:
            self._ready.errback(reason)


class _Factory(ClientFactory):
    def __init__(self, user: str, password: str) -> None:
        self._user = user
        self._password = password
        self.ready: Deferred[_LoadConnection] = Deferred()

    def buildProtocol(self, addr: Any) -> _LoadConnection:
        return _LoadConnection(self._user, self._password, self.ready)

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self.ready.errback(reason)


def connect(
    reactor: Any,
    host: str,
    port: int,
    user: str,
    password: str,
    tls: IOpenSSLClientConnectionCreator | None = None,
) -> Deferred[_LoadConnection]:
    """One load connection, over TLS with ``tls`` (``logbroker.client.client_tls_options``)."""
    factory = _Factory(user, password)
    if tls is None:
        reactor.connectTCP(host, port, factory)
    else:
        reactor.connectSSL(host, port, factory, tls)
    return factory.ready


#: Called about once a second while a produce load runs: seconds elapsed, records acknowledged.
Progress = Callable[[float, int], None]


async def run_produce(
    reactor: Any,
    host: str,
    port: int,
    user: str,
    password: str,
    load: ProduceLoad,
    progress: Progress | None = None,
    tls: IOpenSSLClientConnectionCreator | None = None,
) -> ProduceReport:
    """Drive ``load`` against the broker at ``host:port``; the topic must exist."""
    connections = [
        await connect(reactor, host, port, user, password, tls) for _ in range(load.connections)
    ]
    driver = _ProduceDriver(reactor, connections, produce_frames(load), load)
    ticker = None
    if progress is not None:
        ticker = LoopingCall(lambda: progress(driver.elapsed, driver.records))
        ticker.clock = reactor
        ticker.start(1.0, now=False)
    try:
        return await driver.run()
    finally:
        if ticker is not None:
            ticker.stop()


class _ProduceDriver:
    def __init__(
        self,
        clock: IReactorTime,
        connections: list[_LoadConnection],
        frames: bytes | Sequence[bytes],
        load: ProduceLoad,
    ) -> None:
        """``frames``: the request each connection sends, in their order, or one for all."""
        self._clock = clock
        self._connections = connections
        if isinstance(frames, bytes):
            frames = [frames] * len(connections)
        if len(frames) != len(connections):
            raise ValueError(f"{len(frames)} frames for {len(connections)} connections")
        #: Each connection with the frame it sends.
        self._senders = list(zip(connections, frames, strict=True))
        self._load = load
        self._records = 0
        self._requests = 0
        self._errors = 0
        self._latencies: list[float] = []
        self._end = 0.0
        self._done: Deferred[ProduceReport] = Deferred()
        self._started = 0.0
        self._outstanding = 0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    @property
    def records(self) -> int:
        return self._records

    def run(self) -> Deferred[ProduceReport]:
        self._started = time.perf_counter()
        self._end = self._started + self._load.seconds
        if self._load.rate is None:
            for connection, frame in self._senders:
                for _ in range(self._load.in_flight):
                    self._send(connection, frame, time.perf_counter())
        else:
            self._schedule(0)
        return self._done

    def _send(self, connection: _LoadConnection, frame: bytes, due: float) -> None:
        self._outstanding += 1
        connection.send(
            frame, due, lambda response, due: self._answered(connection, frame, response, due)
        )

    def _schedule(self, index: int) -> None:
        assert self._load.rate is not None
        due = self._started + index / self._load.rate
        now = time.perf_counter()
        if due >= self._end:
            self._maybe_finish()
            return
        if due > now:
            self._clock.callLater(due - now, self._schedule, index)
            return
        connection, frame = self._senders[index % len(self._senders)]
        self._send(connection, frame, due)
        self._schedule(index + 1)

    def _answered(
        self, connection: _LoadConnection, frame: bytes, response: wire.Response, due: float
    ) -> None:
        now = time.perf_counter()
        self._outstanding -= 1
        if now <= self._end:
            self._requests += 1
            if response.reason is None:
                self._records += self._load.batch
                self._latencies.append((now - due) * 1000)
            else:
                self._errors += 1
        if self._load.rate is None and now < self._end:
            # The slot is free now: the next request is due now, whenever it gets written.
            self._send(connection, frame, now)
        else:
            self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self._outstanding or self._done.called:
            return
        for connection in self._connections:
            connection.transport.loseConnection()  # type: ignore[union-attr]
        self._done.callback(
            ProduceReport(
                self._records,
                self._requests,
                self._errors,
                self._load.seconds,
                self._load.size,
                tuple(self._latencies),
            )
        )


@attrs.frozen
class ConsumeReport:
    records: int
    value_bytes: int
    seconds: float

    @property
    def records_per_second(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    @property
    def megabytes_per_second(self) -> float:
        return self.value_bytes / self.seconds / 1e6 if self.seconds else 0.0


def _call(connection: _LoadConnection, frame: bytes) -> Deferred[wire.Response]:
    answered: Deferred[wire.Response] = Deferred()
    connection.send(frame, 0.0, lambda response, _: answered.callback(response))
    return answered


async def run_consume(
    reactor: Any,
    host: str,
    port: int,
    user: str,
    password: str,
    topic: str,
    tls: IOpenSSLClientConnectionCreator | None = None,
) -> ConsumeReport:
    """Read ``topic`` from the start until a fetch comes back empty."""
    connection = await connect(reactor, host, port, user, password, tls)
    records = value_bytes = 0
    cursor: str | None = None
    started = time.perf_counter()
    try:
        while True:
            frame = wire.encode_request(0, wire.Fetch(topic, cursor, None, None, 1000, 0))
            response = await _call(connection, frame)
            if response.reason is not None:
                raise ConnectionError(f"fetch refused: {response.reason}")
            batch = wire.decode_records(response.payload)
            if not batch.records:
                break
            records += len(batch.records)
            value_bytes += sum(len(record.value) for record in batch.records)
            cursor = batch.next_cursor
    finally:
        connection.transport.loseConnection()  # type: ignore[union-attr]
    return ConsumeReport(records, value_bytes, time.perf_counter() - started)
