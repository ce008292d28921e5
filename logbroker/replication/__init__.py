"""Replication between the brokers of a cluster: the peer port (4042).

``codec`` is the sans-IO peer codec (its docstring documents the byte layout), ``handshake`` the
sans-IO handshake of one side, ``protocol`` the thin Twisted adapter: ``PeerProtocol``, the
accepting side's ``PeerServerFactory`` and ``PeerConnections``, one reconnecting outbound link
per peer node.
"""
