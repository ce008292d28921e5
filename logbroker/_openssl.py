"""OpenSSL's errors in words, for the log lines and config errors of every TLS user (the client
port, the peer port, the etcd store)."""

from __future__ import annotations

from OpenSSL import SSL


def openssl_reasons(error: SSL.Error) -> str:
    """The reasons of an OpenSSL error, such as ``ee key too small``."""
    queue = error.args[0] if error.args and isinstance(error.args[0], list) else []
    return ", ".join(str(entry[-1]) for entry in queue) or str(error)
