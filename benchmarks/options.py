"""Do the practitioner's options change what a run learns? `dew train --task guess` three ways,
several seeds each, side by side: held-out reward along the run, the updates it took to reach
`--target` (0.7) and its last value.

The arms (`ARMS`), each a `dew train` of the same task, model and seed:

- `defaults`: dew's defaults (token ratios, clip 0.2, advantages normalised by their group's
  reward std);
- `clip-higher + batch std`: `--clip-high 0.28 --estimator batch` (DAPO's upper bound; the
  advantages divided by the batch's reward std instead of each group's);
- `GSPO`: `--ratio-level sequence --aggregation sequence_mean --clip 3e-4 --clip-high 4e-4`,
  the sequence-level ratio with the aggregation and the clip GSPO's paper pairs it with.

Each run is a `dew train` process of its own; a seed's three arms run one after the other,
and each seed takes them in another order, so a change in the machine's load falls on every
arm alike. The load average (1 minute) is printed before and after each run. The held-out
evaluation is `dew train --eval-every`'s: greedy and mean@k reward over `--eval-tasks` task ids
the training never draws.

    python benchmarks/options.py                      # 3 seeds x 3 arms, 60 updates, the table
    python benchmarks/options.py --steps 200 --eval-every 20   # docs/concepts.md's longer one
    python benchmarks/options.py --seeds 0 --steps 40 --keep runs/
    python benchmarks/options.py --smoke              # every arm for 1 update of a tiny run
    python benchmarks/options.py --ppo-epochs 2       # docs/concepts.md's: 2 updates a batch

With `--ppo-epochs K` (and `--minibatches M`) every arm trains each batch K x M times, rescored
once before the first: from the second update on the ratio current / proximal departs from 1,
and the clips act. At the default, one update a batch, they never do.

The table: arm | seed | updates to target (greedy, mean@k) | last greedy, mean@k | the most
of a step's trained tokens the clip held (`clip_fraction`, a step's mean over its updates) and
its mean over the steps | median seconds a step, then each arm's mean over its seeds (the most,
for the most clipped). An update count is the first evaluation at or above the
target, so it is a multiple of `--eval-every`; `-` is a run that never reached it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {
    "defaults": [],
    "clip-higher + batch std": ["--clip-high", "0.28", "--estimator", "batch"],
    "GSPO": [
        "--ratio-level",
        "sequence",
        "--aggregation",
        "sequence_mean",
        "--clip",
        "3e-4",
        "--clip-high",
        "4e-4",
    ],
}
"""Each arm's `dew train` options beyond the shared ones (`SHARED`)."""

SHARED = ["--task", "guess", "--batch-size", "4", "--samples", "0"]
"""What every run sets: the task, batches of 4 groups (of 16) and no sample file; the rest are
`dew train`'s defaults (dew's transformer, learning rate 3e-4, one batch ahead)."""

SMOKE = ["--batch-size", "2", "--groups", "4", "--d-model", "16", "--layers", "1", "--heads", "2"]
"""`--smoke`'s run beside `SHARED`: a tiny model on small batches."""


def run_arm(
    options: list[str],
    run: Path,
    *,
    seed: int,
    steps: int,
    every: int,
    tasks: int,
    samples: int,
    updates: tuple[int, int] = (1, 1),
    here: bool = False,
):
    """Train one arm in a `dew train` process of its own (`options` beside `SHARED`, with the
    run's seed, length and evaluation, and `updates`, its --ppo-epochs and --minibatches): its
    evaluations and its wall seconds. `here`: in this process instead (`dew.cli.main`, its
    output dropped), as the smoke run trains the arms after its first.

    Raises:
        SystemExit: naming the run folder and the end of its output when `dew train` fails.
    """
    command = [sys.executable, "-m", "dew", "train", *SHARED, *options]
    command += ["--seed", str(seed), "--steps", str(steps), "--eval-every", str(every)]
    command += ["--eval-tasks", str(tasks), "--eval-samples", str(samples)]
    command += ["--checkpoint-every", str(steps), "--run", str(run)]
    command += ["--ppo-epochs", str(updates[0]), "--minibatches", str(updates[1])]
    began = time.perf_counter()
    if here:
        import jax

        from dew.cli import main as dew

        # JAX's default promotion, as in a process of its own (optax's Adam needs it).
        with contextlib.redirect_stdout(io.StringIO()), jax.numpy_dtype_promotion("standard"):
            code = dew(command[3:])
        if code != 0:
            sys.exit(f"dew train failed ({code}) in {run}")
    else:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"dew train failed ({done.returncode}) in {run}:\n{done.stderr[-3000:]}")
    wall = time.perf_counter() - began
    evaluations = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    return evaluations, wall


def reached(evaluations: list[dict], key: str, target: float) -> int | None:
    """The updates of the first evaluation whose `key` is at least `target`, else None."""
    return next((e["updates"] for e in evaluations if e[key] >= target), None)


def _shown(updates: float | None, digits: int = 0) -> str:
    return "-" if updates is None else f"{updates:.{digits}f}"


def table(rows: list[dict], target: float, sampled: str) -> str:
    """The comparison as Markdown: a row a run, then each arm's mean over its seeds (an
    arm's updates to target are averaged over the seeds that reached it, their count beside);
    `sampled` names the sampled reward's column (mean@k)."""
    lines = [
        f"| arm | seed | updates to {target} greedy | to {target} {sampled} | last greedy | "
        f"last {sampled} | clipped, most | clipped, mean | s/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['arm']} | {row['seed']} | {_shown(row['to_greedy'])} | "
            f"{_shown(row['to_sampled'])} | {row['greedy']:.3f} | {row['sampled']:.3f} | "
            f"{row['clipped']:.3f} | {row['clipped_mean']:.3f} | {row['s/update']:.2f} |"
        )
    for arm in ARMS:
        mine = [row for row in rows if row["arm"] == arm]
        if not mine:
            continue
        cells = []
        for key in ("to_greedy", "to_sampled"):
            hit = [row[key] for row in mine if row[key] is not None]
            cells.append(
                f"{_shown(statistics.mean(hit) if hit else None)} ({len(hit)}/{len(mine)})"
            )
        means = [statistics.mean(row[key] for row in mine) for key in ("greedy", "sampled")]
        lines.append(
            f"| **{arm}**, mean | | {cells[0]} | {cells[1]} | {means[0]:.3f} | {means[1]:.3f} | "
            f"{max(row['clipped'] for row in mine):.3f} | "
            f"{statistics.mean(row['clipped_mean'] for row in mine):.3f} | "
            f"{statistics.mean(row['s/update'] for row in mine):.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60, help="updates a run trains for (60)")
    parser.add_argument("--eval-every", type=int, default=10, help="updates between evaluations")
    parser.add_argument("--eval-tasks", type=int, default=32, help="held-out tasks (32)")
    parser.add_argument("--eval-samples", type=int, default=4, help="k of mean@k (4)")
    parser.add_argument("--target", type=float, default=0.7, help="held-out reward to reach")
    parser.add_argument("--keep", type=Path, help="keep the run folders here")
    parser.add_argument("--smoke", action="store_true", help="every arm for 1 update, 1 seed")
    parser.add_argument("--ppo-epochs", type=int, default=1, help="passes over a batch (1)")
    parser.add_argument("--minibatches", type=int, default=1, help="minibatches a pass (1)")
    args = parser.parse_args(argv)
    for option in (
        "steps",
        "eval_every",
        "eval_tasks",
        "eval_samples",
        "ppo_epochs",
        "minibatches",
    ):
        if getattr(args, option) < 1:
            parser.error(
                f"--{option.replace('_', '-')} must be at least 1, not {getattr(args, option)}"
            )
    if args.smoke:
        # One update of each arm, evaluated before and after it: every arm's options reach
        # the trainer and the table fills; the figures mean nothing here. The first arm runs
        # as every run does, in a `dew train` process; the others in this one, which saves a
        # process's start and imports each (the arms differ in options alone).
        args.seeds, args.steps, args.eval_every, args.eval_tasks, args.eval_samples = (
            [0],
            1,
            1,
            2,
            1,
        )
    root = args.keep or Path(tempfile.mkdtemp(prefix="dew-options-"))
    names = list(ARMS)
    rows = []
    for turn, seed in enumerate(args.seeds):
        # Each seed starts at another arm, so the machine's drift meets every arm in turn.
        for arm in names[turn % len(names) :] + names[: turn % len(names)]:
            run = root / f"{arm.split()[0].lower()}-{seed}"
            load = os.getloadavg()[0]
            print(f"training {arm} (seed {seed}) in {run}, load {load:.1f}", flush=True)
            evaluations, wall = run_arm(
                ARMS[arm] + (SMOKE if args.smoke else []),
                run,
                seed=seed,
                steps=args.steps,
                every=args.eval_every,
                tasks=args.eval_tasks,
                samples=args.eval_samples,
                updates=(args.ppo_epochs, args.minibatches),
                here=args.smoke and bool(rows),
            )
            sampled = f"mean@{args.eval_samples}"
            metrics = [
                json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            ]
            rows.append(
                {
                    "arm": arm,
                    "seed": seed,
                    "to_greedy": reached(evaluations, "greedy", args.target),
                    "to_sampled": reached(evaluations, sampled, args.target),
                    "greedy": evaluations[-1]["greedy"],
                    "sampled": evaluations[-1][sampled],
                    "s/update": statistics.median(line["seconds/step"] for line in metrics),
                    "clipped": max(line["clip_fraction"] for line in metrics),
                    "clipped_mean": statistics.mean(line["clip_fraction"] for line in metrics),
                }
            )
            curve = "  ".join(
                f"{e['updates']}: {e['greedy']:.2f}/{e[sampled]:.2f}" for e in evaluations
            )
            print(f"  held-out greedy/{sampled} by updates: {curve}", flush=True)
            print(f"  {wall:.0f} s wall, load {os.getloadavg()[0]:.1f} after", flush=True)
    print()
    print(table(rows, args.target, f"mean@{args.eval_samples}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
