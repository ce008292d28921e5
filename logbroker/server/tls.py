"""TLS and plaintext on one client port, told apart by the first byte the client sends.

A TLS client speaks first, and its first byte is 0x16: the content type of the handshake record
that carries its ClientHello. A plaintext client's first frame starts with a 4-byte big-endian
length, whose first byte is 0x16 only for a frame of 352 MiB or more: never an ``auth``, the
only frame a connection may start with. So one port serves both, and ``SVC_REQUIRE_TLS`` is a
matter of answering plaintext ``tls_required`` rather than of running a second listener.

``secure_protocol`` puts the protocol the client factory built (the *inner* protocol) behind
``_TlsOrPlaintext``, whose lifecycle is::

    WAITING --first byte 0x16--------------------------> TLS (handshake, then inner's bytes)
    WAITING --another first byte, TLS offered-----------> PLAINTEXT
    WAITING --another first byte, TLS required----------> REFUSED (tls_required, then closed)
    any     --connection lost---------------------------> CLOSED

The inner protocol is connected at once, not when the first byte comes: its timers (the auth
timeout) run from the connection's start, and a protocol that counts connections sees every
one, lost before its first byte or not; its ``connectionLost`` comes exactly once. Until the
first byte it sees a plaintext connection, so what it writes and closes before then (an auth
timeout) goes out in plaintext and at once, since which layer that client speaks is not known
yet. (A refusal at accept waits for the first frame when it can; see ``ClientFactory``.) A TLS
connection the broker closes is aborted if the client has not answered the close_notify within
``CLOSE_NOTIFY_GRACE_SECONDS``.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from enum import Enum, auto
from typing import cast

from OpenSSL import SSL
from twisted.internet.interfaces import (
    IAddress,
    IConsumer,
    IDelayedCall,
    IHandshakeListener,
    IProducer,
    IProtocol,
    IPushProducer,
    IReactorTime,
    ITCPTransport,
    ITransport,
)
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from zope.interface import alsoProvides, implementer

from logbroker import wire
from logbroker._openssl import openssl_reasons
from logbroker.security.connections import client_identifier
from logbroker.security.tls import HandshakeOutcome, ServerTls
from logbroker.wire import Reason

log = Logger()

#: How long a TLS client has to answer the broker's close_notify before its socket is closed.
CLOSE_NOTIFY_GRACE_SECONDS = 2.0

#: The first byte of every TLS connection: the handshake record type of the ClientHello.
TLS_HANDSHAKE_RECORD = 0x16


def secure_protocol(protocol: Protocol, tls: ServerTls | None, clock: IReactorTime) -> Protocol:
    """``protocol`` as the client port serves it: unchanged while TLS is off; otherwise behind
    a first-byte check that puts TLS under it or leaves it plaintext (or refuses plaintext
    under ``tls.required``). ``clock`` runs the TLS layer's write coalescing."""
    if tls is None:
        return protocol
    return _TlsOrPlaintext(protocol, tls, clock)


class _TlsLayer(typing.Protocol):
    """What is used here of ``TLSMemoryBIOProtocol``, which Twisted leaves unannotated: the
    TCP connection's protocol below, the inner protocol's transport above."""

    def makeConnection(self, transport: ITransport) -> None: ...
    def dataReceived(self, data: bytes) -> None: ...
    def connectionLost(self, reason: Failure) -> None: ...
    def write(self, data: bytes) -> None: ...
    def writeSequence(self, data: Iterable[bytes]) -> None: ...
    def loseConnection(self) -> None: ...
    def abortConnection(self) -> None: ...


class _State(Enum):
    WAITING = auto()
    TLS = auto()
    PLAINTEXT = auto()
    REFUSED = auto()
    CLOSED = auto()


@implementer(ITransport, IConsumer, IPushProducer)
class _TlsOrPlaintext(Protocol):
    """The protocol of one TCP connection, and the transport of the inner protocol: its writes
    and closes go to the TLS layer once there is one, to the TCP connection otherwise."""

    def __init__(self, inner: IProtocol, tls: ServerTls, clock: IReactorTime) -> None:
        self._inner = inner
        self._tls = tls
        self._clock = clock
        self._state = _State.WAITING
        self._layer: _TlsLayer | None = None
        self._handshake_done = False
        #: Aborts a TLS connection whose client does not answer our close_notify.
        self._closing: IDelayedCall | None = None

    def _tcp(self) -> ITransport:
        assert self.transport is not None
        return self.transport

    # -- the TCP connection's protocol ---------------------------------------------------

    def connectionMade(self) -> None:
        if ITCPTransport.providedBy(self.transport):
            # So that the inner protocol may set its socket options (TCP_NODELAY).
            alsoProvides(self, ITCPTransport)
        self._inner.makeConnection(self)

    def dataReceived(self, data: bytes) -> None:
        if self._state is _State.WAITING:
            self._choose(data)
        elif self._state is _State.TLS:
            assert self._layer is not None
            self._layer.dataReceived(data)
        elif self._state is _State.PLAINTEXT:
            self._inner.dataReceived(data)
        # REFUSED: the connection is closing; what the client still sends is dropped.

    def _choose(self, data: bytes) -> None:
        if data[0] == TLS_HANDSHAKE_RECORD:
            self._state = _State.TLS
            factory = TLSMemoryBIOFactory(self._tls.options, False, Factory(), self._clock)
            # The inner protocol is connected already (to this object, which stays its
            # transport): the TLS layer only carries its bytes.
            layer = factory.protocol(factory, _TlsSide(self), _connectWrapped=False)
            self._layer = cast(_TlsLayer, layer)
            self._layer.makeConnection(self._tcp())
            self._layer.dataReceived(data)
        elif self._tls.required:
            self._state = _State.REFUSED
            self._tcp().write(wire.encode_error(0, Reason.TLS_REQUIRED))
            self._tcp().loseConnection()
        else:
            self._state = _State.PLAINTEXT
            self._inner.dataReceived(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self._closing is not None and self._closing.active():
            self._closing.cancel()
        self._closing = None
        state, self._state = self._state, _State.CLOSED
        if state is _State.TLS:
            # Through the TLS layer, which tells the inner protocol (``_TlsSide``).
            assert self._layer is not None
            self._layer.connectionLost(reason)
        else:
            self._inner.connectionLost(reason)

    def logPrefix(self) -> str:
        return f"{type(self._inner).__name__} (TLS or plaintext)"

    # -- the TLS layer's news (``_TlsSide``) ---------------------------------------------

    def _handshake_completed(self) -> None:
        self._handshake_done = True
        self._tls.on_handshake(HandshakeOutcome.OK)

    def _tls_lost(self, reason: Failure) -> None:
        if not self._handshake_done:
            self._tls.on_handshake(HandshakeOutcome.FAILED)
            error = reason.value
            log.info(
                "TLS handshake with {client_ip} failed: {reason}",
                client_ip=client_identifier(self._tcp().getPeer()),
                reason=(
                    openssl_reasons(error)
                    if isinstance(error, SSL.Error)
                    else reason.getErrorMessage()
                ),
            )
        self._inner.connectionLost(reason)

    # -- the inner protocol's transport --------------------------------------------------

    def _lower(self) -> _TlsLayer | ITransport:
        """Where the inner protocol's bytes go: TLS once the client chose it, else TCP (also
        once closed: the TLS layer cannot be used after that, TCP takes it as a no-op)."""
        if self._state is _State.TLS:
            assert self._layer is not None
            return self._layer
        return self._tcp()

    def write(self, data: bytes) -> None:
        self._lower().write(data)

    def writeSequence(self, data: Iterable[bytes]) -> None:
        self._lower().writeSequence(data)

    def loseConnection(self) -> None:
        if self._state is _State.TLS and not self._handshake_done:
            assert self._layer is not None
            # Mid-handshake, the TLS layer holds a close behind whatever was written meanwhile
            # until the handshake ends, which a stalled client never lets happen; nothing
            # written before the handshake ends could be read anyway.
            self._layer.abortConnection()
            return
        self._lower().loseConnection()
        if self._state is _State.TLS and self._closing is None:
            # The TLS layer sends close_notify and then waits for the client's own before it
            # closes the socket: a client that never answers would keep the connection, and
            # its slot under the connection limits, for ever.
            self._closing = self._clock.callLater(CLOSE_NOTIFY_GRACE_SECONDS, self._abort_tcp)

    def _abort_tcp(self) -> None:
        self._closing = None
        self._abort_below()

    def _abort_below(self) -> None:
        transport = self._tcp()
        if ITCPTransport.providedBy(transport):
            transport.abortConnection()
        else:
            transport.loseConnection()

    def getPeer(self) -> IAddress:
        return self._tcp().getPeer()

    def getHost(self) -> IAddress:
        return self._tcp().getHost()

    # Producers register with the TCP connection itself: the TLS layer would hold a
    # ``loseConnection`` until the producer unregisters, which the client protocol (a producer
    # for its whole life) never does. TCP's pauses are the ones that matter: the TLS layer
    # passes application bytes on as it gets them.

    def registerProducer(self, producer: IProducer, streaming: bool) -> None:
        IConsumer(self.transport).registerProducer(producer, streaming)

    def unregisterProducer(self) -> None:
        IConsumer(self.transport).unregisterProducer()

    def pauseProducing(self) -> None:
        IPushProducer(self.transport).pauseProducing()

    def resumeProducing(self) -> None:
        IPushProducer(self.transport).resumeProducing()

    def stopProducing(self) -> None:
        IPushProducer(self.transport).stopProducing()

    # ITCPTransport, provided when the connection is TCP (``connectionMade``).

    def abortConnection(self) -> None:
        if self._state is _State.TLS:
            assert self._layer is not None
            self._layer.abortConnection()
        else:
            self._abort_below()

    def loseWriteConnection(self) -> None:
        ITCPTransport(self.transport).loseWriteConnection()

    def getTcpNoDelay(self) -> bool:
        return ITCPTransport(self.transport).getTcpNoDelay()

    def setTcpNoDelay(self, enabled: bool) -> None:
        ITCPTransport(self.transport).setTcpNoDelay(enabled)

    def getTcpKeepAlive(self) -> bool:
        return ITCPTransport(self.transport).getTcpKeepAlive()

    def setTcpKeepAlive(self, enabled: bool) -> None:
        ITCPTransport(self.transport).setTcpKeepAlive(enabled)


@implementer(IHandshakeListener)
class _TlsSide(Protocol):
    """What the TLS layer wraps: hands the inner protocol its decrypted bytes and its
    connection's end, and tells the owner how the handshake went."""

    def __init__(self, owner: _TlsOrPlaintext) -> None:
        self._owner = owner

    def dataReceived(self, data: bytes) -> None:
        self._owner._inner.dataReceived(data)

    def handshakeCompleted(self) -> None:
        self._owner._handshake_completed()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._owner._tls_lost(reason)
