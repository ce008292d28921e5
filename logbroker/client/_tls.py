"""TLS for the Twisted clients: the broker's certificate must be signed by a trusted CA and name
the host the client asked for (checked by service_identity, DNS names and IP addresses alike)."""

from __future__ import annotations

from typing import cast

from cryptography import x509
from OpenSSL import crypto
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IOpenSSLClientConnectionCreator,
    IProtocol,
    IProtocolFactory,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.ssl import (
    Certificate,
    optionsForClientTLS,
    trustRootFromCertificates,
)
from twisted.protocols.tls import TLSMemoryBIOFactory, TLSMemoryBIOProtocol
from zope.interface import implementer


def client_tls_options(hostname: str, cafile: str | None = None) -> IOpenSSLClientConnectionCreator:
    """TLS to the broker at ``hostname``, trusting the CA certificates of ``cafile`` (PEM,
    several allowed), or the system's trusted CAs without one. Raises ``OSError`` when
    ``cafile`` cannot be read and ``ValueError`` when it holds no PEM certificate."""
    if cafile is None:
        return optionsForClientTLS(hostname)  # the system's trusted CAs (platformTrust)
    with open(cafile, "rb") as file:
        authorities = x509.load_pem_x509_certificates(file.read())
    # Twisted leaves its trust roots unannotated.
    trust = trustRootFromCertificates(  # type: ignore[no-untyped-call]
        [
            Certificate(crypto.X509.from_cryptography(authority))  # type: ignore[no-untyped-call]
            for authority in authorities
        ]
    )
    return optionsForClientTLS(hostname, trustRoot=trust)


def secured(
    endpoint: IStreamClientEndpoint,
    hostname: str | None,
    cafile: str | None,
    clock: IReactorTime | None,
) -> IStreamClientEndpoint:
    """``endpoint`` with TLS to ``hostname`` on top, or as it is when ``hostname`` is None.
    ``clock`` runs the TLS layer's write coalescing (None: the global reactor)."""
    if hostname is None:
        if cafile is not None:
            # Silently plaintext would be the worst reading of a CA file given without TLS.
            raise ValueError("cafile is only used with TLS: say which host to verify")
        return endpoint
    return _TlsEndpoint(endpoint, client_tls_options(hostname, cafile), clock)


@implementer(IStreamClientEndpoint)
class _TlsEndpoint:
    """Twisted's ``wrapClientTLS`` with an injected clock (Twisted's takes the global
    reactor's, which a client given another reactor or a test's ``Clock`` never runs)."""

    def __init__(
        self,
        endpoint: IStreamClientEndpoint,
        creator: IOpenSSLClientConnectionCreator,
        clock: IReactorTime | None,
    ) -> None:
        self._endpoint = endpoint
        self._creator = creator
        self._clock = clock

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[IProtocol]:
        tls = TLSMemoryBIOFactory(self._creator, True, protocolFactory, self._clock)

        def unwrap(layer: IProtocol) -> IProtocol:
            # The caller's protocol, as a plain endpoint gives it (not the TLS layer).
            inner: IProtocol = cast(TLSMemoryBIOProtocol, layer).wrappedProtocol
            return inner

        connecting: Deferred[IProtocol] = self._endpoint.connect(tls)
        return connecting.addCallback(unwrap)
