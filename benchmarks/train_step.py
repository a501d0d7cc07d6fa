"""Where the trainer's time goes on `dew train`'s default task: computing vs waiting on rollouts.

Runs `dew train`'s pipeline (RolloutServer, RolloutScheduler, Trainer) twice in one process on the
default task and model: synchronously (ahead=0, max_lag=0: batch i is submitted when the trainer
hands it over, so the trainer waits on all its rollouts and the engine idles while it trains) and
one batch ahead (ahead=1, max_lag=1: batch i + 1 rolls out while the trainer trains on batch i).
For each it prints the mean step time and the shares of the trainer's wall time spent computing
(packing, proximal rescoring, the update) and waiting (the scheduler record's `waited`), over the
steps after the first `warmup` (which compile).

    python benchmarks/train_step.py [--smoke]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import attrs
import jax

from dew.train import TrainConfig, train

SETTINGS = {"sync (ahead=0, max_lag=0)": (0, 0), "ahead=1 (max_lag=1)": (1, 1)}


def measure(config: TrainConfig, warmup: int, folder: Path) -> dict[str, float]:
    """Train `config` in `folder`; the step figures after `warmup` steps."""
    lines = []
    train(config, folder, on_step=lines.append)
    measured = lines[warmup:]
    wall = sum(line["seconds/step"] for line in measured)
    waited = sum(line["waited"] for line in measured)
    return {
        "steps": len(measured),
        "step_ms": 1000 * wall / len(measured),
        "compute": 1 - waited / wall,
        "wait": waited / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model and a few steps, for CI")
    args = parser.parse_args()
    if args.smoke:
        # The tests' tiny model and batch (as replay.py's and what_if.py's smokes and most of
        # tests/): in a test session one run compiles its programs and the others read JAX's
        # cache. One step timed after the one that compiles: the figures mean nothing here.
        base = TrainConfig(
            steps=2, batch_size=2, groups=2, tasks=16, d_model=16, heads=2, layers=1, d_ff=32
        )
        warmup = 1
    else:
        base = TrainConfig(steps=60)
        warmup = 10
    print(
        f"task {base.task}, {base.batch_size} tasks x {base.groups} rollouts a step, model "
        f"d_model={base.d_model} layers={base.layers}; {base.steps} steps, first {warmup} "
        f"not counted; backend {jax.default_backend()}"
    )
    print(f"{'setting':28} {'step ms':>8} {'compute':>8} {'wait':>8}")
    with tempfile.TemporaryDirectory() as scratch:
        for name, (ahead, max_lag) in SETTINGS.items():
            config = attrs.evolve(base, ahead=ahead, max_lag=max_lag, checkpoint_every=base.steps)
            figures = measure(config, warmup, Path(scratch) / f"ahead-{ahead}")
            print(
                f"{name:28} {figures['step_ms']:8.1f} {figures['compute']:8.1%} "
                f"{figures['wait']:8.1%}"
            )


if __name__ == "__main__":
    main()
