"""logbroker: a replicated, append-only log broker on Twisted."""

__version__ = "0.1.0.dev0"
