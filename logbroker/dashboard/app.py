"""The dashboard port's HTTP routes: a Klein app with injected dependencies.

Health, readiness, metrics and rate-limit statistics answer anyone (``SVC_METRICS_REQUIRE_AUTH``
puts the last two behind a session); the operator page and user management need a session.
docs/dashboard.md documents every route, body, status and reason.

Sessions are the ones the client port's ``auth`` creates (one ``SessionStore``): a token is
presented as ``Authorization: Bearer <token>`` or in the session cookie ``POST /login`` sets.
Every login attempt and every presented token is first checked against the ``dashboard_auth``
rate limit of the client IP (spec, "Authentication" 2), before any password or token is looked
at. Routes that need no session never look at a token, so they cost no rate-limit token.

Every error is answered ``{"s": "err", "reason": ...}`` with the status the one reason table
(``logbroker.errors.HTTP_STATUS``) gives its reason; anything unforeseen is logged and answered
500 ``internal_error``, never with a traceback.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

import attrs
from klein import Klein
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.iweb import IRequest
from werkzeug.exceptions import MethodNotAllowed
from werkzeug.exceptions import NotFound as NoSuchRoute

from logbroker.broker.core import Broker
from logbroker.config import DashboardSettings
from logbroker.controlplane import (
    ControlPlaneClosedError,
    Topic,
    User,
    UserNotFoundError,
)
from logbroker.dashboard._http import JSON_CONTENT_TYPE, MAX_BODY_BYTES, DashboardRequest
from logbroker.dashboard.payload import (
    NOT_READY_REASONS,
    NodeStatus,
    RateMeter,
    metrics_payload,
    rate_limits_payload,
)
from logbroker.errors import HTTP_STATUS, LogbrokerError, Reason
from logbroker.maintenance.scrub import MaintenanceRefused
from logbroker.maintenance.view import MaintenanceView
from logbroker.metrics import Metrics
from logbroker.security import Permission, SecurityError, UserDirectory
from logbroker.security.connections import client_identifier
from logbroker.security.guards import AuthResult, Guards
from logbroker.security.ratelimit import Action
from logbroker.security.sessions import Origin, Session
from logbroker.storage import RangeLog, SegmentInfo

if TYPE_CHECKING:
    from logbroker.cluster.view import ClusterView

log = Logger()

#: The session cookie. HttpOnly (no script reads it), SameSite=Strict (no other site's page
#: can make the browser send it), Path=/ and, over TLS, Secure.
SESSION_COOKIE = b"logbroker_session"

#: What ``GET /metrics`` answers a Prometheus scrape with (``Accept: text/plain``).
PROMETHEUS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

#: The files under ``static/`` served at ``/static/<name>``, by suffix; the pages (``.html``)
#: are served at ``/`` only, after the session is checked.
ASSET_TYPES = {
    ".css": b"text/css; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".svg": b"image/svg+xml",
}
HTML_CONTENT_TYPE = b"text/html; charset=utf-8"


class DashboardError(LogbrokerError):
    """An error answer of this port's own: the status comes from ``HTTP_STATUS`` by ``reason``;
    the message, when there is one, says what was wrong in words."""

    def __init__(self, reason: Reason, message: str = "") -> None:
        super().__init__(message, reason)


class Unauthenticated(DashboardError):
    """No valid session (or credentials) for a route that needs one."""


class Forbidden(DashboardError):
    """A valid session whose user lacks the permission the route needs."""


class RateLimited(DashboardError):
    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(Reason.RATE_LIMIT_EXCEEDED)
        self.retry_after_ms = retry_after_ms


#: Errors of the routing layer, which knows nothing of reasons.
_ROUTING_ERRORS: tuple[tuple[type[Exception], Reason], ...] = (
    (NoSuchRoute, Reason.NOT_FOUND),
    (MethodNotAllowed, Reason.METHOD_NOT_ALLOWED),
)
#: Reasons that mean something went wrong here, not in the request: logged with the failure.
_FAULTS = frozenset({Reason.INTERNAL_ERROR, Reason.CONTROL_PLANE_ERROR})

#: Errors whose message is meant for whoever sent the request (bad input, in words).
_EXPLAINED = (DashboardError, SecurityError, MaintenanceRefused)


class Node(Protocol):
    """What the dashboard shows of this node."""

    @property
    def status(self) -> NodeStatus: ...

    def topics(self) -> Sequence[Topic]: ...

    def segments(self) -> Mapping[str, Sequence[SegmentInfo]]:
        """Every open range's segments, by range id."""
        ...


@attrs.frozen
class BrokerNode:
    """The ``Node`` of a running broker: its status (the client port's), topics and logs."""

    _status: Callable[[], NodeStatus]
    _broker: Broker
    _logs: Mapping[str, RangeLog]

    @property
    def status(self) -> NodeStatus:
        return self._status()

    def topics(self) -> Sequence[Topic]:
        try:
            return self._broker.topics()
        except ControlPlaneClosedError:
            # Still starting (or stopping): the page and metrics show no topics meanwhile.
            return []

    def segments(self) -> Mapping[str, Sequence[SegmentInfo]]:
        return {range_id: log.segments() for range_id, log in self._logs.items()}


@attrs.frozen
class Asset:
    content_type: bytes
    body: bytes


def load_assets() -> dict[str, Asset]:
    """The files of ``static/``, read once."""
    folder = resources.files(__package__) / "static"
    assets = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        content_type = HTML_CONTENT_TYPE if suffix == ".html" else ASSET_TYPES.get(suffix)
        if content_type is not None:
            assets[entry.name] = Asset(content_type, entry.read_bytes())
    return assets


def _client_ip(request: IRequest) -> str:
    return client_identifier(request.getClientAddress())


def _status(request: IRequest, status: int) -> None:
    # With its reason phrase: twisted.web knows none for 429 and would say "Unknown Status".
    request.setResponseCode(status, HTTPStatus(status).phrase.encode("ascii"))


def _answer(request: IRequest, body: object, status: int = 200) -> bytes:
    _status(request, status)
    request.setHeader(b"Content-Type", JSON_CONTENT_TYPE)
    # Answers carry state (sessions, users, counters): never from a cache.
    request.setHeader(b"Cache-Control", b"no-store")
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


OK = {"s": "ok"}


def _ours(request: IRequest) -> DashboardRequest:
    # Only the dashboard's Site bounds bodies: any other would let one grow without limit.
    assert isinstance(request, DashboardRequest), "serve the dashboard with DashboardSite"
    return request


def _has_body(request: IRequest) -> bool:
    ours = _ours(request)
    return ours.body_too_large or bool(ours.content.getvalue())


def _json_body(request: IRequest) -> dict[str, Any]:
    """The request's JSON object body; 413, 415 or 400 when it is too large, not declared
    JSON, or not a JSON object."""
    ours = _ours(request)
    if ours.body_too_large:
        raise DashboardError(
            Reason.BODY_TOO_LARGE, f"the request body is larger than {MAX_BODY_BYTES // 1024} KiB"
        )
    declared = request.getHeader(b"content-type") or b""
    if declared.partition(b";")[0].strip().lower() != JSON_CONTENT_TYPE:
        # A page on another site can send a form or text/plain here without asking; JSON it
        # cannot, without a CORS preflight this port never grants.
        raise DashboardError(
            Reason.UNSUPPORTED_MEDIA_TYPE, "send the body as Content-Type: application/json"
        )
    try:
        body = json.loads(ours.content.getvalue())
    except (ValueError, RecursionError):
        raise DashboardError(Reason.MALFORMED_REQUEST, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise DashboardError(Reason.MALFORMED_REQUEST, "the body must be a JSON object")
    return body


def _text(body: Mapping[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str):
        raise DashboardError(Reason.MALFORMED_REQUEST, f"{field} must be a string")
    return value


def _texts(body: Mapping[str, Any], field: str) -> list[str]:
    value = body.get(field, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise DashboardError(Reason.MALFORMED_REQUEST, f"{field} must be a list of strings")
    return value


def _query(request: IRequest, field: str) -> str:
    values = request.args.get(field.encode("ascii"))
    if not values:
        raise DashboardError(Reason.MALFORMED_REQUEST, f"{field} is missing")
    try:
        return str(values[0].decode("utf-8"))
    except UnicodeDecodeError:
        raise DashboardError(Reason.MALFORMED_REQUEST, f"{field} is not UTF-8") from None


def _user_json(user: User) -> dict[str, Any]:
    return {"username": user.name, "permissions": sorted(user.permissions)}


def _wants_text(request: IRequest) -> bool:
    """Whether the client asked for ``text/plain`` (Prometheus does)."""
    accept = (request.getHeader(b"accept") or b"").decode("latin-1")
    return any(kind.partition(";")[0].strip().lower() == "text/plain" for kind in accept.split(","))


class DashboardApp:
    """The routes of the dashboard port. ``secure``: served over TLS (the cookie is Secure).
    ``cluster``: the cluster as this node sees it, for the JSON ``/metrics`` and the page's
    Cluster card (without one, ``cluster`` is ``null`` and the card is hidden)."""

    app = Klein()

    def __init__(
        self,
        *,
        clock: IReactorTime,
        settings: DashboardSettings,
        users: UserDirectory,
        guards: Guards,
        node: Node,
        metrics: Metrics,
        mode: str,
        secure: bool,
        cluster: ClusterView | None = None,
        maintenance: MaintenanceView | None = None,
    ) -> None:
        self._clock = clock
        self._settings = settings
        self._users = users
        self._guards = guards
        self._limiter = guards.limiter
        self._sessions = guards.sessions
        self._node = node
        self._metrics = metrics
        self._mode = mode
        self._secure = secure
        #: May be set after construction, as ``ClientFactory.cluster`` may.
        self.cluster = cluster
        self._maintenance = maintenance
        #: Opens a login's session: at once on one node; in a cluster, once the other nodes can
        #: know it (``SharedSessions.login``), so the browser's next request may land anywhere.
        self.open_session: Callable[[str, str, Origin], Deferred[Session]] = (
            lambda user, client_ip, origin: succeed(self._sessions.create(user, client_ip, origin))
        )
        self._meter: RateMeter[tuple[str, str]] = RateMeter()
        self._assets = load_assets()

    # -- errors ------------------------------------------------------------------------------

    @app.handle_errors(Exception)
    def _error(self, request: IRequest, failure: Failure) -> bytes:
        error = failure.value
        reason = _reason_of(error)
        if reason is None or reason in _FAULTS:
            log.failure(
                "Dashboard request {method} {path} failed unexpectedly",
                failure,
                method=request.method.decode("ascii", "replace"),
                path=request.path.decode("ascii", "replace"),
            )
        if reason is None:
            return _answer(request, {"s": "err", "reason": Reason.INTERNAL_ERROR}, 500)
        body: dict[str, Any] = {"s": "err", "reason": reason}
        if isinstance(error, _EXPLAINED) and str(error):
            body["message"] = str(error)
        if isinstance(error, RateLimited):
            # The header is in whole seconds: round up, so that a retry on time succeeds.
            request.setHeader(b"Retry-After", b"%d" % math.ceil(error.retry_after_ms / 1000))
            body["retry_after_ms"] = error.retry_after_ms
        if isinstance(error, MethodNotAllowed) and error.valid_methods:
            request.setHeader(b"Allow", ", ".join(error.valid_methods).encode("ascii"))
        return _answer(request, body, HTTP_STATUS[reason])

    # -- sessions ----------------------------------------------------------------------------

    def _check_rate(self, client_ip: str) -> None:
        decision = self._limiter.check(client_ip, Action.DASHBOARD_AUTH)
        if not decision.allowed:
            raise RateLimited(decision.retry_after_ms)

    def _token(self, request: IRequest) -> str | None:
        """The session token presented: the bearer token, else the cookie's."""
        header = (request.getHeader(b"authorization") or b"").decode("latin-1")
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        cookie = request.getCookie(SESSION_COOKIE)
        return cookie.decode("latin-1") if cookie else None

    def _validate(self, request: IRequest, token: str) -> Session:
        client_ip = _client_ip(request)
        self._check_rate(client_ip)
        validation = self._sessions.validate(token, client_ip)
        if validation.session is None:
            assert validation.rejection is not None
            if validation.hijack:
                log.warn(
                    "Dashboard: a session token came from {client_ip}, not from the address"
                    " that logged in (a stolen token, or NAT rotation)",
                    client_ip=client_ip,
                )
            raise Unauthenticated(Reason(validation.rejection.value))
        return validation.session

    def _user(self, request: IRequest) -> User:
        """The user of the session presented (401 without one)."""
        token = self._token(request)
        if token is None:
            raise Unauthenticated(Reason.AUTH_REQUIRED, "log in first (POST /login)")
        session = self._validate(request, token)
        user = self._users.user(session.user)
        if user is None:
            # Deleted while its session was being checked (deleting revokes its sessions).
            raise Unauthenticated(Reason.INVALID_SESSION)
        return user

    def _admin(self, request: IRequest) -> User:
        user = self._user(request)
        if Permission.ADMIN not in user.permissions:
            raise Forbidden(Reason.PERMISSION_DENIED, "this needs the admin permission")
        return user

    def _viewer(self, request: IRequest) -> User:
        """A user who may see the page (and its data): an admin, or with
        ``SVC_DASHBOARD_REQUIRE_ADMIN=false`` anyone logged in."""
        return self._admin(request) if self._settings.require_admin else self._user(request)

    def _set_cookie(self, request: IRequest, token: str, max_age: int) -> None:
        _ours(request).addCookie(
            SESSION_COOKIE,
            token.encode("ascii"),
            path=b"/",
            max_age=b"%d" % max_age,
            secure=self._secure,
            httpOnly=True,
            sameSite="strict",
        )

    # -- probes and statistics ------------------------------------------------------------------

    @app.route("/health", methods=["GET"])
    def health(self, request: IRequest) -> bytes:
        return _answer(request, {"status": "ok"})

    @app.route("/ready", methods=["GET"])
    def ready(self, request: IRequest) -> bytes:
        status = self._node.status
        if status is NodeStatus.READY:
            return _answer(request, {"status": "ready"})
        return _answer(request, {"status": "not_ready", "reason": NOT_READY_REASONS[status]}, 503)

    @app.route("/metrics", methods=["GET"])
    def metrics(self, request: IRequest) -> bytes:
        if self._settings.metrics_require_auth:
            self._viewer(request)
        if _wants_text(request):
            request.setHeader(b"Content-Type", PROMETHEUS_CONTENT_TYPE)
            request.setHeader(b"Cache-Control", b"no-store")
            return self._metrics.render_text()
        payload = metrics_payload(
            status=self._node.status,
            mode=self._mode,
            now=self._clock.seconds(),
            topics=self._node.topics(),
            segments=self._node.segments(),
            snapshot=self._metrics.snapshot(),
            meter=self._meter,
            guards=self._guards,
            cluster=None if self.cluster is None else self.cluster.status(),
            maintenance=self._maintenance,
        )
        return _answer(request, payload)

    @app.route("/scrub", methods=["POST"])
    def scrub_now(self, request: IRequest) -> bytes:
        """Start a full pass of the integrity scrub over every sealed segment now (admins)."""
        admin = self._admin(request)
        if self._maintenance is None:
            raise MaintenanceRefused("this node has no integrity scrub")
        segments = self._maintenance.scrub_now()
        log.info(
            "Dashboard: {admin} started a full scrub pass over {count} sealed segments",
            admin=admin.name,
            count=segments,
        )
        return _answer(request, {"s": "ok", "scrub": {"full_pass": segments}}, 202)

    @app.route("/rate_limits", methods=["GET"])
    def rate_limits(self, request: IRequest) -> bytes:
        if self._settings.metrics_require_auth:
            self._viewer(request)
        return _answer(request, rate_limits_payload(self._limiter))

    # -- login -------------------------------------------------------------------------------

    @app.route("/login", methods=["POST"])
    async def login(self, request: IRequest) -> bytes:
        client_ip = _client_ip(request)
        try:
            self._check_rate(client_ip)
        except RateLimited:
            self._guards.on_auth(AuthResult.RATE_LIMITED)
            raise
        body = _json_body(request)
        name, password = _text(body, "username"), _text(body, "password")
        user = await self._users.authenticate(name, password)
        if user is None:
            self._guards.on_auth(AuthResult.INVALID_CREDENTIALS)
            log.info("Dashboard login refused from {client_ip}", client_ip=client_ip)
            raise Unauthenticated(Reason.INVALID_CREDENTIALS)
        self._guards.on_auth(AuthResult.OK)
        session = await self.open_session(user.name, client_ip, Origin.DASHBOARD)
        self._set_cookie(request, session.token, self._settings.session_timeout_sec)
        log.info("Dashboard login: {user} from {client_ip}", user=user.name, client_ip=client_ip)
        return _answer(request, {"s": "ok", "token": session.token})

    @app.route("/logout", methods=["GET"])
    def logout(self, request: IRequest) -> bytes:
        """Revoke the session presented, if it is valid from here; always clear the cookie."""
        token = self._token(request)
        if token is not None:
            try:
                self._validate(request, token)
            except Unauthenticated:
                pass
            else:
                self._sessions.revoke(token)
        self._set_cookie(request, "", 0)
        return _answer(request, OK)

    # -- the page ----------------------------------------------------------------------------

    @app.route("/", methods=["GET"])
    def page(self, request: IRequest) -> bytes:
        """The console for a viewer; the login form without a valid session; a page saying
        what is missing for a user who may not view it."""
        name, status = "index.html", 200
        try:
            self._viewer(request)
        except Unauthenticated:
            name = "login.html"
            if self._token(request) is not None:
                self._set_cookie(request, "", 0)
        except Forbidden:
            name, status = "forbidden.html", 403
        _status(request, status)
        request.setHeader(b"Content-Type", HTML_CONTENT_TYPE)
        request.setHeader(b"Cache-Control", b"no-store")
        return self._assets[name].body

    @app.route("/static/<name>", methods=["GET"])
    def static(self, request: IRequest, name: str) -> bytes:
        asset = self._assets.get(name)
        if asset is None or asset.content_type == HTML_CONTENT_TYPE:
            raise DashboardError(Reason.NOT_FOUND)
        request.setHeader(b"Content-Type", asset.content_type)
        # Revalidated on every load, so that an upgraded broker's page is never half old.
        request.setHeader(b"Cache-Control", b"no-cache")
        return asset.body

    # -- users and ACLs (admin) ------------------------------------------------------------------

    def _check_exists(self, name: str) -> None:
        # Listing or revoking grants would otherwise answer an unknown user like a known one.
        if self._users.user(name) is None:
            raise UserNotFoundError(f"user {name!r} does not exist")

    @app.route("/users", methods=["GET"])
    def list_users(self, request: IRequest) -> bytes:
        self._admin(request)
        users = sorted(self._users.list_users(), key=lambda user: user.name)
        return _answer(request, {"s": "ok", "users": [_user_json(user) for user in users]})

    @app.route("/users", methods=["POST"])
    async def create_user(self, request: IRequest) -> bytes:
        admin = self._admin(request)
        body = _json_body(request)
        name, password = _text(body, "username"), _text(body, "password")
        user = await self._users.create_user(name, password, _texts(body, "permissions"))
        log.info("Dashboard: {admin} created user {user}", admin=admin.name, user=name)
        return _answer(request, {"s": "ok", "user": _user_json(user)}, 201)

    @app.route("/users/<name>", methods=["DELETE"])
    async def delete_user(self, request: IRequest, name: str) -> bytes:
        admin = self._admin(request)
        await self._users.delete_user(name)
        log.info("Dashboard: {admin} deleted user {user}", admin=admin.name, user=name)
        return _answer(request, OK)

    @app.route("/users/<name>/password", methods=["PUT"])
    async def change_password(self, request: IRequest, name: str) -> bytes:
        admin = self._admin(request)
        password = _text(_json_body(request), "password")
        await self._users.change_password(name, password)
        log.info("Dashboard: {admin} changed the password of {user}", admin=admin.name, user=name)
        return _answer(request, OK)

    @app.route("/users/<name>/acls", methods=["GET"])
    def list_acls(self, request: IRequest, name: str) -> bytes:
        self._admin(request)
        self._check_exists(name)
        grants = [
            {"operation": grant.operation, "pattern": grant.pattern}
            for grant in sorted(
                self._users.list_acls(name), key=lambda grant: (grant.pattern, grant.operation)
            )
        ]
        return _answer(request, {"s": "ok", "acls": grants})

    @app.route("/users/<name>/acls", methods=["POST"])
    async def grant_acl(self, request: IRequest, name: str) -> bytes:
        admin = self._admin(request)
        body = _json_body(request)
        operation, pattern = _text(body, "operation"), _text(body, "pattern")
        grant = await self._users.grant_acl(name, operation, pattern)
        log.info(
            "Dashboard: {admin} granted {user} {operation} on {pattern}",
            admin=admin.name,
            user=name,
            operation=operation,
            pattern=pattern,
        )
        return _answer(
            request,
            {"s": "ok", "acl": {"operation": grant.operation, "pattern": grant.pattern}},
            201,
        )

    @app.route("/users/<name>/acls", methods=["DELETE"])
    async def revoke_acl(self, request: IRequest, name: str) -> bytes:
        admin = self._admin(request)
        self._check_exists(name)
        if _has_body(request):
            body = _json_body(request)
            operation, pattern = _text(body, "operation"), _text(body, "pattern")
        else:
            operation, pattern = _query(request, "operation"), _query(request, "pattern")
        await self._users.revoke_acl(name, operation, pattern)
        log.info(
            "Dashboard: {admin} revoked {operation} on {pattern} from {user}",
            admin=admin.name,
            user=name,
            operation=operation,
            pattern=pattern,
        )
        return _answer(request, OK)


def _reason_of(error: object) -> Reason | None:
    """The reason a failed request is answered with; None for an error nobody expected."""
    if isinstance(error, LogbrokerError):
        return error.reason
    for kind, reason in _ROUTING_ERRORS:
        if isinstance(error, kind):
            return reason
    return None
