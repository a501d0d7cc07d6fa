"""Goodput under a heavy-tailed rollout duration, per scheduler setting: `dew simulate`.

The simulation is `dew.simulate.long_tail` under trio's mock clock, so the figures are
deterministic; this script is the `dew simulate` command, with its options, and prints its
table: goodput, its share of the capacity bound, the trainer's idle share, lag, wasted
rollout-seconds and selection bias for sync, ahead=1, ahead=2, oversample=2 and a 3/4 admit
(target: ahead=1 at least 1.5x the sync goodput).

    python benchmarks/long_tail.py            # C=64, 16 tasks x 4, mean 10 s, T = 10 s, 30 steps
    python benchmarks/long_tail.py --smoke    # a tiny, fast run
    python benchmarks/long_tail.py --help     # every option with its default
"""

from __future__ import annotations

import sys

from dew.cli import main

if __name__ == "__main__":
    sys.exit(main(["simulate", *sys.argv[1:]]))
