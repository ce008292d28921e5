"""Replay simulation seeds: ``python -m tests.simulation --seed N [--count K]``."""

from __future__ import annotations

import argparse
import sys

from tests.simulation.world import simulate


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.simulation")
    parser.add_argument("--seed", type=int, required=True, help="the first seed to run")
    parser.add_argument("--count", type=int, default=1, help="how many seeds from it")
    args = parser.parse_args()
    failed = 0
    for seed in range(args.seed, args.seed + args.count):
        problems = simulate(seed)
        print(f"seed {seed}: {'ok' if not problems else f'{len(problems)} problems'}")
        for problem in problems:
            print(f"  {problem}")
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
