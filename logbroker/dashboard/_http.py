"""The dashboard's ``Site`` and request: bounded bodies, security headers on every response,
and never a traceback to a client. ``DashboardSite`` is the one HTTP factory of the dashboard
port: TLS is added by wrapping it (and constructing it with ``secure=True``)."""

from __future__ import annotations

import io
import urllib.parse
from collections.abc import Callable
from typing import Any

from twisted.internet.interfaces import IAddress, ITransport
from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

from logbroker.errors import Reason
from logbroker.security.connections import ConnectionRegistry, client_identifier

log = Logger()

#: The largest request body read; larger ones are discarded as they arrive and answered 413.
#: User management's largest body (a user with a long password) is far below it.
MAX_BODY_BYTES = 64 * 1024

#: An idle keep-alive connection is closed after this long.
IDLE_TIMEOUT_SECONDS = 60

JSON_CONTENT_TYPE = b"application/json"

#: Scripts, styles and data come from this origin only, and nothing runs inline: an injected
#: ``<script>`` or ``style`` attribute does nothing. The page cannot be framed (clickjacking).
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)

SECURITY_HEADERS = (
    (b"Content-Security-Policy", CONTENT_SECURITY_POLICY.encode("ascii")),
    (b"X-Content-Type-Options", b"nosniff"),
    (b"X-Frame-Options", b"DENY"),
    (b"Referrer-Policy", b"no-referrer"),
)

#: Only sent over TLS: a browser that saw it refuses plain HTTP to this host for a year.
STRICT_TRANSPORT_SECURITY = (b"Strict-Transport-Security", b"max-age=31536000")

INTERNAL_ERROR_BODY = b'{"s":"err","reason":"internal_error"}'
MALFORMED_URL_BODY = (
    b'{"s":"err","reason":"malformed_request","message":"the URL or Host is not UTF-8"}'
)


class DashboardRequest(Request):
    """A request whose body is held in memory up to ``MAX_BODY_BYTES`` and discarded past it
    (``body_too_large`` then says so; the app answers 413). twisted.web would otherwise spool
    any body, however large, to a temporary file before the app sees the request. A body
    announced larger (``Content-Length``) is refused 413 at once, unread, and the connection
    closed: a client cannot make the port read megabytes it will throw away."""

    #: What a response without an explicit type (say, one from Klein itself) is labelled.
    defaultContentType = JSON_CONTENT_TYPE
    content: io.BytesIO
    body_too_large = False
    #: Answered before it was whole (``_refuse``): nothing more is done with it.
    refused = False

    def gotLength(self, length: int | None) -> None:
        # In memory, whatever the declared length: more than the limit is never kept.
        self.content = io.BytesIO()
        if length is not None and length > MAX_BODY_BYTES:
            # Announced over the limit: refused now, before a byte of it is read, and the
            # connection closed (what follows the headers is that body).
            self.body_too_large = self.refused = True
            # No "100 Continue" after the refusal: the client is not to send the body.
            self.requestHeaders.removeHeader(b"expect")
            self._refuse(
                413,
                b"Request Entity Too Large",
                b'{"s":"err","reason":"body_too_large","message":"a body of %d bytes was'
                b' announced; the limit is %d"}' % (length, MAX_BODY_BYTES),
            )

    def handleContentChunk(self, data: bytes) -> None:
        if self.body_too_large:
            return
        if self.content.tell() + len(data) > MAX_BODY_BYTES:
            self.body_too_large = True
            # Let go of what was buffered: none of it will be read.
            self.content = io.BytesIO()
            return
        self.content.write(data)

    def _refuse(self, status: int, message: bytes, body: bytes) -> None:
        """Answer at once and close, before the request is whole (its body is not read)."""
        transport = self.channel.transport
        assert transport is not None, "a request arrives on a connected channel"
        secure: bool = self.channel.site.secure  # type: ignore[attr-defined]
        answer_and_close(transport, status, message, body, secure)

    def process(self) -> None:
        if self.refused:
            return  # answered already, and the connection is closing
        for name, value in SECURITY_HEADERS:
            self.setHeader(name, value)
        site = self.channel.site  # type: ignore[attr-defined]
        if site.secure:
            self.setHeader(*STRICT_TRANSPORT_SECURITY)
        try:
            urllib.parse.unquote_to_bytes(self.path).decode("utf-8")
            self.getRequestHostname().decode("utf-8")
        except UnicodeDecodeError:
            # Klein would answer this itself, in plain text and with a logged traceback:
            # every answer here is JSON, and bad input is not an error of the broker's.
            self._answer_now(400, MALFORMED_URL_BODY)
            return
        super().process()

    def _answer_now(self, status: int, body: bytes) -> None:
        self.setResponseCode(status)
        self.setHeader(b"Content-Type", JSON_CONTENT_TYPE)
        self.setHeader(b"Cache-Control", b"no-store")
        self.setHeader(b"Content-Length", b"%d" % len(body))
        self.write(body)
        self.finish()

    def processingFailed(self, reason: Failure) -> None:
        # The app answers its own errors; this is a failure outside it. The default answer
        # is HTML (with a traceback if ``displayTracebacks`` were ever turned on).
        log.failure(
            "Dashboard request {method} {path} failed",
            reason,
            method=self.method.decode("ascii", "replace"),
            path=self.path.decode("ascii", "replace"),
        )
        self._answer_now(500, INTERNAL_ERROR_BODY)


class DashboardSite(Site):
    """The dashboard's HTTP factory. ``secure``: served over TLS (adds HSTS)."""

    requestFactory = DashboardRequest
    # "Starting factory" lines for every listen tell an operator nothing.
    noisy = False

    def __init__(self, resource: IResource, *, secure: bool, reactor: Any) -> None:
        super().__init__(
            resource,
            # Bodies are JSON, parsed by the app; never parse form uploads into memory.
            parsePOSTFormSubmission=False,
            timeout=IDLE_TIMEOUT_SECONDS,
            reactor=reactor,
        )
        self.secure = secure

    def log(self, request: http.Request) -> None:
        # No access log: an open operator page polls every 1.5 s, which would drown the
        # broker's own log lines; logins and user changes are logged by the app.
        pass


class _Counted(ProtocolWrapper):
    """A connection that gives its place in the caps back when it ends."""

    release: Callable[[], None] | None = None

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        super().connectionLost(reason)
        if self.release is not None:
            self.release()
            self.release = None


class _Refused(Protocol):
    """A connection over a cap: answered 429 with the reason, then closed, before any request
    is read (as the client port answers an error frame before it closes)."""

    def __init__(self, reason: Reason, client_ip: str, secure: bool) -> None:
        self._body = b'{"s":"err","reason":"%s","message":"too many connections from %s"}' % (
            reason.value.encode("ascii"),
            client_ip.encode("ascii", "replace"),
        )
        self._secure = secure

    def connectionMade(self) -> None:
        assert self.transport is not None
        answer_and_close(self.transport, 429, b"Too Many Requests", self._body, self._secure)


class CappedConnections(WrappingFactory):
    """The dashboard port's connection caps, per client IP and in total, as on the client port
    (the same ``SVC_CONNECTION_LIMIT_*`` settings, counted apart from it): a connection over one
    is answered 429 (``connection_limit_exceeded`` or ``global_limit_exceeded``) and closed."""

    protocol = _Counted
    noisy = False

    def __init__(self, site: DashboardSite, connections: ConnectionRegistry) -> None:
        super().__init__(site)
        self._site = site
        self._connections = connections

    def buildProtocol(self, addr: IAddress) -> Protocol | None:  # type: ignore[override]
        connections = self._connections
        client_ip = client_identifier(addr)
        refusal = connections.acquire(client_ip)
        if refusal is not None:
            log.info(
                "Dashboard: refused a connection from {client_ip}: {reason}",
                client_ip=client_ip,
                reason=refusal.value,
            )
            return _Refused(refusal, client_ip, self._site.secure)
        counted = super().buildProtocol(addr)
        assert isinstance(counted, _Counted)
        counted.release = lambda: connections.release(client_ip)
        return counted


def answer_and_close(
    transport: ITransport, status: int, message: bytes, body: bytes, secure: bool
) -> None:
    """Write a whole JSON answer straight to ``transport``, with the security headers (and
    HSTS when ``secure``), then close: for answers given before a request is read."""
    headers = [
        (b"Content-Type", JSON_CONTENT_TYPE),
        (b"Content-Length", b"%d" % len(body)),
        (b"Cache-Control", b"no-store"),
        (b"Connection", b"close"),
        *SECURITY_HEADERS,
    ]
    if secure:
        headers.append(STRICT_TRANSPORT_SECURITY)
    head = b"HTTP/1.1 %d %s\r\n" % (status, message)
    head += b"".join(b"%s: %s\r\n" % header for header in headers)
    transport.write(head + b"\r\n" + body)
    transport.loseConnection()
