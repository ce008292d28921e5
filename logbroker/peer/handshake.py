"""The peer handshake: one side's sans-IO state machine (no Twisted, no sockets, no logging).

Each side of a new peer connection, the dialer and the listener alike, runs one ``Handshake``:
``start()`` gives the messages to send first, ``receive(message)`` the messages to send in
answer; ``outcome`` says how it ended. The protocol adapter sends what it is given and closes the
connection once ``outcome`` is ``Refused`` (after sending the ``Refuse``, if there is one).

States and transitions (``HandshakeState``)::

    AWAITING_HELLO --Hello ok-----------------> AWAITING_PROOF      (sends Proof)
    AWAITING_PROOF --Proof verifies-----------> AWAITING_WELCOME    (sends Welcome)
    AWAITING_WELCOME --Welcome----------------> ESTABLISHED
    any of the three --Refuse-----------------> REFUSED (by the peer)
    any of the three --a check fails, an unexpected message, fail()--> REFUSED (sends Refuse)

Both sides send ``Hello(PROTOCOL_VERSION, cluster_id, node_id, nonce)`` at once, ``nonce`` being
32 fresh random bytes. On the peer's Hello each side checks, in this order, and refuses with:

* another protocol version, higher or lower: ``incompatible_version``;
* another cluster id: ``wrong_cluster``;
* this node's own id: ``same_node_id`` (a connection back to ourselves, or two nodes set up
  with one id);
* on the dialing side, a node id other than the one dialed: ``unexpected_node``;
* over mutual TLS (``PeerIdentity.mutual_tls``), a node id the peer's certificate does not
  name: ``wrong_certificate``. TLS has verified the certificate against the cluster's CA before
  the first byte; the protocol adapter hands its names (``certified``) to the handshake. A
  certificate names node ``n`` of cluster ``c`` with the subjectAltName
  ``URI:logbroker://c/n`` (``node_uri``), so that a node's certificate is good for that node of
  that cluster only: a node holding its own certificate cannot pass for another.

Each side then proves it holds the cluster secret (``SVC_CLUSTER_SECRET``), over TLS as
without it::

    mac_input(role, node_id, verifier_nonce, prover_nonce) =
        text("logbroker-peer-v1") | text(role) | text(cluster_id) | text(node_id)
        | verifier_nonce[32] | prover_nonce[32]
    Proof.mac = HMAC-SHA256(key=secret, msg=mac_input(own role, own node id,
                                                      the peer's nonce, own nonce))

where ``text = len:u16 utf8`` as in the codec, ``|`` is concatenation, and ``role`` is
``"dialer"`` or ``"listener"``: the role of the side making the proof. Each side recomputes the
peer's proof with the peer's role, the peer's node id, its own nonce and the peer's nonce, and
compares with ``hmac.compare_digest``; a mismatch is ``bad_credentials``. Every field is length
prefixed or fixed size, so no two inputs concatenate alike. A proof sent back to the side that
made it (reflected) never verifies: the role, the node id and the order of the nonces all
differ. The fresh nonce of the verifier makes every proof good for one connection only. The
secret authenticates the handshake, not the frames after it: that is TLS's job where the
network is not trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from enum import Enum, auto

import attrs
from cryptography import x509

from logbroker.peer.frames import (
    NONCE_SIZE,
    PROTOCOL_VERSION,
    Hello,
    PeerMessage,
    PeerReason,
    Proof,
    Refuse,
    Welcome,
    encode_text,
)

#: Domain separation: a MAC made for anything else never verifies as a peer proof.
PROOF_DOMAIN = "logbroker-peer-v1"


def node_uri(cluster_id: str, node_id: str) -> str:
    """The subjectAltName URI by which a certificate names node ``node_id`` of a cluster."""
    return f"logbroker://{cluster_id}/{node_id}"


def certificate_uris(certificate: x509.Certificate) -> frozenset[str]:
    """The URIs among ``certificate``'s subjectAltNames."""
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return frozenset()
    return frozenset(names.value.get_values_for_type(x509.UniformResourceIdentifier))


class Role(Enum):
    DIALER = "dialer"
    LISTENER = "listener"

    @property
    def other(self) -> Role:
        return Role.LISTENER if self is Role.DIALER else Role.DIALER


def proof_mac(
    secret: bytes,
    role: Role,
    cluster_id: str,
    node_id: str,
    verifier_nonce: bytes,
    prover_nonce: bytes,
) -> bytes:
    """The proof that the ``role`` side, node ``node_id``, holds ``secret`` (module docstring)."""
    message = b"".join(
        (
            encode_text(PROOF_DOMAIN),
            encode_text(role.value),
            encode_text(cluster_id),
            encode_text(node_id),
            verifier_nonce,
            prover_nonce,
        )
    )
    return hmac.new(secret, message, hashlib.sha256).digest()


@attrs.frozen
class PeerIdentity:
    """Who this node is to its peers: the cluster ``secret`` each side proves it holds, and
    whether peer connections are ``mutual_tls`` (the transport has verified the peer's
    certificate, which must then name the node id the peer claims)."""

    cluster_id: str
    node_id: str
    secret: bytes = attrs.field(repr=False)
    mutual_tls: bool = False

    def __attrs_post_init__(self) -> None:
        if not self.cluster_id or not self.node_id:
            raise ValueError("a peer identity needs a cluster id and a node id")
        if not self.secret:
            raise ValueError("the cluster secret must not be empty")


class HandshakeState(Enum):
    AWAITING_HELLO = auto()
    AWAITING_PROOF = auto()
    AWAITING_WELCOME = auto()
    ESTABLISHED = auto()
    REFUSED = auto()


@attrs.frozen
class Established:
    peer_node_id: str


@attrs.frozen
class Refused:
    """How a handshake failed. ``by_peer``: the peer refused us (its ``Refuse``), rather than us
    refusing it. ``detail`` is meant for a log line; ``peer_node_id`` is None when the peer's
    Hello never came."""

    reason: str
    detail: str
    by_peer: bool
    peer_node_id: str | None


class Handshake:
    """One side of the handshake of one connection."""

    def __init__(
        self,
        role: Role,
        identity: PeerIdentity,
        *,
        expected_peer: str | None = None,
        nonce: bytes | None = None,
    ) -> None:
        if nonce is None:
            nonce = secrets.token_bytes(NONCE_SIZE)
        if len(nonce) != NONCE_SIZE:
            raise ValueError(f"a nonce is {NONCE_SIZE} bytes")
        self.role = role
        self._identity = identity
        #: The node id the dialer meant to reach (the dialing side only).
        self._expected_peer = expected_peer
        self._nonce = nonce
        self._peer_hello: Hello | None = None
        #: The URIs of the peer's certificate, once TLS has verified it (``certified``).
        self._certified: frozenset[str] | None = None
        self.state = HandshakeState.AWAITING_HELLO
        self.outcome: Established | Refused | None = None

    @property
    def mutual_tls(self) -> bool:
        """Whether the connection is mutual TLS (``PeerIdentity.mutual_tls``)."""
        return self._identity.mutual_tls

    @property
    def peer_node_id(self) -> str | None:
        """What the peer said its node id was (not yet verified before ``ESTABLISHED``)."""
        return None if self._peer_hello is None else self._peer_hello.node_id

    def certified(self, uris: frozenset[str]) -> None:
        """TLS verified the peer's certificate, which names ``uris``: under ``mutual_tls`` the
        node id of the peer's Hello must be one of them."""
        self._certified = uris

    def start(self) -> list[PeerMessage]:
        """What to send as soon as the connection is made."""
        identity = self._identity
        return [Hello(PROTOCOL_VERSION, identity.cluster_id, identity.node_id, self._nonce)]

    def receive(self, message: PeerMessage) -> list[PeerMessage]:
        """Take one message from the peer; return what to send in answer."""
        state = self.state
        if state is HandshakeState.ESTABLISHED:
            raise ValueError("the handshake is over: messages go to the connection now")
        if state is HandshakeState.REFUSED:
            return []
        if isinstance(message, Refuse):
            self._end(Refused(message.reason, message.detail, True, self.peer_node_id))
            return []
        if state is HandshakeState.AWAITING_HELLO and isinstance(message, Hello):
            return self._hello(message)
        if state is HandshakeState.AWAITING_PROOF and isinstance(message, Proof):
            return self._proof(message)
        if state is HandshakeState.AWAITING_PROOF and isinstance(message, Welcome):
            return self.fail(PeerReason.BAD_CREDENTIALS, "the peer sent no proof")
        if state is HandshakeState.AWAITING_WELCOME and isinstance(message, Welcome):
            peer = self.peer_node_id
            assert peer is not None
            self._end(Established(peer))
            return []
        return self.fail(
            PeerReason.UNEXPECTED_MESSAGE,
            f"{type(message).__name__} while {state.name.lower().replace('_', ' ')}",
        )

    def fail(self, reason: PeerReason, detail: str) -> list[PeerMessage]:
        """Refuse the peer (a check failed, bad bytes, a timeout): the ``Refuse`` to send."""
        if self.state in (HandshakeState.ESTABLISHED, HandshakeState.REFUSED):
            return []
        self._end(Refused(reason, detail, False, self.peer_node_id))
        return [Refuse(reason, detail)]

    def _end(self, outcome: Established | Refused) -> None:
        self.outcome = outcome
        if isinstance(outcome, Established):
            self.state = HandshakeState.ESTABLISHED
        else:
            self.state = HandshakeState.REFUSED

    def _hello(self, hello: Hello) -> list[PeerMessage]:
        self._peer_hello = hello
        identity = self._identity
        if hello.protocol_version != PROTOCOL_VERSION:
            return self.fail(
                PeerReason.INCOMPATIBLE_VERSION,
                f"the peer speaks version {hello.protocol_version} of the peer protocol,"
                f" this node version {PROTOCOL_VERSION}",
            )
        if hello.cluster_id != identity.cluster_id:
            return self.fail(
                PeerReason.WRONG_CLUSTER,
                f"the peer is in cluster {hello.cluster_id!r}, this node in"
                f" {identity.cluster_id!r}",
            )
        if hello.node_id == identity.node_id:
            return self.fail(
                PeerReason.SAME_NODE_ID,
                f"the peer says it is node {hello.node_id!r}, which is this node's own id",
            )
        expected = self._expected_peer
        if expected is not None and hello.node_id != expected:
            return self.fail(
                PeerReason.UNEXPECTED_NODE,
                f"dialed node {expected!r}, but node {hello.node_id!r} answered",
            )
        if identity.mutual_tls:
            claimed = node_uri(identity.cluster_id, hello.node_id)
            certified = self._certified
            if certified is None:
                # TLS hands the certificate over before any byte: this is a wiring error.
                return self.fail(PeerReason.BAD_CREDENTIALS, "no certificate from the peer")
            if claimed not in certified:
                named = ", ".join(sorted(certified)) or "no URI"
                return self.fail(
                    PeerReason.WRONG_CERTIFICATE,
                    f"the peer says it is node {hello.node_id!r}, but its certificate names"
                    f" {named}, not {claimed}",
                )
        self.state = HandshakeState.AWAITING_PROOF
        mac = proof_mac(
            identity.secret,
            self.role,
            identity.cluster_id,
            identity.node_id,
            hello.nonce,
            self._nonce,
        )
        return [Proof(mac)]

    def _proof(self, proof: Proof) -> list[PeerMessage]:
        identity = self._identity
        hello = self._peer_hello
        assert hello is not None
        expected = proof_mac(
            identity.secret,
            self.role.other,
            identity.cluster_id,
            hello.node_id,
            self._nonce,
            hello.nonce,
        )
        if not hmac.compare_digest(expected, proof.mac):
            return self.fail(
                PeerReason.BAD_CREDENTIALS,
                f"node {hello.node_id!r} does not prove it holds this cluster's secret"
                " (SVC_CLUSTER_SECRET differs between the two nodes?)",
            )
        self.state = HandshakeState.AWAITING_WELCOME
        return [Welcome()]
