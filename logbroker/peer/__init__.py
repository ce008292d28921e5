"""The peer port (4042): how the nodes of a cluster talk to each other.

``frames`` is the sans-IO codec of the link's frames and ``handshake`` the sans-IO handshake of
one side; ``link`` is one connection (the thin Twisted ``PeerProtocol``), ``window`` the requests
one side of it has waiting or holds back (each kind with its own room), and ``connections``
both ends' factories (``PeerServerFactory`` for the listener, ``PeerConnections`` for one
reconnecting outbound link per peer); ``requester`` is what the layers above send requests
through (``PeerRequester``); ``range_ops`` is the codec of the range operations (forwarded
produces, reads and bounds, consumer groups). Replication's own ops are laid out in
``logbroker.replication.replica_codec``. Nothing here knows of ranges' placement or
replication: ``cluster`` and ``replication`` build on it.
"""
