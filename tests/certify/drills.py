"""Every drill of the certification, in the order a run takes them."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from tests.certify import config_faults, faults, storage_faults
from tests.certify.harness import Certification, Outcome
from tests.certify.report import DrillRecord, Report
from tests.certify.view import CheckFailed
from tests.history import Verdict


@attrs.frozen
class Drill:
    name: str
    #: What the drill does, for the timeline.
    description: str
    run: Callable[[Certification], Outcome]


def run(cert: Certification, drill: Drill, say: Callable[[str], object]) -> DrillRecord:
    """Run ``drill`` on ``cert``'s cluster, printing its verdict; its record."""
    try:
        outcome = drill.run(cert)
    except CheckFailed as failed:
        outcome = cert.outcome_of_failure(failed)
    record = DrillRecord(drill.name, outcome)
    for line in record.lines():
        say(line)
    return record


def conclude(cert: Certification, report: Report, say: Callable[[str], object]) -> Verdict:
    """The end of a run: the load stopped, everything read back through every node and
    checked (guarantee 1), every sealed copy compared (guarantee 4), into ``report``; a failed
    run keeps its directory. The history's verdict."""
    say("\n== the end: load stopped, everything read back through every node")
    verdict, problems = cert.finish()
    report.history(verdict, problems, cert.follower_summary())
    report.copies(*final_copies(cert))
    if not report.passed:
        cert.failed = True
    return verdict


def final_copies(cert: Certification) -> tuple[bool, str, str | None]:
    """The end's ``cluster verify`` (guarantee 4): whether every sealed copy is identical,
    what it printed, and what its first look found if that one did not find them identical.

    ``cluster verify`` is a snapshot, and the end is not a quiet moment: a node back from the
    last drill takes its ranges back (decision 0026) about then, and a segment it seals is
    recorded sealed before its replicas have sealed their copies (each one does within a
    healing tick). So copies found not identical are looked at again until they are; those
    still not identical after the bound fail the guarantee."""
    identical, printed = cert.view.verify_copies()
    if identical:
        return True, printed, None
    first_look = printed.replace("\n", "; ")
    cert.mark(f"`cluster verify`: not every sealed copy identical yet: {first_look}")
    try:
        took, printed = cert.wait_identical(cert.timing.identical_bound)
    except CheckFailed as failed:
        return False, str(failed), first_look
    cert.mark(f"`cluster verify`: every sealed copy identical, {took:.1f} s later")
    return True, printed, first_look


DRILLS = (
    Drill("power-kill", "SIGKILL of a busy range's primary, then restart", faults.power_kill),
    Drill(
        "partition", "a busy range's primary isolated (its link down), then healed", faults.isolate
    ),
    Drill("one-way cut", "a primary's outgoing packets dropped, then healed", faults.one_way),
    Drill(
        "peer partition",
        "a primary cut from its peers but not from etcd: a failover, not an outage",
        faults.primary_cut_from_peers,
    ),
    Drill("etcd partition", "a primary cut from etcd but not from its peers", faults.cut_from_etcd),
    Drill(
        "hung etcd member",
        "an etcd member that answers nothing (a grey failure) while a primary is SIGKILLed",
        faults.hung_etcd_member,
    ),
    Drill(
        "partitioned power-kill",
        "a primary cut from its peers, then SIGKILLed before the cut heals",
        faults.partitioned_power_kill,
    ),
    Drill(
        "lagging power-kill",
        "SIGKILL of a primary whose followers lag (its peer links slowed), then restart",
        faults.lagging_power_kill,
    ),
    Drill("slow link", "a primary's peer links slowed by a delaying proxy", faults.slow_link),
    Drill("stall", "SIGSTOP of a primary past its lease, then SIGCONT", faults.stall),
    Drill("rolling restart", "SIGTERM and restart of each node in turn", faults.rolling_restart),
    Drill(
        "storage faults",
        "a stopped follower's copies damaged (torn and truncated active copies, a sealed copy"
        " deleted, bit rot, a rotted index), then started",
        storage_faults.damaged_follower,
    ),
    Drill(
        "full volume",
        "a node's small data volume filled while producing, then freed",
        storage_faults.full_volume,
    ),
    Drill(
        "rolling config",
        "the group-commit interval changed node by node, each restarted",
        config_faults.rolling_config,
    ),
    Drill(
        "bad config",
        "a setting that fails at boot pushed to one node under its supervisor, then rolled back",
        config_faults.bad_config,
    ),
)
