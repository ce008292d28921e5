"""The open-file limit the broker runs with, and the segment files it leaves room for.

``raise_file_limit`` raises the soft limit to the hard one at start (the soft one is often
1,024 while the hard one allows far more). The range logs keep at most
``FileLimit.max_open_files`` segment files open between them (``logbroker.storage._handles``
closes the least recently used idle ones past it), so a node may hold more ranges than it has
descriptors; the rest are kept for connections, etcd's, reads of sealed segments and the logs
writing at the moment.
"""

from __future__ import annotations

import resource
from collections.abc import Callable

import attrs

#: File descriptors kept for what is not a segment file a range log keeps open: client and
#: peer connections, etcd's, the dashboard's, reads of sealed segments in reader threads, the
#: process's own, and the writers of logs writing past the budget; a quarter of a limit below
#: four times this.
DESCRIPTORS_KEPT = 4096


@attrs.frozen
class FileLimit:
    """The open-file limit (``RLIMIT_NOFILE``) the broker runs with, and how many segment
    files the range logs may keep open between them."""

    descriptors: int
    #: What the limit was before ``raise_file_limit`` raised it, if it did.
    raised_from: int | None = None

    @property
    def kept(self) -> int:
        return min(DESCRIPTORS_KEPT, self.descriptors // 4)

    @property
    def max_open_files(self) -> int:
        return max(1, self.descriptors - self.kept)


#: What an unlimited limit counts as.
_UNLIMITED = 1 << 20


def raise_file_limit(
    getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
    setrlimit: Callable[[int, tuple[int, int]], None] = resource.setrlimit,
) -> FileLimit:
    """Raise this process's soft open-file limit to its hard limit (the soft one is often 1,024
    while the hard one allows far more) and say what it is."""
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return FileLimit(_UNLIMITED)
    if hard == resource.RLIM_INFINITY or soft == hard:
        # An unlimited hard limit cannot be the soft one (the kernel caps it): kept as it is.
        return FileLimit(soft)
    try:
        setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        return FileLimit(soft)
    return FileLimit(hard, raised_from=soft)
