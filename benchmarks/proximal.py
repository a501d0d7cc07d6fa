"""The proximal log-probs rescored before each update, or taken from the update's own pass.

`dew train --proximal rescore` (the default) scores each packed batch under the trainer's
weights, then updates; `--proximal current` takes those log-probs from the update's own forward
pass (the same values: each batch trains one update at those weights). Two figures, each mode
measured side by side in one process:

- the trainer's compute per step, for each model shape: the step's jitted work over the rows
  `dew train` packs (the rescoring and the update; `dew tune`'s `step_seconds`), the median
  of `--repeats` steps, the modes timed in alternating rounds;
- whole `dew train` runs of the default task with each model shape, one batch ahead: steps
  per second after the first steps (which compile), and the share of the trainer's time it
  waited on rollouts, each mode run `--runs` times, alternating. Only a run whose trainer is
  its bottleneck (it seldom waits) can step faster for a cheaper trainer step.

    python benchmarks/proximal.py                # two model shapes, 40-step runs
    python benchmarks/proximal.py --smoke        # the tests' tiny model, for CI
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import attrs
import jax

from dew.train import TrainConfig, train
from dew.train._timing import step_seconds

MODES = ("rescore", "current")


def step_figures(config: TrainConfig, folder: Path, rounds: int, repeats: int) -> dict[str, float]:
    """Each mode's median solo step seconds for `config`, timed in alternating rounds."""
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:
        run = folder / mode
        run.mkdir(parents=True)
        written = attrs.asdict(attrs.evolve(config, proximal=mode))
        (run / "config.json").write_text(json.dumps(written))
    for _ in range(rounds):
        for mode in MODES:
            timed = step_seconds(folder / mode, [config.batch_size], repeats=repeats)
            seconds[mode].append(timed[config.batch_size])
    return {mode: statistics.median(values) for mode, values in seconds.items()}


def run_figures(
    config: TrainConfig, folder: Path, runs: int, warmup: int
) -> dict[str, tuple[float, float]]:
    """Each mode's steps per second over whole runs after `warmup` steps, and the share of the
    trainer's time it waited on rollouts, medians over `runs` runs, the modes alternating."""
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    waits: dict[str, list[float]] = {mode: [] for mode in MODES}
    for index in range(runs):
        for mode in MODES:
            lines = []
            run = attrs.evolve(config, proximal=mode, checkpoint_every=config.steps)
            train(run, folder / f"{mode}-{index}", on_step=lines.append)
            measured = lines[warmup:]
            wall = sum(line["seconds/step"] for line in measured)
            rates[mode].append(len(measured) / wall)
            waits[mode].append(sum(line["waited"] for line in measured) / wall)
    return {
        mode: (statistics.median(rates[mode]), statistics.median(waits[mode])) for mode in MODES
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tests' tiny model, for CI")
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each mode")
    parser.add_argument("--runs", type=int, default=3, help="dew train runs of each mode")
    args = parser.parse_args()
    if args.smoke:
        tiny = dict(batch_size=2, groups=2, tasks=16, d_model=16, heads=2, layers=1, d_ff=32)
        # One step timed in each part, after the one that compiles: its figures mean nothing.
        shapes = {"tiny": TrainConfig(steps=2, **tiny)}
        whole, warmup, rounds, repeats, runs = TrainConfig(steps=2, **tiny), 1, 1, 1, 1
    else:
        shapes = {
            "default (d_model 64, 2 layers)": TrainConfig(),
            "d_model 256, 4 layers": TrainConfig(d_model=256, layers=4, heads=4, d_ff=1024),
        }
        whole, warmup = TrainConfig(steps=40, samples=0), 10
        rounds, repeats, runs = args.rounds, args.repeats, args.runs
    print(f"backend {jax.default_backend()}; {len(jax.devices())} device(s)")
    header = f"{'rescore ms':>11} {'current ms':>11} {'ratio':>7}"
    print(f"{'trainer step (rows of a batch)':34} {header}")
    with tempfile.TemporaryDirectory() as scratch:
        for index, (name, config) in enumerate(shapes.items()):
            figures = step_figures(config, Path(scratch) / f"step-{index}", rounds, repeats)
            print(
                f"{name:34} {1000 * figures['rescore']:11.2f} {1000 * figures['current']:11.2f} "
                f"{figures['current'] / figures['rescore']:7.3f}"
            )
        print(
            f"\ndew train {whole.task}, {whole.batch_size} x {whole.groups} a step, ahead "
            f"{whole.ahead}: {whole.steps} steps, first {warmup} not counted, median of {runs}"
        )
        print(
            f"{'steps per second (trainer waited)':34} {'rescore':>15} {'current':>15} {'ratio':>7}"
        )
        for index, (name, config) in enumerate(shapes.items()):
            shape = {key: getattr(config, key) for key in ("d_model", "layers", "heads", "d_ff")}
            run = attrs.evolve(whole, **shape)
            figures = run_figures(run, Path(scratch) / f"runs-{index}", runs, warmup)
            (rate, wait), (rate_c, wait_c) = figures["rescore"], figures["current"]
            print(
                f"{name:34} {rate:8.2f} ({wait:4.0%}) {rate_c:8.2f} ({wait_c:4.0%}) "
                f"{rate_c / rate:7.3f}"
            )


if __name__ == "__main__":
    main()
