"""Certificates for the TLS tests, made with ``cryptography``: a CA, certificates it signs for
names and IP addresses, self-signed ones, and ones that are expired or not valid yet; and the
broker's ``ServerTls`` of one."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.hazmat.primitives.serialization import (
    BestAvailableEncryption,
    Encoding,
    NoEncryption,
    PrivateFormat,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from logbroker.config import TlsSettings, TlsVerify, TlsVersion
from logbroker.security.tls import ServerTls, load_server_tls

#: Certificates are valid around the real time, since OpenSSL checks them against it in every
#: handshake; a margin of days keeps the tests' outcome independent of how long they run.
NOW = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
DAY = datetime.timedelta(days=1)


@attrs.frozen
class Issued:
    certificate: x509.Certificate
    key: CertificateIssuerPrivateKeyTypes

    @property
    def cert_pem(self) -> bytes:
        return self.certificate.public_bytes(Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())

    def encrypted_key_pem(self, passphrase: bytes) -> bytes:
        return self.key.private_bytes(
            Encoding.PEM, PrivateFormat.PKCS8, BestAvailableEncryption(passphrase)
        )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _alternative_names(names: Sequence[str]) -> list[x509.GeneralName]:
    alternatives: list[x509.GeneralName] = []
    for name in names:
        try:
            alternatives.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternatives.append(x509.DNSName(name))
    return alternatives


def make_ca(
    common_name: str = "logbroker test CA",
    issuer: Issued | None = None,
    not_before: datetime.datetime = NOW - 30 * DAY,
    not_after: datetime.datetime = NOW + 365 * DAY,
) -> Issued:
    """A CA certificate: self-signed, or an intermediate one signed by ``issuer``."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(issuer.certificate.subject if issuer else _name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(
                issuer.key.public_key()  # type: ignore[arg-type]
            ),
            False,
        )
    return Issued(builder.sign(issuer.key if issuer else key, hashes.SHA256()), key)


def issue(
    issuer: Issued | None,
    names: Sequence[str] = ("localhost", "127.0.0.1"),
    not_before: datetime.datetime = NOW - DAY,
    not_after: datetime.datetime = NOW + 90 * DAY,
    client: bool = False,
    rsa_bits: int | None = None,
    *,
    both: bool = False,
    uris: Sequence[str] = (),
    anonymous: bool = False,
) -> Issued:
    """A server (or ``client``, or ``both``) certificate for ``names`` (DNS names or IP
    addresses) and ``uris`` (URI names), signed by ``issuer`` or self-signed; an EC P-256 key
    unless ``rsa_bits`` asks for RSA. ``anonymous``: an empty subject (no Common Name), the
    names in the subjectAltName alone, as etcd's gateway wants of client certificates."""
    key: CertificateIssuerPrivateKeyTypes = (
        rsa.generate_private_key(65537, rsa_bits)
        if rsa_bits
        else ec.generate_private_key(ec.SECP256R1())
    )
    subject = x509.Name([]) if anonymous else _name(names[0])
    if both:
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    else:
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.certificate.subject if issuer else _name(names[0]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [*_alternative_names(names), *map(x509.UniformResourceIdentifier, uris)]
            ),
            # RFC 5280: the subjectAltName is critical when the subject is empty.
            critical=anonymous,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(
                issuer.key.public_key()  # type: ignore[arg-type]
            ),
            False,
        )
    return Issued(builder.sign(issuer.key if issuer else key, hashes.SHA256()), key)


def write(path: Path, *parts: bytes) -> str:
    """Write ``parts`` one after the other to ``path``; its name as a string."""
    path.write_bytes(b"".join(parts))
    return str(path)


def serving(
    server: Issued, required: bool = True, on_handshake: Callable[[str], object] | None = None
) -> ServerTls:
    """The ``ServerTls`` of ``server``'s certificate and key, loaded as the broker loads them."""
    files = {"/tls/cert.pem": server.cert_pem, "/tls/key.pem": server.key_pem}
    settings = TlsSettings(
        enabled=True,
        required=required,
        certfile="/tls/cert.pem",
        keyfile="/tls/key.pem",
        cacertfile=None,
        verify=TlsVerify.VERIFY_NONE,
        versions=(TlsVersion.TLSV1_3, TlsVersion.TLSV1_2),
    )
    tls = load_server_tls(settings, NOW, files.__getitem__)
    assert tls is not None
    return tls if on_handshake is None else attrs.evolve(tls, on_handshake=on_handshake)
