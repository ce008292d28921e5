"""Interop checks for logbroker, using only client.py (written from DESIGN.md section 4)."""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client import (  # noqa: E402
    AUTH,
    CREATE_TOPIC,
    FETCH,
    PRODUCE,
    BrokerError,
    Closed,
    Connection,
    Reader,
    Record,
    enc_record,
    enc_str,
    enc_u8,
    enc_u32,
    encode_produce,
    frame,
    request_body,
)

HOST = "127.0.0.1"
PORT = int(os.environ.get("PORT", "24040"))
RUN = os.environ.get("RUN", str(int(time.time())))

results: list[tuple[str, bool, str]] = []


def check(name):
    def deco(fn):
        try:
            detail = fn() or ""
            results.append((name, True, detail))
            print(f"PASS {name} {detail}")
        except Exception as e:  # noqa: BLE001
            tb = traceback.format_exc(limit=3)
            results.append((name, False, f"{type(e).__name__}: {e}"))
            print(f"FAIL {name}: {type(e).__name__}: {e}\n{tb}")
        return fn

    return deco


def conn(user="app", pw="app123", timeout=10.0) -> Connection:
    c = Connection(HOST, PORT, timeout=timeout)
    if user is not None:
        c.auth(user, pw)
    return c


def expect_error(fn, reason):
    try:
        fn()
    except BrokerError as e:
        assert e.reason == reason, f"expected {reason!r}, got {e.reason!r} (code {e.error_code})"
        assert e.error_code == 1, f"error_code {e.error_code} != 1"
        return e
    raise AssertionError(f"expected error {reason!r}, got success")


def assert_closed(c: Connection, within=3.0):
    c.settimeout(within)
    try:
        data = c.sock.recv(1)
    except ConnectionResetError:
        return "reset"
    except socket.timeout:
        raise AssertionError("connection not closed within %.1fs" % within) from None
    assert data == b"", f"expected EOF, got {data!r}"
    return "eof"


def fetch_all(c: Connection, topic, cursor=None, group=None, member=None, max=1000):
    out = []
    rounds = 0
    while True:
        r = c.fetch(topic, cursor, group, member, max=max)
        rounds += 1
        out.extend(r.records)
        if r.next_cursor is not None:
            cursor = r.next_cursor
        if not r.records:
            return out, cursor, rounds
        group = None  # after the first round, follow the explicit cursor
        assert rounds < 10000


admin = conn("admin", "admin123")


# ------------------------------------------------------------------ auth


@check("auth ok returns a token")
def _():
    c = Connection(HOST, PORT)
    tok = c.auth("app", "app123")
    c.close()
    assert tok is not None and len(tok) > 0, f"token {tok!r}"
    return f"token={tok[:16]!r}... ({len(tok)} bytes)"


@check("first frame not auth -> auth_required + close")
def _():
    c = Connection(HOST, PORT)
    corr = c.send_request(CREATE_TOPIC, enc_str(f"noauth-{RUN}") + enc_u8(0), corr=4242)
    r = c.read_response()
    reason = Reader(r.payload).str()
    assert r.error_code == 1, r
    assert reason == b"auth_required", reason
    how = assert_closed(c)
    c.close()
    return f"corr in reply={r.correlation_id} (sent {corr}); close={how}"


@check("wrong password -> invalid_credentials")
def _():
    c = Connection(HOST, PORT)
    expect_error(lambda: c.auth("app", "wrong"), "invalid_credentials")
    # informational: is the connection closed afterwards?
    try:
        how = assert_closed(c, 1.0)
    except AssertionError:
        how = "left open"
    c.close()
    return f"after failure: {how}"


@check("unknown user -> invalid_credentials")
def _():
    c = Connection(HOST, PORT)
    expect_error(lambda: c.auth("nobody-" + RUN, "x"), "invalid_credentials")
    c.close()


# ------------------------------------------------------------------ topics

T_SHAPES = f"shapes-{RUN}"


@check("create_topic keyspace_bits 16 ok, then again already_exists")
def _():
    admin.create_topic(T_SHAPES, 16)
    expect_error(lambda: admin.create_topic(T_SHAPES, 16), "already_exists")


@check("create_topic keyspace_bits 40 -> invalid_keyspace_bits")
def _():
    expect_error(lambda: admin.create_topic(f"ks40-{RUN}", 40), "invalid_keyspace_bits")


@check("create_topic keyspace_bits 0, 1, 32 ok; 33 invalid (extra)")
def _():
    for b in (0, 1, 32):
        admin.create_topic(f"ks{b}-{RUN}", b)
    expect_error(lambda: admin.create_topic(f"ks33-{RUN}", 33), "invalid_keyspace_bits")


@check("create_topic bad names -> invalid_topic_name (extra)")
def _():
    for n in ("..", ".", "a/b", "", "x" * 250):
        expect_error(lambda n=n: admin.create_topic(n, 0), "invalid_topic_name")


# ------------------------------------------------------------------ produce/fetch shapes

SHAPES = [
    Record(None, b"v-nullkey", 1),
    Record(b"", b"v-emptykey", 2),
    Record(b"k-emptyval", b"", 3),
    Record(b"bin", b"\x00\xff\x00" + bytes(range(256)) + b"\xff\x00", 4),
    Record(b"\x00\xff\x00", b"binary key", 5),
    Record(b"ts0", b"ts zero", 0),
    Record(b"tsmax", b"ts max", 2**64 - 1),
    Record(
        b"hdrs",
        b"headers",
        6,
        ((None, None), (b"", b""), (b"h", None), (None, b"v"), (b"", None), (None, b""), (b"\x00\xff", b"\xff\x00")),
    ),
    Record(b"hdr-dup", b"dup headers", 7, ((b"a", b"1"), (b"a", b"2"))),
    Record(None, b"", 0),  # null key + empty value
    Record(b"", b"", 2**64 - 1, ((None, None),)),
    Record(b"big", bytes(range(256)) * 256, 8),  # 64 KiB
] + [Record(b"ord", f"ord-{i}".encode(), 100 + i) for i in range(20)] + [
    Record(b"", f"empty-ord-{i}".encode(), 200 + i) for i in range(5)
] + [Record(None, f"keyless-{i}".encode(), 300 + i) for i in range(10)]


@check("produce records of every shape")
def _():
    n = admin.produce(T_SHAPES, SHAPES[:12])
    assert n == 12, n
    n = admin.produce(T_SHAPES, SHAPES[12:])
    assert n == len(SHAPES) - 12, n
    return f"{len(SHAPES)} records"


@check("fetch all back byte-exact (multiset + per-key order)")
def _():
    c = conn()
    got, _, rounds = fetch_all(c, T_SHAPES)
    c.close()
    want_enc = Counter(enc_record(r) for r in SHAPES)
    got_enc = Counter(enc_record(r) for r in got)
    missing = want_enc - got_enc
    extra = got_enc - want_enc
    assert not missing and not extra, f"missing={list(missing)[:3]!r} extra={list(extra)[:3]!r}"
    by_key_want = defaultdict(list)
    by_key_got = defaultdict(list)
    for r in SHAPES:
        if r.key is not None:
            by_key_want[r.key].append(r)
    for r in got:
        if r.key is not None:
            by_key_got[r.key].append(r)
    for k in by_key_want:
        assert by_key_want[k] == by_key_got[k], f"order differs for key {k!r}"
    # null key and empty key must stay distinct
    assert sum(1 for r in got if r.key is None) == 12
    assert sum(1 for r in got if r.key == b"") == 7
    return f"{len(got)} records in {rounds} fetches"


# ------------------------------------------------------------------ fetch limits and cursors

T_MANY = f"many-{RUN}"
MANY = [Record(f"k{i % 7}".encode(), f"m-{i}".encode(), i) for i in range(2500)]


@check("fetch max 0 returns at most 100")
def _():
    admin.create_topic(T_MANY, 0)
    for i in range(0, len(MANY), 500):
        assert admin.produce(T_MANY, MANY[i : i + 500]) == 500
    r = admin.fetch(T_MANY, None, max=0)
    assert 0 < len(r.records) <= 100, len(r.records)
    return f"got {len(r.records)}"


@check("fetch max 5000 capped at 1000 (extra)")
def _():
    r = admin.fetch(T_MANY, None, max=5000)
    assert 0 < len(r.records) <= 1000, len(r.records)
    return f"got {len(r.records)}"


@check("cursors: continue with next_cursor gets the rest, exactly once")
def _():
    got, _, rounds = fetch_all(admin, T_MANY, max=100)
    assert len(got) == len(MANY), len(got)
    assert Counter(enc_record(r) for r in got) == Counter(enc_record(r) for r in MANY)
    for k in {r.key for r in MANY}:
        assert [r for r in got if r.key == k] == [r for r in MANY if r.key == k], k
    return f"{len(got)} records in {rounds} fetches"


@check("garbage cursor -> invalid_cursor")
def _():
    for cur in (b"garbage!!", b"AAAA", b"AAAA====", "\u00e9".encode(), b"", b"A" * 100000):
        expect_error(lambda cur=cur: admin.fetch(T_MANY, cur), "invalid_cursor")
    return "6 variants incl. empty, non-ASCII UTF-8 and 100 KB"


@check("garbage cursor that is not valid UTF-8 -> invalid_cursor")
def _():
    expect_error(lambda: admin.fetch(T_MANY, b"\xff\x00\x01"), "invalid_cursor")


@check("fetch unknown topic -> no_such_topic (extra)")
def _():
    expect_error(lambda: admin.fetch(f"nope-{RUN}", None), "no_such_topic")


@check("commit cursor for a group; fetch with group + null cursor resumes")
def _():
    c = conn()
    first = c.fetch(T_MANY, None, max=300)
    assert len(first.records) > 0
    c.commit(T_MANY, f"g-{RUN}", first.next_cursor)
    expected, _, _ = fetch_all(c, T_MANY, first.next_cursor)
    resumed, _, _ = fetch_all(c, T_MANY, None, f"g-{RUN}", None)
    c.close()
    rest = Counter(map(enc_record, MANY)) - Counter(map(enc_record, first.records))
    assert Counter(map(enc_record, resumed)) == Counter(map(enc_record, expected)) == rest, (
        f"resumed {len(resumed)} vs expected {len(expected)} vs rest {sum(rest.values())}"
    )
    return f"first {len(first.records)}, resumed+drained {len(resumed)} = the rest (member null)"


@check("group with no commit + null cursor starts at the beginning (extra)")
def _():
    got, _, _ = fetch_all(admin, T_MANY, None, f"fresh-{RUN}", None)
    assert Counter(map(enc_record, got)) == Counter(map(enc_record, MANY)), len(got)


# ------------------------------------------------------------------ long poll


@check("long poll (wait_ms 5000 on empty topic) answered when another connection produces")
def _():
    t = f"lp-{RUN}"
    admin.create_topic(t, 0)
    a = conn()
    b = conn()
    corr = a.send_request(
        FETCH, enc_str(t) + enc_str(None) + enc_str(None) + enc_str(None) + enc_u32(0) + enc_u32(5000)
    )
    time.sleep(0.7)
    t0 = time.monotonic()
    assert b.produce(t, [Record(b"lp", b"wake up", 1)]) == 1
    resp = a.wait_for(corr)
    dt = time.monotonic() - t0
    a.close()
    b.close()
    assert resp.error_code == 0, resp
    from client import parse_fetch

    fr = parse_fetch(resp.payload)
    assert [r.value for r in fr.records] == [b"wake up"], fr
    assert dt < 2.0, f"answered {dt:.2f}s after produce"
    return f"answered {dt * 1000:.0f} ms after produce"


@check("long poll with no data returns empty after ~wait_ms (extra)")
def _():
    t = f"lp2-{RUN}"
    admin.create_topic(t, 0)
    t0 = time.monotonic()
    r = admin.fetch(t, None, wait_ms=1000)
    dt = time.monotonic() - t0
    assert r.records == []
    assert 0.8 < dt < 3.0, dt
    return f"{dt * 1000:.0f} ms, next_cursor {'null' if r.next_cursor is None else 'present'}"


# ------------------------------------------------------------------ subscribe


@check("subscribe window 5 max 2: pushes bounded, stream_ack returns credit, leave_group")
def _():
    t = f"sub-{RUN}"
    admin.create_topic(t, 0)
    recs = [Record(f"s{i % 3}".encode(), f"sv-{i}".encode(), i) for i in range(23)]
    assert admin.produce(t, recs) == 23
    s = conn(timeout=10)
    group, member = f"sg-{RUN}", "m1"
    corr = s.subscribe(t, group, member, window=5, max=2)
    received = []
    unacked = 0
    max_unacked = 0
    sizes = []
    acks = 0
    last_cursor = None
    stalls = 0
    while len(received) < 23 and stalls < 5:
        s.settimeout(1.5)
        try:
            push = s.read_push(corr)
        except socket.timeout:
            # stalled: window must be full (5 unacked) unless everything is delivered
            assert unacked == 5 or len(received) == 23, f"stalled with {unacked} unacked"
            stalls += 1
            s.stream_ack(t, group, member, last_cursor, unacked)
            acks += 1
            unacked = 0
            continue
        stalls = 0
        n = len(push.records)
        sizes.append(n)
        assert n <= 2, f"push of {n} > max 2"
        assert n <= 5 - unacked, f"push of {n} with {unacked} unacked exceeds window"
        unacked += n
        max_unacked = max(max_unacked, unacked)
        assert unacked <= 5
        received.extend(push.records)
        if push.next_cursor is not None:
            last_cursor = push.next_cursor
    if unacked:
        s.stream_ack(t, group, member, last_cursor, unacked)
        acks += 1
    assert Counter(map(enc_record, received)) == Counter(map(enc_record, recs)), f"got {len(received)}"
    s.settimeout(10)
    s.leave_group(t, group, member)
    s.close()
    # the last stream_ack committed the cursor: the group resumes at the end
    r = admin.fetch(t, None, group, None, max=1000)
    return (
        f"push sizes={sizes}, max unacked={max_unacked}, acks={acks}; "
        f"group fetch after final ack -> {len(r.records)} records"
    )


@check("stream_ack produces no reply frame (extra)")
def _():
    t = f"sub2-{RUN}"
    admin.create_topic(t, 0)
    admin.produce(t, [Record(b"a", b"1", 1)])
    s = conn()
    corr = s.subscribe(t, f"sg2-{RUN}", "m", window=10, max=10)
    p = s.read_push(corr)
    assert len(p.records) == 1
    ack_corr = s.stream_ack(t, f"sg2-{RUN}", "m", p.next_cursor, 1)
    s.settimeout(1.0)
    frames = []
    try:
        while True:
            frames.append(s.read_response())
    except socket.timeout:
        pass
    s.settimeout(10)
    s.leave_group(t, f"sg2-{RUN}", "m")
    s.close()
    bad = [f for f in frames if f.correlation_id == ack_corr]
    assert not bad, f"reply to stream_ack: {bad}"
    return f"other frames seen in 1 s: {[(f.correlation_id, len(f.payload)) for f in frames]}"


# ------------------------------------------------------------------ users and ACLs

U = f"user{RUN}"


@check("user management: create, list, change password, log in with new, delete")
def _():
    admin.create_user(U, "pw-one", ["produce", "consume"])
    users = dict(admin.list_users())
    assert U.encode() in users, list(users)
    assert sorted(users[U.encode()]) == [b"consume", b"produce"], users[U.encode()]
    c = conn(U, "pw-one")
    c.close()
    admin.change_password(U, "pw-two")
    c = conn(U, "pw-two")
    c.close()
    c = Connection(HOST, PORT)
    expect_error(lambda: c.auth(U, "pw-one"), "invalid_credentials")
    c.close()
    expect_error(lambda: admin.create_user(U, "x", ["produce"]), "user_exists")
    return f"list_users -> {sorted(k.decode() for k in users)}"


@check("ACLs: grant, list, revoke")
def _():
    admin.grant_acl(U, "produce", "orders.*")
    admin.grant_acl(U, "consume", "exact-topic")
    acls = admin.list_acls(U)
    assert (b"produce", b"orders.*") in acls and (b"consume", b"exact-topic") in acls, acls
    admin.revoke_acl(U, "produce", "orders.*")
    acls2 = admin.list_acls(U)
    assert (b"produce", b"orders.*") not in acls2 and (b"consume", b"exact-topic") in acls2, acls2
    admin.revoke_acl(U, "consume", "exact-topic")
    acls3 = admin.list_acls(U)
    return f"after grant {acls}; after revokes {acls3}"


@check("grant_acl bad op -> invalid_operation (extra)")
def _():
    expect_error(lambda: admin.grant_acl(U, "admin", "x"), "invalid_operation")


@check("delete user, then login fails and not listed")
def _():
    admin.delete_user(U)
    c = Connection(HOST, PORT)
    expect_error(lambda: c.auth(U, "pw-two"), "invalid_credentials")
    c.close()
    assert U.encode() not in dict(admin.list_users())
    expect_error(lambda: admin.delete_user(U), "user_not_found")


@check("create_user bad perms -> invalid_permissions (extra)")
def _():
    expect_error(lambda: admin.create_user(f"bp{RUN}", "x", ["superuser"]), "invalid_permissions")


@check("consumer producing -> permission_denied")
def _():
    c = conn("consumer", "consumer123")
    expect_error(lambda: c.produce(T_SHAPES, [Record(b"x", b"y", 0)]), "permission_denied")
    c.close()


@check("non-admin list_users -> permission_denied (extra)")
def _():
    c = conn("app", "app123")
    expect_error(lambda: c.list_users(), "permission_denied")
    c.close()


# ------------------------------------------------------------------ errors


@check("unknown api key -> unknown_api_key with request's correlation id")
def _():
    c = conn()
    out = []
    for key in (12, 13, 63, 65, 999, 65535):  # 64 is a (list-topics-like) extension
        corr = c.send_request(key, b"whatever", corr=0x10000 + key)
        r = c.read_response()
        assert r.correlation_id == corr, f"key {key}: corr {r.correlation_id} != {corr}"
        assert r.error_code == 1 and Reader(r.payload).str() == b"unknown_api_key", (key, r)
        out.append(key)
    # still usable afterwards (informational assert)
    c.fetch(T_SHAPES, None, max=1)
    c.close()
    return f"keys {out}; connection still usable"


@check("malformed payload -> malformed_request with request's correlation id")
def _():
    c = conn()
    cases = {
        "truncated (missing u8)": (CREATE_TOPIC, enc_str(f"mal-{RUN}")),
        "trailing byte": (CREATE_TOPIC, enc_str(f"mal2-{RUN}") + enc_u8(0) + b"\x00"),
        "bad str tag 0x02": (FETCH, b"\x02" + b"\x00" * 20),
        "str len past end": (PRODUCE, b"\x01" + struct.pack(">I", 1000) + b"abc"),
        "record count too high": (PRODUCE, enc_str(T_SHAPES) + enc_u32(3) + enc_record(Record(b"a", b"b", 0))),
        "empty payload": (FETCH, b""),
    }
    seen = {}
    for i, (name, (key, payload)) in enumerate(cases.items()):
        corr = c.send_request(key, payload, corr=7000 + i)
        r = c.read_response()
        reason = Reader(r.payload).str()
        seen[name] = (r.correlation_id, reason)
        assert r.correlation_id == corr and r.error_code == 1 and reason == b"malformed_request", (name, r, reason)
    c.fetch(T_SHAPES, None, max=1)
    c.close()
    return f"{len(cases)} variants; connection still usable"


@check("frame length > 16 MiB -> frame_too_large, corr 0, close")
def _():
    c = conn()
    c.send_raw(struct.pack(">I", 16 * 1024 * 1024 + 1) + struct.pack(">HI", FETCH, 99))
    r = c.read_response()
    reason = Reader(r.payload).str()
    assert r.correlation_id == 0, r.correlation_id
    assert r.error_code == 1 and reason == b"frame_too_large", (r, reason)
    how = assert_closed(c)
    c.close()
    return f"close={how}"


@check("frame length > 16 MiB before auth (extra)")
def _():
    c = Connection(HOST, PORT)
    c.send_raw(struct.pack(">I", 0xFFFFFFFF))
    r = c.read_response()
    reason = Reader(r.payload).str()
    how = assert_closed(c)
    c.close()
    assert r.correlation_id == 0 and reason == b"frame_too_large", (r.correlation_id, reason)
    return f"close={how}"


@check("frame of exactly 16 MiB is not frame_too_large (extra)")
def _():
    c = conn(timeout=30)
    t = f"big-{RUN}"
    admin.create_topic(t, 0)
    head = enc_str(t) + enc_u32(1)
    rec_fixed = len(enc_record(Record(b"k", b"", 0)))
    body_len = 16 * 1024 * 1024
    value_len = body_len - 6 - len(head) - rec_fixed
    payload = head + enc_record(Record(b"k", b"\xab" * value_len, 0))
    body = request_body(PRODUCE, 31337, payload)
    assert len(body) == body_len
    c.send_raw(frame(body))
    r = c.read_response()
    reason = Reader(r.payload).str() if r.error_code else None
    c.close()
    assert reason != b"frame_too_large", reason
    return f"corr={r.correlation_id} code={r.error_code} reason={reason!r}"


@check("pipelined: 10 produces sent before reading, all answered by correlation id")
def _():
    t = f"pipe-{RUN}"
    admin.create_topic(t, 0)
    c = conn()
    data = b""
    corrs = []
    for i in range(10):
        corr = 900 + i
        corrs.append(corr)
        data += frame(request_body(PRODUCE, corr, encode_produce(t, [Record(b"p", f"p-{i}".encode(), i)] * (i + 1))))
    c.send_raw(data)
    seen = {}
    order = []
    for _ in range(10):
        r = c.read_response()
        assert r.error_code == 0, (r, Reader(r.payload).str())
        rd = Reader(r.payload)
        seen[r.correlation_id] = rd.u32()
        rd.end()
        order.append(r.correlation_id)
    c.close()
    assert seen == {900 + i: i + 1 for i in range(10)}, seen
    got, _, _ = fetch_all(admin, t)
    assert [r.value for r in got] == [f"p-{i}".encode() for i in range(10) for _ in range(i + 1)]
    return f"reply order {'in order' if order == corrs else order}; per-key order kept"


@check("unexpected second auth (extra)")
def _():
    c = conn()
    try:
        c.auth("app", "app123")
        res = "accepted"
    except BrokerError as e:
        res = e.reason
    except Closed:
        res = "closed"
    c.close()
    return res


admin.close()
print()
passed = sum(1 for _, ok, _ in results if ok)
print(f"{passed}/{len(results)} passed")
for name, ok, detail in results:
    if not ok:
        print(f"  FAILED: {name}: {detail}")
sys.exit(0 if passed == len(results) else 1)
