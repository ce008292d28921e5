"""A secured cluster end to end: three real ``twistd logbroker`` nodes with TLS on, so that their
peer port and links run mutual TLS with node certificates of the cluster's CA, on a real etcd
with TLS, client certificates and auth (``tests.etcd.EtcdSecurity``). Replication works over
those links; a node refuses, counts and logs a peer port connection with a certificate of
another CA, one in plaintext, and connections past its cap on handshakes from one address."""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from logbroker.client.blocking import BlockingClient
from logbroker.records import Record
from tests.certificates import Issued, issue, make_ca, write
from tests.cluster import BrokerCluster, Node
from tests.etcd import EtcdCluster, secured_etcd_cluster
from tests.integration.twistd import Samples, scrape

pytestmark = pytest.mark.integration

__all__ = ["secured_etcd_cluster"]

CLUSTER_CA = make_ca("cluster CA")
#: Connections in their handshake a node takes from one address (the test's own cap).
MAX_HANDSHAKES_PER_IP = 3


def node_certificate(cluster_id: str, node: str, authority: Issued = CLUSTER_CA) -> Issued:
    """A node's certificate: its address for clients, its node URI for peers."""
    return issue(
        authority, ("localhost", "127.0.0.1"), both=True, uris=(f"logbroker://{cluster_id}/{node}",)
    )


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, secured_etcd_cluster: EtcdCluster
) -> Iterator[BrokerCluster]:
    directory = tmp_path_factory.mktemp("secured-cluster")
    security = secured_etcd_cluster.security
    assert security is not None
    endpoints = ",".join(m.endpoint.removeprefix("https://") for m in secured_etcd_cluster.members)
    made = BrokerCluster(
        directory,
        secured_etcd_cluster,
        settings={
            "SVC_CONTROL_PLANE": f"etcd+https://{endpoints}",
            **security.broker_settings(),
            "SVC_LOG_REPLICATION_FACTOR": "3",
            # TLS offered to clients (plaintext too), and so mutual TLS between the nodes.
            "SVC_ENABLE_TLS": "true",
            "SVC_PEER_TLS_CACERTFILE": write(directory / "cluster-ca.pem", CLUSTER_CA.cert_pem),
            "SVC_PEER_MAX_HANDSHAKES_PER_IP": str(MAX_HANDSHAKES_PER_IP),
        },
    )
    for node in made.nodes:
        certificate = node_certificate(made.cluster_id, node.node_id)
        node.settings["SVC_TLS_CERTFILE"] = write(
            directory / f"{node.node_id}.pem", certificate.cert_pem
        )
        node.settings["SVC_TLS_KEYFILE"] = write(
            directory / f"{node.node_id}-key.pem", certificate.key_pem
        )
    try:
        made.start()
        yield made
    finally:
        made.stop()


def scrape_tls(node: Node) -> Samples:
    """The node's ``/metrics``: HTTPS, since the node has TLS on."""
    return scrape(
        node.dashboard_port, ssl.create_default_context(cadata=CLUSTER_CA.cert_pem.decode())
    )


def refused(node: Node, reason: str) -> float:
    return scrape_tls(node)[("svc_peer_connections_refused_total", (("reason", reason),))]


def eventually(check: object, seconds: float = 30.0) -> None:
    assert callable(check)
    deadline = time.monotonic() + seconds
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_the_nodes_replicate_over_mutual_tls(cluster: BrokerCluster) -> None:
    n1, _, n3 = cluster.nodes
    for node in cluster.nodes:
        assert f"peer port {node.peer_port} (mutual TLS)" in "".join(node.output)

    def linked() -> None:
        for node in cluster.nodes:
            assert scrape_tls(node)[("svc_peer_connections", ())] == 4

    eventually(linked)
    records = [Record(b"value-%d" % i, key=b"key-%d" % i) for i in range(30)]
    with BlockingClient.connect("127.0.0.1", n1.port, "app", "app123") as client:
        client.create_topic("secured")
        assert client.produce("secured", records) == len(records)

    def read_through_n3() -> None:
        with BlockingClient.connect("127.0.0.1", n3.port, "app", "app123") as client:
            batch = client.fetch("secured", None, None, None, 1000, 0)
        assert sorted(r.value for r in batch.records) == sorted(r.value for r in records)

    eventually(read_through_n3)
    for node in cluster.nodes:
        assert refused(node, "tls") == 0
        assert refused(node, "certificate") == 0


def test_a_peer_port_refuses_a_certificate_of_another_ca(cluster: BrokerCluster) -> None:
    n1 = cluster.nodes[0]
    before = refused(n1, "tls")
    impostor = node_certificate(cluster.cluster_id, "n2", authority=make_ca("another CA"))
    directory = Path(cluster.nodes[0].directory)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.load_cert_chain(
        write(directory / "impostor.pem", impostor.cert_pem),
        write(directory / "impostor-key.pem", impostor.key_pem),
    )
    # TLS 1.3: the server checks the client's certificate once the client is done, so the
    # refusal shows on the client's first read (or write), if at all.
    with (
        socket.create_connection(("127.0.0.1", n1.peer_port), timeout=10) as raw,
        contextlib.suppress(ssl.SSLError, ConnectionError),
        context.wrap_socket(raw) as tls,
    ):
        tls.sendall(b"\0" * 8)
        tls.recv(1)

    eventually(lambda: _grew(n1, "tls", before))
    assert "certificate verify failed" in "".join(n1.output)


def test_a_peer_port_refuses_plaintext(cluster: BrokerCluster) -> None:
    n2 = cluster.nodes[1]
    before = refused(n2, "tls")
    with socket.create_connection(("127.0.0.1", n2.peer_port), timeout=10) as raw:
        raw.sendall(b"\x00\x00\x00\x10not the peer protocol")
        with contextlib.suppress(ConnectionError):
            raw.recv(1024)
    eventually(lambda: _grew(n2, "tls", before))
    assert "Refused the TLS handshake of the peer at" in "".join(n2.output)


def test_connections_past_the_cap_on_handshakes_are_refused_at_accept(
    cluster: BrokerCluster,
) -> None:
    n3 = cluster.nodes[2]
    before = refused(n3, "per_ip_limit")
    idle = [
        socket.create_connection(("127.0.0.1", n3.peer_port), timeout=10)
        for _ in range(MAX_HANDSHAKES_PER_IP)
    ]
    try:
        # Accepted (in a moment) and held, in their TLS handshake, until the handshake timeout.
        time.sleep(1)
        with socket.create_connection(("127.0.0.1", n3.peer_port), timeout=10) as past:
            assert past.recv(1) == b""  # closed at accept
        eventually(lambda: _grew(n3, "per_ip_limit", before))
    finally:
        for sock in idle:
            sock.close()
    assert "Refused 1 peer port connection(s) at accept" in "".join(n3.output)


def _grew(node: Node, reason: str, before: float) -> None:
    assert refused(node, reason) > before
