"""A node's membership on a real three-member etcd keeps its lease while the member it talks to
stops answering: a member that is slow or hung, not gone, refuses nothing, so only the
keepalives' own deadlines can move the node off it."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator

import attrs
import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.task import deferLater

from logbroker.cluster.membership import Membership, NodeRecord
from logbroker.controlplane import EtcdGatewayStore
from tests.etcd import EtcdCluster, Member, etcd_cluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

TTL_MS = 3000


@attrs.define
class Node:
    membership: Membership
    store: EtcdGatewayStore
    #: The member the store tries first: not etcd's leader, so that stopping it starts no
    #: election (an election holds every request, and this is not what is tested).
    first: Member
    lost: list[str] = attrs.Factory(list)


@pytest_twisted.async_yield_fixture
async def node(etcd_cluster: EtcdCluster) -> AsyncIterator[Node]:  # noqa: F811
    leader = etcd_cluster.leader()
    first = next(member for member in etcd_cluster.members if member is not leader)
    others = [member.endpoint for member in etcd_cluster.members if member is not first]
    store = EtcdGatewayStore([first.endpoint, *others], reactor=reactor, timeout=5)  # type: ignore[arg-type]
    record = NodeRecord("n1", "n1.internal", 4040, 4041, 4042, (("zone", "a"),), "0.1")
    prefix = f"/membership-test-{uuid.uuid4().hex}/cluster/".encode()
    membership = Membership(store, prefix, record, reactor, TTL_MS)  # type: ignore[arg-type]
    made = Node(membership, store, first)
    membership.on_lease_lost.append(lambda: made.lost.append("lost"))
    membership.startService()
    await membership.registered()
    yield made
    if first.process is not None:
        os.kill(first.process.pid, signal.SIGCONT)
    await membership.stopService()
    await store.delete_prefix(prefix)
    await store.close()


@pytest_twisted.ensureDeferred
async def test_a_node_keeps_its_lease_while_its_etcd_member_answers_nothing(node: Node) -> None:
    assert node.first.process is not None
    os.kill(node.first.process.pid, signal.SIGSTOP)
    # Twice the lease's TTL: every keepalive sent to the stopped member is given up after a
    # third of it, and the lease runs out after one TTL without an answer.
    await deferLater(reactor, 2 * TTL_MS / 1000)  # type: ignore[arg-type]

    assert node.lost == []
    assert node.membership.holds_lease
    age = node.membership.lease_age()
    assert age is not None
    assert age < TTL_MS / 1000
