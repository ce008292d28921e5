"""Sessions bound to a token and a client IP: expiry and hijack attempts, counted."""

from __future__ import annotations

from twisted.internet.task import Clock

from logbroker.security.sessions import (
    MAX_SESSIONS_PER_USER,
    Origin,
    Rejection,
    SessionStore,
    Validation,
)

DASHBOARD = Origin.DASHBOARD


def store(clock: Clock, timeout_sec: int = 3600) -> tuple[SessionStore, list[str]]:
    events: list[str] = []
    sessions = SessionStore(
        clock,
        timeout_sec,
        on_expired=lambda: events.append("expired"),
        on_hijack=lambda: events.append("hijack"),
    )
    return sessions, events


def test_a_session_is_valid_from_its_own_ip_until_it_expires() -> None:
    clock = Clock()
    sessions, events = store(clock, timeout_sec=60)
    session = sessions.create("alice", "10.0.0.1", DASHBOARD)
    assert session.user == "alice"
    assert len(session.token) >= 40
    assert sessions.validate(session.token, "10.0.0.1") == Validation(session)
    clock.advance(59.999)
    assert sessions.validate(session.token, "10.0.0.1").session == session
    clock.advance(0.001)
    expired = sessions.validate(session.token, "10.0.0.1")
    assert (expired.session, expired.expired, expired.hijack) == (None, True, False)
    assert expired.rejection is Rejection.EXPIRED
    # Forgotten: presented again it is simply unknown, and not counted twice.
    assert sessions.validate(session.token, "10.0.0.1").rejection is Rejection.INVALID
    assert events == ["expired"]
    assert events.count("expired") == 1


def test_a_token_from_another_ip_is_a_hijack_attempt_and_the_session_survives() -> None:
    clock = Clock()
    sessions, events = store(clock)
    session = sessions.create("alice", "127.0.0.1", DASHBOARD)
    refused = sessions.validate(session.token, "127.0.0.2")
    assert (refused.session, refused.hijack, refused.expired) == (None, True, False)
    assert refused.rejection is Rejection.HIJACK
    assert sessions.validate(session.token, "127.0.0.1").session == session
    assert events == ["hijack"]
    assert events.count("hijack") == 1


def test_one_validation_can_count_both_expired_and_hijack() -> None:
    clock = Clock()
    sessions, events = store(clock, timeout_sec=1)
    session = sessions.create("alice", "127.0.0.1", DASHBOARD)
    clock.advance(2)
    refused = sessions.validate(session.token, "127.0.0.2")
    assert (refused.expired, refused.hijack) == (True, True)
    assert sorted(events) == ["expired", "hijack"]
    assert (events.count("expired"), events.count("hijack")) == (1, 1)


def test_unknown_tokens_are_rejected_without_counting() -> None:
    sessions, events = store(Clock())
    assert sessions.validate("nope", "10.0.0.1").rejection is Rejection.INVALID
    assert events == []


def test_revoke_one_and_revoke_a_users_all() -> None:
    sessions, _ = store(Clock())
    first = sessions.create("alice", "10.0.0.1", DASHBOARD)
    second = sessions.create("alice", "10.0.0.2", DASHBOARD)
    other = sessions.create("bob", "10.0.0.1", DASHBOARD)
    assert first.token != second.token
    assert sessions.revoke(first.token)
    assert not sessions.revoke(first.token)
    assert sessions.validate(first.token, "10.0.0.1").session is None
    assert sessions.revoke_user("alice") == 1
    assert sessions.validate(second.token, "10.0.0.2").session is None
    assert sessions.validate(other.token, "10.0.0.1").session == other


def test_remove_expired_forgets_without_counting() -> None:
    clock = Clock()
    sessions, events = store(clock, timeout_sec=10)
    sessions.create("alice", "10.0.0.1", DASHBOARD)
    clock.advance(5)
    kept = sessions.create("alice", "10.0.0.1", DASHBOARD)
    clock.advance(5)
    assert sessions.remove_expired() == 1
    assert len(sessions) == 1
    assert sessions.validate(kept.token, "10.0.0.1").session == kept
    assert events == []


def test_a_user_holds_a_bounded_number_of_sessions_per_origin_losing_the_oldest() -> None:
    clock = Clock()
    sessions, _ = store(clock)
    first = sessions.create("alice", "10.0.0.1", DASHBOARD)
    second = sessions.create("alice", "10.0.0.1", DASHBOARD)
    for _ in range(MAX_SESSIONS_PER_USER):
        clock.advance(0.001)
        sessions.create("alice", "10.0.0.1", Origin.CLIENT_PORT)
    # A fleet of clients logging in as alice does not log her dashboard out ...
    assert sessions.validate(first.token, "10.0.0.1").session == first
    assert len(sessions) == MAX_SESSIONS_PER_USER + 2
    # ... more dashboard logins push out her oldest dashboard session, and only that.
    for _ in range(MAX_SESSIONS_PER_USER - 1):
        sessions.create("alice", "10.0.0.1", DASHBOARD)
    assert sessions.validate(first.token, "10.0.0.1").session is None
    assert sessions.validate(second.token, "10.0.0.1").session == second
    assert len(sessions) == 2 * MAX_SESSIONS_PER_USER
    assert sessions.revoke_user("alice") == 2 * MAX_SESSIONS_PER_USER
    assert len(sessions) == 0


def test_the_token_is_not_in_the_repr() -> None:
    session = store(Clock())[0].create("alice", "10.0.0.1", DASHBOARD)
    assert session.token not in repr(session)
