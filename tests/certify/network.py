"""The certification's network: network namespaces joined by a bridge, and the faults on it.

Each node ``i`` (1, 2, 3) is a namespace ``lbcert-n<i>`` holding one etcd member and one broker
on the address ``10.77.0.<i>``; the checker (the harness itself and every command it runs) is
in ``lbcert-checker`` on ``10.77.0.100``. The bridge lives in a namespace of its own,
``lbcert-switch``, and each veth is made with both ends inside namespaces, so the machine's own
namespace gets no interface, no address and no rule, and no namespace has a route out: nothing
the harness sends can leave the namespaces it made.

Faults:

- ``isolate``/``rejoin``: a node's switch port down and up (every link of the node cut, both
  ways);
- ``block``: nftables rules in a node's namespace dropping packets to and/or from chosen
  addresses and ports (a one-way cut, a node cut from its peers but not from etcd, a node cut
  from etcd but not from its peers); ``unblock`` removes them all.

Linux only, as root, with ``ip`` (iproute2) and ``nft`` (nftables).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence

import attrs

PREFIX = "lbcert"
SUBNET = "10.77.0"
CHECKER_HOST = 100
#: The nftables table the faults live in, in a node's namespace.
_TABLE = "certify"
#: The nftables table of the slow-link drill's redirects.
_NAT = "certify_nat"
_CLONE_NEWNET = 0x40000000


class NetworkUnavailable(Exception):
    """This machine cannot host the certification's network: why, and what to do."""


def require_network_tools() -> None:
    """Raise ``NetworkUnavailable`` unless this process may make namespaces and rules."""
    if os.geteuid() != 0:
        raise NetworkUnavailable(
            "the certification makes network namespaces and firewall rules, which needs root;"
            " run it as root (sudo make certify)"
        )
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            raise NetworkUnavailable(
                f"`{tool}` is missing; install Debian's {package} (scripts/install --test does)"
            )
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise NetworkUnavailable(
            f"`ip netns` does not work here ({probe.stderr.strip() or probe.returncode}); the"
            " certification needs network namespaces"
        )


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")
    return done.stdout


@attrs.frozen
class Block:
    """Packets one node's namespace drops: those going to (``outgoing``) and/or coming from
    (``incoming``) the ``peers``' addresses (and 127.0.0.1 with ``loopback``; any address when
    none are named). With ports named,
    only TCP packets whose far end is on one of ``ports`` (a service of the peers) or whose near
    end is on one of ``local_ports`` (a service of this node) are dropped."""

    peers: tuple[int, ...] = ()
    #: Also the node's own loopback address (its own services, as it reaches them).
    loopback: bool = False
    ports: tuple[int, ...] = ()
    local_ports: tuple[int, ...] = ()
    outgoing: bool = True
    incoming: bool = True

    def rules(self) -> list[str]:
        found = []
        for chain, wanted, far, far_port, near_port in (
            ("output", self.outgoing, "daddr", "dport", "sport"),
            ("input", self.incoming, "saddr", "sport", "dport"),
        ):
            if not wanted:
                continue
            addresses = [f"{SUBNET}.{peer}" for peer in self.peers]
            addresses += ["127.0.0.1"] if self.loopback else []
            match = f"ip {far} {{ {', '.join(addresses)} }} " if addresses else ""
            ports = [(far_port, self.ports), (near_port, self.local_ports)]
            if not self.ports and not self.local_ports:
                found.append(f"add rule inet {_TABLE} {chain} {match}drop")
            for side, numbers in ports:
                if numbers:
                    listed = ", ".join(str(n) for n in numbers)
                    found.append(
                        f"add rule inet {_TABLE} {chain} {match}tcp {side} {{ {listed} }} drop"
                    )
        return found


class Network:
    """The namespaces of one certification run; ``create`` makes them (removing any a previous
    run left), ``destroy`` removes them and every process still inside."""

    def __init__(self, size: int = 3, prefix: str = PREFIX) -> None:
        self.size = size
        self.prefix = prefix
        self.switch = f"{prefix}-switch"
        self.checker = f"{prefix}-checker"
        self._original: int | None = None

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node}"

    @property
    def namespaces(self) -> list[str]:
        return [self.namespace(node) for node in range(1, self.size + 1)] + [self.checker]

    def existing(self) -> list[str]:
        """This prefix's namespaces that exist now (left by a run that could not clean up)."""
        listed = _run("ip", "netns", "list")
        names = [line.split()[0] for line in listed.splitlines() if line.strip()]
        return [name for name in names if name.startswith(f"{self.prefix}-")]

    def check_free(self) -> None:
        """Raise ``NetworkUnavailable`` if this prefix's namespaces have processes in them:
        another run is under way (``create`` would remove its namespaces)."""
        for name in self.existing():
            if self._pids(name):
                raise NetworkUnavailable(
                    f"namespace {name} has processes in it: another certification is running"
                    " on this machine; wait for it, or stop it (its namespaces go with it)"
                )

    def create(self) -> None:
        """Make the namespaces, the bridge and the links; a previous run's leftovers (checked
        free with ``check_free``) are removed first."""
        self.destroy()
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        hosts = [(self.namespace(n), n) for n in range(1, self.size + 1)]
        for name, host in [*hosts, (self.checker, CHECKER_HOST)]:
            _run("ip", "netns", "add", name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
            port = self._port(host)
            _run(
                "ip", "link", "add", "eth0", "netns", name, "type", "veth",
                "peer", "name", port, "netns", self.switch,
            )  # fmt: skip
            _run("ip", "-n", name, "addr", "add", f"{SUBNET}.{host}/24", "dev", "eth0")
            _run("ip", "-n", name, "link", "set", "eth0", "up")
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            if name != self.checker:
                self._add_table(name)

    def destroy(self) -> None:
        """Kill whatever still runs in this prefix's namespaces, then delete them (their veths
        go with them)."""
        self.leave()
        for name in self.existing():
            for pid in self._pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    @staticmethod
    def _pids(name: str) -> list[int]:
        listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        return [int(pid) for pid in listed.stdout.split() if pid.isdigit()]

    def enter_checker(self) -> None:
        """Move this thread (and the threads and processes it starts from now on) into the
        checker's namespace; ``leave`` moves it back."""
        if self._original is None:
            self._original = os.open("/proc/self/ns/net", os.O_RDONLY)
        _setns(f"/run/netns/{self.checker}")

    def leave(self) -> None:
        if self._original is None:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(self._original, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back to the original network namespace")
        os.close(self._original)
        self._original = None

    def exec_prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program in node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    # -- faults ---------------------------------------------------------------------------

    def isolate(self, node: int) -> None:
        _run("ip", "-n", self.switch, "link", "set", self._port(node), "down")

    def rejoin(self, node: int) -> None:
        _run("ip", "-n", self.switch, "link", "set", self._port(node), "up")

    def block(self, node: int, blocks: Iterable[Block]) -> None:
        rules = [rule for block in blocks for rule in block.rules()]
        self._nft(self.namespace(node), rules)

    def unblock(self, node: int) -> None:
        name = self.namespace(node)
        self._nft(name, [f"flush chain inet {_TABLE} input", f"flush chain inet {_TABLE} output"])

    def redirect(self, node: int, peers: Iterable[int], port: int, to: int, mark: int) -> None:
        """Send node ``node``'s new connections to ``peers``' ``port`` to the local port ``to``
        instead (a relay, whose own connections carry ``mark`` and pass)."""
        listed = ", ".join(self.address(peer) for peer in peers)
        self._nft(
            self.namespace(node),
            [
                f"add table ip {_NAT}",
                f"add chain ip {_NAT} output {{ type nat hook output priority -100; }}",
                f"add rule ip {_NAT} output ip daddr {{ {listed} }} tcp dport {port}"
                f" meta mark != {mark} redirect to :{to}",
            ],
        )

    def unredirect(self, node: int) -> None:
        self._nft(self.namespace(node), [f"delete table ip {_NAT}"])

    def reset(self, node: int, port: int) -> None:
        """Break node ``node``'s open connections on ``port`` (either end) with TCP resets, so
        that they are made again (through a redirect added since)."""
        rules = [
            f"add rule inet {_TABLE} {chain} tcp {side} {port} reject with tcp reset"
            for chain in ("input", "output")
            for side in ("sport", "dport")
        ]
        self._nft(self.namespace(node), rules)
        time.sleep(0.5)
        self.unblock(node)

    def _add_table(self, name: str) -> None:
        self._nft(
            name,
            [
                f"add table inet {_TABLE}",
                f"add chain inet {_TABLE} input {{ type filter hook input priority 0; }}",
                f"add chain inet {_TABLE} output {{ type filter hook output priority 0; }}",
            ],
        )

    @staticmethod
    def _nft(name: str, commands: Sequence[str]) -> None:
        done = subprocess.run(
            ["ip", "netns", "exec", name, "nft", "-f", "-"],
            input="\n".join(commands) + "\n",
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"nft in {name} refused {commands}: {done.stderr.strip()}")

    def _port(self, host: int) -> str:
        return f"sw{host}"


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {path}")
    finally:
        os.close(fd)
