"""The client port's TLS material: what ``load_server_tls`` refuses, naming the variable at
fault, and what the ``ServerTls`` it builds accepts in real (in-memory) handshakes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import attrs
import pytest
from cryptography.hazmat.primitives.serialization import Encoding
from OpenSSL import SSL, crypto

from logbroker.config import ConfigError, EnvMode, TlsSettings, TlsVerify, TlsVersion
from logbroker.security.tls import ServerTls, load_server_tls, server_tls
from tests.certificates import DAY, NOW, Issued, issue, make_ca

CERT, KEY, CA = "/tls/cert.pem", "/tls/key.pem", "/tls/ca.pem"
TLS_1_3, TLS_1_2 = TlsVersion.TLSV1_3, TlsVersion.TLSV1_2


def settings(
    verify: TlsVerify = TlsVerify.VERIFY_NONE,
    versions: tuple[TlsVersion, ...] = (TLS_1_3, TLS_1_2),
    cacertfile: str | None = None,
    required: bool = True,
) -> TlsSettings:
    return TlsSettings(
        enabled=True,
        required=required,
        certfile=CERT,
        keyfile=KEY,
        cacertfile=cacertfile,
        verify=verify,
        versions=versions,
    )


def reader(files: Mapping[str, bytes | OSError]) -> Callable[[str], bytes]:
    def read(path: str) -> bytes:
        content = files[path]
        if isinstance(content, OSError):
            raise content
        return content

    return read


def handshake(server: SSL.Context, client: SSL.Context) -> str:
    """A whole handshake in memory, for the name ``localhost``: the version it agreed on, or
    the ``SSL.Error`` of the side that refused."""
    server_side = SSL.Connection(server)
    server_side.set_accept_state()
    client_side = SSL.Connection(client)
    client_side.set_connect_state()
    client_side.set_tlsext_host_name(b"localhost")
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, side, peer in (
            ("client", client_side, server_side),
            ("server", server_side, client_side),
        ):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except SSL.WantReadError:
                    pass
            with contextlib.suppress(SSL.WantReadError):  # raised when there is nothing to send
                peer.bio_write(side.bio_read(1 << 16))
        if all(done.values()):
            return client_side.get_protocol_version_name()
    raise AssertionError("the handshake did not finish")


def client(
    trusted: Issued | None,
    minimum: int = SSL.TLS1_2_VERSION,
    maximum: int = 0,
    certificate: Issued | None = None,
    security_level_0: bool = False,
) -> SSL.Context:
    """A client that verifies the server against ``trusted`` (when given), speaking the
    versions from ``minimum`` to ``maximum`` (0: the highest), presenting ``certificate``."""
    context = SSL.Context(SSL.TLS_METHOD)
    context.set_min_proto_version(minimum)
    context.set_max_proto_version(maximum)
    if security_level_0:
        # OpenSSL 3 will not even offer TLS 1.1 at its default level: lowered here, a refusal
        # is the server's doing.
        context.set_cipher_list(b"DEFAULT:@SECLEVEL=0")
    if trusted is not None:
        store = context.get_cert_store()
        assert store is not None
        store.add_cert(crypto.X509.from_cryptography(trusted.certificate))
        context.set_verify(SSL.VERIFY_PEER)
    if certificate is not None:
        context.use_certificate(certificate.certificate)
        context.use_privatekey(certificate.key)
    return context


@pytest.fixture(scope="module")
def ca() -> Issued:
    return make_ca()


@pytest.fixture(scope="module")
def server(ca: Issued) -> Issued:
    return issue(ca)


def good_files(server: Issued, ca: Issued | None = None) -> dict[str, bytes | OSError]:
    files: dict[str, bytes | OSError] = {CERT: server.cert_pem, KEY: server.key_pem}
    if ca is not None:
        files[CA] = ca.cert_pem
    return files


def load(tls: TlsSettings, files: Mapping[str, bytes | OSError]) -> ServerTls:
    loaded = load_server_tls(tls, NOW, reader(files))
    assert loaded is not None
    return loaded


# -- what is accepted ----------------------------------------------------------------------


def test_tls_off_reads_nothing() -> None:
    off = attrs.evolve(settings(), enabled=False, required=False)

    assert load_server_tls(off, NOW, reader({})) is None


def test_a_certificate_and_its_key_serve_tls_1_3_and_1_2(ca: Issued, server: Issued) -> None:
    tls = load(settings(), good_files(server))

    context = tls.options.getContext()
    assert tls.required
    assert handshake(context, client(ca)) == "TLSv1.3"
    assert handshake(context, client(ca, maximum=SSL.TLS1_2_VERSION)) == "TLSv1.2"


def test_tls_1_1_is_never_accepted(ca: Issued, server: Issued) -> None:
    old_client = client(ca, SSL.TLS1_1_VERSION, SSL.TLS1_1_VERSION, security_level_0=True)
    # The same client gets TLS 1.1 from a server that allows it: it does offer it.
    permissive = SSL.Context(SSL.TLS_METHOD)
    permissive.set_min_proto_version(SSL.TLS1_1_VERSION)
    permissive.set_cipher_list(b"DEFAULT:@SECLEVEL=0")
    permissive.use_certificate(server.certificate)
    permissive.use_privatekey(server.key)
    assert handshake(permissive, old_client) == "TLSv1.1"

    tls = load(settings(versions=(TLS_1_2,)), good_files(server))

    with pytest.raises(SSL.Error, match="unsupported protocol"):
        handshake(tls.options.getContext(), old_client)


@pytest.mark.parametrize(
    ("versions", "agreed", "refused"),
    [
        ((TLS_1_3,), "TLSv1.3", SSL.TLS1_2_VERSION),
        ((TLS_1_2,), "TLSv1.2", SSL.TLS1_3_VERSION),
    ],
)
def test_only_the_configured_versions_are_accepted(
    ca: Issued,
    server: Issued,
    versions: tuple[TlsVersion, ...],
    agreed: str,
    refused: int,
) -> None:
    context = load(settings(versions=versions), good_files(server)).options.getContext()

    assert handshake(context, client(ca)) == agreed
    with pytest.raises(SSL.Error):
        handshake(context, client(ca, refused, refused))


def test_intermediate_certificates_after_the_server_s_are_sent_along() -> None:
    root = make_ca()
    intermediate = make_ca("logbroker test intermediate", issuer=root)
    leaf = issue(intermediate)
    files = good_files(leaf)
    files[CERT] = leaf.cert_pem + intermediate.cert_pem

    context = load(settings(), files).options.getContext()

    # The client trusts the root only: the intermediate must come from the server.
    assert handshake(context, client(root)) == "TLSv1.3"


def test_verify_peer_requires_a_client_certificate_signed_by_the_ca_file(
    ca: Issued, server: Issued
) -> None:
    tls = load(settings(TlsVerify.VERIFY_PEER, cacertfile=CA), good_files(server, ca))
    context = tls.options.getContext()

    assert handshake(context, client(ca, certificate=issue(ca, ["app"], client=True))) == "TLSv1.3"
    with pytest.raises(SSL.Error, match="peer did not return a certificate"):
        handshake(context, client(ca))
    with pytest.raises(SSL.Error, match="certificate verify failed"):
        handshake(context, client(ca, certificate=issue(None, ["app"], client=True)))
    # HTTPS for the dashboard asks browsers and scrapers for no certificate.
    assert handshake(tls.https_options.getContext(), client(ca)) == "TLSv1.3"


# -- what is refused -----------------------------------------------------------------------

PERMISSION_DENIED = PermissionError(13, "Permission denied")
VERIFY_PEER = settings(TlsVerify.VERIFY_PEER, cacertfile=CA)
#: Each way the files can be wrong: the settings, what to change in good files (given the CA
#: and the server's certificate), the variable named and what the message says.
Case = tuple[
    TlsSettings,
    Callable[[Issued, Issued], dict[str, bytes | OSError]],
    str,
    str,
]
REFUSED: dict[str, Case] = {
    "unreadable certificate": (
        settings(),
        lambda ca, server: {CERT: PERMISSION_DENIED},
        "SVC_TLS_CERTFILE",
        "a file logbroker can read (Permission denied)",
    ),
    "certificate file holding a key": (
        settings(),
        lambda ca, server: {CERT: server.key_pem},
        "SVC_TLS_CERTFILE",
        "PEM certificates",
    ),
    "certificate in DER": (
        settings(),
        lambda ca, server: {CERT: server.certificate.public_bytes(Encoding.DER)},
        "SVC_TLS_CERTFILE",
        "PEM certificates",
    ),
    "expired certificate": (
        settings(),
        lambda ca, server: {
            CERT: issue(ca, not_before=NOW - 9 * DAY, not_after=NOW - DAY).cert_pem
        },
        "SVC_TLS_CERTFILE",
        "certificates valid now (CN=localhost expired on ",
    ),
    "certificate not valid yet": (
        settings(),
        lambda ca, server: {
            CERT: issue(ca, not_before=NOW + DAY, not_after=NOW + 9 * DAY).cert_pem
        },
        "SVC_TLS_CERTFILE",
        "certificates valid now (CN=localhost is not valid until ",
    ),
    "expired intermediate certificate": (
        settings(),
        lambda ca, server: {
            CERT: server.cert_pem
            + make_ca("expired", not_before=NOW - 9 * DAY, not_after=NOW - DAY).cert_pem
        },
        "SVC_TLS_CERTFILE",
        "certificates valid now (CN=expired expired on ",
    ),
    "key too small for OpenSSL": (
        settings(),
        # Refused at the default security level of OpenSSL 3 as Debian builds it (2: RSA keys
        # of at least 2048 bits).
        lambda ca, server: _pair(issue(ca, rsa_bits=1024)),
        "SVC_TLS_CERTFILE",
        "a certificate and key OpenSSL accepts (ee key too small)",
    ),
    "unreadable key": (
        settings(),
        lambda ca, server: {KEY: PERMISSION_DENIED},
        "SVC_TLS_KEYFILE",
        "a file logbroker can read (Permission denied)",
    ),
    "key file holding a certificate": (
        settings(),
        lambda ca, server: {KEY: server.cert_pem},
        "SVC_TLS_KEYFILE",
        "a PEM private key",
    ),
    "encrypted key": (
        settings(),
        lambda ca, server: {KEY: server.encrypted_key_pem(b"secret")},
        "SVC_TLS_KEYFILE",
        "an unencrypted PEM private key (this one needs a passphrase)",
    ),
    "key of another certificate": (
        settings(),
        lambda ca, server: {KEY: issue(ca).key_pem},
        "SVC_TLS_KEYFILE",
        "the private key of the certificate in SVC_TLS_CERTFILE",
    ),
    "unreadable CA file": (
        VERIFY_PEER,
        lambda ca, server: {CA: PERMISSION_DENIED},
        "SVC_TLS_CACERTFILE",
        "a file logbroker can read (Permission denied)",
    ),
    "CA file without certificates": (
        VERIFY_PEER,
        lambda ca, server: {CA: b"not a certificate"},
        "SVC_TLS_CACERTFILE",
        "PEM certificates",
    ),
    "CA file checked even under verify_none": (
        settings(cacertfile=CA),
        lambda ca, server: {CA: b""},
        "SVC_TLS_CACERTFILE",
        "PEM certificates",
    ),
}


def _pair(issued: Issued) -> dict[str, bytes | OSError]:
    return {CERT: issued.cert_pem, KEY: issued.key_pem}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_each_problem_names_its_variable_and_file(ca: Issued, server: Issued, case: str) -> None:
    tls, change, variable, expected = REFUSED[case]
    path = {"SVC_TLS_CERTFILE": CERT, "SVC_TLS_KEYFILE": KEY, "SVC_TLS_CACERTFILE": CA}[variable]

    with pytest.raises(ConfigError) as raised:
        load_server_tls(tls, NOW, reader({**good_files(server, ca), **change(ca, server)}))

    assert raised.value.variable == variable
    assert str(raised.value).startswith(f"{variable}={path!r} is invalid: expected {expected}")


# -- prod refuses, dev and test warn -------------------------------------------------------


def test_prod_stops_on_a_bad_file_carrying_the_warnings_so_far(server: Issued) -> None:
    warnings = ["unknown setting SVC_TYPO is ignored"]
    files = {**good_files(server), KEY: b"garbage"}

    with pytest.raises(ConfigError) as raised:
        server_tls(settings(), EnvMode.PROD, NOW, warnings, reader(files))

    assert raised.value.variable == "SVC_TLS_KEYFILE"
    assert raised.value.warnings == ["unknown setting SVC_TYPO is ignored"]


@pytest.mark.parametrize("mode", [EnvMode.DEV, EnvMode.TEST])
def test_dev_and_test_warn_about_a_bad_file_and_run_without_tls(
    server: Issued, mode: EnvMode
) -> None:
    warnings: list[str] = []
    files = {**good_files(server), KEY: b"garbage"}

    assert server_tls(settings(), mode, NOW, warnings, reader(files)) is None

    [warning] = warnings
    assert warning.startswith(f"SVC_TLS_KEYFILE={KEY!r} is invalid: expected a PEM private key")
    assert warning.endswith(f"; TLS stays off (in {mode.value} an invalid TLS setting only warns)")


@pytest.mark.parametrize("mode", list(EnvMode))
def test_good_files_serve_in_every_mode(server: Issued, mode: EnvMode) -> None:
    warnings: list[str] = []

    assert server_tls(settings(), mode, NOW, warnings, reader(good_files(server))) is not None
    assert warnings == []
