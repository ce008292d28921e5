"""Quorum replication of each range's segments (decision 0008).

A segment's primary streams its stored bytes to the segment's replicas (``primary``) and
acknowledges a produce once a quorum holds it durably (``quorum``); replicas check epochs and
contiguity (``replica``); a node comes to lead a segment by claiming it (``takeover``); healing
brings the copies back to what the control plane says (``healing``). The replication ops travel
over the peer link (``logbroker.peer``), laid out in ``replica_codec``.
"""
