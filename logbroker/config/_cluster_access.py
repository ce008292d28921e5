"""How a cluster node reaches etcd and who may open its peer port: the ``SVC_ETCD_*`` and
``SVC_PEER_*`` settings (docs/cluster.md, "Securing a cluster").

etcd holds every user's password hash, the ACL grants and the sessions: whoever reaches it can
make themselves admin. So etcd may be reached over TLS (``etcd+https://``) with a client
certificate and as an etcd user, and prod refuses plaintext etcd on any address but loopback
unless ``SVC_ETCD_ALLOW_PLAINTEXT`` says the network is private.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence

import attrs

from logbroker.config._env import ConfigError, parse_bool, parse_int, parse_text

#: The schemes of ``SVC_CONTROL_PLANE`` that name etcd: plaintext, and TLS.
ETCD_PLAINTEXT = "etcd://"
ETCD_TLS = "etcd+https://"


@attrs.frozen
class EtcdAccess:
    """How the node talks to etcd. File paths are absolute and were found to exist at boot."""

    #: ``etcd+https://``: TLS, the server's certificate verified against ``cacertfile`` (the
    #: system's trusted CAs when None) and its host name or address.
    https: bool = False
    cacertfile: str | None = None
    #: The client certificate and key presented to etcd (both or neither; TLS only).
    certfile: str | None = None
    keyfile: str | None = None
    #: The etcd user (with etcd's auth enabled) the node authenticates as; both or neither.
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)

    @property
    def scheme(self) -> str:
        return "https" if self.https else "http"


@attrs.frozen
class PeerPortLimits:
    """Connections to the peer port that have not finished their handshake (TLS and the peer
    handshake): more than these are refused at accept."""

    max_handshakes_per_ip: int = 8
    max_handshakes: int = 64


def _file(env: Mapping[str, str], variable: str, cwd: str) -> str | None:
    text = parse_text(env, variable)
    if text is None:
        return None
    path = os.path.abspath(os.path.join(cwd, text))
    if not os.path.isfile(path):
        raise ConfigError(variable, env[variable], f"an existing file ({path} is not one)")
    return path


def _both_or_neither(env: Mapping[str, str], first: str, second: str) -> None:
    for given, missing in ((first, second), (second, first)):
        if env.get(given) and not env.get(missing):
            raise ConfigError(missing, None, f"a value, since {given} is set (both or neither)")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) can only be this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def etcd_access(
    env: Mapping[str, str],
    https: bool,
    endpoints: Sequence[tuple[str, int]],
    prod: bool,
    cwd: str,
    warnings: list[str],
) -> EtcdAccess:
    """The ``SVC_ETCD_*`` settings of a node whose ``SVC_CONTROL_PLANE`` names ``endpoints``
    (none: the local control plane, for which they are only parsed; ``https``:
    ``etcd+https://``). Every problem is fatal in every mode: a node that cannot reach etcd
    cannot serve at all."""
    _both_or_neither(env, "SVC_ETCD_CERTFILE", "SVC_ETCD_KEYFILE")
    _both_or_neither(env, "SVC_ETCD_USER", "SVC_ETCD_PASSWORD")
    files = {
        variable: _file(env, variable, cwd)
        for variable in ("SVC_ETCD_CACERTFILE", "SVC_ETCD_CERTFILE", "SVC_ETCD_KEYFILE")
    }
    allow_plaintext = parse_bool(env, "SVC_ETCD_ALLOW_PLAINTEXT", False)
    if endpoints and not https:
        for variable, path in files.items():
            if path is not None:
                raise ConfigError(
                    variable,
                    env[variable],
                    "no value while SVC_CONTROL_PLANE is etcd://, which is plaintext (use"
                    " etcd+https://host:port,... for TLS)",
                )
        remote = [host for host, _ in endpoints if not is_loopback(host)]
        if prod and remote and not allow_plaintext:
            raise ConfigError(
                "SVC_CONTROL_PLANE",
                env["SVC_CONTROL_PLANE"],
                f"etcd+https://... in prod: etcd at {remote[0]} is not on this machine, and it"
                " holds every password hash, ACL grant and session (SVC_ETCD_ALLOW_PLAINTEXT"
                "=true allows plaintext etcd, on a private network only)",
            )
        if remote and env.get("SVC_ETCD_USER"):
            warnings.append(
                f"SVC_ETCD_PASSWORD goes to etcd at {remote[0]} in plaintext"
                " (SVC_CONTROL_PLANE=etcd://); use etcd+https:// for TLS"
            )
    return EtcdAccess(
        https=https,
        cacertfile=files["SVC_ETCD_CACERTFILE"],
        certfile=files["SVC_ETCD_CERTFILE"],
        keyfile=files["SVC_ETCD_KEYFILE"],
        user=parse_text(env, "SVC_ETCD_USER"),
        # A secret, taken as given (blanks may be part of it).
        password=env.get("SVC_ETCD_PASSWORD") or None,
    )


def peer_port_limits(env: Mapping[str, str]) -> PeerPortLimits:
    return PeerPortLimits(
        max_handshakes_per_ip=parse_int(env, "SVC_PEER_MAX_HANDSHAKES_PER_IP", 8, 1),
        max_handshakes=parse_int(env, "SVC_PEER_MAX_HANDSHAKES", 64, 1),
    )
