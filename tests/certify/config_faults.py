"""The configuration drills: a setting rolled out node by node, and a bad one pushed to one
node (guarantee 5)."""

from __future__ import annotations

import time

from tests.certify.harness import Certification, Outcome
from tests.certify.view import CheckFailed

#: At replication factor 3 the group-commit interval in effect is this one (with
#: ``SVC_REPLICATION_GROUP_COMMIT`` on, and an fsync per range's file: with one sync for every
#: range no append is parked, decision 0023); ``SVC_GROUP_COMMIT_INTERVAL_MS`` is the factor-1
#: knob.
REPLICATED_INTERVAL = "SVC_REPLICATION_GROUP_COMMIT_INTERVAL_MS"
#: A value every node refuses at boot (exit status 2, naming the variable).
BAD_SETTING = ("SVC_SEGMENT_MAX_BYTES", "sixty-four megabytes")
#: The exits at boot that make a crash loop, for the drill.
CRASHES = 3


def rolling_config(cert: Certification) -> Outcome:
    """The group-commit interval changed node by node, each node restarted with it: writes
    keep being acknowledged, and each node's boot log states the new value in effect.

    ``SVC_GROUP_COMMIT_INTERVAL_MS`` is changed as well; at replication factor 3 the node logs
    that it does not apply, and the interval it does apply is changed with it. The first roll
    also moves each node from one sync for every range to an fsync per range's file
    (``SVC_FSYNC_SCOPE=file``), where the interval parks appends: the cluster runs mixed
    while it rolls, and in the other mode from then on."""
    interval = "3" if cert.brokers[0].settings.get(REPLICATED_INTERVAL) == "7" else "7"
    change = {
        "SVC_FSYNC_SCOPE": "file",
        "SVC_REPLICATION_GROUP_COMMIT": "true",
        REPLICATED_INTERVAL: interval,
        "SVC_GROUP_COMMIT_INTERVAL_MS": interval,
    }
    described = ", ".join(f"{name}={value}" for name, value in change.items())
    started = cert.mark(f"rolling config change to {described}, node by node")
    problems: list[tuple[int, str]] = []
    expected = f"{REPLICATED_INTERVAL}={interval};"
    for broker in cert.brokers:
        broker.settings.update(change)
        since = broker.log_size()
        broker.stop()
        broker.release()
        took = cert.wait_healthy(cert.timing.health_bound, under_replicated=False)
        if expected in broker.log_since(since):
            cert.mark(f"{broker.node_id} applies {expected[:-1]}; 3 of 3 after {took:.1f} s")
        else:
            problems.append((3, f"{broker.node_id} did not log {expected[:-1]} at boot"))
    ended = cert.mark("rolling config change done")
    outcome = cert.after_fault(started, ended)
    flowing = cert.acknowledged_between(started, ended)
    cert.mark(f"{flowing} writes acknowledged while the config rolled")
    if flowing == 0:
        problems.append((3, "no write was acknowledged while the config rolled"))
    outcome.problems[:0] = problems
    return outcome


def bad_config(cert: Certification) -> Outcome:
    """A setting that fails at boot pushed to one node, restarted by its supervisor as
    systemd's ``Restart=always`` would: it must crash-loop and never turn ready while the
    other two keep taking quorum writes; rolling the setting back restores 3 of 3."""
    broker = cert.brokers[-1]
    name, value = BAD_SETTING
    good = broker.settings.get(name)
    started = cert.mark(f"{name}={value!r} pushed to {broker.node_id}, restarted")
    problems: list[tuple[int, str]] = []
    exits_before = broker.unexpected_exits
    broker.settings[name] = value
    broker.stop()
    broker.release()
    # Watched until it has crashed CRASHES times (or the bound passes): never ready meanwhile.
    deadline = time.monotonic() + cert.timing.recovery_bound
    while time.monotonic() < deadline and broker.unexpected_exits - exits_before < CRASHES:
        if broker.ready():
            problems.append((5, f"{broker.node_id} turned ready with {name}={value!r}"))
            break
        time.sleep(0.2)
    crashes = broker.unexpected_exits - exits_before
    cert.mark(f"{broker.node_id} exited {crashes} times at boot, never ready")
    if crashes < CRASHES:
        problems.append((5, f"{broker.node_id} exited only {crashes} times: no crash loop"))
    if name not in broker.log_tail(50):
        problems.append((5, f"{broker.node_id}'s log does not name {name}"))
    try:
        took = cert.wait_recovered(cert.timing.recovery_bound, cert.view.others(broker))
        cert.mark(f"the other two take quorum writes in every range ({took:.1f} s)")
    except CheckFailed as failed:
        problems.append((5, f"while {broker.node_id} crash-looped: {failed}"))
    if good is None:
        del broker.settings[name]
    else:
        broker.settings[name] = good
    ended = cert.mark(f"{name} rolled back on {broker.node_id}; its supervisor restarts it")
    outcome = cert.after_fault(started, ended)
    outcome.exercised.add(5)
    outcome.notes[5] = (
        f"{broker.node_id} exited {crashes} times with {name}={value!r}, never ready; the"
        " other two took writes in every range"
    )
    problems += [(5, f"after the rollback: {text}") for tag, text in outcome.problems if tag == 2]
    outcome.problems[:0] = problems
    return outcome
