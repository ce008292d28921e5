"""The deterministic simulation of replication under faults (see ``world``).

Every CI run checks ``SIMULATION_SEEDS`` seeds (2,000 by default; more with the environment
variable ``LOGBROKER_SIMULATION_SEEDS``, or another first seed with
``LOGBROKER_SIMULATION_FIRST_SEED``). A failing seed names the one command that replays it.
"""

from __future__ import annotations

import os

import pytest

from logbroker.replication.primary import ReplicationSettings
from logbroker.storage import FileSystem, _operations
from logbroker.storage._jobs import _seal_files
from logbroker.storage._segment import Sealed
from tests.simulation.world import simulate

SIMULATION_SEEDS = int(os.environ.get("LOGBROKER_SIMULATION_SEEDS", "2000"))
FIRST_SEED = int(os.environ.get("LOGBROKER_SIMULATION_FIRST_SEED", "0"))
BATCH = 50


def _replay(seed: int) -> str:
    return f".venv/bin/python -m tests.simulation --seed {seed}"


@pytest.mark.parametrize(
    "first", range(FIRST_SEED, FIRST_SEED + SIMULATION_SEEDS, BATCH), ids=lambda s: f"seeds{s}"
)
def test_no_acknowledged_record_is_lost_under_faults(first: int) -> None:
    last = min(first + BATCH, FIRST_SEED + SIMULATION_SEEDS)
    for seed in range(first, last):
        problems = simulate(seed)
        assert not problems, (
            f"seed {seed} broke a guarantee; replay it with: {_replay(seed)}\n"
            + "\n".join(problems[:20])
        )


class _AcknowledgeEarly(ReplicationSettings):
    """The broken variant: a produce is acknowledged once the primary alone holds it."""

    @property
    def quorum(self) -> int:
        return 1


def test_the_checker_catches_acknowledging_before_a_quorum() -> None:
    broken = _AcknowledgeEarly(
        replication_factor=3,
        window_bytes=4096,
        max_message_bytes=1024,
        backlog_bytes=3000,
        ack_timeout_seconds=3.0,
    )
    caught = [
        seed for seed in range(40) if any("is lost" in p for p in simulate(seed, settings=broken))
    ]
    assert caught, "40 seeds of a primary acknowledging alone lost nothing: the checker is blind"


def test_the_checker_catches_a_copy_fetched_whole_without_its_epoch_marker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The broken variant: a copy healing fetches whole is installed without the epoch the
    # control plane sealed the segment at, as before the epoch was passed down; its siblings,
    # sealed in place, carry one. The checker compares every file, not only the .log.
    def without_epoch(fs: FileSystem, path: str, data: bytes, sealed: Sealed, epoch: int) -> None:
        _seal_files(fs, path, sealed.seal, sealed.index, None)
        fs.write_atomic(path, data)

    monkeypatch.setattr(_operations, "_install_job", without_epoch)
    caught = [
        seed for seed in range(40) if any("missing_files .epoch" in p for p in simulate(seed))
    ]
    assert caught, "40 seeds of copies installed without their epoch: the checker is blind"
