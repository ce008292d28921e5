"""Placement: which nodes hold a segment's replicas. Pure: no Twisted, no I/O, no clock.

The caller passes the membership it sees (``PlacementNode``: id, attributes, alive) and the rule
(``PlacementRule``, from ``SVC_LOG_REPLICATION_FACTOR``, ``SVC_LOG_SPREAD_BY``,
``SVC_LOG_MIN_DOMAINS`` and ``SVC_LOG_SPREAD_POLICY``); the answer depends on nothing else, so
every node computes the same replica set from the same membership.

**Ranking: rendezvous (highest-random-weight) hashing.** Each live node scores
``blake2b-64(segment key, node id)``, and the nodes are ranked by score (node id breaks the
never-seen tie). Every segment gets its own pseudo-random order of the nodes, so segments and
primaries spread evenly without a ring, virtual nodes or any stored state, and the movement is
minimal: a node that leaves only vacates the slots it held (each is taken by the next node in that
segment's order), and a node that joins only takes the segments where it ranks high enough, one
slot each. The hash is a keyed digest, never Python's ``hash`` (salted per process), so every node
and every release ranks alike; ``test_scores_are_pinned`` pins it, because a change would make
nodes of different versions disagree.

**Spread first, then score.** With ``spread_by`` set, the nodes are grouped into domains by the
value of that attribute. Walking the ranking, the best node of each new domain is taken until
``min_domains`` domains are covered; the remaining slots go to the best remaining nodes, whatever
their domain. The replica set is then ordered by score, so the primary (the first member) is the
best-ranked node of all, and primaries spread evenly across nodes however unevenly the domains
are sized. Whenever the live nodes span ``min_domains`` domains the set does too; otherwise it
spans every live domain, and the policy decides: ``hard`` refuses (``SpreadError``, reason
``no_quorum``: the producer is refused rather than the replicas concentrated), ``soft`` places it
and says so (``Placement.spread_met`` is false; ``domain_violations`` counts it).

**Domains of nodes without the attribute.** A node that does not declare the ``spread_by``
attribute is a domain of its own: nothing says it shares a failure domain with any other node,
and a partly labelled cluster (during a rolling reconfiguration, say) stays placeable. Such a node
helps cover ``min_domains``; label every node to make the spread mean what it says.

**Quorum and short sets.** Fewer live nodes than the write quorum (``floor(RF/2) + 1``) cannot
acknowledge a write: ``NoQuorumError`` (reason ``no_quorum``). Fewer than RF but at least a quorum:
the set takes every live node and is marked ``short``; the caller decides whether to accept it.

**Repair keeps what it has.** ``replace`` keeps every live member, in order (so the primary stays
first while it lives), and appends replacements for the missing slots in the same rendezvous
order, taking uncovered domains first. New members go last: a node still backfilling is never the
primary. A repair never refuses for the spread, even under ``hard``: refusing would leave fewer
copies without spreading them any better; the shortfall shows in ``domain_violations``.

**The preferred leader.** A range's leadership moves with its failures: whoever claims a dead
primary's segment leads it, and the segments it opens after, from then on. ``preferred_leader``
names, among a replica set, the member that leads the range when all is well: the best-ranked
for the key its first segment was placed by, so the primaries ``place`` spread at creation are
the preferred leaders, and leadership spreads across nodes as evenly as placement does.
``logbroker.replication.balance`` hands the ranges back to them (decision 0026).

**Counting violations.** ``domain_violations`` judges each replica set by its *live* members: a
copy on a dead node, or on a node the membership does not list, protects nothing until it comes
back or is replaced, so a set whose surviving copies sit in too few domains is the availability
risk ``svc_domain_violations`` alerts on. A rule without a spread requirement (``min_domains`` 1)
counts nothing.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Sequence

import attrs

from logbroker.config import ClusterSettings, SpreadPolicy
from logbroker.errors import LogbrokerError, Reason

__all__ = [
    "NoLiveReplicaError",
    "NoQuorumError",
    "Placement",
    "PlacementError",
    "PlacementNode",
    "PlacementRule",
    "SpreadError",
    "domain_violations",
    "place",
    "preferred_leader",
    "replace",
    "segment_key",
]

#: Separates placement scores from any other use of blake2b over the same bytes.
_PERSON = b"logbroker.place"


def segment_key(range_id: str, base_offset: int) -> str:
    """The key a segment is placed by: ``<range_id>@<base_offset>``, unique per segment."""
    return f"{range_id}@{base_offset}"


@functools.lru_cache(maxsize=1 << 16)
def preferred_leader(range_id: str, replicas: tuple[str, ...]) -> str:
    """The member of ``replicas`` that should lead ``range_id``: the best-ranked for the key
    of the range's first segment (``segment_key(range_id, 0)``), which ``place`` made its
    first primary. Raises ``ValueError`` for an empty replica set. Remembered: it is asked of
    every range, over and over, and the replica sets rarely change."""
    if not replicas:
        raise ValueError(f"range {range_id}: an empty replica set has no leader")
    key = segment_key(range_id, 0)
    return max(replicas, key=lambda node_id: (_score(key, node_id), node_id))


def _score(key: str, node_id: str) -> int:
    """The node's rendezvous weight for ``key``: 64 bits of blake2b, the same in every process."""
    key_bytes = key.encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(
        len(key_bytes).to_bytes(4, "big") + key_bytes + node_id.encode("utf-8", "surrogatepass"),
        digest_size=8,
        person=_PERSON,
    ).digest()
    return int.from_bytes(digest, "big")


# -- values -----------------------------------------------------------------------------------


def _check_attributes(
    node: PlacementNode, attribute: attrs.Attribute[tuple[tuple[str, str], ...]], value: object
) -> None:
    if not (
        isinstance(value, tuple)
        and all(
            isinstance(pair, tuple)
            and len(pair) == 2
            and all(isinstance(part, str) and part for part in pair)
            for pair in value
        )
    ):
        raise ValueError(
            f"node {node.node_id!r}: attributes must be a tuple of (name, value) pairs of "
            f"non-empty strings, not {value!r}"
        )
    names = [name for name, _ in value]
    if len(set(names)) != len(names):
        raise ValueError(f"node {node.node_id!r} names an attribute twice: {value!r}")


def _non_empty_text(_: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty string, not {value!r}")


@attrs.frozen
class PlacementNode:
    """A node as placement sees it: its id, its ``SVC_LOG_ATTRIBUTES`` and whether it is alive."""

    node_id: str = attrs.field(validator=_non_empty_text)
    #: ``(name, value)`` pairs, as ``ClusterSettings.attributes`` holds them.
    attributes: tuple[tuple[str, str], ...] = attrs.field(default=(), validator=_check_attributes)
    alive: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    def attribute(self, name: str) -> str | None:
        """The value of attribute ``name``, or ``None`` if the node does not declare it."""
        for key, value in self.attributes:
            if key == name:
                return value
        return None


@attrs.frozen
class PlacementRule:
    """How many replicas a segment gets and across which domains they must spread.

    Checked as ``BrokerConfig`` checks the variables: ``min_domains`` is at most the replication
    factor, and above 1 only with ``spread_by``.
    """

    replication_factor: int = attrs.field()
    #: The attribute whose values are the failure domains, or ``None`` for no spread.
    spread_by: str | None = attrs.field(default=None)
    min_domains: int = attrs.field(default=1)
    policy: SpreadPolicy = attrs.field(
        default=SpreadPolicy.SOFT, validator=attrs.validators.instance_of(SpreadPolicy)
    )

    @replication_factor.validator
    def _check_factor(self, attribute: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"replication_factor must be an integer of at least 1, not {value!r}")

    @spread_by.validator
    def _check_spread_by(self, attribute: attrs.Attribute[str | None], value: object) -> None:
        if value is not None and not (isinstance(value, str) and value):
            raise ValueError(f"spread_by must be an attribute name or None, not {value!r}")

    @min_domains.validator
    def _check_min_domains(self, attribute: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"min_domains must be an integer of at least 1, not {value!r}")
        if value > 1 and self.spread_by is None:
            raise ValueError(f"min_domains {value} needs spread_by: the attribute to spread across")
        if value > self.replication_factor:
            raise ValueError(
                f"min_domains {value} exceeds the replication factor {self.replication_factor}: "
                "replicas cannot span more domains than there are replicas"
            )

    @classmethod
    def from_settings(cls, settings: ClusterSettings) -> PlacementRule:
        return cls(
            replication_factor=settings.replication_factor,
            spread_by=settings.spread_by,
            min_domains=settings.min_domains,
            policy=settings.spread_policy,
        )

    @property
    def quorum(self) -> int:
        """Replicas that must be durable to acknowledge a write: ``floor(RF/2) + 1``."""
        return self.replication_factor // 2 + 1

    @property
    def spreads(self) -> bool:
        """Whether the rule asks for more than one domain."""
        return self.spread_by is not None and self.min_domains > 1


def _check_replicas(_: object, attribute: attrs.Attribute[tuple[str, ...]], value: object) -> None:
    if (
        not isinstance(value, tuple)
        or not value
        or len(set(value)) != len(value)
        or not all(isinstance(node, str) and node for node in value)
    ):
        raise ValueError(f"replicas must be a tuple of distinct node ids, not {value!r}")


@attrs.frozen
class Placement:
    """A replica set chosen by ``place`` or ``replace``."""

    #: The nodes holding the segment; the first member is the primary.
    replicas: tuple[str, ...] = attrs.field(validator=_check_replicas)
    #: Whether the live members span the rule's ``min_domains`` (always true without a spread).
    spread_met: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    #: Fewer replicas than the replication factor: there were not enough live nodes.
    short: bool = attrs.field(validator=attrs.validators.instance_of(bool))

    @property
    def primary(self) -> str:
        return self.replicas[0]


# -- errors -----------------------------------------------------------------------------------


class PlacementError(LogbrokerError):
    """A segment cannot be placed or repaired; ``detail`` says what happened and what to do."""

    default_reason = Reason.NO_QUORUM


class NoQuorumError(PlacementError):
    """Fewer live nodes than the write quorum."""

    def __init__(
        self, key: str, live: Sequence[str], rule: PlacementRule, action: str = "place"
    ) -> None:
        super().__init__(
            f"cannot {action} segment {key}: {len(live)} live node(s) "
            f"({', '.join(live) or 'none'}) is fewer than the write quorum of {rule.quorum} for "
            f"SVC_LOG_REPLICATION_FACTOR={rule.replication_factor}; bring nodes back or add some"
        )
        self.segment_key = key
        self.live = tuple(live)
        self.quorum = rule.quorum


class SpreadError(PlacementError):
    """Under the ``hard`` policy: the live nodes span fewer domains than ``min_domains``."""

    def __init__(self, key: str, attribute: str, domains: Sequence[str], min_domains: int) -> None:
        super().__init__(
            f"cannot place segment {key}: SVC_LOG_SPREAD_BY={attribute} needs "
            f"SVC_LOG_MIN_DOMAINS={min_domains} distinct values among the live nodes, but they "
            f"span only {len(domains)} ({', '.join(domains) or 'none'}); bring up nodes in "
            f"another {attribute}, or set SVC_LOG_SPREAD_POLICY=soft to place anyway and count "
            "the segment in svc_domain_violations"
        )
        self.segment_key = key
        self.attribute = attribute
        #: The live domains, described: values, and ``<node> (no <attribute>)`` for unlabelled.
        self.domains = tuple(domains)
        self.min_domains = min_domains


class NoLiveReplicaError(PlacementError):
    """``replace`` found no live member to copy the segment from."""

    def __init__(self, key: str, replicas: Sequence[str]) -> None:
        super().__init__(
            f"cannot repair segment {key}: none of its replicas ({', '.join(replicas)}) is alive, "
            "so there is no copy to backfill from; bring one of them back"
        )
        self.segment_key = key
        self.replicas = tuple(replicas)


# -- planning ---------------------------------------------------------------------------------

#: A failure domain: ``(True, value)`` for a node declaring the attribute, ``(False, node_id)``
#: for one that does not (a domain of its own).
_Domain = tuple[bool, str]


def _domain(node: PlacementNode, attribute: str | None) -> _Domain:
    value = None if attribute is None else node.attribute(attribute)
    return (False, node.node_id) if value is None else (True, value)


def _describe(domain: _Domain, attribute: str) -> str:
    known, name = domain
    return name if known else f"{name} (no {attribute})"


def _live_by_id(nodes: Iterable[PlacementNode]) -> dict[str, PlacementNode]:
    """The live nodes by id; a node listed twice is a caller's error."""
    seen: set[str] = set()
    live: dict[str, PlacementNode] = {}
    for node in nodes:
        if node.node_id in seen:
            raise ValueError(f"node {node.node_id!r} is listed twice")
        seen.add(node.node_id)
        if node.alive:
            live[node.node_id] = node
    return live


def _ranked(key: str, nodes: Iterable[PlacementNode]) -> list[PlacementNode]:
    """``nodes`` in ``key``'s rendezvous order, best first."""
    return sorted(nodes, key=lambda node: (_score(key, node.node_id), node.node_id), reverse=True)


def _pick(
    ranked: Sequence[PlacementNode],
    slots: int,
    covered: set[_Domain],
    rule: PlacementRule,
) -> list[PlacementNode]:
    """Up to ``slots`` of ``ranked``: first the best node of each domain not yet ``covered``
    until ``min_domains`` are, then the best of the rest, all returned in rank order."""
    chosen: set[str] = set()
    if rule.spreads:
        covered = set(covered)
        for node in ranked:
            if len(chosen) == slots or len(covered) >= rule.min_domains:
                break
            domain = _domain(node, rule.spread_by)
            if domain not in covered:
                covered.add(domain)
                chosen.add(node.node_id)
    for node in ranked:
        if len(chosen) == slots:
            break
        chosen.add(node.node_id)
    return [node for node in ranked if node.node_id in chosen]


def _spread_met(members: Iterable[PlacementNode], rule: PlacementRule) -> bool:
    if not rule.spreads:
        return True
    return len({_domain(node, rule.spread_by) for node in members}) >= rule.min_domains


def place(key: str, nodes: Iterable[PlacementNode], rule: PlacementRule) -> Placement:
    """The replica set of a new segment ``key`` (see ``segment_key``) among the live ``nodes``.

    Raises ``NoQuorumError`` with fewer live nodes than the quorum, and ``SpreadError`` under the
    hard policy when the live nodes span fewer than ``min_domains`` domains.
    """
    live = _live_by_id(nodes)
    if len(live) < rule.quorum:
        raise NoQuorumError(key, sorted(live), rule)
    ranked = _ranked(key, live.values())
    members = _pick(ranked, min(rule.replication_factor, len(ranked)), set(), rule)
    spread_met = _spread_met(members, rule)
    if not spread_met and rule.policy is SpreadPolicy.HARD and rule.spread_by is not None:
        domains = {_domain(node, rule.spread_by) for node in ranked}
        described = sorted(domains, key=lambda domain: (not domain[0], domain[1]))
        raise SpreadError(
            key,
            rule.spread_by,
            [_describe(domain, rule.spread_by) for domain in described],
            rule.min_domains,
        )
    return Placement(
        replicas=tuple(node.node_id for node in members),
        spread_met=spread_met,
        short=len(members) < rule.replication_factor,
    )


def replace(
    key: str, replicas: Sequence[str], nodes: Iterable[PlacementNode], rule: PlacementRule
) -> Placement:
    """Repair segment ``key``'s replica set: keep its live members in order, and append the
    best live nodes (uncovered domains first) until it has ``replication_factor`` members.

    A set with no dead member and enough members comes back unchanged. Raises ``NoQuorumError``
    with fewer live nodes than the quorum and ``NoLiveReplicaError`` when no member is alive;
    never refuses for the spread (the result says whether it is met).
    """
    if not replicas or len(set(replicas)) != len(replicas):
        raise ValueError(f"segment {key}: replicas must be distinct node ids, not {replicas!r}")
    live = _live_by_id(nodes)
    kept = [live[member] for member in replicas if member in live]
    if not kept:
        raise NoLiveReplicaError(key, replicas)
    if len(live) < rule.quorum:
        raise NoQuorumError(key, sorted(live), rule, "repair")
    kept_ids = {node.node_id for node in kept}
    candidates = _ranked(key, (node for node in live.values() if node.node_id not in kept_ids))
    slots = max(0, min(rule.replication_factor, len(live)) - len(kept))
    covered = {_domain(node, rule.spread_by) for node in kept}
    members = kept + _pick(candidates, slots, covered, rule)
    return Placement(
        replicas=tuple(node.node_id for node in members),
        spread_met=_spread_met(members, rule),
        short=len(members) < rule.replication_factor,
    )


def domain_violations(
    replica_sets: Iterable[Sequence[str]], nodes: Iterable[PlacementNode], rule: PlacementRule
) -> int:
    """How many of ``replica_sets`` have live members spanning fewer than ``min_domains``
    domains: the value of ``svc_domain_violations``. Dead and unlisted members count for no
    domain; without a spread requirement nothing is counted."""
    if not rule.spreads:
        return 0
    live = _live_by_id(nodes)
    return sum(
        not _spread_met((live[member] for member in replicas if member in live), rule)
        for replicas in replica_sets
    )
