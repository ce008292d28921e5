"""The process and network drills: a power-kill, partitions of several shapes, a stall and a
rolling restart, each of a busy range's primary where the fault has one target.

A drill injects its fault, the load going on, ends it, and hands the harness what it needs to
judge the aftermath (``Certification.after_fault``). A fault that must cost only a failover
also checks, while it lasts, that the other nodes still take writes in every range.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tests.certify.harness import LEASE_SECONDS, Certification, Outcome
from tests.certify.load import DirectProducer
from tests.certify.network import Block
from tests.certify.nodes import ETCD_CLIENT_PORT, PEER_PORT, Broker
from tests.certify.view import TOPIC, CheckFailed, Problem

#: The slow-link drill: the relays' port in every namespace, the mark on their own packets,
#: and the delay they add to every chunk, each way.
RELAY_PORT = 14042
RELAY_MARK = 0x77
SLOW_LINK_MS = 50
#: How long a primary cut from its peers keeps taking produces before it is killed.
CUT_BEFORE_KILL = 1.5


def power_kill(cert: Certification) -> Outcome:
    broker, range_id = cert.view.busy_primary()
    started = cert.mark(f"SIGKILL {broker.node_id}, primary of {range_id}")
    broker.kill()
    time.sleep(cert.timing.fault)
    broker.release()
    ended = cert.mark(f"{broker.node_id} started again")
    return cert.after_fault(started, ended)


def isolate(cert: Certification) -> Outcome:
    broker, range_id = cert.view.busy_primary()
    started = cert.mark(f"{broker.node_id} (primary of {range_id}) cut off: its link down")
    cert.network.isolate(broker.node)
    try:
        time.sleep(cert.timing.fault)
    finally:
        cert.network.rejoin(broker.node)
    ended = cert.mark(f"{broker.node_id}'s link up")
    return cert.after_fault(started, ended)


def one_way(cert: Certification) -> Outcome:
    broker, range_id = cert.view.busy_primary()
    started = cert.mark(
        f"one-way cut: {broker.node_id} (primary of {range_id}) hears everyone, reaches no one"
    )
    cert.network.block(broker.node, [Block(incoming=False)])
    try:
        time.sleep(cert.timing.fault)
    finally:
        cert.network.unblock(broker.node)
    ended = cert.mark(f"one-way cut of {broker.node_id} healed")
    return cert.after_fault(started, ended)


def primary_cut_from_peers(cert: Certification) -> Outcome:
    """The primary of a busy range cut from its peers but not from etcd: it keeps its lease,
    so only the peers' view can take its ranges away. While the cut lasts, every range must
    take writes through the other two nodes (a failover, not the loss of the cut node's
    ranges)."""
    broker, range_id = cert.view.busy_primary()
    others = [b.node for b in cert.view.others(broker)]
    started = cert.mark(
        f"{broker.node_id} (primary of {range_id}) cut from its peers' links, not from etcd"
    )
    cert.network.block(
        broker.node, [Block(peers=tuple(others), ports=(PEER_PORT,), local_ports=(PEER_PORT,))]
    )
    try:
        problems = _others_take_writes(cert, broker, f"{broker.node_id} was cut from its peers")
        time.sleep(cert.timing.fault)
    finally:
        cert.network.unblock(broker.node)
    ended = cert.mark(f"{broker.node_id}'s peer links restored")
    outcome = cert.after_fault(started, ended)
    outcome.problems[:0] = problems
    return outcome


def _others_take_writes(cert: Certification, broker: Broker, meanwhile: str) -> list[Problem]:
    """While ``broker`` suffers its fault: every range must take writes through the other
    nodes within the recovery bound (a failover, not an outage); the problem if not."""
    try:
        took = cert.wait_recovered(cert.timing.recovery_bound, cert.view.others(broker))
    except CheckFailed as failed:
        return [(3, f"while {meanwhile}: {failed}")]
    cert.mark(f"every range takes writes through the other nodes after {took:.1f} s")
    return []


def partitioned_power_kill(cert: Certification) -> Outcome:
    """A busy range's primary cut from its peers (not from its clients or etcd), its own
    clients producing to the ranges it leads, then SIGKILLed before the cut heals: nothing it
    took during the cut can reach a quorum, so none of it may be acknowledged (checked of the
    produces begun once the cut holds). A build that acknowledges on its own copy fails here,
    and loses it all: the checker's first negative control."""
    broker, range_id = cert.view.busy_primary()
    others = tuple(b.node for b in cert.view.others(broker))
    keys = cert.keys_of_ranges([int(r.rsplit(".", 1)[1]) for r in cert.view.led_by(broker)])
    direct = DirectProducer(broker.server, TOPIC, keys, cert.history, CUT_BEFORE_KILL)
    direct.start()
    # The produces begun once the cut holds can reach no quorum. A client produces one at a
    # time, and the produce in flight when the cut begins waits until the kill: a second
    # client, logged in before the cut, begins producing once it holds.
    during = DirectProducer(broker.server, TOPIC, keys, cert.history, CUT_BEFORE_KILL)
    during.connect()
    started = cert.mark(f"{broker.node_id} (primary of {range_id}) cut from its peers")
    cut = Block(peers=others, ports=(PEER_PORT,), local_ports=(PEER_PORT,))
    cert.network.block(broker.node, [cut])
    cut_at = time.monotonic()
    during.start()
    try:
        time.sleep(CUT_BEFORE_KILL)
        cert.mark(f"SIGKILL {broker.node_id}, still cut off")
        broker.kill()
    finally:
        cert.network.unblock(broker.node)
        try:
            direct.stop()
        finally:
            during.stop()
    outcome = Outcome()
    outcome.exercised.add(1)
    taken = [p for p in cert.history.produces if p.started >= cut_at and p.key in keys]
    acknowledged = sum(p.acknowledged for p in taken)
    cert.mark(
        f"of the {len(taken)} produces its clients began during the cut, {acknowledged}"
        " acknowledged"
    )
    if acknowledged:
        outcome.problems.append(
            (
                1,
                f"{broker.node_id} acknowledged {acknowledged} of the produces its clients"
                " began while it was cut from its peers: none could reach a quorum",
            )
        )
    elif taken:
        outcome.notes[1] = (
            "a primary cut from its peers acknowledged none of the produces begun during the cut"
        )
    _wait_taken_over(cert, broker, outcome)
    time.sleep(cert.timing.fault)
    broker.release()
    ended = cert.mark(f"{broker.node_id} started again, its links whole")
    return _merged(outcome, cert.after_fault(started, ended))


def cut_from_etcd(cert: Certification) -> Outcome:
    """A broker that reaches its peers but no etcd member (its own included; the member
    itself stays in its cluster and serves the other brokers): its lease runs out and its
    ranges go to the others."""
    broker, range_id = cert.view.busy_primary()
    others = tuple(b.node for b in cert.view.others(broker))
    started = cert.mark(f"{broker.node_id} (primary of {range_id}) cut from etcd, not its peers")
    cert.network.block(broker.node, [Block(peers=others, loopback=True, ports=(ETCD_CLIENT_PORT,))])
    try:
        time.sleep(LEASE_SECONDS)
        problems = _others_take_writes(cert, broker, f"{broker.node_id} was cut from etcd")
        time.sleep(cert.timing.fault)
    finally:
        cert.network.unblock(broker.node)
    ended = cert.mark(f"{broker.node_id} reaches etcd again")
    outcome = cert.after_fault(started, ended)
    outcome.problems[:0] = problems
    return outcome


def slow_link(cert: Certification) -> Outcome:
    """Every peer link of a busy range's primary slowed by a delaying relay (this kernel has
    no netem): the writes it leads must keep being acknowledged, only slower."""
    broker, range_id = cert.view.busy_primary()
    started = cert.mark(
        f"{broker.node_id}'s peer links (primary of {range_id}) slowed by {SLOW_LINK_MS} ms"
        " each way"
    )
    problems: list[Problem] = []
    with _slowed(cert, broker):
        time.sleep(cert.timing.fault)
        flowing = cert.acknowledged_between(started, time.monotonic())
        cert.mark(f"{flowing} writes acknowledged over the slow links")
        if flowing == 0:
            problems.append((3, "no write was acknowledged over the slow links"))
    ended = cert.mark(f"{broker.node_id}'s peer links at full speed again")
    outcome = cert.after_fault(started, ended)
    outcome.problems[:0] = problems
    return outcome


def lagging_power_kill(cert: Certification) -> Outcome:
    """SIGKILL of a busy range's primary while its followers lag behind it (its peer links
    slowed): a power cut of the node, so what its links held in flight is lost with it. What
    it acknowledged must already be on a quorum, whatever it alone held. (A build that
    acknowledges on its own copy loses its last writes: the checker's negative control.)"""
    broker, range_id = cert.view.busy_primary()
    keys = cert.keys_of_ranges([int(r.rsplit(".", 1)[1]) for r in cert.view.led_by(broker)])
    direct = DirectProducer(broker.server, TOPIC, keys, cert.history, cert.timing.fault)
    direct.start()
    try:
        with _slowed(cert, broker) as relays:
            time.sleep(cert.timing.settle)
            started = cert.mark(
                f"SIGKILL {broker.node_id}, primary of {range_id}, its clients producing to"
                f" it, its peer links slowed by {SLOW_LINK_MS} ms each way; what they held in"
                " flight dropped"
            )
            broker.kill()
            for relay in relays:
                relay.kill()
    finally:
        direct.stop()
    outcome = Outcome()
    _wait_taken_over(cert, broker, outcome)
    time.sleep(cert.timing.fault)
    broker.release()
    ended = cert.mark(f"{broker.node_id} started again, its links at full speed")
    return _merged(outcome, cert.after_fault(started, ended))


def _wait_taken_over(cert: Certification, broker: Broker, outcome: Outcome) -> None:
    """Wait until the ranges ``broker`` led go on without it (before it is back, else it may
    lead them again on its own copy)."""
    try:
        took = cert.wait_for(
            lambda: not cert.view.led_by(broker),
            cert.timing.recovery_bound,
            f"the ranges {broker.node_id} led taken over",
        )
        cert.mark(f"its ranges taken over by the other nodes after {took:.1f} s")
    except CheckFailed as failed:
        outcome.problems.append((3, str(failed)))


def _merged(first: Outcome, then: Outcome) -> Outcome:
    """``then``, with ``first``'s problems before its own, and its guarantees and notes."""
    then.problems[:0] = first.problems
    then.exercised |= first.exercised
    then.notes = {**first.notes, **then.notes}
    return then


@contextlib.contextmanager
def _slowed(cert: Certification, broker: Broker) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Every peer connection to or from ``broker`` through a delaying relay while inside;
    yields the relays (killing them drops what they hold)."""
    others = [b.node for b in cert.view.others(broker)]
    nodes = range(1, cert.network.size + 1)
    relays = [_start_relay(cert, node) for node in nodes]
    try:
        time.sleep(0.5)  # the relays listening
        for node in nodes:
            peers = others if node == broker.node else [broker.node]
            cert.network.redirect(node, peers, PEER_PORT, RELAY_PORT, RELAY_MARK)
        # Open peer connections were made before the redirect: break them, so that they are
        # made again through the relays.
        cert.network.reset(broker.node, PEER_PORT)
        yield relays
    finally:
        for node in nodes:
            cert.network.unredirect(node)
        for relay in relays:
            relay.kill()
            relay.wait(timeout=30)


def _start_relay(cert: Certification, node: int) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "tests.certify.relay", str(RELAY_PORT), str(SLOW_LINK_MS)]
    return subprocess.Popen(
        [*cert.network.exec_prefix(node), *command, hex(RELAY_MARK)],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.DEVNULL,
    )


def hung_etcd_member(cert: Certification) -> Outcome:
    """An etcd member that takes connections and requests but answers none (its gateway cut
    from its own gRPC server, its process up: a grey failure), and meanwhile a busy range's
    primary on another node SIGKILLed. The brokers that used the member must give up on it and
    follow the control plane through the others: the two live nodes must take writes in every
    range again within the bound, as after a plain power-kill."""
    broker, range_id = cert.view.busy_primary()
    member = next(m for m in cert.etcd if m.node != broker.node)
    started = cert.mark(f"etcd member e{member.node} answers nothing, its process up")
    cert.network.block(
        member.node, [Block(peers=(member.node,), ports=(ETCD_CLIENT_PORT,), incoming=False)]
    )
    problems: list[Problem] = []
    try:
        time.sleep(cert.timing.settle)
        cert.mark(f"SIGKILL {broker.node_id}, primary of {range_id}, e{member.node} still hung")
        broker.kill()
        problems = _others_take_writes(cert, broker, f"e{member.node} answered nothing")
        time.sleep(cert.timing.fault)
    finally:
        cert.network.unblock(member.node)
        broker.release()
    ended = cert.mark(f"etcd member e{member.node} answers again; {broker.node_id} started")
    outcome = cert.after_fault(started, ended)
    outcome.problems[:0] = problems
    return outcome


def stall(cert: Certification) -> Outcome:
    broker, range_id = cert.view.busy_primary()
    started = cert.mark(f"SIGSTOP {broker.node_id}, primary of {range_id}, past its lease")
    broker.signal(signal.SIGSTOP)
    try:
        time.sleep(LEASE_SECONDS + cert.timing.fault)
    finally:
        broker.signal(signal.SIGCONT)
    ended = cert.mark(f"SIGCONT {broker.node_id}")
    return cert.after_fault(started, ended)


def rolling_restart(cert: Certification) -> Outcome:
    started = cert.mark("rolling restart: SIGTERM and start of each node in turn")
    for broker in cert.brokers:
        cert.mark(f"SIGTERM {broker.node_id}")
        broker.stop()
        broker.release()
        took = cert.wait_healthy(cert.timing.health_bound, under_replicated=False)
        cert.mark(f"{broker.node_id} back, 3 of 3 alive after {took:.1f} s")
    ended = cert.mark("rolling restart done")
    return cert.after_fault(started, ended)
