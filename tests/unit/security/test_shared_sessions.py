"""Sessions shared through etcd: several nodes, each its own ``SessionStore``, on one in-memory
etcd and one clock."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from twisted.internet.task import Clock

from logbroker.security.sessions import (
    MAX_SESSIONS_PER_USER,
    Origin,
    Rejection,
    Session,
    SessionStore,
    session_key,
)
from logbroker.security.shared_sessions import (
    KEPT_EXPIRED_SEC,
    LEASE_BUCKET_SEC,
    WRITE_WAIT_SEC,
    SharedSessions,
    decode_session,
    encode_session,
)
from logbroker.testing import MemoryKeyValueStore
from tests.unit.storage.helpers import result_of

PREFIX = b"/logbroker/test/"
SESSIONS = PREFIX + b"sessions/"
TIMEOUT_SEC = 3600
DASHBOARD = Origin.DASHBOARD
CLIENT_PORT = Origin.CLIENT_PORT


class Node:
    def __init__(self, name: str, cluster: Cluster, origins: frozenset[Origin]) -> None:
        self.name = name
        self.events: list[str] = []
        self.sessions = SessionStore(
            cluster.clock,
            TIMEOUT_SEC,
            on_expired=lambda: self.events.append("expired"),
            on_hijack=lambda: self.events.append("hijack"),
        )
        self.shared = SharedSessions(
            self.sessions, cluster.store, PREFIX, cluster.clock, origins=origins
        )

    def login(self, user: str = "alice", ip: str = "10.0.0.1", origin: Origin = DASHBOARD) -> str:
        return self.sessions.create(user, ip, origin).token

    def user_of(self, token: str, ip: str = "10.0.0.1") -> str | None:
        session = self.sessions.validate(token, ip).session
        return None if session is None else session.user


class Cluster:
    def __init__(self) -> None:
        self.clock = Clock()
        self.store = MemoryKeyValueStore(self.clock)
        self.nodes: list[Node] = []

    def node(self, name: str, origins: frozenset[Origin] = frozenset(Origin)) -> Node:
        node = Node(name, self, origins)
        node.shared.startService()
        self.nodes.append(node)
        return node

    def advance(self, seconds: float, step: float = 1.0) -> None:
        for _ in range(round(seconds / step)):
            self.clock.advance(step)

    def leases(self) -> set[int]:
        return {kv.lease for kv in result_of(self.store.range_prefix(SESSIONS)).kvs}

    def session_keys(self) -> list[bytes]:
        kvs = result_of(self.store.range_prefix(SESSIONS)).kvs
        return [kv.key for kv in kvs if not kv.key.startswith(SESSIONS + b"revoked/")]

    def stop(self) -> None:
        for node in self.nodes:
            if node.shared.running:
                result_of(node.shared.stopService())
        self.store.stop()
        assert not self.clock.getDelayedCalls()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    yield made
    made.stop()


def test_a_dashboard_session_made_on_one_node_is_valid_on_another(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    token = a.login()
    session = b.sessions.validate(token, "10.0.0.1").session
    assert session is not None
    assert (session.user, session.origin) == ("alice", DASHBOARD)
    # The token presented comes back, as from a local session (``auth`` by token answers it).
    assert session.token == token
    assert session == a.sessions.validate(token, "10.0.0.1").session
    assert a.events == b.events == []


def test_etcd_holds_the_tokens_hash_and_never_the_token(cluster: Cluster) -> None:
    a = cluster.node("a")
    token = a.login()
    [key] = cluster.session_keys()
    assert key == SESSIONS + session_key(token).hex().encode()
    kv = cluster.store.get(key)
    assert kv is not None
    assert token.encode() not in kv.value
    assert json.loads(kv.value) == {
        "user": "alice",
        "client_ip": "10.0.0.1",
        "origin": "dashboard",
        "created_ms": 0,
        "expires_ms": TIMEOUT_SEC * 1000,
    }
    assert kv.lease != 0


def test_the_record_round_trips_without_the_token() -> None:
    session = Session("secret", "alice", "::1", CLIENT_PORT, 5, 10)
    assert decode_session(encode_session(session)) == Session(
        "", "alice", "::1", CLIENT_PORT, 5, 10
    )
    for bad in (b"{", b"[]", b'{"user": "alice"}', encode_session(session).replace(b"5", b'"5"')):
        with pytest.raises(ValueError, match="not a session record"):
            decode_session(bad)


def test_a_shared_session_from_another_ip_is_a_hijack_counted_where_it_was_presented(
    cluster: Cluster,
) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    token = a.login(ip="10.0.0.1")
    refused = b.sessions.validate(token, "10.0.0.66")
    assert (refused.session, refused.hijack, refused.expired) == (None, True, False)
    assert refused.rejection is Rejection.HIJACK
    assert b.events == ["hijack"]
    assert a.events == []
    # Kept for its owner, on both nodes.
    assert b.user_of(token) == a.user_of(token) == "alice"


def test_a_session_revoked_on_one_node_ends_on_the_others(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    token = a.login()
    kept = a.login()
    assert b.sessions.revoke(token)
    assert a.user_of(token) is None
    assert b.user_of(token) is None
    assert a.user_of(kept) == b.user_of(kept) == "alice"
    assert cluster.session_keys() == [SESSIONS + session_key(kept).hex().encode()]
    assert len(a.sessions) == len(b.sessions) == 1


def test_revoking_a_user_on_one_node_ends_all_its_sessions_everywhere(cluster: Cluster) -> None:
    a, b, c = cluster.node("a"), cluster.node("b"), cluster.node("c")
    tokens = [a.login(), b.login(ip="10.0.0.2"), c.login(origin=CLIENT_PORT)]
    bob = c.login(user="bob")
    assert all(node.user_of(tokens[0]) == "alice" for node in (a, b, c))

    assert a.sessions.revoke_user("alice") == 3
    for node in (a, b, c):
        assert [node.user_of(token) for token in tokens] == [None, None, None]
        assert node.user_of(bob) == "bob"
        assert len(node.sessions) == 1
    assert cluster.session_keys() == [SESSIONS + session_key(bob).hex().encode()]
    # Logging in again works, everywhere.
    cluster.clock.advance(1)
    again = c.login()
    assert a.user_of(again) == "alice"


def test_a_session_written_after_its_users_revocation_is_ignored_everywhere(
    cluster: Cluster,
) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    cluster.store.unavailable = True
    stuck = b.login()
    assert b.shared.pending == 1
    cluster.store.unavailable = False
    # a's revocation reaches etcd while b's session still waits to be written.
    cluster.clock.advance(1)
    a.sessions.revoke_user("alice")
    assert b.user_of(stuck) is None
    cluster.advance(2)
    assert b.shared.pending == 0
    assert a.user_of(stuck) is None
    assert b.user_of(stuck) is None
    # A session opened after the revocation is fine.
    fresh = b.login()
    assert a.user_of(fresh) == "alice"


def test_a_revoked_marker_written_by_another_client_drops_what_it_covers(
    cluster: Cluster,
) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    token = a.login()
    cluster.clock.advance(1)
    newer_token = b.login()
    # A node that wrote only the marker (its own store had none of alice's sessions).
    marker = json.dumps({"revoked_ms": 500}).encode()
    result_of(cluster.store.put(SESSIONS + b"revoked/alice", marker))
    for node in (a, b):
        assert node.user_of(token) is None
        assert node.user_of(newer_token) == "alice"
    # The node that opened it deleted its key.
    assert cluster.session_keys() == [SESSIONS + session_key(newer_token).hex().encode()]


def test_every_node_treats_the_session_as_expired_at_its_expiry_then_the_lease_removes_it(
    cluster: Cluster,
) -> None:
    a, b, c = cluster.node("a"), cluster.node("b"), cluster.node("c")
    token = a.login()
    cluster.advance(TIMEOUT_SEC - 1, step=TIMEOUT_SEC - 1)
    assert b.user_of(token) == "alice"
    cluster.clock.advance(1)
    for node in (a, b, c):
        expired = node.sessions.validate(token, "10.0.0.1")
        assert (expired.session, expired.expired) == (None, True)
        assert node.events == ["expired"]
    # The key outlives the session a little (to its lease's bucket), then goes with the lease.
    assert len(cluster.session_keys()) == 1
    cluster.advance(KEPT_EXPIRED_SEC + LEASE_BUCKET_SEC)
    assert cluster.session_keys() == []


def test_the_lease_removes_the_key_everywhere_even_from_nodes_that_never_checked(
    cluster: Cluster,
) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    a.login()
    assert len(b.sessions) == 1
    cluster.advance(TIMEOUT_SEC + KEPT_EXPIRED_SEC + LEASE_BUCKET_SEC, step=60)
    assert cluster.session_keys() == []
    assert len(a.sessions) == len(b.sessions) == 0
    assert a.events == b.events == []


def test_logins_of_one_bucket_share_a_lease(cluster: Cluster) -> None:
    a = cluster.node("a")
    for _ in range(5):
        a.login()
        cluster.clock.advance(1)
    assert len(cluster.leases()) == 1
    cluster.advance(LEASE_BUCKET_SEC)
    a.login()
    assert len(cluster.leases()) == 2


def test_a_node_started_later_loads_the_sessions_already_there(cluster: Cluster) -> None:
    a = cluster.node("a")
    tokens = [a.login(), a.login(user="bob", origin=CLIENT_PORT)]
    b = cluster.node("b")
    assert [b.user_of(token) for token in tokens] == ["alice", "bob"]


def test_client_port_sessions_can_stay_local(cluster: Cluster) -> None:
    a = cluster.node("a", origins=frozenset({DASHBOARD}))
    b = cluster.node("b")
    client = a.login(origin=CLIENT_PORT)
    dashboard = a.login()
    assert a.user_of(client) == "alice"
    assert b.user_of(client) is None
    assert b.user_of(dashboard) == "alice"


def test_a_dropped_watch_resumes_from_where_it_stopped(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    cluster.store.drop_watches()
    assert [a.shared.following, b.shared.following] == [False, False]
    # Changes made while b does not watch ...
    token = a.login()
    revoked = a.login()
    a.sessions.revoke(revoked)
    assert b.user_of(token) is None
    # ... reach it when it resumes.
    cluster.clock.advance(1)
    assert [a.shared.following, b.shared.following] == [True, True]
    assert b.user_of(token) == "alice"
    assert b.user_of(revoked) is None
    assert cluster.store.watch_count == 2


def test_a_compaction_reloads_and_forgets_what_is_gone(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    gone = a.login()
    assert b.user_of(gone) == "alice"
    cluster.store.drop_watches()
    b.sessions.revoke(gone)
    assert b.user_of(gone) is None
    kept = b.login(user="bob")
    cluster.store.compact(cluster.store.revision)
    cluster.clock.advance(1)
    assert [a.shared.following, b.shared.following] == [True, True]
    assert a.user_of(gone) is None
    assert a.user_of(kept) == "bob"
    assert len(a.sessions) == len(b.sessions) == 1


def test_while_etcd_is_down_logins_work_locally_and_are_shared_once_it_is_back(
    cluster: Cluster,
) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    known = a.login()
    cluster.store.unavailable = True
    cluster.store.drop_watches()
    tokens = [a.login(), a.login(origin=CLIENT_PORT)]
    assert [a.user_of(token) for token in tokens] == ["alice", "alice"]
    # What was known before still validates, on both nodes.
    assert a.user_of(known) == b.user_of(known) == "alice"
    assert b.user_of(tokens[0]) is None
    assert a.shared.pending == 2
    cluster.advance(5)
    cluster.store.unavailable = False
    cluster.clock.advance(1)
    assert a.shared.pending == 0
    assert [b.user_of(token) for token in tokens] == ["alice", "alice"]


def test_trouble_is_logged_once_not_per_login() -> None:
    from twisted.logger import LogLevel, globalLogPublisher

    warnings: list[str] = []

    def observe(event: dict[str, object]) -> None:
        if event.get("log_level") is LogLevel.warn:
            warnings.append(str(event.get("log_format")))

    globalLogPublisher.addObserver(observe)
    made = Cluster()
    try:
        a = made.node("a")
        made.store.unavailable = True
        made.store.drop_watches()
        for _ in range(10):
            a.login()
        made.advance(10)
        assert len(warnings) == 2  # one for writes, one for the watch
        made.store.unavailable = False
        made.clock.advance(1)
        assert a.shared.pending == 0
        made.store.unavailable = True
        a.login()
        assert len(warnings) == 3
        made.store.unavailable = False
    finally:
        globalLogPublisher.removeObserver(observe)
        made.stop()


def test_a_node_starting_while_etcd_is_down_loads_once_it_is_back(cluster: Cluster) -> None:
    a = cluster.node("a")
    token = a.login()
    cluster.store.unavailable = True
    b = cluster.node("b")
    local = b.login()
    assert b.user_of(local) == "alice"
    assert b.user_of(token) is None
    cluster.advance(3)
    cluster.store.unavailable = False
    cluster.clock.advance(1)
    assert b.user_of(token) == "alice"
    assert a.user_of(local) == "alice"


def test_login_waits_for_the_write_but_not_long(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    # etcd answers at once: the session is valid everywhere when login fires.
    quick = result_of(a.shared.login("alice", "10.0.0.1", DASHBOARD))
    assert b.user_of(quick.token) == "alice"
    # etcd is slow: login fires after a short wait, the session valid here.
    cluster.store.hold()
    waiting = a.shared.login("alice", "10.0.0.1", DASHBOARD)
    assert not waiting.called
    cluster.clock.advance(WRITE_WAIT_SEC)
    slow = result_of(waiting)
    assert a.user_of(slow.token) == "alice"
    cluster.store.release()
    assert b.user_of(slow.token) == "alice"
    # The write is answered first: login fires then.
    cluster.store.hold()
    waiting = a.shared.login("alice", "10.0.0.1", DASHBOARD)
    cluster.store.release()
    assert b.user_of(result_of(waiting).token) == "alice"
    # etcd is known to be down: no wait at all.
    cluster.store.unavailable = True
    a.login()
    assert result_of(a.shared.login("alice", "10.0.0.1", DASHBOARD)).user == "alice"
    cluster.store.unavailable = False


def test_a_session_revoked_while_its_write_is_on_the_way_stays_revoked(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    cluster.store.hold()
    token = a.login()
    a.sessions.revoke(token)
    cluster.store.release()
    assert a.user_of(token) is None
    assert b.user_of(token) is None
    assert cluster.session_keys() == []


def test_quota_pushes_out_the_oldest_everywhere(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    first = a.login()
    for _ in range(MAX_SESSIONS_PER_USER):
        b.login()
    assert a.user_of(first) is None
    assert b.user_of(first) is None
    assert len(a.sessions) == len(b.sessions) == MAX_SESSIONS_PER_USER
    assert len(cluster.session_keys()) == MAX_SESSIONS_PER_USER


def test_stopping_a_node_leaves_its_sessions_valid_on_the_others(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    token = a.login()
    result_of(a.shared.stopService())
    assert b.user_of(token) == "alice"
    cluster.advance(60, step=10)
    assert b.user_of(token) == "alice"


def test_keys_that_are_not_sessions_are_ignored(cluster: Cluster) -> None:
    a = cluster.node("a")
    result_of(cluster.store.put(SESSIONS + b"nonsense", b"{}"))
    result_of(cluster.store.put(SESSIONS + b"ab" * 32, b"not json"))
    token = a.login()
    b = cluster.node("b")
    assert b.user_of(token) == "alice"
    assert len(b.sessions) == 1


def test_a_write_whose_answer_was_lost_is_written_again(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    cluster.store.lost_answers = 1
    token = a.login()
    assert a.shared.pending == 1
    assert b.user_of(token) == "alice"
    cluster.clock.advance(1)
    assert a.shared.pending == 0
    assert len(cluster.session_keys()) == 1


def test_a_lease_etcd_lost_is_granted_anew(cluster: Cluster) -> None:
    a, b = cluster.node("a"), cluster.node("b")
    lost = a.login()
    [lease] = cluster.leases()
    result_of(cluster.store.revoke(lease))
    # Its keys went with it (everywhere: the session is over) ...
    assert (a.user_of(lost), b.user_of(lost)) == (None, None)
    # ... and the next login is shared under a new lease, at once.
    token = a.login()
    assert a.shared.pending == 0
    assert b.user_of(token) == "alice"
    assert cluster.leases() not in ({lease}, set())
