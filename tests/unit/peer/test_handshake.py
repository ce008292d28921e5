"""The peer handshake (``logbroker.peer.handshake``) between two sans-IO sides: the Hello
checks, the proof of the cluster secret, and over mutual TLS the node names of the
certificates."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from logbroker.peer.frames import (
    PROTOCOL_VERSION,
    Hello,
    PeerMessage,
    PeerReason,
    Ping,
    Proof,
    Refuse,
    Welcome,
    decode_body,
    encode_body,
)
from logbroker.peer.handshake import (
    Established,
    Handshake,
    HandshakeState,
    PeerIdentity,
    Refused,
    Role,
    certificate_uris,
    node_uri,
    proof_mac,
)
from tests.certificates import issue, make_ca

SECRET = b"cluster secret"
DIALER_NONCE = b"d" * 32
LISTENER_NONCE = b"l" * 32


def identity(
    node_id: str, cluster_id: str = "c1", secret: bytes = SECRET, mutual_tls: bool = False
) -> PeerIdentity:
    return PeerIdentity(cluster_id, node_id, secret, mutual_tls)


def pair(
    dialer: PeerIdentity | None = None,
    listener: PeerIdentity | None = None,
    expected_peer: str | None = None,
) -> tuple[Handshake, Handshake]:
    return (
        Handshake(
            Role.DIALER,
            dialer or identity("a"),
            expected_peer=expected_peer,
            nonce=DIALER_NONCE,
        ),
        Handshake(Role.LISTENER, listener or identity("b"), nonce=LISTENER_NONCE),
    )


def run(dialer: Handshake, listener: Handshake) -> list[tuple[str, PeerMessage]]:
    """Exchange messages until neither side has anything to send; every message goes through
    the codec. Returns what was sent, in order, by whom."""
    sent: list[tuple[str, PeerMessage]] = []
    to_listener = list(dialer.start())
    to_dialer = list(listener.start())
    while to_listener or to_dialer:
        if to_listener:
            message = to_listener.pop(0)
            sent.append(("dialer", message))
            to_dialer.extend(listener.receive(decode_body(encode_body(message))))
        if to_dialer:
            message = to_dialer.pop(0)
            sent.append(("listener", message))
            to_listener.extend(dialer.receive(decode_body(encode_body(message))))
    return sent


def test_both_sides_establish_with_the_shared_secret() -> None:
    dialer, listener = pair(expected_peer="b")
    sent = run(dialer, listener)
    assert dialer.outcome == Established("b")
    assert listener.outcome == Established("a")
    assert dialer.state is listener.state is HandshakeState.ESTABLISHED
    kinds = [(who, type(message)) for who, message in sent]
    assert kinds.count(("dialer", Proof)) == kinds.count(("listener", Proof)) == 1
    assert ("dialer", Welcome) in kinds
    assert ("listener", Welcome) in kinds


def test_the_proof_is_exactly_the_documented_hmac() -> None:
    dialer, listener = pair()
    sent = run(dialer, listener)
    [dialer_proof] = [m for who, m in sent if who == "dialer" and isinstance(m, Proof)]
    # text = len:u16 utf8; the dialer proves itself over the listener's nonce, then its own.
    expected_input = (
        b"\x00\x11logbroker-peer-v1"
        + b"\x00\x06dialer"
        + b"\x00\x02c1"
        + b"\x00\x01a"
        + LISTENER_NONCE
        + DIALER_NONCE
    )
    assert dialer_proof.mac == hmac.new(SECRET, expected_input, hashlib.sha256).digest()


def test_hello_carries_version_cluster_node_and_a_fresh_nonce() -> None:
    [hello] = Handshake(Role.DIALER, identity("a")).start()
    assert isinstance(hello, Hello)
    assert (hello.protocol_version, hello.cluster_id, hello.node_id) == (
        PROTOCOL_VERSION,
        "c1",
        "a",
    )
    [other] = Handshake(Role.DIALER, identity("a")).start()
    assert isinstance(other, Hello)
    assert other.nonce != hello.nonce


def test_another_cluster_is_refused() -> None:
    dialer, listener = pair(dialer=identity("a", cluster_id="c2"))
    sent = run(dialer, listener)
    assert isinstance(listener.outcome, Refused)
    assert listener.outcome.reason == PeerReason.WRONG_CLUSTER
    assert not listener.outcome.by_peer
    assert "'c2'" in listener.outcome.detail
    assert isinstance(dialer.outcome, Refused)
    assert dialer.outcome.reason == PeerReason.WRONG_CLUSTER
    # Neither side sent a proof to a node of another cluster.
    assert not any(isinstance(message, Proof) for _, message in sent)


def test_a_wrong_secret_is_refused() -> None:
    dialer, listener = pair(dialer=identity("a", secret=b"another secret"))
    run(dialer, listener)
    for side in (dialer, listener):
        assert isinstance(side.outcome, Refused)
        assert side.outcome.reason == PeerReason.BAD_CREDENTIALS
        assert side.state is HandshakeState.REFUSED
    # Each side found the other's proof wrong: neither was refused only by the peer.
    assert not dialer.outcome.by_peer or not listener.outcome.by_peer


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 0xFFFF])
def test_another_version_is_refused(version: int) -> None:
    listener = Handshake(Role.LISTENER, identity("b"), nonce=LISTENER_NONCE)
    listener.start()
    [refusal] = listener.receive(Hello(version, "c1", "a", DIALER_NONCE))
    assert refusal == Refuse(PeerReason.INCOMPATIBLE_VERSION, refusal.detail)
    assert f"version {version}" in refusal.detail
    assert isinstance(listener.outcome, Refused)
    assert listener.outcome.reason == PeerReason.INCOMPATIBLE_VERSION
    assert listener.outcome.peer_node_id == "a"


def test_a_reflected_proof_never_verifies() -> None:
    """The listener's own proof, sent back to it as if it were the dialer's."""
    listener = Handshake(Role.LISTENER, identity("b"), nonce=LISTENER_NONCE)
    listener.start()
    [own_proof] = listener.receive(Hello(PROTOCOL_VERSION, "c1", "a", DIALER_NONCE))
    assert isinstance(own_proof, Proof)
    [refusal] = listener.receive(own_proof)
    assert isinstance(refusal, Refuse)
    assert refusal.reason == PeerReason.BAD_CREDENTIALS


def test_a_proof_made_for_the_other_role_never_verifies() -> None:
    """Everything right but the role: a proof a listener would make does not pass for a dialer
    (one connection's listener proof cannot be replayed as a dialer proof on another)."""
    listener = Handshake(Role.LISTENER, identity("b"), nonce=LISTENER_NONCE)
    listener.start()
    listener.receive(Hello(PROTOCOL_VERSION, "c1", "a", DIALER_NONCE))
    wrong_role = proof_mac(SECRET, Role.LISTENER, "c1", "a", LISTENER_NONCE, DIALER_NONCE)
    right_role = proof_mac(SECRET, Role.DIALER, "c1", "a", LISTENER_NONCE, DIALER_NONCE)
    assert wrong_role != right_role
    [refusal] = listener.receive(Proof(wrong_role))
    assert isinstance(refusal, Refuse)
    assert refusal.reason == PeerReason.BAD_CREDENTIALS


def test_the_right_proof_verifies() -> None:
    listener = Handshake(Role.LISTENER, identity("b"), nonce=LISTENER_NONCE)
    listener.start()
    listener.receive(Hello(PROTOCOL_VERSION, "c1", "a", DIALER_NONCE))
    mac = proof_mac(SECRET, Role.DIALER, "c1", "a", LISTENER_NONCE, DIALER_NONCE)
    assert listener.receive(Proof(mac)) == [Welcome()]
    assert listener.receive(Welcome()) == []
    assert listener.outcome == Established("a")


def test_a_peer_claiming_our_own_node_id_is_refused() -> None:
    dialer, listener = pair(dialer=identity("b"), listener=identity("b"))
    run(dialer, listener)
    assert isinstance(listener.outcome, Refused)
    assert listener.outcome.reason == PeerReason.SAME_NODE_ID
    assert isinstance(dialer.outcome, Refused)
    assert dialer.outcome.reason == PeerReason.SAME_NODE_ID


def test_the_dialer_refuses_a_node_other_than_the_one_it_dialed() -> None:
    dialer, listener = pair(expected_peer="c")
    run(dialer, listener)
    assert isinstance(dialer.outcome, Refused)
    assert dialer.outcome.reason == PeerReason.UNEXPECTED_NODE
    assert not dialer.outcome.by_peer
    assert isinstance(listener.outcome, Refused)
    assert listener.outcome.reason == PeerReason.UNEXPECTED_NODE
    assert listener.outcome.by_peer


# -- over mutual TLS: the certificates name the nodes -----------------------------------------


def tls_pair(
    dialer_names: frozenset[str] | None,
    listener_names: frozenset[str] | None,
    dialer_secret: bytes = SECRET,
) -> tuple[Handshake, Handshake]:
    """Two mutual TLS sides, each handed (unless None) the names of the other's certificate."""
    dialer, listener = pair(
        dialer=identity("a", secret=dialer_secret, mutual_tls=True),
        listener=identity("b", mutual_tls=True),
        expected_peer="b",
    )
    if dialer_names is not None:
        listener.certified(dialer_names)
    if listener_names is not None:
        dialer.certified(listener_names)
    return dialer, listener


def test_a_node_is_named_by_the_uri_of_its_cluster_and_id() -> None:
    assert node_uri("prod", "broker-1") == "logbroker://prod/broker-1"


def test_certificates_naming_their_nodes_establish_and_the_secret_is_still_proven() -> None:
    dialer, listener = tls_pair(
        frozenset({"logbroker://c1/a"}), frozenset({"logbroker://c1/b", "logbroker://c1/x"})
    )
    sent = run(dialer, listener)
    assert dialer.outcome == Established("b")
    assert listener.outcome == Established("a")
    assert sum(isinstance(message, Proof) for _, message in sent) == 2


@pytest.mark.parametrize(
    "names",
    [
        pytest.param(frozenset({"logbroker://c1/x"}), id="another-node"),
        pytest.param(frozenset({"logbroker://c2/a"}), id="another-cluster"),
        pytest.param(frozenset(), id="no-uri"),
    ],
)
def test_the_listener_refuses_a_dialer_whose_certificate_names_another(
    names: frozenset[str],
) -> None:
    dialer, listener = tls_pair(names, frozenset({"logbroker://c1/b"}))
    sent = run(dialer, listener)
    assert isinstance(listener.outcome, Refused)
    assert listener.outcome.reason == PeerReason.WRONG_CERTIFICATE
    assert not listener.outcome.by_peer
    assert "not logbroker://c1/a" in listener.outcome.detail
    assert (", ".join(sorted(names)) or "no URI") in listener.outcome.detail
    # Refused before anything of the secret is proven to the impostor.
    assert not any(isinstance(m, Proof) for who, m in sent if who == "listener")
    assert isinstance(dialer.outcome, Refused)
    assert dialer.outcome.by_peer


def test_the_dialer_refuses_a_listener_whose_certificate_names_another() -> None:
    dialer, listener = tls_pair(frozenset({"logbroker://c1/a"}), frozenset({"logbroker://c1/a"}))
    run(dialer, listener)
    assert isinstance(dialer.outcome, Refused)
    assert dialer.outcome.reason == PeerReason.WRONG_CERTIFICATE
    assert "node 'b'" in dialer.outcome.detail


def test_without_a_certificate_handed_over_a_mutual_tls_side_refuses() -> None:
    dialer, listener = tls_pair(None, frozenset({"logbroker://c1/b"}))
    run(dialer, listener)
    assert isinstance(listener.outcome, Refused)
    assert listener.outcome.reason == PeerReason.BAD_CREDENTIALS


def test_over_mutual_tls_a_wrong_secret_is_still_refused() -> None:
    dialer, listener = tls_pair(
        frozenset({"logbroker://c1/a"}), frozenset({"logbroker://c1/b"}), dialer_secret=b"wrong"
    )
    run(dialer, listener)
    assert isinstance(listener.outcome, Refused)
    assert listener.outcome.reason == PeerReason.BAD_CREDENTIALS


def test_the_uris_of_a_certificate_are_its_uri_subject_alternative_names() -> None:
    certificate = issue(
        make_ca(), ("broker-1.example", "10.0.0.1"), uris=("logbroker://c1/a", "https://x/")
    ).certificate
    assert certificate_uris(certificate) == {"logbroker://c1/a", "https://x/"}
    assert certificate_uris(issue(make_ca()).certificate) == frozenset()


def test_an_unexpected_message_is_refused() -> None:
    listener = Handshake(Role.LISTENER, identity("b"), nonce=LISTENER_NONCE)
    listener.start()
    [refusal] = listener.receive(Ping(1))
    assert isinstance(refusal, Refuse)
    assert refusal.reason == PeerReason.UNEXPECTED_MESSAGE
    assert "awaiting hello" in refusal.detail


def test_a_welcome_before_the_proof_is_refused() -> None:
    listener = Handshake(Role.LISTENER, identity("b"), nonce=LISTENER_NONCE)
    listener.start()
    listener.receive(Hello(PROTOCOL_VERSION, "c1", "a", DIALER_NONCE))
    [refusal] = listener.receive(Welcome())
    assert isinstance(refusal, Refuse)
    assert refusal.reason == PeerReason.BAD_CREDENTIALS


def test_a_refusal_from_the_peer_ends_the_handshake() -> None:
    dialer = Handshake(Role.DIALER, identity("a"), nonce=DIALER_NONCE)
    dialer.start()
    assert dialer.receive(Refuse("wrong_cluster", "go away")) == []
    assert dialer.outcome == Refused("wrong_cluster", "go away", True, None)
    # Nothing more is said once it is over.
    assert dialer.receive(Welcome()) == []
    assert dialer.fail(PeerReason.TIMEOUT, "late") == []


def test_fail_refuses_with_the_reason_given() -> None:
    dialer = Handshake(Role.DIALER, identity("a"), nonce=DIALER_NONCE)
    dialer.start()
    assert dialer.fail(PeerReason.TIMEOUT, "no handshake within 10 seconds") == [
        Refuse(PeerReason.TIMEOUT, "no handshake within 10 seconds")
    ]
    assert dialer.outcome == Refused(
        PeerReason.TIMEOUT, "no handshake within 10 seconds", False, None
    )


def test_messages_after_the_handshake_are_not_its_business() -> None:
    dialer, listener = pair()
    run(dialer, listener)
    with pytest.raises(ValueError, match="over"):
        dialer.receive(Ping(1))


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: PeerIdentity("c1", "a", b""), id="empty-secret"),
        pytest.param(lambda: PeerIdentity("c1", "a", b"", mutual_tls=True), id="tls-no-secret"),
        pytest.param(lambda: PeerIdentity("", "a", SECRET), id="no-cluster"),
        pytest.param(lambda: PeerIdentity("c1", "", SECRET), id="no-node"),
    ],
)
def test_an_identity_must_say_how_peers_authenticate(build: object) -> None:
    assert callable(build)
    with pytest.raises(ValueError):  # noqa: PT011 - each check says what, in its own words
        build()


def test_the_secret_is_not_in_the_identity_repr() -> None:
    assert "cluster secret" not in repr(identity("a"))
