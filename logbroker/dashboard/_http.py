"""The dashboard's ``Site`` and request: bounded bodies, security headers on every response,
and never a traceback to a client. ``DashboardSite`` is the one HTTP factory of the dashboard
port: TLS is added by wrapping it (and constructing it with ``secure=True``)."""

from __future__ import annotations

import io
import urllib.parse
from typing import Any

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import http
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

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
    any body, however large, to a temporary file before the app sees the request."""

    #: What a response without an explicit type (say, one from Klein itself) is labelled.
    defaultContentType = JSON_CONTENT_TYPE
    content: io.BytesIO
    body_too_large = False

    def gotLength(self, length: int | None) -> None:
        # In memory, whatever the declared length: more than the limit is never kept.
        self.content = io.BytesIO()

    def handleContentChunk(self, data: bytes) -> None:
        if self.body_too_large:
            return
        if self.content.tell() + len(data) > MAX_BODY_BYTES:
            self.body_too_large = True
            # Let go of what was buffered: none of it will be read.
            self.content = io.BytesIO()
            return
        self.content.write(data)

    def process(self) -> None:
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
