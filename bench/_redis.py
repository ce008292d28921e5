"""A minimal Redis client for the benchmarks: RESP encoding, an incremental reply parser, and a
Twisted load connection that sends pipelined ``XADD`` requests.

Only what ``produce_vs_redis.py`` needs, so the project takes no Redis client as a dependency.
``encode_command`` and ``ReplyParser`` are pure functions of bytes (unit-tested in
``tests/unit/test_bench_resp.py``); ``RedisLoadConnection`` speaks to a real server.

A request of the load generator is ``batch`` ``XADD`` commands written together on one
connection (one ``transport.write``, prepared once by ``xadd_pipeline``); it is answered when all
``batch`` replies have arrived. Redis answers the commands of one connection in order, so the
replies are matched to requests by counting.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from typing import Any, TypeAlias

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTCP
from twisted.internet.protocol import ClientFactory, Protocol, connectionDone
from twisted.python.failure import Failure

_CRLF = b"\r\n"
_STREAM_ID = re.compile(rb"[0-9]+-[0-9]+")


class ReplyError:
    """An error reply (``-ERR ...``): a value the parser returns, not an exception it raises."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReplyError) and other.message == self.message

    def __hash__(self) -> int:
        return hash(self.message)

    def __repr__(self) -> str:
        return f"ReplyError({self.message!r})"


#: A parsed reply: simple and bulk strings as bytes, integers as int, a null bulk string or null
#: array as None, an error as ``ReplyError``, an array as a list of replies.
Reply: TypeAlias = bytes | int | ReplyError | list["Reply"] | None


class ProtocolError(ValueError):
    """The bytes received are not RESP."""


def encode_command(*arguments: bytes | str | int) -> bytes:
    """One command as a RESP array of bulk strings (how clients send every command)."""
    parts = [b"*%d\r\n" % len(arguments)]
    for argument in arguments:
        if isinstance(argument, str):
            data = argument.encode()
        elif isinstance(argument, int):
            data = b"%d" % argument
        else:
            data = bytes(argument)
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def xadd_pipeline(stream: bytes | str, value: bytes, batch: int, keys: int = 0) -> bytes:
    """``batch`` ``XADD stream * v value`` commands, back to back, for one write; with ``keys``,
    each entry carries its record's key too (``k key-<i mod keys> v value``), as logbroker's
    keyed load does."""
    if not keys:
        return encode_command(b"XADD", stream, b"*", b"v", value) * batch
    return b"".join(
        encode_command(b"XADD", stream, b"*", b"k", f"key-{index % keys}", b"v", value)
        for index in range(batch)
    )


def is_stream_id(reply: Reply) -> bool:
    """Whether ``reply`` is what a successful ``XADD`` returns: an id like ``1700000000000-0``."""
    return isinstance(reply, bytes) and _STREAM_ID.fullmatch(reply) is not None


class ReplyParser:
    """Turns the byte stream from a Redis server into replies, whatever the chunking.

    ``feed`` returns the replies completed by ``data``, in order; an incomplete reply stays
    buffered until the bytes that complete it arrive. Raises ``ProtocolError`` on bytes that
    are not RESP (the stream cannot be resynchronised after that).
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received that do not complete a reply yet."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Reply]:
        self._buffer += data
        replies: list[Reply] = []
        position = 0
        while position < len(self._buffer):
            parsed = self._parse(position)
            if parsed is None:
                break
            reply, position = parsed
            replies.append(reply)
        del self._buffer[:position]
        return replies

    def _parse(self, position: int) -> tuple[Reply, int] | None:
        """The reply starting at ``position`` and the position after it, or None when the
        buffer does not hold all of it yet."""
        buffer = self._buffer
        line_end = buffer.find(_CRLF, position)
        if line_end < 0:
            return None
        kind = buffer[position]
        line = bytes(buffer[position + 1 : line_end])
        after = line_end + 2
        if kind == 0x24:  # $ bulk string
            size = _integer(line)
            if size == -1:
                return None, after
            if size < 0:
                raise ProtocolError(f"bad bulk string length {size}")
            end = after + size
            if len(buffer) < end + 2:
                return None
            if buffer[end : end + 2] != _CRLF:
                raise ProtocolError("bulk string not followed by CRLF")
            return bytes(buffer[after:end]), end + 2
        if kind == 0x2B:  # + simple string
            return line, after
        if kind == 0x2D:  # - error
            return ReplyError(line.decode("utf-8", "replace")), after
        if kind == 0x3A:  # : integer
            return _integer(line), after
        if kind == 0x2A:  # * array
            count = _integer(line)
            if count == -1:
                return None, after
            if count < 0:
                raise ProtocolError(f"bad array length {count}")
            items: list[Reply] = []
            for _ in range(count):
                parsed = self._parse(after)
                if parsed is None:
                    return None
                item, after = parsed
                items.append(item)
            return items, after
        raise ProtocolError(f"unknown reply type {chr(kind)!r}")


def _integer(line: bytes) -> int:
    try:
        return int(line)
    except ValueError:
        raise ProtocolError(f"not an integer: {line!r}") from None


class Outcome:
    """What a request came to, in the shape ``logbroker.benchmark``'s driver reads from a
    response: ``reason`` is None when every reply was a stream id, else the first bad reply."""

    __slots__ = ("reason",)

    def __init__(self, reason: str | None) -> None:
        self.reason = reason


_OK = Outcome(None)


class RedisLoadConnection(Protocol):
    """Sends prepared pipelines of ``commands_per_request`` XADDs; matches replies by count.

    It has the ``send(frame, due, answered)`` method of ``logbroker.benchmark``'s load
    connections, so the same closed-loop driver (and the same latency accounting, from when
    each request was due) runs the Redis load.
    """

    def __init__(self, commands_per_request: int, ready: Deferred[RedisLoadConnection]) -> None:
        self._per_request = commands_per_request
        self._ready = ready
        self._parser = ReplyParser()
        #: Requests in the order sent: [due, answered, replies still expected, first bad reply]
        self._outstanding: deque[list[Any]] = deque()
        self.lost: Failure | None = None

    def connectionMade(self) -> None:
        self._ready.callback(self)

    def send(self, frame: bytes, due: float, answered: Callable[[Outcome, float], None]) -> None:
        self._outstanding.append([due, answered, self._per_request, None])
        self.transport.write(frame)  # type: ignore[union-attr]

    def dataReceived(self, data: bytes) -> None:
        outstanding = self._outstanding
        for reply in self._parser.feed(data):
            head = outstanding[0]
            if head[3] is None and not is_stream_id(reply):
                head[3] = repr(reply)
            head[2] -= 1
            if head[2] == 0:
                outstanding.popleft()
                head[1](_OK if head[3] is None else Outcome(head[3]), head[0])

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.lost = reason
        if not self._ready.called:
            self._ready.errback(reason)


class _Factory(ClientFactory):
    def __init__(self, commands_per_request: int) -> None:
        self._per_request = commands_per_request
        self.ready: Deferred[RedisLoadConnection] = Deferred()

    def buildProtocol(self, addr: Any) -> RedisLoadConnection:
        return RedisLoadConnection(self._per_request, self.ready)

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self.ready.errback(reason)


def connect(
    reactor: IReactorTCP, host: str, port: int, commands_per_request: int
) -> Deferred[RedisLoadConnection]:
    factory = _Factory(commands_per_request)
    reactor.connectTCP(host, port, factory)
    return factory.ready
