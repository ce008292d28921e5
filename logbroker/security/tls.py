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
from OpenSSL import SSL, crypto
from twisted.internet.ssl import CertificateOptions, TLSVersion

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


_VERSIONS = {TlsVersion.TLSV1_2: TLSVersion.TLSv1_2, TlsVersion.TLSV1_3: TLSVersion.TLSv1_3}
_CERTFILE, _KEYFILE, _CACERTFILE = "SVC_TLS_CERTFILE", "SVC_TLS_KEYFILE", "SVC_TLS_CACERTFILE"


def _read_file(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def server_tls(
    settings: TlsSettings,
    mode: EnvMode,
    now: datetime,
    warnings: list[str],
    read: Callable[[str], bytes] = _read_file,
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
    settings: TlsSettings, now: datetime, read: Callable[[str], bytes] = _read_file
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
    certificates = _certificates(_CERTFILE, certfile, _read(_CERTFILE, certfile, read))
    for certificate in certificates:
        _check_valid(certfile, certificate, now)
    key = _private_key(keyfile, _read(_KEYFILE, keyfile, read))
    if _spki(key.public_key()) != _spki(certificates[0].public_key()):
        raise ConfigError(
            _KEYFILE,
            keyfile,
            f"the private key of the certificate in {_CERTFILE} (this key belongs to another"
            " certificate)",
        )
    authorities = None
    if settings.cacertfile is not None:
        cacertfile = settings.cacertfile
        authorities = [
            crypto.X509.from_cryptography(authority)
            for authority in _certificates(
                _CACERTFILE, cacertfile, _read(_CACERTFILE, cacertfile, read)
            )
        ]

    leaf, *chain = certificates
    versions = sorted(_VERSIONS[version] for version in settings.versions)

    def options(verify_peer: bool) -> CertificateOptions:
        made = CertificateOptions(
            # cryptography's objects, which pyOpenSSL takes in place of its own deprecated
            # ones; Twisted passes them on untouched but has not updated its annotations.
            privateKey=key,  # type: ignore[arg-type]
            certificate=leaf,  # type: ignore[arg-type]
            extraCertChain=chain,  # type: ignore[arg-type]
            verify=verify_peer,
            caCerts=authorities if verify_peer else None,
            requireCertificate=verify_peer,
            raiseMinimumTo=versions[0],
            lowerMaximumSecurityTo=versions[-1],
        )
        try:
            # Built now, so that what OpenSSL itself refuses (a key too small for its security
            # level, a weak signature) stops the boot rather than every handshake.
            made.getContext()
        except SSL.Error as error:
            raise ConfigError(
                _CERTFILE,
                certfile,
                f"a certificate and key OpenSSL accepts ({openssl_reasons(error)})",
            ) from None
        return made

    return ServerTls(
        options=options(settings.verify is TlsVerify.VERIFY_PEER),
        required=settings.required,
        https_options=options(False),
    )


def _read(variable: str, path: str, read: Callable[[str], bytes]) -> bytes:
    try:
        return read(path)
    except OSError as error:
        raise ConfigError(
            variable, path, f"a file logbroker can read ({error.strerror or error})"
        ) from None


def _certificates(variable: str, path: str, data: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ConfigError(
            variable, path, "PEM certificates (-----BEGIN CERTIFICATE----- blocks); none parse"
        ) from None


def _check_valid(path: str, certificate: x509.Certificate, now: datetime) -> None:
    subject = certificate.subject.rfc4514_string() or "a certificate without a subject"
    after, before = certificate.not_valid_after_utc, certificate.not_valid_before_utc
    if now > after:
        problem = f"{subject} expired on {after:%Y-%m-%d %H:%M:%S} UTC"
    elif now < before:
        problem = f"{subject} is not valid until {before:%Y-%m-%d %H:%M:%S} UTC"
    else:
        return
    raise ConfigError(_CERTFILE, path, f"certificates valid now ({problem})")


def _private_key(path: str, data: bytes) -> PrivateKeyTypes:
    try:
        key = load_pem_private_key(data, password=None)
    except TypeError:
        # The broker starts unattended: there is nobody to type a passphrase.
        raise ConfigError(
            _KEYFILE, path, "an unencrypted PEM private key (this one needs a passphrase)"
        ) from None
    except (ValueError, UnsupportedAlgorithm):
        raise ConfigError(
            _KEYFILE, path, "a PEM private key (-----BEGIN PRIVATE KEY----- block); none parses"
        ) from None
    return key


def _spki(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)


def openssl_reasons(error: SSL.Error) -> str:
    """The reasons of an OpenSSL error, such as ``ee key too small``."""
    queue = error.args[0] if error.args and isinstance(error.args[0], list) else []
    return ", ".join(str(entry[-1]) for entry in queue) or str(error)
