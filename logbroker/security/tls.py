"""The client port's TLS material, read and checked once at boot into a ready ``ServerTls``.

``logbroker.config`` has checked the TLS settings and that their files exist; this module reads
the files and checks what they hold: PEM certificates and an unencrypted PEM key, the key
matching the certificate, every certificate of ``SVC_TLS_CERTFILE`` valid at boot, CA
certificates that parse, and OpenSSL accepting the lot. Each problem is a ``ConfigError`` naming
the variable whose file is at fault, so that a broker with a bad certificate stops at boot
instead of failing every handshake later.

``load_server_tls`` is the check itself: given a way to read files and the time, it is
deterministic (tests feed it generated certificates). ``server_tls`` adds the spec's rule: an
invalid TLS configuration is fatal in prod and only a warning in dev and test, which then run
without TLS, as they do for the settings ``logbroker.config`` finds invalid.

On a cluster node (``TlsSettings.peer_cacertfile`` set) the same certificate and key also serve
the peer port, both ways (``PeerTls``): the certificate must then be fit for TLS clients as well
as servers, and each peer must present one signed by a CA of the peer CA file.

The PEM checks (``read_file``, ``read_certificates``, ``read_private_key``, ``check_valid``,
``check_key_matches``) are shared with the TLS towards etcd (``logbroker.security.etcd_tls``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from datetime import datetime

import attrs
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes, PublicKeyTypes
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    PublicFormat,
    load_pem_private_key,
)
from cryptography.x509.oid import ExtendedKeyUsageOID
from OpenSSL import SSL, crypto
from twisted.internet.ssl import CertificateOptions, TLSVersion

from logbroker._openssl import openssl_reasons
from logbroker.config import (
    ConfigError,
    EnvMode,
    TlsSettings,
    TlsVerify,
    TlsVersion,
    tls_off_warning,
)


class HandshakeOutcome(enum.StrEnum):
    """How a TLS handshake on the client port ended (the label of its metric)."""

    OK = "ok"
    #: Refused by either side (no common version, a client that does not trust the
    #: certificate, a missing client certificate under verify_peer) or cut off before the end.
    FAILED = "failed"


def _ignore(outcome: str) -> None:
    """The default ``on_handshake``: nothing counts handshakes until metrics are wired."""


@attrs.frozen(eq=False)
class ServerTls:
    """TLS ready to serve, built once at boot from checked files (``server_tls``)."""

    #: The client port's: the configured versions, and client certificates signed by a CA of
    #: ``SVC_TLS_CACERTFILE`` required under ``verify_peer``.
    options: CertificateOptions
    #: Plaintext on the client port is answered ``tls_required`` and closed.
    required: bool
    #: The same certificate and versions for an HTTPS listener (``reactor.listenSSL``,
    #: ``TLSMemoryBIOFactory``), never asking for a client certificate: browsers and metrics
    #: scrapers have none, and the dashboard has logins of its own.
    https_options: CertificateOptions
    #: Called with a ``HandshakeOutcome`` as each handshake on the client port ends.
    on_handshake: Callable[[str], object] = _ignore
    #: The peer port's, on a cluster node.
    peer: PeerTls | None = None


@attrs.frozen(eq=False)
class PeerTls:
    """The peer port's TLS, whichever side dials: this node's certificate presented, and a
    certificate signed by a CA of the peer CA file required of the peer and verified. Which
    node a certificate names is the peer handshake's business (``logbroker.peer.handshake``)."""

    options: CertificateOptions
    #: This node's certificate (the first of ``SVC_TLS_CERTFILE``), which must name the node.
    certificate: x509.Certificate


_VERSIONS = {TlsVersion.TLSV1_2: TLSVersion.TLSv1_2, TlsVersion.TLSV1_3: TLSVersion.TLSv1_3}
_CERTFILE, _KEYFILE, _CACERTFILE = "SVC_TLS_CERTFILE", "SVC_TLS_KEYFILE", "SVC_TLS_CACERTFILE"
_PEER_CACERTFILE = "SVC_PEER_TLS_CACERTFILE"


def read_file(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def server_tls(
    settings: TlsSettings,
    mode: EnvMode,
    now: datetime,
    warnings: list[str],
    read: Callable[[str], bytes] = read_file,
) -> ServerTls | None:
    """``load_server_tls``, under the spec's rule for an invalid TLS configuration: in prod its
    ``ConfigError`` stops the boot (carrying ``warnings``, as ``BrokerConfig.from_env``'s
    does); in dev and test it is appended to ``warnings`` and the broker runs without TLS
    (None)."""
    try:
        return load_server_tls(settings, now, read)
    except ConfigError as problem:
        if mode is EnvMode.PROD:
            problem.warnings = warnings
            raise
        warnings.append(tls_off_warning(problem, mode))
        return None


def load_server_tls(
    settings: TlsSettings, now: datetime, read: Callable[[str], bytes] = read_file
) -> ServerTls | None:
    """The ``ServerTls`` of ``settings`` (None while TLS is off), its files read with ``read``
    and checked as of ``now`` (timezone-aware). Raises ``ConfigError`` naming the variable whose
    file is unreadable or holds what it should not."""
    if not settings.enabled:
        return None
    certfile, keyfile = settings.certfile, settings.keyfile
    # BrokerConfig.from_env refuses TLS without both files, and verify_peer without CA ones.
    assert certfile is not None
    assert keyfile is not None
    assert settings.cacertfile is not None or settings.verify is TlsVerify.VERIFY_NONE
    certificates = read_certificates(_CERTFILE, certfile, read)
    for certificate in certificates:
        check_valid(_CERTFILE, certfile, certificate, now)
    key = read_private_key(_KEYFILE, keyfile, read)
    check_key_matches(_KEYFILE, keyfile, key, certificates[0], _CERTFILE)
    authorities = None
    if settings.cacertfile is not None:
        authorities = read_certificates(_CACERTFILE, settings.cacertfile, read)

    leaf = certificates[0]
    versions = tuple(_VERSIONS[version] for version in settings.versions)

    def options(verify_with: list[x509.Certificate] | None) -> CertificateOptions:
        return _certificate_options(
            _CERTFILE, certfile, key, certificates, versions, verify_with=verify_with
        )

    peer = None
    if settings.peer_cacertfile is not None:
        _check_fit_both_ways(certfile, leaf)
        peer_cacertfile = settings.peer_cacertfile
        peer_authorities = (
            authorities
            if authorities is not None and peer_cacertfile == settings.cacertfile
            else read_certificates(_PEER_CACERTFILE, peer_cacertfile, read)
        )
        peer = PeerTls(options(peer_authorities), leaf)
    return ServerTls(
        options=options(authorities if settings.verify is TlsVerify.VERIFY_PEER else None),
        required=settings.required,
        https_options=options(None),
        peer=peer,
    )


def _certificate_options(
    variable: str,
    path: str,
    key: PrivateKeyTypes,
    certificates: list[x509.Certificate],
    versions: tuple[TLSVersion, ...],
    verify_with: list[x509.Certificate] | None,
) -> CertificateOptions:
    """Options presenting ``certificates`` (the first is the leaf, the rest its chain) with
    ``key``, speaking ``versions``, and, given ``verify_with``, requiring of the other side a
    certificate signed by one of them. Built and checked at once, so that what OpenSSL itself
    refuses (a key too small for its security level, a weak signature) stops the boot rather
    than every handshake: a ``ConfigError`` naming ``variable`` (the certificate's)."""
    leaf, *chain = certificates
    made = CertificateOptions(
        # cryptography's objects, which pyOpenSSL takes in place of its own deprecated
        # ones; Twisted passes them on untouched but has not updated its annotations.
        privateKey=key,  # type: ignore[arg-type]
        certificate=leaf,  # type: ignore[arg-type]
        extraCertChain=chain,  # type: ignore[arg-type]
        verify=verify_with is not None,
        caCerts=(
            None
            if verify_with is None
            else [crypto.X509.from_cryptography(authority) for authority in verify_with]
        ),
        requireCertificate=verify_with is not None,
        raiseMinimumTo=min(versions),
        lowerMaximumSecurityTo=max(versions),
    )
    try:
        made.getContext()
    except SSL.Error as error:
        raise ConfigError(
            variable,
            path,
            f"a certificate and key OpenSSL accepts ({openssl_reasons(error)})",
        ) from None
    return made


def _check_fit_both_ways(path: str, certificate: x509.Certificate) -> None:
    """A peer port certificate serves as a TLS server's towards the nodes that dial this one,
    and as a TLS client's towards those it dials: OpenSSL refuses a certificate whose extended
    key usage, when it has one, does not allow what it is used for."""
    missing = missing_usages(certificate, ("serverAuth", "clientAuth"))
    if missing:
        raise ConfigError(
            _CERTFILE,
            path,
            "a certificate for TLS servers and clients alike (extendedKeyUsage serverAuth,"
            " clientAuth), since the peer port uses it both ways; this one lacks"
            f" {' and '.join(missing)}",
        )


_USAGES = {
    "serverAuth": ExtendedKeyUsageOID.SERVER_AUTH,
    "clientAuth": ExtendedKeyUsageOID.CLIENT_AUTH,
}


def missing_usages(certificate: x509.Certificate, needed: tuple[str, ...]) -> list[str]:
    """Which of ``needed`` (``serverAuth``, ``clientAuth``) the certificate's extended key
    usage leaves out (none when it has no such extension: then it is fit for any use)."""
    try:
        usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return []
    return [name for name in needed if _USAGES[name] not in usages]


def _read(variable: str, path: str, read: Callable[[str], bytes]) -> bytes:
    try:
        return read(path)
    except OSError as error:
        raise ConfigError(
            variable, path, f"a file logbroker can read ({error.strerror or error})"
        ) from None


def read_certificates(
    variable: str, path: str, read: Callable[[str], bytes] = read_file
) -> list[x509.Certificate]:
    """The PEM certificates of the file at ``path`` (named by ``variable``), at least one."""
    data = _read(variable, path, read)
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ConfigError(
            variable, path, "PEM certificates (-----BEGIN CERTIFICATE----- blocks); none parse"
        ) from None


def check_valid(variable: str, path: str, certificate: x509.Certificate, now: datetime) -> None:
    subject = certificate.subject.rfc4514_string() or "a certificate without a subject"
    after, before = certificate.not_valid_after_utc, certificate.not_valid_before_utc
    if now > after:
        problem = f"{subject} expired on {after:%Y-%m-%d %H:%M:%S} UTC"
    elif now < before:
        problem = f"{subject} is not valid until {before:%Y-%m-%d %H:%M:%S} UTC"
    else:
        return
    raise ConfigError(variable, path, f"certificates valid now ({problem})")


def read_private_key(
    variable: str, path: str, read: Callable[[str], bytes] = read_file
) -> PrivateKeyTypes:
    """The unencrypted PEM private key of the file at ``path`` (named by ``variable``)."""
    data = _read(variable, path, read)
    try:
        key = load_pem_private_key(data, password=None)
    except TypeError:
        # The broker starts unattended: there is nobody to type a passphrase.
        raise ConfigError(
            variable, path, "an unencrypted PEM private key (this one needs a passphrase)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(
            variable, path, "a PEM private key (-----BEGIN PRIVATE KEY----- block); none parses"
        ) from None
    return key


def check_key_matches(
    variable: str,
    path: str,
    key: PrivateKeyTypes,
    certificate: x509.Certificate,
    certificate_variable: str,
) -> None:
    """``ConfigError`` naming ``variable`` unless ``key`` is ``certificate``'s private key."""
    if _spki(key.public_key()) != _spki(certificate.public_key()):
        raise ConfigError(
            variable,
            path,
            f"the private key of the certificate in {certificate_variable} (this key belongs to"
            " another certificate)",
        )


def _spki(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
