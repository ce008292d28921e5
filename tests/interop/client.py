"""Standalone client for the logbroker wire protocol v1, written from DESIGN.md section 4 only.

Standard library only (socket, struct).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

# api keys
AUTH = 0
CREATE_TOPIC = 1
PRODUCE = 2
FETCH = 3
COMMIT = 4
SUBSCRIBE = 5
STREAM_ACK = 6
LEAVE_GROUP = 7
CREATE_USER = 8
DELETE_USER = 9
CHANGE_PASSWORD = 10
LIST_USERS = 11
GRANT_ACL = 14
REVOKE_ACL = 15
LIST_ACLS = 16

MAX_FRAME = 16 * 1024 * 1024


class ProtocolError(Exception):
    pass


class Closed(ProtocolError):
    """The peer closed the connection."""


class BrokerError(Exception):
    """An error response (error_code != 0)."""

    def __init__(self, reason: bytes | None, correlation_id: int, error_code: int):
        self.reason = reason.decode("utf-8", "replace") if reason is not None else None
        self.raw_reason = reason
        self.correlation_id = correlation_id
        self.error_code = error_code
        super().__init__(f"{self.reason} (corr={correlation_id}, code={error_code})")


# ---------------------------------------------------------------- encoding


def enc_u8(v: int) -> bytes:
    return struct.pack(">B", v)


def enc_u16(v: int) -> bytes:
    return struct.pack(">H", v)


def enc_u32(v: int) -> bytes:
    return struct.pack(">I", v)


def enc_u64(v: int) -> bytes:
    return struct.pack(">Q", v)


def _b(v: str | bytes | None) -> bytes | None:
    if v is None:
        return None
    if isinstance(v, str):
        return v.encode("utf-8")
    return bytes(v)


def enc_str(v: str | bytes | None) -> bytes:
    b = _b(v)
    if b is None:
        return b"\x00"
    return b"\x01" + enc_u32(len(b)) + b


def enc_perms(perms: list[str | bytes | None]) -> bytes:
    return enc_u32(len(perms)) + b"".join(enc_str(p) for p in perms)


@dataclass(frozen=True)
class Record:
    key: bytes | None
    value: bytes
    timestamp_ms: int = 0
    headers: tuple[tuple[bytes | None, bytes | None], ...] = field(default_factory=tuple)


def enc_record(r: Record) -> bytes:
    out = [enc_str(r.key), enc_u32(len(r.value)), r.value, enc_u64(r.timestamp_ms), enc_u32(len(r.headers))]
    for k, v in r.headers:
        out.append(enc_str(k))
        out.append(enc_str(v))
    return b"".join(out)


def frame(body: bytes) -> bytes:
    return enc_u32(len(body)) + body


def request_body(api_key: int, corr: int, payload: bytes) -> bytes:
    return enc_u16(api_key) + enc_u32(corr) + payload


# ---------------------------------------------------------------- decoding


class Reader:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ProtocolError(f"short payload: need {n} at {self.pos}, have {len(self.data)}")
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return struct.unpack(">H", self.take(2))[0]

    def u32(self) -> int:
        return struct.unpack(">I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack(">Q", self.take(8))[0]

    def str(self) -> bytes | None:
        tag = self.u8()
        if tag == 0:
            return None
        if tag == 1:
            n = self.u32()
            return self.take(n)
        raise ProtocolError(f"bad str tag {tag:#x} at {self.pos - 1}")

    def perms(self) -> list[bytes | None]:
        return [self.str() for _ in range(self.u32())]

    def record(self) -> Record:
        key = self.str()
        value = self.take(self.u32())
        ts = self.u64()
        hdrs = tuple((self.str(), self.str()) for _ in range(self.u32()))
        return Record(key, value, ts, hdrs)

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"trailing bytes: {len(self.data) - self.pos}")


@dataclass
class Response:
    correlation_id: int
    error_code: int
    payload: bytes

    def reason(self) -> str | None:
        r = Reader(self.payload).str()
        return r.decode("utf-8", "replace") if r is not None else None


@dataclass
class FetchResult:
    records: list[Record]
    next_cursor: bytes | None


def parse_fetch(payload: bytes) -> FetchResult:
    r = Reader(payload)
    n = r.u32()
    recs = [r.record() for _ in range(n)]
    cur = r.str()
    r.end()
    return FetchResult(recs, cur)


# ---------------------------------------------------------------- connection


class Connection:
    def __init__(self, host: str = "127.0.0.1", port: int = 4040, timeout: float = 10.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""
        self._next_corr = 1
        self.pending: dict[int, list[Response]] = {}  # out-of-order arrivals

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *a: object) -> None:
        self.close()

    def settimeout(self, t: float | None) -> None:
        self.sock.settimeout(t)

    # raw I/O
    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _recv_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise Closed(f"connection closed with {len(self._buf)} buffered bytes")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def read_frame(self) -> bytes:
        (n,) = struct.unpack(">I", self._recv_exact(4))
        return self._recv_exact(n)

    def read_response(self) -> Response:
        body = self.read_frame()
        if len(body) < 6:
            raise ProtocolError(f"response too short: {body!r}")
        corr, code = struct.unpack(">IH", body[:6])
        return Response(corr, code, body[6:])

    def next_corr(self) -> int:
        c = self._next_corr
        self._next_corr += 1
        return c

    def send_request(self, api_key: int, payload: bytes, corr: int | None = None) -> int:
        if corr is None:
            corr = self.next_corr()
        self.send_raw(frame(request_body(api_key, corr, payload)))
        return corr

    def wait_for(self, corr: int) -> Response:
        q = self.pending.get(corr)
        if q:
            r = q.pop(0)
            return r
        while True:
            r = self.read_response()
            if r.correlation_id == corr:
                return r
            self.pending.setdefault(r.correlation_id, []).append(r)

    def call(self, api_key: int, payload: bytes) -> bytes:
        corr = self.send_request(api_key, payload)
        r = self.wait_for(corr)
        if r.error_code != 0:
            raise BrokerError(Reader(r.payload).str(), r.correlation_id, r.error_code)
        return r.payload

    # operations
    def auth(self, user: str, password: str) -> bytes | None:
        r = Reader(self.call(AUTH, enc_str(user) + enc_str(password)))
        tok = r.str()
        r.end()
        return tok

    def create_topic(self, topic: str, keyspace_bits: int = 0) -> None:
        p = self.call(CREATE_TOPIC, enc_str(topic) + enc_u8(keyspace_bits))
        Reader(p).end()

    def produce(self, topic: str, records: list[Record]) -> int:
        p = self.call(PRODUCE, encode_produce(topic, records))
        r = Reader(p)
        n = r.u32()
        r.end()
        return n

    def fetch(
        self,
        topic: str,
        cursor: bytes | str | None = None,
        group: str | None = None,
        member: str | None = None,
        max: int = 0,
        wait_ms: int = 0,
    ) -> FetchResult:
        payload = (
            enc_str(topic) + enc_str(cursor) + enc_str(group) + enc_str(member) + enc_u32(max) + enc_u32(wait_ms)
        )
        return parse_fetch(self.call(FETCH, payload))

    def commit(self, topic: str, group: str, cursor: bytes | str | None) -> None:
        Reader(self.call(COMMIT, enc_str(topic) + enc_str(group) + enc_str(cursor))).end()

    def subscribe(self, topic: str, group: str, member: str, window: int, max: int) -> int:
        """Send subscribe; returns the correlation id pushes will carry. No direct reply."""
        payload = enc_str(topic) + enc_str(group) + enc_str(member) + enc_u32(window) + enc_u32(max)
        return self.send_request(SUBSCRIBE, payload)

    def read_push(self, corr: int) -> FetchResult:
        r = self.wait_for(corr)
        if r.error_code != 0:
            raise BrokerError(Reader(r.payload).str(), r.correlation_id, r.error_code)
        return parse_fetch(r.payload)

    def stream_ack(self, topic: str, group: str, member: str, cursor: bytes | None, count: int) -> int:
        """No reply is defined; returns the correlation id used."""
        payload = enc_str(topic) + enc_str(group) + enc_str(member) + enc_str(cursor) + enc_u32(count)
        return self.send_request(STREAM_ACK, payload)

    def leave_group(self, topic: str, group: str, member: str) -> None:
        Reader(self.call(LEAVE_GROUP, enc_str(topic) + enc_str(group) + enc_str(member))).end()

    def create_user(self, user: str, password: str, perms: list[str]) -> None:
        Reader(self.call(CREATE_USER, enc_str(user) + enc_str(password) + enc_perms(perms))).end()

    def delete_user(self, user: str) -> None:
        Reader(self.call(DELETE_USER, enc_str(user))).end()

    def change_password(self, user: str, new_pass: str) -> None:
        Reader(self.call(CHANGE_PASSWORD, enc_str(user) + enc_str(new_pass))).end()

    def list_users(self) -> list[tuple[bytes | None, list[bytes | None]]]:
        r = Reader(self.call(LIST_USERS, b""))
        out = [(r.str(), r.perms()) for _ in range(r.u32())]
        r.end()
        return out

    def grant_acl(self, user: str, op: str, pattern: str) -> None:
        Reader(self.call(GRANT_ACL, enc_str(user) + enc_str(op) + enc_str(pattern))).end()

    def revoke_acl(self, user: str, op: str, pattern: str) -> None:
        Reader(self.call(REVOKE_ACL, enc_str(user) + enc_str(op) + enc_str(pattern))).end()

    def list_acls(self, user: str) -> list[tuple[bytes | None, bytes | None]]:
        r = Reader(self.call(LIST_ACLS, enc_str(user)))
        out = [(r.str(), r.str()) for _ in range(r.u32())]
        r.end()
        return out


def encode_produce(topic: str, records: list[Record]) -> bytes:
    return enc_str(topic) + enc_u32(len(records)) + b"".join(enc_record(r) for r in records)
