"""The client port: the Twisted protocol and factory over ``logbroker.wire`` and the broker."""
