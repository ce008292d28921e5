"""The open-file limit the broker runs with, and the open ranges it leaves room for.

Each open range keeps its active segment's file open, so a node holding tens of thousands of
ranges needs as many descriptors. ``raise_file_limit`` raises the soft limit to the hard one at
start (the soft one is often 1,024 while the hard one allows far more); ``StorageService``
opens no more ranges than ``FileLimit.max_open_ranges``, refusing another with
``TooManyRangesError`` rather than failing a write or a connection later for want of a
descriptor.
"""

from __future__ import annotations

import resource
from collections.abc import Callable

import attrs

#: File descriptors kept for what is not a range's open segment: client and peer connections,
#: etcd's, the dashboard's, reads of sealed segments, the process's own; a quarter of a
#: limit below four times this.
DESCRIPTORS_KEPT = 4096


@attrs.frozen
class FileLimit:
    """The open-file limit (``RLIMIT_NOFILE``) the broker runs with, and the open ranges it
    leaves room for: each open range keeps its active segment's file open."""

    descriptors: int
    #: What the limit was before ``raise_file_limit`` raised it, if it did.
    raised_from: int | None = None

    @property
    def kept(self) -> int:
        return min(DESCRIPTORS_KEPT, self.descriptors // 4)

    @property
    def max_open_ranges(self) -> int:
        return max(1, self.descriptors - self.kept)

    def why(self) -> str:
        return (
            f"as many as its open-file limit of {self.descriptors} allows (one each, with"
            f" {self.kept} kept for connections); raise the limit (LimitNOFILE= in the"
            f" systemd unit, ulimit -n) and restart, or spread the ranges over more nodes"
        )


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
