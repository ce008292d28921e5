"""Clients of the broker: ``blocking`` (scripts and tools)."""
