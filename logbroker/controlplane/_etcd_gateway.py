"""``KeyValueStore`` over etcd 3.4's v3 JSON gateway (gRPC-gateway), with treq.

Every request is a ``POST`` of a JSON body to ``/v3/...`` on one member. The gateway's JSON is
protobuf's: keys and values are base64, 64-bit integers are strings, and fields at their default
value are left out (a failed transaction has no ``succeeded``, a put event no ``type``, a lease
that is gone a keepalive ``TTL`` of nothing). Streaming calls (watch) answer one JSON object per
line, each ``{"result": ...}`` or ``{"error": ...}``.

Every member is used: requests go to the member that last answered; one that fails is skipped
(marked down) and the next is tried; a member marked down is tried after the healthy ones, so
it comes back into use once it answers again. A request is sent to another member only when its
outcome is known: when the connection could not be made, or when etcd answered that it could not
serve it (no leader). A transaction that reached a member and got no answer (a timeout, a lost
connection) may have been applied: it fails with ``OutcomeUnknownError`` rather than being sent
again. Reads, watches and lease calls are safe to repeat and go to the next member.

A watch that the member ends, or loses its leader during (``hasleader`` metadata), ends with
``on_lost``; the caller resumes it from the next revision, which goes to a live member.

Each request is reported once to ``on_request(op, result, seconds)``, timed on the reactor's clock
from the call to its outcome (failing over to other members included). ``op`` is ``range`` (each
page of a read), ``txn`` (puts too), ``watch`` (setting it up: until the member answers, not the
watch's lifetime), ``grant``, ``keepalive`` or ``revoke``; deletes and compactions, which only
operators' chores and tests make, are not reported. ``result`` is ``ok`` for any answer
(a transaction whose compare failed included), ``error`` when etcd answered and refused, and
``unavailable`` without an answer: no member reachable, a timeout, an unknown outcome, or a
request its caller cancelled.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from treq import content
from treq._types import _ITreqReactor
from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.error import ConnectError, ConnectingCancelledError, DNSLookupError
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.client import Agent, HTTPConnectionPool
from twisted.web.http_headers import Headers
from twisted.web.iweb import IResponse

from logbroker.controlplane._kv import (
    Compare,
    Delete,
    DeletePrefix,
    EventType,
    Get,
    KeyValue,
    OnEvents,
    OnLost,
    Operation,
    Put,
    RangeResult,
    Target,
    TxnResult,
    WatchEvent,
    prefix_end,
)
from logbroker.controlplane.errors import (
    CompactedError,
    ControlPlaneError,
    ControlPlaneUnavailableError,
    LeaseNotFoundError,
    OutcomeUnknownError,
    StoreError,
)

log = Logger()

_T = TypeVar("_T")

#: ``(op, result, seconds)``: one request to etcd ended (see the module docstring).
OnRequest = Callable[[str, str, float], None]

#: gRPC status codes etcd answers with.
_NOT_FOUND = 5
_UNAVAILABLE = 14
#: How many keys one range request reads; a bigger state is read in pages at one revision.
RANGE_PAGE = 1000
#: The longest line a watch may send (a revision's events): etcd's default request limit
#: (1.5 MiB) as base64, with room for the JSON around it.
MAX_WATCH_LINE = 4 * 1024 * 1024


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _int(record: dict[str, Any], key: str) -> int:
    """A protobuf int64 field: a string, or missing when 0."""
    return int(record.get(key, 0))


def _kv(record: dict[str, Any]) -> KeyValue:
    return KeyValue(
        _unb64(record.get("key")),
        _unb64(record.get("value")),
        _int(record, "create_revision"),
        _int(record, "mod_revision"),
        _int(record, "lease"),
    )


def _revision(payload: dict[str, Any]) -> int:
    return _int(payload.get("header", {}), "revision")


def _compare(compare: Compare) -> dict[str, Any]:
    body: dict[str, Any] = {
        "key": _b64(compare.key),
        "target": compare.target.value,
        "result": compare.result.value,
    }
    if compare.target is Target.VALUE:
        assert isinstance(compare.operand, bytes)
        body["value"] = _b64(compare.operand)
    else:
        field = "mod_revision" if compare.target is Target.MOD else "create_revision"
        body[field] = str(compare.operand)
    return body


def _operation(op: Operation) -> dict[str, Any]:
    if isinstance(op, Put):
        put: dict[str, Any] = {"key": _b64(op.key), "value": _b64(op.value)}
        if op.lease:
            put["lease"] = str(op.lease)
        return {"request_put": put}
    if isinstance(op, Delete):
        return {"request_delete_range": {"key": _b64(op.key)}}
    if isinstance(op, DeletePrefix):
        return {
            "request_delete_range": {
                "key": _b64(op.prefix),
                "range_end": _b64(prefix_end(op.prefix)),
            }
        }
    return {"request_range": {"key": _b64(op.key)}}


def _ignore_request(op: str, result: str, seconds: float) -> None:
    pass


def _failed_as(error: BaseException) -> str:
    """The ``result`` of a request that failed with ``error``."""
    if isinstance(error, ControlPlaneUnavailableError | TimeoutError | CancelledError):
        return "unavailable"
    return "error"


class _NotSent(Exception):
    """The request never reached the member."""


class _Refused(Exception):
    """The member answered that it cannot serve the request now (no leader); not applied."""


class _Lines(Protocol):
    """A watch's response body, split into JSON lines."""

    def __init__(self, on_line: Any, finished: Deferred[None]) -> None:
        self._on_line = on_line
        self._finished: Deferred[None] | None = finished
        self._buffer = b""

    def dataReceived(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        try:
            if len(self._buffer) > MAX_WATCH_LINE:
                raise StoreError(f"a watch line grew past {MAX_WATCH_LINE} bytes")
            for line in lines:
                if line.strip():
                    self._on_line(json.loads(line))
        except Exception:
            self.abort(Failure())  # type: ignore[no-untyped-call]

    def abort(self, reason: Failure | None = None) -> None:
        finished, self._finished = self._finished, None
        if self.transport is not None:
            self.transport.loseConnection()
        if finished is not None:
            if reason is None:
                finished.callback(None)
            else:
                finished.errback(reason)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        finished, self._finished = self._finished, None
        if finished is not None:
            finished.errback(reason)


class _GatewayWatch:
    def __init__(
        self,
        store: EtcdGatewayStore,
        prefix: bytes,
        start_revision: int,
        on_events: OnEvents,
        on_lost: OnLost,
    ) -> None:
        self._store = store
        self._on_events = on_events
        self._on_lost = on_lost
        self._body = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(prefix_end(prefix)),
                "start_revision": str(start_revision),
            }
        }
        self._lines: _Lines | None = None
        self._request: Deferred[None] | None = None
        self.active = True

    def start(self) -> None:
        self._request = Deferred.fromCoroutine(self._run())

    async def _run(self) -> None:
        try:
            endpoint, response = await self._store._observed(
                "watch", self._store._open_stream("/v3/watch", self._body)
            )
            finished: Deferred[None] = Deferred()
            self._lines = _Lines(self._line, finished)
            response.deliverBody(self._lines)  # type: ignore[no-untyped-call]
            if not self.active:
                # Cancelled while the request was on its way.
                self._lines.abort()
                return
            try:
                await finished
            except Exception as e:
                if self.active and not isinstance(e, CompactedError):
                    self._store._mark_down(endpoint, e)
                raise
            raise ControlPlaneUnavailableError(f"etcd member {endpoint} ended the watch")
        except Exception as e:
            self._lost(e)

    def _line(self, message: dict[str, Any]) -> None:
        if not self.active:
            return
        if "error" in message:
            error = message["error"]
            raise ControlPlaneUnavailableError(f"the watch failed: {error.get('message', error)!r}")
        result = message.get("result", {})
        compacted = _int(result, "compact_revision")
        if compacted:
            raise CompactedError(
                f"revision {self._body['create_request']['start_revision']} has been "
                f"compacted (to {compacted})",
                compacted,
            )
        if result.get("canceled"):
            raise ControlPlaneUnavailableError(
                f"etcd cancelled the watch ({result.get('cancel_reason', 'no reason given')})"
            )
        events = [
            WatchEvent(
                EventType.DELETE if event.get("type") == "DELETE" else EventType.PUT,
                _kv(event["kv"]),
            )
            for event in result.get("events", ())
        ]
        if events:
            self._on_events(events)

    def _lost(self, error: Exception) -> None:
        if not self.active:
            return
        self.active = False
        if not isinstance(error, ControlPlaneError):
            error = ControlPlaneUnavailableError(f"the watch's etcd member went away ({error!r})")
        self._on_lost(error)

    def cancel(self) -> None:
        if not self.active:
            return
        self.active = False
        if self._lines is not None:
            self._lines.abort()
        elif self._request is not None:
            self._request.cancel()


class EtcdGatewayStore:
    """etcd at ``endpoints`` (``http://host:port`` of each member), through its JSON gateway.

    ``timeout`` bounds each request; ``reactor`` makes the connections and times them;
    ``on_request`` hears of each request's outcome (see the module docstring)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        reactor: _ITreqReactor,
        timeout: float = 5.0,
        on_request: OnRequest = _ignore_request,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self._reactor = reactor
        self._timeout = timeout
        self._on_request = on_request
        self._pool = HTTPConnectionPool(reactor, persistent=True)  # type: ignore[no-untyped-call]
        self._pool.maxPersistentPerHost = 4
        self._http = HTTPClient(Agent(reactor, pool=self._pool))  # type: ignore[no-untyped-call]
        # Writes each get a new connection: one sent on a pooled connection that its member
        # closed (it died) fails without an answer, an unknown outcome; a new connection to a
        # dead member is refused, which is known not to have taken effect.
        self._writes = HTTPClient(
            Agent(reactor, pool=HTTPConnectionPool(reactor, persistent=False))  # type: ignore[no-untyped-call]
        )
        #: endpoint -> when it last failed; absent when it answered since.
        self._down: dict[str, float] = {}
        self._preferred = self.endpoints[0]

    # -- endpoints -----------------------------------------------------------------------------

    def _order(self) -> list[str]:
        """Every endpoint: the preferred one, then the others up, then those down by how long
        they have been."""
        start = self.endpoints.index(self._preferred)
        rotated = self.endpoints[start:] + self.endpoints[:start]
        up = [endpoint for endpoint in rotated if endpoint not in self._down]
        down = sorted((e for e in rotated if e in self._down), key=self._down.__getitem__)
        return up + down

    def _mark_down(self, endpoint: str, error: object) -> None:
        if endpoint not in self._down:
            log.warn("etcd member {endpoint} failed: {error}", endpoint=endpoint, error=error)
        self._down[endpoint] = self._reactor.seconds()

    def _mark_up(self, endpoint: str) -> None:
        if self._down.pop(endpoint, None) is not None:
            log.info("etcd member {endpoint} answers again", endpoint=endpoint)
        self._preferred = endpoint

    # -- requests ------------------------------------------------------------------------------

    async def _post_once(
        self, endpoint: str, path: str, body: Any, *, stream: bool, write: bool
    ) -> Any:
        # etcd's "require leader": a member cut off from its leader says so at once (and
        # ends a watch) instead of holding the request until it times out.
        headers = Headers({"Grpc-Metadata-Hasleader": ["true"]})
        client = self._writes if write else self._http
        requested = client.post(
            endpoint + path, json=body, unbuffered=True, headers=headers, reactor=self._reactor
        )
        requested.addTimeout(self._timeout, self._reactor)
        try:
            response: IResponse = await requested
        except (ConnectError, ConnectingCancelledError, DNSLookupError) as e:
            raise _NotSent(repr(e)) from e
        if stream and response.code == 200:
            return response
        reading = content(response)
        reading.addTimeout(self._timeout, self._reactor)
        data = await reading
        try:
            payload = json.loads(data)
        except ValueError:
            raise StoreError(
                f"etcd member {endpoint} answered {path} with HTTP {response.code} and no JSON: "
                f"{data[:200]!r}; is it etcd's gateway?"
            ) from None
        if response.code == 200:
            return payload
        message = str(payload.get("message") or payload.get("error") or payload)
        code = payload.get("code")
        if code == _NOT_FOUND and "lease not found" in message:
            raise LeaseNotFoundError(f"etcd: {message}")
        if code == _UNAVAILABLE:
            if "no leader" in message or "not capable" in message:
                raise _Refused(message)
            raise OutcomeUnknownError(f"etcd member {endpoint} answered {path}: {message}")
        raise StoreError(f"etcd member {endpoint} refused {path}: {message} (code {code})")

    async def _call(self, path: str, body: Any, *, repeatable: bool, stream: bool = False) -> Any:
        """POST ``body`` to the first member that answers; see the module docstring."""
        failures: list[str] = []
        for endpoint in self._order():
            try:
                answer = await self._post_once(
                    endpoint, path, body, stream=stream, write=not repeatable
                )
            except (_NotSent, _Refused) as e:
                self._mark_down(endpoint, e)
                failures.append(f"{endpoint}: {e}")
                continue
            except CancelledError:
                raise
            except (LeaseNotFoundError, StoreError):
                self._mark_up(endpoint)
                raise
            except OutcomeUnknownError as e:
                self._mark_down(endpoint, e)
                if not repeatable:
                    raise
                failures.append(f"{endpoint}: {e}")
                continue
            except Exception as e:
                self._mark_down(endpoint, e)
                reason = "timed out" if isinstance(e, TimeoutError) else repr(e)
                if not repeatable:
                    raise OutcomeUnknownError(
                        f"etcd member {endpoint} got {path} but did not answer ({reason}): it "
                        "may or may not have taken effect"
                    ) from e
                failures.append(f"{endpoint}: {reason}")
                continue
            self._mark_up(endpoint)
            return (endpoint, answer) if stream else answer
        raise ControlPlaneUnavailableError(
            f"no etcd member answered {path} ({'; '.join(failures)}); check that etcd runs at "
            f"{', '.join(self.endpoints)}"
        )

    async def _observed(self, op: str, request: Awaitable[_T]) -> _T:
        """``request``'s outcome, reported to ``on_request`` as one ``op``."""
        start = self._reactor.seconds()
        try:
            answer = await request
        except BaseException as e:
            self._on_request(op, _failed_as(e), self._reactor.seconds() - start)
            raise
        self._on_request(op, "ok", self._reactor.seconds() - start)
        return answer

    async def _open_stream(self, path: str, body: Any) -> tuple[str, IResponse]:
        opened: tuple[str, IResponse] = await self._call(path, body, repeatable=True, stream=True)
        return opened

    # -- the KeyValueStore interface -----------------------------------------------------------

    def range_prefix(self, prefix: bytes) -> Deferred[RangeResult]:
        return Deferred.fromCoroutine(self._range_prefix(prefix))

    async def _range_prefix(self, prefix: bytes) -> RangeResult:
        end = _b64(prefix_end(prefix))
        kvs: list[KeyValue] = []
        start = prefix
        revision = 0
        while True:
            body: dict[str, Any] = {"key": _b64(start), "range_end": end, "limit": RANGE_PAGE}
            if revision:
                # Later pages at the first one's revision: one consistent snapshot.
                body["revision"] = str(revision)
            payload = await self._observed(
                "range", self._call("/v3/kv/range", body, repeatable=True)
            )
            revision = revision or _revision(payload)
            page = [_kv(record) for record in payload.get("kvs", ())]
            kvs.extend(page)
            if not payload.get("more") or not page:
                return RangeResult(tuple(kvs), revision)
            start = page[-1].key + b"\0"

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Operation],
        failure: Sequence[Operation] = (),
    ) -> Deferred[TxnResult]:
        return Deferred.fromCoroutine(self._observed("txn", self._txn(compares, success, failure)))

    async def _txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Operation],
        failure: Sequence[Operation],
    ) -> TxnResult:
        body = {
            "compare": [_compare(compare) for compare in compares],
            "success": [_operation(op) for op in success],
            "failure": [_operation(op) for op in failure],
        }
        payload = await self._call("/v3/kv/txn", body, repeatable=False)
        # Left out when false, like every protobuf default.
        succeeded = bool(payload.get("succeeded", False))
        gets: list[KeyValue | None] = []
        branch = success if succeeded else failure
        responses = payload.get("responses", [])
        for op, response in zip(branch, responses, strict=True):
            if isinstance(op, Get):
                found = response.get("response_range", {}).get("kvs", [])
                gets.append(_kv(found[0]) if found else None)
        return TxnResult(succeeded, _revision(payload), tuple(gets))

    def put(self, key: bytes, value: bytes, lease: int = 0) -> Deferred[int]:
        return self.txn([], [Put(key, value, lease)]).addCallback(lambda r: r.revision)

    def delete(self, key: bytes) -> Deferred[int]:
        return Deferred.fromCoroutine(self._delete({"key": _b64(key)}))

    def delete_prefix(self, prefix: bytes) -> Deferred[int]:
        return Deferred.fromCoroutine(
            self._delete({"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        )

    async def _delete(self, body: dict[str, Any]) -> int:
        payload = await self._call("/v3/kv/deleterange", body, repeatable=False)
        return _int(payload, "deleted")

    def watch(
        self, prefix: bytes, start_revision: int, on_events: OnEvents, on_lost: OnLost
    ) -> _GatewayWatch:
        watch = _GatewayWatch(self, prefix, start_revision, on_events, on_lost)
        watch.start()
        return watch

    def grant(self, ttl_seconds: int) -> Deferred[int]:
        return Deferred.fromCoroutine(self._observed("grant", self._grant(ttl_seconds)))

    async def _grant(self, ttl_seconds: int) -> int:
        # Repeatable: a grant whose answer was lost leaves a lease nobody keeps alive, which
        # expires on its own.
        payload = await self._call("/v3/lease/grant", {"TTL": ttl_seconds}, repeatable=True)
        if payload.get("error"):
            raise StoreError(f"etcd did not grant a lease: {payload['error']}")
        return _int(payload, "ID")

    def keepalive(self, lease: int) -> Deferred[int]:
        return Deferred.fromCoroutine(self._observed("keepalive", self._keepalive(lease)))

    async def _keepalive(self, lease: int) -> int:
        # A stream of one answer: the gateway closes it when the request body ends.
        payload = await self._call("/v3/lease/keepalive", {"ID": str(lease)}, repeatable=True)
        if isinstance(payload, dict) and "error" in payload:
            error = payload["error"]
            raise StoreError(f"etcd refused to keep lease {lease} alive: {error!r}")
        return _int(payload.get("result", {}), "TTL")

    def revoke(self, lease: int) -> Deferred[None]:
        return Deferred.fromCoroutine(self._observed("revoke", self._revoke(lease)))

    async def _revoke(self, lease: int) -> None:
        await self._call("/v3/lease/revoke", {"ID": str(lease)}, repeatable=True)

    def compact(self, revision: int) -> Deferred[None]:
        """Forget history below ``revision`` (an operator's chore; tests use it too)."""
        return Deferred.fromCoroutine(self._compact(revision))

    async def _compact(self, revision: int) -> None:
        body = {"revision": str(revision), "physical": True}
        await self._call("/v3/kv/compaction", body, repeatable=True)

    def close(self) -> Deferred[None]:
        closed: Deferred[None] = self._pool.closeCachedConnections()  # type: ignore[no-untyped-call]
        return closed
