"""Predicted against measured: calibrate from one real `dew train` run, predict another setting.

For each target setting, in pairs run back to back (so the two runs share the machine's load as
far as they can): a baseline `dew train --record` run at `--ahead 1 --max-lag 1`, then a
recorded run at the target setting. The baseline's trace is calibrated (`dew.calibrate`), the
target setting simulated on it over the target run's window (`Workload.warmup`), and the
target's trace measured alike (`dew.calibrate.observe`). Prints one row per pair: predicted
and measured goodput (samples per second) and trainer idle share, and the relative error.

A shared machine's load changes from one minute to the next, and a CPU run slows with it. A
fixed jitted loop is timed before, between and after the two runs; the ratio of its times
around the target to those around the baseline is the slowdown, and the `slowed` prediction
scales the baseline's durations and step times by it (`Calibration.slowed`) before simulating.

    python benchmarks/what_if.py                      # guess task, 40 steps, two pairs a target
    python benchmarks/what_if.py --keep runs/         # the same, keeping the runs
    python benchmarks/what_if.py --analyse runs/      # the table again from kept runs
    python benchmarks/what_if.py --smoke              # copy task, a tiny model, one short pair
    python benchmarks/what_if.py --only over admit    # the targets whose names hold a word

The engine (`dew train`'s RolloutServer) has one slot per rollout that can be in flight, so
the simulation's engine is unbounded (`slots=None`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from dew import calibrate, simulate

BASELINE = ("ahead=1 sync=1 lag=1", {"ahead": 1, "sync_every": 1, "max_lag": 1})
TARGETS = (
    ("ahead=1 sync=2 lag=2", {"ahead": 1, "sync_every": 2, "max_lag": 2}),
    ("ahead=1 sync=1 lag=2", {"ahead": 1, "sync_every": 1, "max_lag": 2}),
    ("ahead=1 sync=3 lag=3", {"ahead": 1, "sync_every": 3, "max_lag": 3}),
    ("ahead=0 sync=1 lag=0", {"ahead": 0, "sync_every": 1, "max_lag": 0}),
    ("ahead=2 sync=1 lag=2", {"ahead": 2, "sync_every": 1, "max_lag": 2}),
    # The long tail's two cuts, at the baseline's ahead and lag.
    ("ahead=1 lag=1 over=4", {"ahead": 1, "sync_every": 1, "max_lag": 1, "oversample": 4}),
    ("ahead=1 lag=1 admit=3", {"ahead": 1, "sync_every": 1, "max_lag": 1, "admit": 3}),
)
FULL = ["--task", "guess", "--steps", "40", "--batch-size", "4", "--groups", "8"]
SMOKE = ["--task", "copy", "--steps", "4", "--batch-size", "2", "--groups", "2"]
SMOKE += ["--d-model", "16", "--layers", "1", "--heads", "2", "--d-ff", "32"]


def train(folder: Path, name: str, knobs: dict, options: list[str]) -> Path:
    """Run `dew train` in a process of its own at the knobs, recording; return the trace."""
    trace = folder / f"{name}.trace"
    flags = [f"--{knob.replace('_', '-')}={value}" for knob, value in knobs.items()]
    command = "import sys; from dew.cli import main; sys.exit(main())"
    subprocess.run(
        [sys.executable, "-c", command, "train", *options, *flags]
        + ["--run", str(folder / name), "--record", str(trace)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return trace


def update_seconds(run: Path, warmup: int) -> float:
    """The median seconds of the trainer's jitted update after warmup, from the run's metrics:
    the same computation in every run of one batch shape, so its time tracks the machine's
    load."""
    lines = (run / "metrics.jsonl").read_text().splitlines()[warmup:]
    return float(np.median([json.loads(line)["seconds/update"] for line in lines]))


def predict(
    baseline: Path,
    target: Path,
    knobs: dict,
    warmup: int,
    seeds: int,
    slower: float = 1.0,
    engine: float = 1.0,
):
    """The target setting simulated on the baseline's calibration (slowed by `slower`, its
    rollouts by `engine` more), over the target's window; and the target run measured."""
    measured = calibrate.observe(target, warmup=warmup)
    fitted = calibrate.calibrate([baseline], warmup=warmup).scaled(
        engine=slower * engine, trainer=slower
    )
    steps = measured.steps + warmup + 1
    setting = simulate.Setting("target", **knobs)
    outcomes = [
        simulate.simulate(fitted.workload(steps=steps, seed=seed, slots=None), setting)
        for seed in range(seeds)
    ]
    goodput = float(np.mean([o.goodput for o in outcomes]))
    idle = float(np.mean([o.idle for o in outcomes]))
    return goodput, idle, measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny pair, for CI")
    parser.add_argument("--pairs", type=int, default=2, help="baseline/target pairs a target")
    parser.add_argument("--warmup", type=int, default=3, help="first calls left out")
    parser.add_argument(
        "--only", nargs="+", default=None, help="the targets whose names hold one of these"
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs in this folder")
    parser.add_argument(
        "--analyse", type=Path, default=None, help="predict from the runs kept in this folder"
    )
    args = parser.parse_args()
    options, targets, pairs = (SMOKE, TARGETS[:1], 1) if args.smoke else (FULL, TARGETS, args.pairs)
    warmup = 1 if args.smoke else args.warmup
    if args.only:
        targets = tuple(t for t in targets if any(word in t[0] for word in args.only))
        if not targets:
            names = ", ".join(name for name, _ in TARGETS)
            parser.error(f"--only {' '.join(args.only)}: no target's name holds it ({names})")
    groups = int(options[options.index("--groups") + 1])
    print(
        "goodput in samples/s, idle as a share. as is: from the baseline's times; slowed: "
        "those times scaled by the trainer update's slowdown from baseline to target; "
        "+slots: the rollouts also scaled by the engine's slots, target over baseline"
    )
    print(
        f"{'target':<22}{'pair':>5}{'slowdown':>9}{'measured':>9}{'as is':>7}{'err':>7}"
        f"{'slowed':>8}{'err':>7}{'+slots':>8}{'err':>7}{'idle meas':>10}{'as is':>7}"
        f"{'slowed':>8}{'+slots':>8}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) if args.keep is None else args.keep
        folder = args.analyse or folder
        folder.mkdir(parents=True, exist_ok=True)
        for name, knobs in targets:
            for pair in range(pairs):
                tag = f"{name.replace(' ', '_')}-{pair}"
                if args.analyse is None:
                    train(folder, f"base-{tag}", BASELINE[1], options)
                    train(folder, f"target-{tag}", knobs, options)
                baseline, target = folder / f"base-{tag}.trace", folder / f"target-{tag}.trace"
                slower = update_seconds(folder / f"target-{tag}", warmup) / update_seconds(
                    folder / f"base-{tag}", warmup
                )
                # dew train gives its engine batch x (groups + oversample) x (ahead + 1) slots,
                # and the CPU engine decodes all of them each step: its step costs about in
                # proportion.
                slots = (knobs["ahead"] + 1) / (BASELINE[1]["ahead"] + 1)
                slots *= (groups + knobs.get("oversample", 0)) / groups
                plain, plain_idle, measured = predict(baseline, target, knobs, warmup, 2)
                goodput, idle, _ = predict(baseline, target, knobs, warmup, 2, slower)
                sized, sized_idle, _ = predict(baseline, target, knobs, warmup, 2, slower, slots)
                print(
                    f"{name:<22}{pair:>5}{slower:>9.2f}{measured.goodput:>9.2f}{plain:>7.2f}"
                    f"{plain / measured.goodput - 1:>7.1%}{goodput:>8.2f}"
                    f"{goodput / measured.goodput - 1:>7.1%}{sized:>8.2f}"
                    f"{sized / measured.goodput - 1:>7.1%}{measured.idle:>10.1%}"
                    f"{plain_idle:>7.1%}{idle:>8.1%}{sized_idle:>8.1%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
