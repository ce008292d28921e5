"""Running as one of several nodes: where segments' replicas live (``placement``)."""
