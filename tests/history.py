"""A history of keyed produces, and the checker of what a cluster gives back after faults.

Producers ask the ``History`` for each record's value (``next_value``: unique, carrying the
key's sequence number) and record every produce they attempt (``record``): its key, value,
sequence number, when it started and finished on the monotonic clock, and whether it was
acknowledged or failed (and why). Once the load has stopped and everything is read back,
``History.check(read)`` compares the two and returns a ``Verdict``:

- every acknowledged value is read back (nothing acknowledged is lost);
- no value is read twice (a retried produce carries its stamp, so it is stored once);
- per key, acknowledged records read back in the order they were acknowledged: one acknowledged
  before another was sent is read before it;
- nothing is read that no one produced;

and it counts the failed produces (allowed during a fault: a failed produce may or may not be
stored, so a failed value read back once is no problem) and the longest produce latency.

Thread-safe: each producer thread records into the one history.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Sequence

import attrs

#: Between a value's key and its sequence number; keys must not contain it.
_SEPARATOR = b"#"


@attrs.frozen
class Produce:
    """One produce of one record, as its producer saw it."""

    key: bytes
    value: bytes
    sequence: int
    started: float
    finished: float
    #: None when acknowledged; otherwise why it failed (a refusal's reason or an error's type).
    failure: str | None

    @property
    def acknowledged(self) -> bool:
        return self.failure is None

    @property
    def latency(self) -> float:
        return self.finished - self.started


@attrs.frozen
class Verdict:
    """What ``History.check`` found; ``problems`` is empty when every guarantee held."""

    acknowledged: int
    failed: int
    #: Failures by reason, for the report.
    failures: dict[str, int]
    #: Failed produces whose value reads back anyway (allowed: the outcome was unknown).
    failed_but_stored: int
    #: The longest latency of an acknowledged produce, and when that produce started (seconds
    #: since the history began, as every moment in the verdict).
    longest_latency: float
    longest_latency_at: float
    #: The events marked (``History.mark``), in order.
    events: tuple[tuple[float, str], ...]
    lost: tuple[bytes, ...]
    duplicated: tuple[bytes, ...]
    unknown: tuple[bytes, ...]
    #: Per key, a description of the first pair read out of acknowledgement order.
    out_of_order: tuple[str, ...]

    @property
    def problems(self) -> list[str]:
        found = []
        if self.lost:
            found.append(f"{len(self.lost)} acknowledged values lost: {_sample(self.lost)}")
        if self.duplicated:
            found.append(
                f"{len(self.duplicated)} values read more than once: {_sample(self.duplicated)}"
            )
        if self.unknown:
            found.append(f"{len(self.unknown)} values never produced: {_sample(self.unknown)}")
        found.extend(self.out_of_order)
        return found

    def summary(self) -> str:
        failures = ", ".join(f"{reason} {n}" for reason, n in sorted(self.failures.items()))
        return (
            f"{self.acknowledged} acknowledged, {self.failed} failed ({failures or 'none'}; "
            f"{self.failed_but_stored} of them stored), longest latency "
            f"{self.longest_latency:.2f} s at +{self.longest_latency_at:.1f} s; "
            + ", ".join(f"+{moment:.1f} s {event}" for moment, event in self.events)
        )


def _sample(values: Sequence[bytes], count: int = 10) -> str:
    shown = ", ".join(v.decode(errors="replace") for v in values[:count])
    return shown + (" ..." if len(values) > count else "")


class History:
    """Every produce attempted, in the order they finished."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sequences: collections.Counter[bytes] = collections.Counter()
        self._produces: list[Produce] = []
        self._marks: list[tuple[float, str]] = []
        self.origin = time.monotonic()

    def next_value(self, key: bytes) -> tuple[int, bytes]:
        """The next sequence number of ``key`` and a value, unique in this history, carrying
        it."""
        if _SEPARATOR in key:
            raise ValueError(f"a key must not contain {_SEPARATOR!r}: {key!r}")
        with self._lock:
            sequence = self._sequences[key]
            self._sequences[key] += 1
        return sequence, key + _SEPARATOR + b"%d" % sequence

    def record(
        self,
        key: bytes,
        value: bytes,
        sequence: int,
        started: float,
        finished: float,
        failure: str | None = None,
    ) -> None:
        """One produce's outcome: ``failure`` None when it was acknowledged."""
        with self._lock:
            self._produces.append(Produce(key, value, sequence, started, finished, failure))

    def mark(self, event: str) -> float:
        """Note ``event`` (a fault, a restart) in the history's report; return when it was."""
        moment = time.monotonic()
        with self._lock:
            self._marks.append((moment, event))
        return moment

    @property
    def produces(self) -> list[Produce]:
        with self._lock:
            return list(self._produces)

    def acknowledged_keys(self, since: float) -> set[bytes]:
        """The keys with a produce acknowledged after ``since`` (monotonic clock)."""
        return {p.key for p in self.produces if p.acknowledged and p.finished > since}

    def check(self, read: Iterable[tuple[bytes | None, bytes]]) -> Verdict:
        """Compare what was read back, ``(key, value)`` in the order read, with the history."""
        read = list(read)
        with self._lock:
            produces = list(self._produces)
            marks = list(self._marks)
        by_value = {p.value: p for p in produces}
        acknowledged = [p for p in produces if p.acknowledged]
        failed = [p for p in produces if not p.acknowledged]
        read_values = [value for _, value in read]
        counts = collections.Counter(read_values)

        lost = tuple(p.value for p in acknowledged if p.value not in counts)
        duplicated = tuple(value for value, n in counts.items() if n > 1)
        # A record read back under another key than it was produced with is unknown too.
        unknown = tuple(
            dict.fromkeys(
                value for key, value in read if value not in by_value or by_value[value].key != key
            )
        )

        # Per key, in the order read: a record acknowledged before an earlier-read one was
        # even sent is out of order. The first such pair of each key is evidence enough.
        out_of_order: dict[bytes, str] = {}
        latest_sent: dict[bytes, Produce] = {}
        for value in dict.fromkeys(read_values):
            produce = by_value.get(value)
            if produce is None or not produce.acknowledged:
                continue
            earlier = latest_sent.get(produce.key)
            if earlier is not None and produce.finished < earlier.started:
                out_of_order.setdefault(
                    produce.key,
                    f"key {produce.key.decode(errors='replace')}: sequence {produce.sequence} "
                    f"reads back after sequence {earlier.sequence}, which was sent only after "
                    f"{produce.sequence} was acknowledged",
                )
            if earlier is None or produce.started > earlier.started:
                latest_sent[produce.key] = produce

        origin = self.origin
        slowest = max(acknowledged, key=lambda p: p.latency, default=None)
        return Verdict(
            acknowledged=len(acknowledged),
            failed=len(failed),
            failures=dict(collections.Counter(p.failure or "" for p in failed)),
            failed_but_stored=sum(1 for p in failed if p.value in counts),
            longest_latency=0.0 if slowest is None else slowest.latency,
            longest_latency_at=0.0 if slowest is None else slowest.started - origin,
            lost=lost,
            duplicated=duplicated,
            unknown=unknown,
            out_of_order=tuple(out_of_order.values()),
            events=tuple((moment - origin, event) for moment, event in marks),
        )
