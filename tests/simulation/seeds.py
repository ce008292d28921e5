"""The simulation's seeds, run in worker processes from the moment the suite is collected.

The rest of the suite runs one test at a time and leaves most of the machine idle (the
integration tests mostly wait on real processes), so the seeds' batches start in the background
as soon as pytest knows it will run them, in processes at the lowest priority (``nice`` 19: the
brokers, etcd and the tests themselves come first), and the simulation's tests, run last,
collect what the workers found. Run alone, the simulation's tests start them the same way.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor

from tests.simulation.world import simulate

#: Seeds per CI run (``LOGBROKER_SIMULATION_SEEDS``), from ``LOGBROKER_SIMULATION_FIRST_SEED``.
SIMULATION_SEEDS = int(os.environ.get("LOGBROKER_SIMULATION_SEEDS", "2000"))
FIRST_SEED = int(os.environ.get("LOGBROKER_SIMULATION_FIRST_SEED", "0"))
#: Seeds per test (and per task handed to a worker).
BATCH = 50
#: The first seed of each batch.
BATCH_STARTS = range(FIRST_SEED, FIRST_SEED + SIMULATION_SEEDS, BATCH)
#: Processes running seeds at once: every core (at most 4); ``LOGBROKER_SIMULATION_WORKERS``
#: overrides, and 1 runs each batch in the test that checks it.
WORKERS = int(os.environ.get("LOGBROKER_SIMULATION_WORKERS", str(min(os.cpu_count() or 1, 4))))

#: What a batch gives back: each seed with the problems its run found.
BatchResult = list[tuple[int, list[str]]]


def batch_of(first: int) -> range:
    """The seeds of the batch that starts at ``first``."""
    return range(first, min(first + BATCH, FIRST_SEED + SIMULATION_SEEDS))


def run_batch(seeds: Sequence[int]) -> BatchResult:
    return [(seed, simulate(seed)) for seed in seeds]


def _worker_starts() -> None:
    # Behind everything else on the machine. And what the worker inherited (the whole test
    # session) moves out of the garbage collector's sight: the collection after each run then
    # scans that run's objects alone.
    os.nice(19)
    gc.freeze()


class BackgroundSeeds:
    """Batches of seeds handed to worker processes once, and their results on demand."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._batches: dict[tuple[int, ...], Future[BatchResult]] = {}

    def start(self, batches: Iterable[Sequence[int]]) -> None:
        """Hand ``batches`` to the workers (those not handed over yet), in this order."""
        if WORKERS <= 1:
            return
        for batch in batches:
            key = tuple(batch)
            if key in self._batches:
                continue
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    WORKERS,
                    mp_context=multiprocessing.get_context("fork"),
                    initializer=_worker_starts,
                )
            self._batches[key] = self._pool.submit(run_batch, key)

    def result(self, batch: Sequence[int]) -> BatchResult:
        """What ``batch`` found: from the workers (handing it over now if it was not), or run
        here with a single worker."""
        if WORKERS <= 1:
            return run_batch(batch)
        self.start([batch])
        return self._batches[tuple(batch)].result()

    def stop(self) -> None:
        """Stop the workers; batches not started are dropped."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool = None
        self._batches.clear()


#: The suite's one set of workers (``tests/conftest.py`` starts and stops it).
BACKGROUND = BackgroundSeeds()
