"""`dew tune` against real runs: record one `dew train` run, predict three other settings from
its trace alone, run them, and set predicted beside measured.

The recorded run is `dew train --task echo --steps 40 --batch-size 4 --groups 8` at its
defaults, ahead 1 and max_lag 1 (`--task guess` for the earlier task). From its trace alone
(`dew.calibrate`, 3 warm-up calls left out) `dew tune`'s machinery (`dew.tune.tune`, 2 seeds, an
engine with a slot for every rollout in flight as `dew train`'s) predicts three targets:
synchronous (ahead 0), ahead 2, and admit below the batch (the first 3 of 4 groups, ahead 1).
Each target then runs for real, recorded, and its trace is measured over the same window with
the simulation's definitions (`dew.calibrate.observe`). Issue 23's goal: within 10 % on goodput
and 5 points on the trainer's idle share.

Four predictions per target, side by side:

- `plain`: the trace's rollouts and step times as recorded, each setting's engine sized to its
  ahead (`dew tune --engine-scaling 1`, as dew train's CPU engine decodes a [slots] shape).
- `model`: and the trainer's step timed alone at the rows each setting trains (`dew tune
  --time-trainer`: the recorded run's model, update and rescoring, timed on this machine; a
  step's seconds do not follow its rows in proportion) and the CPU
  the trainer and the engine share modelled (`--contention fit`, `Calibration.contention`):
  the recorded step times and rollouts stripped of what the other side's work added to them,
  and each side slowed again in the simulation by as much as the two overlap there.
- `+probe`: `model` with the contention fitted to the recorded run and a 15-step synchronous
  run together (a fifth run), whose solo speeds a run one batch ahead barely shows.
- `slowed`: `model` with the recorded run's times scaled by the machine's slowdown from it to
  the target (their median seconds/update): information from the target run, about the load
  rather than the scheduler, to tell the model's error from the load's on a busy machine.
- `+rollouts`: `model` with the target run's own rollouts in place of the recorded run's
  (`Calibration.rollouts_from`), the recorded trainer kept: information from the target run,
  about what its policy learned to do rather than the scheduler. A setting changes what the
  policy trains on and so the rollouts it goes on to produce (admit 3 on `--task guess` learned
  to give up after fewer guesses), which no prediction from the recorded run's rollouts
  foresees; this column tells the model's error apart from that change's. Each target's
  rollouts beside the recorded run's (calls per rollout, mean seconds) are printed below.

    python benchmarks/tune_accuracy.py                 # 5 runs of about a minute, then the table
    python benchmarks/tune_accuracy.py --keep runs/    # the same, keeping the runs
    python benchmarks/tune_accuracy.py --analyse runs/ # the table again from kept runs
    python benchmarks/tune_accuracy.py --smoke         # simulated runs instead, in seconds
    python benchmarks/tune_accuracy.py --pooled r1/ r2/ ...  # each kept round's targets from
        # its own recorded run and from every round's recorded runs calibrated together
    python benchmarks/tune_accuracy.py --learning-rate 1e-9   # every run's policy held still
    python benchmarks/tune_accuracy.py --task guess    # on GuessDigit, whose policy's turns move
    python benchmarks/tune_accuracy.py --steps 200     # longer runs: less of the machine's noise

`--task echo` (the default) is EchoDigits: an episode's turns are its task's whatever the policy
replies, so every run, whatever its setting teaches the policy, meets the recorded run's
workload, and the table measures the model of the scheduler, the engine and the CPU alone. On
`--task guess` a setting changes what the policy learns to do, and with it the workload
(`+rollouts` tells the two errors apart).

`--learning-rate 1e-9` keeps every step's work (the same update, rescoring and pushes) while
Adam moves the weights by about 1e-9 a step: each run samples the rollouts its first policy
would, so the targets' workload is the recorded run's. On `--task guess` that is the untrained
policy's, one call a rollout and every run but the synchronous one bound by the trainer, which
is no fairer a test of the model (docs/tuning.md gives the figures).

The load average (1 minute) is printed before and after: on a machine that is not idle, a CPU
run's speed moves with other people's work, which no model of the scheduler predicts.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import trio
import trio.testing

from dew import calibrate, tune
from dew.envs.simulated import SimulatedConfig, SimulatedSource
from dew.simulate import Contention, Setting, SharedCpu, SharingEngine
from dew.testing import record_run
from dew.train import step_seconds
from what_if import train  # noqa: E402  (the sibling benchmark's recorded dew train run)

BASELINE = ("ahead=1 lag=1", {"ahead": 1, "max_lag": 1})
TARGETS = (
    ("ahead=0 lag=0", {"ahead": 0, "max_lag": 0}),
    ("ahead=2 lag=2", {"ahead": 2, "max_lag": 2}),
    ("ahead=1 lag=1 admit=3", {"ahead": 1, "max_lag": 1, "admit": 3}),
)
FULL = ["--batch-size", "4", "--groups", "8"]
STEPS = 40
TASKS = ("echo", "guess")
# A short synchronous run beside the recorded one: it never overlaps, so set beside the recorded
# run it shows each side's solo speed, which a run one batch ahead, nearly always overlapped,
# barely does.
PROBE = ("probe ahead=0 lag=0", {"ahead": 0, "max_lag": 0})
PROBE_STEPS = 15
# --smoke's runs are simulated ones on a CPU shared by this much (see `simulated`), of this many
# steps (its probe's half), each prediction from one seed: enough to run every column's code.
SMOKE_CPU = Contention(trainer=0.5, engine=0.5)
SMOKE_STEPS = 12


def simulated(folder: Path, name: str, knobs: dict, steps: int) -> Path:
    """--smoke's stand-in for `train`: a recorded simulated run under trio's mock clock whose
    trainer (1 s of solo work a step) and engine share a CPU (SMOKE_CPU), in seconds."""
    trace = folder / f"{name}.trace"
    cpu = SharedCpu(SMOKE_CPU)
    engine = SharingEngine(cpu=cpu)
    run = functools.partial(
        record_run,
        SimulatedSource(engine, SimulatedConfig(seed=1, duration_mean=1.0, duration_sigma=0.3)),
        engine,
        trace,
        updates=range(steps),
        batch_size=4,
        gap=1.0,
        spend=functools.partial(cpu.spend, "trainer"),
        width=512,
        rows=16,
        groups=4,
        **knobs,
    )
    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    return trace


def predict(
    fitted: calibrate.Calibration,
    knobs: dict,
    steps: int,
    seeds: int,
    *,
    engine: float,
    trainer: Callable[[Setting], float] | None = None,
    contention: bool | Contention = False,
) -> tuple[float, float]:
    """The target's row from `dew tune`'s machinery: goodput and idle share over seeds."""
    workload = fitted.workload(steps=steps, slots=None, contention=contention)
    grid = tune.Grid(
        ahead=(knobs["ahead"],),
        sync_every=(1,),
        max_lag=(knobs["max_lag"],),
        admit=(knobs.get("admit"),),
    )
    (row,) = tune.tune(
        workload,
        grid,
        seeds=seeds,
        engine=tune.sized_to_ahead(fitted.aheads[0], engine),
        trainer=trainer,
    )
    return row.goodput, row.idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="simulated runs on a shared CPU instead, for CI"
    )
    parser.add_argument("--warmup", type=int, default=3, help="first calls left out")
    parser.add_argument("--seeds", type=int, default=2, help="simulated runs per prediction")
    parser.add_argument(
        "--engine-scaling", type=float, default=1.0, help="dew tune --engine-scaling (default 1)"
    )
    parser.add_argument(
        "--trainer-scaling",
        type=float,
        default=None,
        help="dew tune --trainer-scaling EXPONENT instead of the trainer's step timed at each "
        "setting's rows (dew tune --time-trainer, the default)",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="every run's dew train --learning-rate (default: dew train's); 1e-9 holds the "
        "policy still, so that no setting changes the rollouts its policy produces",
    )
    parser.add_argument(
        "--task",
        choices=TASKS,
        default=None,
        help="every run's dew train --task: echo (the default: turns no policy changes) or guess",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"steps of the recorded run and of each target (default {STEPS}; the probe "
        f"keeps {PROBE_STEPS}): a longer window averages more of the machine's noise away",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs in this folder")
    parser.add_argument(
        "--analyse", type=Path, default=None, help="predict from the runs kept in this folder"
    )
    parser.add_argument(
        "--pooled",
        type=Path,
        nargs="+",
        default=None,
        metavar="FOLDER",
        help="kept rounds (--keep folders): each one's targets predicted from its own recorded "
        "run and from all the rounds' recorded runs calibrated together",
    )
    args = parser.parse_args()
    if args.pooled:
        for option in ("smoke", "analyse", "keep", "task", "steps", "learning_rate"):
            if getattr(args, option) not in (None, False):
                parser.error(f"--pooled reads kept rounds: not with --{option.replace('_', '-')}")
        for folder in args.pooled:
            for name, _ in (BASELINE, *TARGETS):
                if not (folder / f"{_file(name)}.trace").is_file():
                    parser.error(f"--pooled: {folder} holds no {_file(name)}.trace (keep a round "
                                 f"with --keep)")  # fmt: skip
        try:
            print(pooled(args.pooled, args.warmup, args.seeds))
        except ValueError as error:  # a trace that is not one, or rounds of other shapes
            parser.error(f"--pooled: {error}")
        return
    warmup, probe_steps = (2, SMOKE_STEPS // 2) if args.smoke else (args.warmup, PROBE_STEPS)
    if args.smoke:
        args.seeds = 1
        # The simulated engine's calls take as long however many run, and its trainer's step
        # as long however many rows: nothing to size.
        args.engine_scaling, args.trainer_scaling = 0.0, 0.0
    if args.learning_rate is not None and (args.smoke or args.analyse):
        parser.error("--learning-rate is for the runs: not with --smoke or --analyse")
    for option in ("task", "steps"):
        if getattr(args, option) is not None and (args.smoke or args.analyse):
            parser.error(f"--{option} is for the runs: not with --smoke or --analyse")
    if args.steps is not None and not args.warmup + 5 <= args.steps <= 2000:
        parser.error(f"--steps must be within [--warmup + 5, 2000], got {args.steps}")
    if args.learning_rate is not None and not 0 < args.learning_rate <= 1:
        parser.error(f"--learning-rate must be within (0, 1], got {args.learning_rate}")
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.analyse or args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        if args.analyse is None:
            runs = SMOKE_STEPS if args.smoke else args.steps or STEPS
            for name, knobs in (BASELINE, *TARGETS, PROBE):
                steps = probe_steps if name == PROBE[0] else runs
                if args.smoke:
                    simulated(folder, _file(name), knobs, steps)
                else:
                    flags = [f"--task={args.task or TASKS[0]}", f"--steps={steps}"]
                    if args.learning_rate is not None:
                        flags.append(f"--learning-rate={args.learning_rate}")
                    train(folder, _file(name), knobs, FULL + flags)
        load.append(os.getloadavg()[0])
        baseline = folder / f"{_file(BASELINE[0])}.trace"
        fitted = calibrate.calibrate([baseline], warmup=warmup)
        probed = calibrate.calibrate(
            [baseline, folder / f"{_file(PROBE[0])}.trace"], warmup=warmup
        ).contention
        print(calibrate.report(fitted))
        print(
            f"  with the synchronous probe: trainer +{probed.trainer:.0%}, "
            f"engine +{probed.engine:.0%}"
        )
        trainer, timed = sized_trainer(folder, fitted, args.trainer_scaling)
        rows, shifts = [], []
        for name, knobs in TARGETS:
            measured = calibrate.observe(folder / f"{_file(name)}.trace", warmup=warmup)
            steps = measured.steps + warmup + 1
            plain = predict(fitted, knobs, steps, args.seeds, engine=args.engine_scaling)
            model = dict(engine=args.engine_scaling, trainer=trainer)
            alone = predict(fitted, knobs, steps, args.seeds, contention=True, **model)
            probe = predict(fitted, knobs, steps, args.seeds, contention=probed, **model)
            # The machine's speed meanwhile: the trainer's jitted update is one computation in
            # every run of one batch shape, so its time tracks the load (simulated runs have
            # none to track).
            # (less the share of that time its rows account for: admit's update has fewer).
            slower = 1.0
            if not args.smoke:
                rows_cost = trainer(Setting(name, **knobs)) if trainer else 1.0
                slower = speed(folder, name) / speed(folder, BASELINE[0]) / rows_cost
            slowed = fitted.scaled(engine=slower, trainer=slower)
            load_free = predict(slowed, knobs, steps, args.seeds, contention=True, **model)
            own = calibrate.calibrate([folder / f"{_file(name)}.trace"], warmup=warmup)
            workload = predict(
                fitted.rollouts_from(own), knobs, steps, args.seeds, contention=True, **model
            )
            shifts.append((name, own))
            rows.append((name, measured, plain, alone, probe, load_free, workload))
        # The synchronous target and the probe are one setting run minutes apart: how far their
        # goodputs differ is what the machine alone moves a run by, a floor under any error.
        same = calibrate.observe(folder / f"{_file(PROBE[0])}.trace", warmup=warmup).goodput
    print(f"load average (1 min) before the runs {load[0]:.2f}, after {load[1]:.2f}")
    print(
        "goodput: samples/s, error = predicted / measured - 1; idle: the trainer's share, error "
        "= predicted - measured in points.\nplain: dew tune --engine-scaling "
        f"{args.engine_scaling:g}; model: and {timed} "
        "--contention fit (from the recorded run); +probe: the contention fitted to the "
        f"recorded run and a {probe_steps}-step synchronous probe run together; slowed: model, "
        "with the recorded run's times scaled by the machine's slowdown from it to the target "
        "(the ratio of their median seconds/update: the load, measured from the target run); "
        "+rollouts: model, with the target run's own rollouts (what its policy learned to do, "
        "measured from the target run) beside the recorded trainer"
    )
    names = ("plain", "model", "+probe", "slowed", "+rollouts")
    columns = "".join(f"{name:>10}{'err':>8}" for name in names)
    print(f"{'':<22}{'goodput':-^99} {'idle':-^99}")
    print(f"{'target':<22}{'measured':>9}{columns}{'measured':>10}{columns}")
    for name, measured, *predictions in rows:
        line = f"{name:<22}{measured.goodput:>9.2f}"
        for goodput, _ in predictions:
            line += f"{goodput:>10.2f}{goodput / measured.goodput - 1:>+8.1%}"
        line += f"{measured.idle:>10.1%}"
        for _, idle in predictions:
            line += f"{idle:>10.1%}{100 * (idle - measured.idle):>+8.1f}"
        print(line)
    print(
        "the rollouts each run's policy produced (finished ones, over the window): calls per "
        "rollout and mean seconds, the recorded run's first"
    )
    for name, own in (("recorded " + BASELINE[0], fitted), *shifts):
        print(f"  {name:<30}{_calls(own):>6.2f} calls{own.mean_duration:>9.4f} s")
    target = next(measured.goodput for name, measured, *_ in rows if name == TARGETS[0][0])
    print(
        f"one setting twice (the {TARGETS[0][0]} target, then the probe over its "
        f"{probe_steps} steps): goodput {target:.2f} and {same:.2f}, {same / target - 1:+.1%}: "
        "the machine's own noise between runs"
    )


def sized_trainer(
    folder: Path, fitted: calibrate.Calibration, exponent: float | None
) -> tuple[Callable[[Setting], float] | None, str]:
    """The trainer's factor for each target and how it was had: `--trainer-scaling`'s power of
    the rows, or (by default) the recorded run's step timed alone at each target's rows."""
    recorded = fitted.admitted[0]
    if exponent is not None:
        sized = tune.sized_to_rows(fitted.tasks, exponent, recorded) if exponent else None
        return sized, f"--trainer-scaling {exponent:g}"
    settings = [Setting(name, **knobs) for name, knobs in TARGETS]
    counts = sorted({recorded, *(tune.admitted(s, fitted.tasks) for s in settings)})
    seconds = step_seconds(folder / _file(BASELINE[0]), counts)
    figures = ", ".join(f"{count} groups {seconds[count]:.4f} s" for count in counts)
    print(f"the recorded run's trainer step timed alone: {figures}")
    return tune.timed_rows(seconds, fitted.tasks, recorded), "--time-trainer"


def pooled(rounds: list[Path], warmup: int, seeds: int) -> str:
    """Each kept round's targets predicted (`model`: contention fitted, the round's trainer
    timed) from its own recorded run and from every round's recorded runs calibrated together,
    which draws each simulated group, and each step, from one of them: errors side by side,
    then how many land within 10 % on goodput and 5 points on the idle share."""
    traces = [folder / f"{_file(BASELINE[0])}.trace" for folder in rounds]
    together = calibrate.calibrate(traces, warmup=warmup)
    lines = [f"{'round':<12}{'target':<24}{'own':>18}{'pooled':>18}   (goodput % / idle points)"]
    errors: dict[str, list[tuple[float, float]]] = {"own": [], "pooled": []}
    for folder, trace in zip(rounds, traces, strict=True):
        own = calibrate.calibrate([trace], warmup=warmup)
        trainer, _ = sized_trainer(folder, own, None)
        for name, knobs in TARGETS:
            measured = calibrate.observe(folder / f"{_file(name)}.trace", warmup=warmup)
            cells = ""
            for label, fitted in (("own", own), ("pooled", together)):
                goodput, idle = predict(
                    fitted, knobs, measured.steps + warmup + 1, seeds, engine=1.0,
                    trainer=trainer, contention=True,
                )  # fmt: skip
                error = (goodput / measured.goodput - 1, 100 * (idle - measured.idle))
                errors[label].append(error)
                cells += f"{f'{error[0]:+.1%} / {error[1]:+.1f}':>18}"
            lines.append(f"{folder.name:<12}{name:<24}{cells}")
    for label, found in errors.items():
        goodput = sum(abs(g) <= 0.10 for g, _ in found)
        idle = sum(abs(i) <= 5 for _, i in found)
        mean = np.mean([abs(g) for g, _ in found])
        lines.append(
            f"{label}: goodput within 10 % at {goodput} of {len(found)}, idle within 5 points at "
            f"{idle}; mean |goodput error| {mean:.1%}"
        )
    return "\n".join(lines)


def _calls(fitted: calibrate.Calibration) -> float:
    """The mean calls per finished rollout of a calibration."""
    return sum(n * count for n, count in fitted.calls.items()) / sum(fitted.calls.values())


def speed(folder: Path, name: str) -> float:
    """The median seconds of a kept run's jitted update, warm-up left out (its metrics log)."""
    lines = (folder / _file(name) / "metrics.jsonl").read_text().splitlines()
    return float(np.median([json.loads(line)["seconds/update"] for line in lines[3:]]))


def _file(name: str) -> str:
    return name.replace(" ", "_")


if __name__ == "__main__":
    main()
