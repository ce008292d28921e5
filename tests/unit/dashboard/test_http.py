"""The dashboard's Site on its own: a failure outside the app is answered like the app's own
unexpected errors, as JSON with the security headers and without a traceback."""

from __future__ import annotations

from typing import Any

import pytest_twisted
from twisted.internet import reactor
from twisted.web.resource import Resource

from logbroker.dashboard import DashboardSite
from tests.unit.dashboard.helpers import http_from


class Broken(Resource):
    isLeaf = True

    def render_GET(self, request: Any) -> bytes:
        raise RuntimeError("secret internal detail")


@pytest_twisted.ensureDeferred
async def test_a_failure_outside_the_app_is_a_json_500_without_a_traceback(
    logged_errors: list[dict[str, Any]],
) -> None:
    port = reactor.listenTCP(  # type: ignore[attr-defined]
        0, DashboardSite(Broken(), secure=False, reactor=reactor), interface="127.0.0.1"
    )
    try:
        response = await http_from().get(f"http://127.0.0.1:{port.getHost().port}/")
        body = await response.text("utf-8")
    finally:
        await port.stopListening()

    assert response.code == 500
    assert response.headers.getRawHeaders("Content-Type") == ["application/json"]
    assert response.headers.getRawHeaders("X-Frame-Options") == ["DENY"]
    assert body == '{"s":"err","reason":"internal_error"}'
    assert len(logged_errors) == 1
    assert "secret internal detail" in str(logged_errors[0]["log_failure"].value)
    logged_errors.clear()
