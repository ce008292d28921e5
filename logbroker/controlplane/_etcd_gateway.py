"""``KeyValueStore`` over etcd 3.4's v3 JSON gateway (gRPC-gateway), with treq.

Every request is a ``POST`` of a JSON body to ``/v3/...`` on one member. The gateway's JSON is
protobuf's: keys and values are base64, 64-bit integers are strings, and fields at their default
value are left out (a failed transaction has no ``succeeded``, a put event no ``type``, a lease
that is gone a keepalive ``TTL`` of nothing). Streaming calls (watch) answer one JSON object per
line, each ``{"result": ...}`` or ``{"error": ...}``.

Every member is used: requests go to the member that last answered; one that fails is skipped
(marked down) and the next is tried; a member marked down is tried after the healthy ones, so it
comes back into use once it answers again. A member that has left a request unanswered for
``slow_after`` seconds is tried after the others that answer in time (before those marked down)
until that request ends: a member that is slow or hung refuses nothing, and without this every
request would queue behind it until one timed out. A request is sent to another member only when its
outcome is known: when the connection could not be made, or when etcd answered that it could not
serve it (no leader). A transaction that reached a member and got no answer (a timeout, a lost
connection) may have been applied: it fails with ``OutcomeUnknownError`` rather than being sent
again. Reads, watches and lease calls are safe to repeat and go to the next member.

A watch that the member ends, or loses its leader during (``hasleader`` metadata), ends with
``on_lost``; the caller resumes it from the next revision, which goes to a live member.

Security. Endpoints are ``http://`` or ``https://`` URLs; ``tls`` (``IPolicyForHTTPS``, see
``logbroker.security.etcd_tls``) makes the TLS connections: etcd's certificate verified, the
client certificate presented. A member that refuses the TLS handshake (or whose certificate is
not trusted) has not seen the request, so it is skipped like an unreachable one; when every
member does so, the request fails with ``ControlPlaneAccessError`` saying why. With ``user``
(etcd's auth on) every request carries the token of an ``EtcdSession``
(``logbroker.controlplane._etcd_auth``): a request etcd answers ``invalid auth token`` (an
expired token) is sent again, to the same member, with a new token; a watch etcd cancels for
that reason ends with ``on_lost`` and its resumption authenticates anew. A wrong password, a
missing user or a missing permission fail with ``ControlPlaneAccessError`` at once, without
trying other members: they would answer the same.

Each request is reported once to ``on_request(op, result, seconds)``, timed on the reactor's clock
from the call to its outcome (failing over to other members included). ``op`` is ``range`` (each
page of a read), ``txn`` (puts too), ``watch`` (setting it up: until the member answers, not the
watch's lifetime), ``grant``, ``keepalive`` or ``revoke``; deletes and compactions, which only
operators' chores and tests make, are not reported. ``result`` is ``ok`` for any answer
(a transaction whose compare failed included), ``error`` when etcd answered and refused, and
``unavailable`` without an answer: no member reachable, a timeout, an unknown outcome, or a
request its caller cancelled. Each authentication is reported too, as ``authenticate``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from OpenSSL import SSL
from treq import content
from treq._types import _ITreqReactor
from treq.client import HTTPClient
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.error import ConnectError, ConnectingCancelledError, DNSLookupError
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web._newclient import RequestTransmissionFailed, ResponseNeverReceived
from twisted.web.client import (
    Agent,
    BrowserLikePolicyForHTTPS,
    HTTPConnectionPool,
    _HTTP11ClientFactory,
)
from twisted.web.http_headers import Headers
from twisted.web.iweb import IPolicyForHTTPS, IResponse

from logbroker._openssl import openssl_reasons
from logbroker.controlplane._etcd_auth import NO_TOKEN, EtcdSession, EtcdUser
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
    AlreadyCompactedError,
    CompactedError,
    ControlPlaneAccessError,
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
_INVALID_ARGUMENT = 3
_NOT_FOUND = 5
_PERMISSION_DENIED = 7
_OUT_OF_RANGE = 11
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16
#: How many keys one range request reads; a bigger state is read in pages at one revision.
RANGE_PAGE = 1000
#: The longest line a watch may send (a revision's events): etcd's default request limit
#: (1.5 MiB) as base64, with room for the JSON around it.
MAX_WATCH_LINE = 4 * 1024 * 1024
#: How long a member may leave a request unanswered before the next requests go to the others
#: first. A healthy etcd answers in milliseconds; membership keepalives go out every third of
#: the lease's TTL (``SVC_NODE_LEASE_MS``, at least 2 s): the keepalive after one that a member
#: holds goes to another member.
SLOW_AFTER = 0.5


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
    if isinstance(error, ControlPlaneAccessError):
        return "error"
    if isinstance(error, ControlPlaneUnavailableError | TimeoutError | CancelledError):
        return "unavailable"
    return "error"


class _NotSent(Exception):
    """The request never reached the member."""


class _Refused(Exception):
    """The member answered that it cannot serve the request now (no leader); not applied."""


class _TlsRefused(_NotSent):
    """The TLS handshake with the member failed, so the request never reached etcd."""


class _TokenRejected(Exception):
    """etcd wants a (new) token: the request carried none, or one it no longer knows."""


class _WatchTokenExpired(ControlPlaneUnavailableError):
    """etcd cancelled a watch for an expired token: nothing wrong with the member."""


def _tls_error(error: BaseException) -> SSL.Error | None:
    """The OpenSSL error that ended a request's connection, if one did."""
    if isinstance(error, SSL.Error):
        return error
    if isinstance(error, ResponseNeverReceived | RequestTransmissionFailed):
        for reason in error.reasons:
            if isinstance(reason.value, SSL.Error):
                return reason.value
    return None


def _tls_problem(error: SSL.Error) -> str:
    """OpenSSL's reasons, and what they likely mean here."""
    reasons = openssl_reasons(error)
    if "certificate verify failed" in reasons:
        hint = "etcd's certificate is not signed by a CA of SVC_ETCD_CACERTFILE, or does not name"
        hint += " the endpoint's host"
    elif "alert" in reasons:
        hint = "etcd refused this node's client certificate: set SVC_ETCD_CERTFILE and"
        hint += " SVC_ETCD_KEYFILE to one signed by a CA etcd trusts (--trusted-ca-file)"
    else:
        hint = "check SVC_ETCD_CACERTFILE, SVC_ETCD_CERTFILE and etcd's TLS flags"
    return f"TLS handshake failed ({reasons}): {hint}"


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
        #: The member the watch streams from, once it is set up.
        self.endpoint: str | None = None
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
            self.endpoint = endpoint
            self._store._watches.add(self)
            try:
                await finished
            except Exception as e:
                self._store._watches.discard(self)
                if self.active and not isinstance(e, CompactedError | _WatchTokenExpired):
                    self._store._mark_down(endpoint, e)
                raise
            raise ControlPlaneUnavailableError(f"etcd member {endpoint} ended the watch")
        except Exception as e:
            self._lost(e)
        finally:
            self._store._watches.discard(self)

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
            if "invalid auth token" in result.get("cancel_reason", ""):
                self._store._token_expired()
                raise _WatchTokenExpired("etcd cancelled the watch: its token expired")
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

    def member_failed(self, error: object) -> None:
        """Its member failed another request: a member that stopped answering (stopped, cut
        off, its gateway hung) keeps a watch's stream open and sends nothing, without a word.
        End the watch, so that its owner resumes it on a member that answers."""
        if not self.active:
            return
        lines = self._lines
        self._lost(
            ControlPlaneUnavailableError(
                f"etcd member {self.endpoint} failed another request ({error}), so its watch"
                " may have gone silent"
            )
        )
        if lines is not None:
            lines.abort()

    def cancel(self) -> None:
        if not self.active:
            return
        self.active = False
        if self._lines is not None:
            self._lines.abort()
        elif self._request is not None:
            self._request.cancel()


class _QuietHTTP11ClientFactory(_HTTP11ClientFactory):
    # Twisted logs every factory's start and stop: with a new connection for each write,
    # two lines per control-plane change, thousands a minute on a busy cluster.
    noisy = False


def _quiet_pool(reactor: _ITreqReactor, *, persistent: bool) -> HTTPConnectionPool:
    pool = HTTPConnectionPool(reactor, persistent=persistent)  # type: ignore[no-untyped-call]
    pool._factory = _QuietHTTP11ClientFactory
    return pool


class EtcdGatewayStore:
    """etcd at ``endpoints`` (``http://host:port`` or ``https://host:port`` of each member),
    through its JSON gateway.

    ``timeout`` bounds each request; ``slow_after`` is how long a member may leave a request
    unanswered before the next requests try the other members first; ``reactor`` makes the
    connections and times them; ``on_request`` hears of each request's outcome; ``tls`` makes
    the ``https://`` connections, and ``user`` is the etcd user requests authenticate as (see
    the module docstring)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        reactor: _ITreqReactor,
        timeout: float = 5.0,
        slow_after: float = SLOW_AFTER,
        on_request: OnRequest = _ignore_request,
        tls: IPolicyForHTTPS | None = None,
        user: EtcdUser | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint")
        self.endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self._reactor = reactor
        self._timeout = timeout
        self._slow_after = slow_after
        self._on_request = on_request
        policy = tls if tls is not None else BrowserLikePolicyForHTTPS()  # type: ignore[no-untyped-call]
        self._pool = _quiet_pool(reactor, persistent=True)
        self._pool.maxPersistentPerHost = 4
        self._http = HTTPClient(Agent(reactor, policy, pool=self._pool))  # type: ignore[no-untyped-call]
        # Writes each get a new connection: one sent on a pooled connection that its member
        # closed (it died) fails without an answer, an unknown outcome; a new connection to a
        # dead member is refused, which is known not to have taken effect.
        self._writes = HTTPClient(
            Agent(reactor, policy, pool=_quiet_pool(reactor, persistent=False))  # type: ignore[no-untyped-call]
        )
        self._session = None if user is None else EtcdSession(user, self._authenticate)
        #: endpoint -> when it last failed; absent when it answered since.
        self._down: dict[str, float] = {}
        self._preferred = self.endpoints[0]
        #: endpoint -> when each of its requests now unanswered was sent.
        self._unanswered: dict[str, list[float]] = {}
        #: The watches streaming now, each from its member.
        self._watches: set[_GatewayWatch] = set()

    # -- endpoints -----------------------------------------------------------------------------

    def _order(self) -> list[str]:
        """Every endpoint: the preferred one, then the others up, then those up but slow (a
        request unanswered for ``slow_after``) from the least behind, then those down by how
        long they have been."""
        start = self.endpoints.index(self._preferred)
        rotated = self.endpoints[start:] + self.endpoints[:start]
        up = [endpoint for endpoint in rotated if endpoint not in self._down]
        waited = {endpoint: self._waited(endpoint) for endpoint in up}
        prompt = [endpoint for endpoint in up if waited[endpoint] < self._slow_after]
        slow = sorted((e for e in up if waited[e] >= self._slow_after), key=waited.__getitem__)
        down = sorted((e for e in rotated if e in self._down), key=self._down.__getitem__)
        return prompt + slow + down

    def _waited(self, endpoint: str) -> float:
        """How long ``endpoint``'s oldest unanswered request has waited (0 with none)."""
        sent = self._unanswered.get(endpoint)
        return self._reactor.seconds() - min(sent) if sent else 0.0

    def _sending(self, endpoint: str) -> float:
        sent = self._reactor.seconds()
        self._unanswered.setdefault(endpoint, []).append(sent)
        return sent

    def _ended(self, endpoint: str, sent: float) -> None:
        unanswered = self._unanswered[endpoint]
        unanswered.remove(sent)
        if not unanswered:
            del self._unanswered[endpoint]

    def _mark_down(self, endpoint: str, error: object) -> None:
        if endpoint not in self._down:
            log.warn("etcd member {endpoint} failed: {error}", endpoint=endpoint, error=error)
        self._down[endpoint] = self._reactor.seconds()
        for watch in [w for w in self._watches if w.endpoint == endpoint]:
            watch.member_failed(error)

    def _mark_up(self, endpoint: str) -> None:
        if self._down.pop(endpoint, None) is not None:
            log.info("etcd member {endpoint} answers again", endpoint=endpoint)
        self._preferred = endpoint

    # -- requests ------------------------------------------------------------------------------

    async def _post_once(
        self,
        endpoint: str,
        path: str,
        body: Any,
        *,
        stream: bool,
        write: bool,
        token: str = NO_TOKEN,
    ) -> Any:
        # etcd's "require leader": a member cut off from its leader says so at once (and
        # ends a watch) instead of holding the request until it times out.
        headers = Headers({"Grpc-Metadata-Hasleader": ["true"]})
        if token:
            headers.setRawHeaders("Authorization", [token])
        client = self._writes if write else self._http
        requested = client.post(
            endpoint + path, json=body, unbuffered=True, headers=headers, reactor=self._reactor
        )
        requested.addTimeout(self._timeout, self._reactor)
        try:
            response: IResponse = await requested
        except (ConnectError, ConnectingCancelledError, DNSLookupError) as e:
            raise _NotSent(repr(e)) from e
        except Exception as e:
            tls = _tls_error(e)
            if tls is None:
                raise
            raise _TlsRefused(_tls_problem(tls)) from e
        if stream and response.code == 200:
            return response
        reading = content(response)
        reading.addTimeout(self._timeout, self._reactor)
        data = await reading
        try:
            payload = json.loads(data)
        except ValueError:
            if b"CommonName" in data:
                raise ControlPlaneAccessError(
                    f"etcd member {endpoint} refused this node's client certificate: it has a"
                    " Common Name, which etcd's JSON gateway refuses while etcd's auth is on"
                    " (SVC_ETCD_CERTFILE: give it an empty subject and a subjectAltName)"
                ) from None
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
        if code == _OUT_OF_RANGE and "has been compacted" in message:
            raise AlreadyCompactedError(f"etcd: {message}")
        if (code == _UNAUTHENTICATED and "invalid auth token" in message) or (
            code == _INVALID_ARGUMENT and "user name is empty" in message
        ):
            raise _TokenRejected(message)
        if code == _PERMISSION_DENIED:
            if self._session is None:
                remedy = "etcd's auth is on: set SVC_ETCD_USER and SVC_ETCD_PASSWORD"
            else:
                remedy = f"grant etcd user {self._session.user.name!r} (SVC_ETCD_USER) a role"
                remedy += " with readwrite on the prefix /logbroker/"
            raise ControlPlaneAccessError(
                f"etcd member {endpoint} refused {path}: {message}; {remedy}"
            )
        if code == _UNAVAILABLE:
            if "no leader" in message or "not capable" in message:
                raise _Refused(message)
            raise OutcomeUnknownError(f"etcd member {endpoint} answered {path}: {message}")
        raise StoreError(f"etcd member {endpoint} refused {path}: {message} (code {code})")

    async def _call(
        self,
        path: str,
        body: Any,
        *,
        repeatable: bool,
        stream: bool = False,
        authenticated: bool = True,
    ) -> Any:
        """POST ``body`` to the first member that answers; see the module docstring.
        ``authenticated``: with the session's token (every request but the authentication)."""
        if authenticated and self._session is not None:
            # Authenticated once for every member: if no member gives a token, none is asked.
            await self._session.token()
        failures: list[str] = []
        refused_tls = 0
        for endpoint in self._order():
            sent = self._sending(endpoint)
            try:
                answer = await self._post_as_user(
                    endpoint,
                    path,
                    body,
                    stream=stream,
                    write=not repeatable,
                    authenticated=authenticated,
                )
            except (_NotSent, _Refused) as e:
                refused_tls += isinstance(e, _TlsRefused)
                self._mark_down(endpoint, e)
                failures.append(f"{endpoint}: {e}")
                continue
            except (CancelledError, ControlPlaneAccessError):
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
            finally:
                self._ended(endpoint, sent)
            self._mark_up(endpoint)
            return (endpoint, answer) if stream else answer
        if refused_tls == len(self.endpoints):
            raise ControlPlaneAccessError(
                f"every etcd member refused this node at TLS ({'; '.join(failures)})"
            )
        raise ControlPlaneUnavailableError(
            f"no etcd member answered {path} ({'; '.join(failures)}); check that etcd runs at "
            f"{', '.join(self.endpoints)}"
        )

    async def _post_as_user(
        self,
        endpoint: str,
        path: str,
        body: Any,
        *,
        stream: bool,
        write: bool,
        authenticated: bool,
    ) -> Any:
        """``_post_once`` with the session's token, and once more with a new token if etcd
        refused that one (it expired): not applied, so safe to send again."""
        session = self._session if authenticated else None
        if session is None:
            try:
                return await self._post_once(endpoint, path, body, stream=stream, write=write)
            except _TokenRejected as e:
                raise ControlPlaneAccessError(
                    f"etcd member {endpoint} wants a user ({e}): etcd's auth is on, so set"
                    " SVC_ETCD_USER and SVC_ETCD_PASSWORD"
                ) from None
        refusal = None
        for _ in range(2):
            token = await session.token()
            try:
                return await self._post_once(
                    endpoint, path, body, stream=stream, write=write, token=token
                )
            except _TokenRejected as e:
                session.rejected(token)
                refusal = e
        raise ControlPlaneAccessError(
            f"etcd member {endpoint} refused a token it had just given user"
            f" {session.user.name!r} ({refusal})"
        )

    async def _authenticate(self, user: EtcdUser) -> str:
        """A token for ``user`` (``NO_TOKEN`` while etcd's auth is off)."""
        body = {"name": user.name, "password": user.password}
        try:
            payload = await self._observed(
                "authenticate",
                self._call("/v3/auth/authenticate", body, repeatable=True, authenticated=False),
            )
        except StoreError as e:
            if "authentication is not enabled" in str(e):
                log.warn(
                    "etcd's auth is not enabled, so SVC_ETCD_USER {user} is not used: anyone who"
                    " reaches etcd can change the cluster's users and grants (etcdctl auth"
                    " enable)",
                    user=user.name,
                )
                return NO_TOKEN
            if "authentication failed" in str(e):
                raise ControlPlaneAccessError(
                    f"etcd refused user {user.name!r} (SVC_ETCD_USER) with its password"
                    f" (SVC_ETCD_PASSWORD): {e}"
                ) from None
            raise
        token = payload.get("token")
        if not isinstance(token, str) or not token:
            raise StoreError(f"etcd authenticated user {user.name!r} but gave no token")
        return token

    def _token_expired(self) -> None:
        """A watch was cancelled for an expired token: the next request authenticates anew."""
        if self._session is not None:
            self._session.expire()

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
