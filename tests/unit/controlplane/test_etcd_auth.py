"""``EtcdGatewayStore`` as an etcd user and over TLS, with every HTTP exchange answered by the
test: the token on each request, one authentication shared by the requests that wait for it, a
new token when etcd says the old one expired, and the refusals that are the operator's to mend
(``ControlPlaneAccessError``). Real etcd with TLS and auth: tests/integration/."""

from __future__ import annotations

from typing import Any

import pytest
from OpenSSL import SSL
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.web._newclient import ResponseNeverReceived

from logbroker.controlplane import (
    ControlPlaneAccessError,
    ControlPlaneUnavailableError,
    EtcdGatewayStore,
    EtcdUser,
    StoreError,
)
from logbroker.controlplane._etcd_auth import NO_TOKEN, EtcdSession
from logbroker.controlplane._etcd_gateway import (
    _NotSent,
    _tls_problem,
    _TlsRefused,
    _TokenRejected,
)
from logbroker.controlplane._kv import Put
from tests.unit.storage.helpers import failure_of, result_of

USER = EtcdUser("logbroker", "the password")
EXPIRED = _TokenRejected("etcdserver: invalid auth token")


class Exchange:
    """One request the store sent, waiting for the test's answer."""

    def __init__(self, endpoint: str, path: str, body: Any, token: str) -> None:
        self.endpoint = endpoint
        self.path = path
        self.body = body
        self.token = token
        self.answer: Deferred[Any] = Deferred()


class Stubbed:
    """A store of two members as ``USER`` whose every HTTP exchange the test answers."""

    def __init__(self, user: EtcdUser | None = USER) -> None:
        self.reports: list[tuple[str, str]] = []
        self.store = EtcdGatewayStore(
            ["https://a:1", "https://b:2"],
            reactor=MemoryReactorClock(),
            on_request=lambda op, result, seconds: self.reports.append((op, result)),
            user=user,
        )
        self.sent: list[Exchange] = []
        self.store._post_once = self._post_once  # type: ignore[method-assign]

    async def _post_once(
        self, endpoint: str, path: str, body: Any, *, stream: bool, write: bool, token: str = ""
    ) -> Any:
        exchange = Exchange(endpoint, path, body, token)
        self.sent.append(exchange)
        return await exchange.answer

    def pending(self) -> list[Exchange]:
        return [exchange for exchange in self.sent if not exchange.answer.called]

    def answer(self, payload: Any) -> None:
        [exchange] = self.pending()
        exchange.answer.callback(payload)

    def fail(self, error: Exception) -> None:
        [exchange] = self.pending()
        exchange.answer.errback(error)

    def authenticate(self, token: str) -> None:
        [exchange] = self.pending()
        assert exchange.path == "/v3/auth/authenticate"
        assert exchange.body == {"name": "logbroker", "password": "the password"}
        assert exchange.token == NO_TOKEN
        exchange.answer.callback({"header": {}, "token": token})


RANGE_ANSWER = {"header": {"revision": "3"}, "kvs": []}


def test_the_first_request_authenticates_and_carries_the_token() -> None:
    stubbed = Stubbed()
    read = stubbed.store.range_prefix(b"/logbroker/")
    stubbed.authenticate("token-1")
    [_, request] = stubbed.sent
    assert (request.path, request.token) == ("/v3/kv/range", "token-1")
    stubbed.answer(RANGE_ANSWER)

    assert result_of(read).revision == 3
    # Later requests reuse it without authenticating again.
    stubbed.store.range_prefix(b"/logbroker/")
    assert stubbed.pending()[0].token == "token-1"
    stubbed.answer(RANGE_ANSWER)
    assert stubbed.reports == [("authenticate", "ok"), ("range", "ok"), ("range", "ok")]


def test_requests_waiting_for_a_token_share_one_authentication() -> None:
    stubbed = Stubbed()
    reads = [stubbed.store.range_prefix(b"/logbroker/") for _ in range(3)]
    stubbed.authenticate("token-1")

    assert [e.token for e in stubbed.pending()] == ["token-1"] * 3
    for exchange in stubbed.pending():
        exchange.answer.callback(RANGE_ANSWER)
    assert all(result_of(read).revision == 3 for read in reads)
    assert [e.path for e in stubbed.sent].count("/v3/auth/authenticate") == 1


def test_an_expired_token_is_renewed_and_the_request_sent_again_to_the_same_member() -> None:
    stubbed = Stubbed()
    txn = stubbed.store.txn([], [Put(b"/logbroker/a", b"1")])
    stubbed.authenticate("token-1")
    stubbed.fail(EXPIRED)
    stubbed.authenticate("token-2")
    [again] = stubbed.pending()
    assert (again.endpoint, again.path, again.token) == ("https://a:1", "/v3/kv/txn", "token-2")
    stubbed.answer({"header": {"revision": "9"}, "succeeded": True, "responses": [{}]})

    assert result_of(txn).revision == 9
    assert stubbed.reports == [("authenticate", "ok"), ("authenticate", "ok"), ("txn", "ok")]


def test_a_token_refused_twice_in_a_row_is_the_operator_s_problem() -> None:
    stubbed = Stubbed()
    read = stubbed.store.range_prefix(b"/logbroker/")
    stubbed.authenticate("token-1")
    stubbed.fail(EXPIRED)
    stubbed.authenticate("token-2")
    stubbed.fail(EXPIRED)

    error = failure_of(read).trap(ControlPlaneAccessError)
    assert error is ControlPlaneAccessError
    assert stubbed.pending() == []


def test_a_wrong_password_fails_at_once_naming_the_settings() -> None:
    stubbed = Stubbed()
    read = stubbed.store.range_prefix(b"/logbroker/")
    stubbed.fail(
        StoreError(
            "etcd member https://a:1 refused /v3/auth/authenticate: etcdserver: authentication"
            " failed, invalid user ID or password (code 3)"
        )
    )

    failure = failure_of(read)
    failure.trap(ControlPlaneAccessError)
    assert "SVC_ETCD_USER" in str(failure.value)
    assert "SVC_ETCD_PASSWORD" in str(failure.value)
    assert "the password" not in str(failure.value)
    # One member said so: the others would say the same.
    assert [e.endpoint for e in stubbed.sent] == ["https://a:1"]
    assert stubbed.reports == [("authenticate", "error"), ("range", "error")]


def test_a_failed_authentication_is_tried_again_by_the_next_request() -> None:
    stubbed = Stubbed()
    first = stubbed.store.range_prefix(b"/logbroker/")
    stubbed.fail(_NotSent("connection refused"))
    stubbed.fail(_NotSent("connection refused"))
    failure_of(first).trap(ControlPlaneUnavailableError)

    second = stubbed.store.range_prefix(b"/logbroker/")
    stubbed.authenticate("token-1")
    stubbed.answer(RANGE_ANSWER)
    assert result_of(second).revision == 3


def test_while_etcd_s_auth_is_off_requests_go_without_a_token_until_it_asks(
    logged_errors: list[dict[str, Any]],
) -> None:
    stubbed = Stubbed()
    read = stubbed.store.range_prefix(b"/logbroker/")
    stubbed.fail(
        StoreError(
            "etcd member https://a:1 refused /v3/auth/authenticate: etcdserver: authentication"
            " is not enabled (code 9)"
        )
    )
    assert stubbed.pending()[0].token == NO_TOKEN
    stubbed.answer(RANGE_ANSWER)
    assert result_of(read).revision == 3

    # Then an operator enables auth: etcd asks for a user, and gets one.
    later = stubbed.store.range_prefix(b"/logbroker/")
    stubbed.fail(_TokenRejected("etcdserver: user name is empty"))
    stubbed.authenticate("token-1")
    assert stubbed.pending()[0].token == "token-1"
    stubbed.answer(RANGE_ANSWER)
    assert result_of(later).revision == 3
    assert logged_errors == []


def test_without_a_user_etcd_asking_for_one_says_which_settings_to_set() -> None:
    stubbed = Stubbed(user=None)
    read = stubbed.store.range_prefix(b"/logbroker/")
    assert stubbed.pending()[0].token == NO_TOKEN
    stubbed.fail(_TokenRejected("etcdserver: user name is empty"))

    failure = failure_of(read)
    failure.trap(ControlPlaneAccessError)
    assert "set SVC_ETCD_USER and SVC_ETCD_PASSWORD" in str(failure.value)


def test_every_member_refusing_tls_is_an_access_error_naming_the_cause() -> None:
    stubbed = Stubbed(user=None)
    read = stubbed.store.range_prefix(b"/logbroker/")
    alert = SSL.Error([("SSL routines", "", "tlsv13 alert certificate required")])
    stubbed.fail(_TlsRefused(_tls_problem(alert)))
    stubbed.fail(_TlsRefused(_tls_problem(alert)))

    failure = failure_of(read)
    failure.trap(ControlPlaneAccessError)
    assert "tlsv13 alert certificate required" in str(failure.value)
    assert "SVC_ETCD_CERTFILE" in str(failure.value)
    assert stubbed.reports == [("range", "error")]


def test_one_member_refusing_tls_is_skipped_like_an_unreachable_one() -> None:
    stubbed = Stubbed(user=None)
    read = stubbed.store.range_prefix(b"/logbroker/")
    verify = SSL.Error([("SSL routines", "", "certificate verify failed")])
    stubbed.fail(_TlsRefused(_tls_problem(verify)))
    stubbed.answer(RANGE_ANSWER)

    assert result_of(read).revision == 3
    assert [e.endpoint for e in stubbed.sent] == ["https://a:1", "https://b:2"]


def test_tls_problems_say_what_to_look_at() -> None:
    verify = SSL.Error([("SSL routines", "", "certificate verify failed")])
    alert = SSL.Error([("SSL routines", "", "sslv3 alert bad certificate")])

    assert "SVC_ETCD_CACERTFILE" in _tls_problem(verify)
    assert "SVC_ETCD_CERTFILE" in _tls_problem(alert)


def test_a_tls_failure_of_the_agent_is_a_request_never_sent() -> None:
    from logbroker.controlplane._etcd_gateway import _tls_error

    alert = SSL.Error([("SSL routines", "", "tlsv1 alert unknown ca")])
    never = ResponseNeverReceived([Failure(alert)])

    assert _tls_error(never) is alert
    assert _tls_error(ResponseNeverReceived([Failure(ValueError())])) is None


class StreamedResponse:
    """A watch's HTTP response: its body is what the test feeds the protocol it delivers to."""

    code = 200

    def __init__(self) -> None:
        self.body: Any = None

    def deliverBody(self, protocol: Any) -> None:
        self.body = protocol


def test_a_watch_cancelled_for_an_expired_token_renews_it_without_blaming_the_member(
    logged_errors: list[dict[str, Any]],
) -> None:
    stubbed = Stubbed()
    stubbed.store.range_prefix(b"/logbroker/")
    stubbed.authenticate("token-1")
    stubbed.answer(RANGE_ANSWER)
    lost: list[Exception] = []
    watch = stubbed.store.watch(b"/logbroker/", 4, lambda events: None, lost.append)
    [opening] = stubbed.pending()
    assert opening.token == "token-1"
    response = StreamedResponse()
    opening.answer.callback(response)
    # What the gateway streams when etcd refuses the watch's token.
    response.body.dataReceived(
        b'{"result":{"created":true,"canceled":true,"cancel_reason":"rpc error: code ='
        b' Unauthenticated desc = etcdserver: invalid auth token"}}\n'
    )

    [error] = lost
    assert isinstance(error, ControlPlaneUnavailableError)
    assert "token expired" in str(error)
    assert not watch.active
    # The member is not marked down (a warning would say so), and the resumption
    # authenticates anew.
    assert stubbed.store._down == {}
    stubbed.store.watch(b"/logbroker/", 4, lambda events: None, lost.append).cancel()
    stubbed.authenticate("token-2")
    assert stubbed.pending() == []
    assert logged_errors == []


@pytest.mark.parametrize("outcome", ["token", "failure"])
def test_a_session_hands_every_waiter_the_one_outcome(outcome: str) -> None:
    calls: list[EtcdUser] = []
    pending: Deferred[str] = Deferred()

    async def authenticate(user: EtcdUser) -> str:
        calls.append(user)
        return await pending

    session = EtcdSession(USER, authenticate)
    first, second = session.token(), session.token()
    if outcome == "token":
        pending.callback("token-1")
        assert (result_of(first), result_of(second)) == ("token-1", "token-1")
        assert result_of(session.token()) == "token-1"
    else:
        pending.errback(ControlPlaneAccessError("no"))
        failure_of(first).trap(ControlPlaneAccessError)
        failure_of(second).trap(ControlPlaneAccessError)
    assert calls == [USER]


def test_a_session_forgets_only_the_token_refused() -> None:
    tokens = ["token-1", "token-2", "token-3"]

    async def authenticate(user: EtcdUser) -> str:
        return tokens.pop(0)

    session = EtcdSession(USER, authenticate)
    assert result_of(session.token()) == "token-1"
    session.rejected("token-1")
    assert result_of(session.token()) == "token-2"
    # A request that still carried the first token comes back refused: the second is kept.
    session.rejected("token-1")
    assert result_of(session.token()) == "token-2"
    session.expire()
    assert result_of(session.token()) == "token-3"
    assert "the password" not in repr(USER)
