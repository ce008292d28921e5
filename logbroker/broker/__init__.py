"""The broker core: topics, keyspaces and ranges, produce and fetch, cursors, consumer groups.

Transport-free: the client protocol (``logbroker.server``) translates requests into calls here.
"""
