"""The TLS towards etcd (``SVC_CONTROL_PLANE=etcd+https://``), read and checked once at boot.

``load_etcd_tls`` reads ``SVC_ETCD_CACERTFILE`` (the CAs etcd's certificate must be signed by;
unset: the system's) and the client certificate and key of ``SVC_ETCD_CERTFILE`` and
``SVC_ETCD_KEYFILE``, with the client port's PEM checks (``logbroker.security.tls``), and
makes the ``EtcdTls`` the etcd store's HTTP agent connects with: every connection verifies
etcd's certificate and the host name or address of the endpoint it dials (service_identity),
and presents the client certificate. Problems are ``ConfigError`` naming the variable, in every
mode: a cluster node that cannot reach etcd cannot serve.

With ``SVC_ETCD_USER`` set (etcd's auth on), the client certificate must have no Common Name:
etcd 3.4's JSON gateway answers every request whose client certificate has one with an error
(CVE-2018-16886: it would otherwise authenticate the request as the user the CN names), so
such a certificate is refused at boot rather than at the first request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from cryptography import x509
from cryptography.x509.oid import NameOID
from OpenSSL import SSL, crypto
from twisted.internet._sslverify import IOpenSSLTrustRoot
from twisted.internet.interfaces import IOpenSSLClientConnectionCreator
from twisted.internet.ssl import Certificate, optionsForClientTLS, trustRootFromCertificates
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

from logbroker._openssl import openssl_reasons
from logbroker.config import ConfigError, EtcdAccess
from logbroker.security.tls import (
    check_key_matches,
    check_valid,
    missing_usages,
    read_certificates,
    read_file,
    read_private_key,
)

_CACERTFILE, _CERTFILE, _KEYFILE = "SVC_ETCD_CACERTFILE", "SVC_ETCD_CERTFILE", "SVC_ETCD_KEYFILE"


@implementer(IPolicyForHTTPS)
class EtcdTls:
    """How the etcd store's agent connects to each member: TLS verifying the member's
    certificate against ``trust`` (None: the system's CAs) and its host, presenting the client
    certificate of ``client`` (``CertificateOptions`` arguments) if any."""

    def __init__(self, trust: IOpenSSLTrustRoot | None, client: dict[str, Any]) -> None:
        self._trust = trust
        self._client = client

    def creatorForNetloc(self, hostname: bytes, port: int) -> IOpenSSLClientConnectionCreator:
        # An IPv6 address comes in its URL's brackets.
        host = hostname.decode("ascii").removeprefix("[").removesuffix("]")
        return optionsForClientTLS(host, self._trust, extraCertificateOptions=self._client)


def load_etcd_tls(
    access: EtcdAccess,
    hosts: Sequence[str],
    now: datetime,
    read: Callable[[str], bytes] = read_file,
) -> EtcdTls | None:
    """The ``EtcdTls`` of ``access`` (None for plaintext etcd), its files read with ``read`` and
    checked as of ``now``; built once for each of ``hosts`` (the endpoints'), so that what
    OpenSSL refuses stops the boot. Raises ``ConfigError`` naming the variable at fault."""
    if not access.https:
        return None
    trust = None
    if access.cacertfile is not None:
        trust = trustRootFromCertificates(  # type: ignore[no-untyped-call]
            [
                Certificate(crypto.X509.from_cryptography(authority))  # type: ignore[no-untyped-call]
                for authority in read_certificates(_CACERTFILE, access.cacertfile, read)
            ]
        )
    client: dict[str, Any] = {}
    if access.certfile is not None:
        assert access.keyfile is not None  # logbroker.config wants both or neither
        certificates = read_certificates(_CERTFILE, access.certfile, read)
        for certificate in certificates:
            check_valid(_CERTFILE, access.certfile, certificate, now)
        leaf, *chain = certificates
        key = read_private_key(_KEYFILE, access.keyfile, read)
        check_key_matches(_KEYFILE, access.keyfile, key, leaf, _CERTFILE)
        _check_client_certificate(access, leaf)
        client = {"privateKey": key, "certificate": leaf, "extraCertChain": chain}
    tls = EtcdTls(trust, client)
    for host in hosts:
        try:
            tls.creatorForNetloc(host.encode("ascii"), 0)
        except SSL.Error as error:
            raise ConfigError(
                _CERTFILE,
                access.certfile,
                f"a certificate and key OpenSSL accepts ({openssl_reasons(error)})",
            ) from None
    return tls


def _check_client_certificate(access: EtcdAccess, leaf: x509.Certificate) -> None:
    assert access.certfile is not None
    if missing_usages(leaf, ("clientAuth",)):
        raise ConfigError(
            _CERTFILE,
            access.certfile,
            "a certificate for TLS clients (extendedKeyUsage clientAuth); this one is not",
        )
    names = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if access.user is not None and names:
        raise ConfigError(
            _CERTFILE,
            access.certfile,
            f"a client certificate without a Common Name (this one has CN={names[0].value!s})"
            " while SVC_ETCD_USER is set: etcd's JSON gateway refuses every request whose"
            " client certificate has one once etcd's auth is on (give it an empty subject and"
            " a subjectAltName)",
        )
