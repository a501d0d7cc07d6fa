"""Goodput under a heavy-tailed rollout duration, per scheduler setting: `dew simulate`, and
carry-over and the adaptive cut beside today's best fixed settings on issue 23's reference
workload and three others.

The simulations are `dew.simulate` under trio's mock clock (the real RolloutScheduler over the
simulated source and engine), so the figures are deterministic.

    python benchmarks/long_tail.py            # dew simulate's table: C=64, 16 tasks x 4, ...
    python benchmarks/long_tail.py --help     # its options
    python benchmarks/long_tail.py --reference [--steps 300] [--seeds 10] [--jobs 2]
        # the reference workload (8 tasks x 8 rollouts, C=64, lognormal sigma 1, T = mean
        # rollout, one call per rollout): the best fixed settings, carry-over at max_lag 3, 5
        # and 8, and admit="auto" with carry-over at each (the same ahead as the fixed row
        # above it, waste budget 0.15), each figure as mean [min, max] over seeds: goodput's
        # share of the capacity bound min(C / mean, B G / T), the wasted share of rollout-seconds
        # and of slot-seconds (slot waste: queueing left out), admitted / population mean
        # duration, the ratio the staleness window allows at the run's pace, and the mean
        # seconds a call waited for a slot; last, the carry-over rows at max_lag 5 and 8 with
        # starts aligned to pushes (align_starts)
    python benchmarks/long_tail.py --workloads [--steps 300] [--seeds 10] [--jobs 2]
                                   [--auto-ahead 1]
        # auto told only max_lag 5 and its budget (0.15, 0.25; ahead the default, 1, or
        # --auto-ahead's: what a second batch in flight would buy it) against
        # the best of nine fixed settings at max_lag 5 whose slot waste is within the same
        # budget, on the reference workload, sigma 0.5, 1.5 and 2.0, T = 3 x mean and a
        # bimodal mix (80 % short, 20 % ten times as long), auto told nothing of which:
        # auto's goodput and slot waste, whether it held its budget (every seed within a
        # point), the best fixed setting within it and auto's goodput over that one's
    python benchmarks/long_tail.py --smoke    # each, tiny and fast

Targets (issue 23): carry-over at max_lag 5 >= 0.90 of the bound at <= 15 % waste and a duration
ratio >= 0.90; at max_lag 8 >= 0.95, <= 7 %, >= 0.95; at max_lag 3 above 0.75 at <= 23 % waste;
auto within 5 % of the best setting's goodput on each workload (issue 46: the best within the
same budget, in slot-seconds, which auto holds within a point).

Figures (300 steps, seeds 0..9; share of bound / wasted / admitted over population mean
duration, means; [min, max] in docs/concepts.md, "The reference workload"):
    ahead=3 oversample=1          0.730 / 21.3 % / 0.719
    carry lag=3 ahead=1 admit=3   0.802 / 20.8 % / 0.803     no hedge 0.742 / 30.8 % / 0.834
    carry lag=5 ahead=2 admit=4   0.932 / 10.4 % / 0.877     no hedge 0.879 / 16.4 % / 0.891
    carry lag=8 ahead=3 admit=4   0.969 /  3.9 % / 0.941     no hedge 0.951 /  6.2 % / 0.944
    auto (budget 0.15) lag 3, 5, 8: 0.678 / 15.0 %, 0.958 / 12.0 %, 0.973 / 4.0 % (per-call rule)
    carry lag=3 ahead=1 admit=5   0.678 / 13.6 %  (the best fixed setting within 15 % there)
    carry lag=5 align             0.932 / 10.4 % / 0.878     (slot waste 12.8 %; 12.8 % unaligned)
    carry lag=8 align             0.975 /  3.9 % / 0.940     (slot waste  5.3 %;  5.4 % unaligned)
    (aligned starts, issue 46 item 1: no start waited; docs/concepts.md, "Push-aligned starts")
Share and waste targets are met at every lag; the duration ratio misses at 5 and 8, where the
staleness window alone allows about 0.893 and 0.950 at those runs' pace (the `window allows`
column; docs/concepts.md, "The bound the staleness window puts on the duration ratio").
Workloads (300 steps, seeds 0..1 of the issue's ten; docs/concepts.md, "The adaptive cut"),
auto's goodput over the best fixed setting's within its budget, at 0.15 / 0.25, mean over seeds,
with the steady admit as of 98bc720 (stretches of 2 x max_lag calls until the admit first turns
back, a held admit judged on two stretches, a step down as far as the measure's headroom
reaches; the rule before it, on the same seeds, in brackets): reference 0.933 / 0.963 (0.934 /
0.949), sigma 0.5 0.960 (0.946), sigma 1.5 3.59 (only no cut fits 0.15; 3.77) / 0.894 (0.901),
sigma 2.0 3.24 (only no cut fits 0.15; 2.78) / 0.918 (0.907), T = 3 x mean 0.999 (0.999),
bimodal 0.978 / 0.979 (0.982 / 0.951): nine of twelve within 5 % (six before); its slot waste
within a point of its budget on every seed but sigma 2.0 at 0.15 (16.035 % on seed 0; the rule
before 16.034 %). At --auto-ahead 2 (seed 0 only) eleven of twelve, the budget held on all: what
is left on the light tails is `ahead`, which auto is not told.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import multiprocessing
import statistics
import sys

import numpy as np

from dew.cli import main
from dew.envs.simulated import ObservedRollout
from dew.objectives.rl.sessions import Status
from dew.simulate import Setting, Workload, simulate

REFERENCE = dict(
    slots=64,
    tasks=8,
    groups=8,
    duration_mean=10.0,
    duration_sigma=1.0,
    calls=(1, 1),
    step_time=10.0,
)
BUDGET = dict(waste_budget=0.15)

SETTINGS = (
    # Today's best fixed settings on this workload (issue 23): at most a quarter wasted, and the
    # one that reaches the bound.
    Setting("ahead=3 oversample=1", ahead=3, max_lag=3, oversample=1),
    Setting("ahead=3 oversample=4", ahead=3, max_lag=3, oversample=4),
    # Carry-over: the best of a small search (100 steps, seed 0) at each max_lag, the same
    # without hedges, and beside them the cut the scheduler chooses itself, at the same ahead.
    Setting("carry lag=3 ahead=1 admit=3", ahead=1, max_lag=3, admit=3, carry_over=True),
    Setting("carry lag=3 no hedge", ahead=1, max_lag=3, admit=3, carry_over=True, hedge=False),
    Setting("auto lag=3 ahead=1", ahead=1, max_lag=3, admit="auto", carry_over=True, **BUDGET),
    # The best fixed carry-over setting at max_lag 3 within auto's budget there.
    Setting("carry lag=3 ahead=1 admit=5", ahead=1, max_lag=3, admit=5, carry_over=True),
    Setting("carry lag=5 ahead=2 admit=4", ahead=2, max_lag=5, admit=4, carry_over=True),
    Setting("carry lag=5 no hedge", ahead=2, max_lag=5, admit=4, carry_over=True, hedge=False),
    Setting("auto lag=5 ahead=2", ahead=2, max_lag=5, admit="auto", carry_over=True, **BUDGET),
    Setting("carry lag=8 ahead=3 admit=4", ahead=3, max_lag=8, admit=4, carry_over=True),
    Setting("carry lag=8 no hedge", ahead=3, max_lag=8, admit=4, carry_over=True, hedge=False),
    Setting("auto lag=8 ahead=3", ahead=3, max_lag=8, admit="auto", carry_over=True, **BUDGET),
    # The carry-over rows at max_lag 5 and 8 with starts aligned to pushes (align_starts, issue
    # 46 item 1), the scheduler starting rollouts on the engine's 64 slots itself.
    Setting("carry lag=5 align", ahead=2, max_lag=5, admit=4, carry_over=True, align_starts=True),
    Setting("carry lag=8 align", ahead=3, max_lag=8, admit=4, carry_over=True, align_starts=True),
)


def _bimodal(count: int = 2000) -> tuple[ObservedRollout, ...]:
    """Issue 46's bimodal mix as a pool the simulated sessions resample: 80 % short rollouts and
    20 % ten times as long, each mode lognormal with sigma 0.5, of mean 10 s over all (the
    short mode's mean 10 / 2.8 s). Drawn from a seed of its own, so every run meets one pool."""
    rng = np.random.default_rng(46)
    short = REFERENCE["duration_mean"] / (0.8 + 0.2 * 10)
    seconds = rng.lognormal(math.log(short) - 0.5**2 / 2, 0.5, count)
    seconds[int(0.8 * count) :] *= 10
    return tuple(ObservedRollout((float(s),), Status.COMPLETED) for s in seconds)


# The workloads auto must do well on without being told which: the reference, a lighter and two
# heavier tails, a bimodal mix, and a trainer three times slower than a mean rollout.
WORKLOADS = {
    "reference": REFERENCE,
    "sigma=0.5": REFERENCE | dict(duration_sigma=0.5),
    "sigma=1.5": REFERENCE | dict(duration_sigma=1.5),
    "sigma=2.0": REFERENCE | dict(duration_sigma=2.0),
    "T=3xmean": REFERENCE | dict(step_time=30.0),
    "bimodal": REFERENCE | dict(observed=_bimodal()),
}
# The fixed settings at max_lag 5 auto is measured against on each workload: no cut, the
# oversampling of the reference table, and carry-over at ahead 1 and 2 over the admits.
AT_LAG_5 = (
    Setting("ahead=2 lag=5", ahead=2, max_lag=5),
    Setting("ahead=3 oversample=1 lag=5", ahead=3, max_lag=5, oversample=1),
    Setting("carry ahead=1 admit=1", ahead=1, max_lag=5, admit=1, carry_over=True),
    Setting("carry ahead=1 admit=2", ahead=1, max_lag=5, admit=2, carry_over=True),
    Setting("carry ahead=1 admit=4", ahead=1, max_lag=5, admit=4, carry_over=True),
    Setting("carry ahead=2 admit=2", ahead=2, max_lag=5, admit=2, carry_over=True),
    Setting("carry ahead=2 admit=4", ahead=2, max_lag=5, admit=4, carry_over=True),
    Setting("carry ahead=2 admit=6", ahead=2, max_lag=5, admit=6, carry_over=True),
    Setting("carry ahead=2 admit=7", ahead=2, max_lag=5, admit=7, carry_over=True),
)
AUTO_AT_LAG_5 = dict(max_lag=5, admit="auto", carry_over=True)


def _autos(ahead: int = 1) -> tuple[Setting, ...]:
    """Auto told only max_lag 5 and its budget, under carry-over, at the reference table's
    budget and at a looser one; `ahead` the default, 1, unless `--auto-ahead` says otherwise
    (what a second batch in flight would buy auto, which the default does not give it)."""
    return tuple(
        Setting(f"auto budget={b}", ahead=ahead, **AUTO_AT_LAG_5, waste_budget=b)
        for b in (0.15, 0.25)
    )


AUTOS = _autos()


def _one(
    job: tuple[Workload, Setting],
) -> tuple[str, float, float, float, float, float, float, float]:
    workload, setting = job
    outcome = simulate(workload, setting)
    # The bound for every setting: the engine's and a whole batch a step's.
    bound = min(
        workload.slots / workload.population_mean,
        workload.tasks * workload.groups / workload.step_time,
    )
    share = outcome.goodput / bound
    period = outcome.elapsed / (workload.steps - workload.warmup)
    return (
        setting.name,
        share,
        outcome.wasted,
        outcome.selection,
        outcome.goodput,
        _ratio_allowed(workload, setting.max_lag * period),
        outcome.slot_wait,
        outcome.slot_wasted,
    )


def _ratio_allowed(workload: Workload, window: float) -> float:
    """The admitted over population mean duration if every lognormal rollout shorter than
    `window` seconds were admitted and no longer one: E[X | X < L] / E[X].

    A rollout's version is pushed at a hand-over and the hand-over max_lag calls later is the
    last that may admit it: max_lag of the run's mean periods is the window of one that starts
    the moment its version is pushed, and one that waits for a slot has less. What runs longer
    is never admitted, whatever the policy, so this bounds a run's duration ratio."""
    sigma = workload.duration_sigma
    if sigma == 0 or window <= 0:
        return math.nan
    z = (math.log(window) - math.log(workload.duration_mean) + sigma**2 / 2) / sigma
    normal = statistics.NormalDist()
    return normal.cdf(z - sigma) / normal.cdf(z)


def _run(work: list[tuple[Workload, Setting]], jobs: int) -> list[tuple]:
    if jobs == 1:  # a pool of one would only add a process start (importing JAX) to the loop
        return [_one(job) for job in work]
    # Spawned, not forked: the parent has imported JAX, whose threads a fork would copy.
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=spawn) as pool:
        return list(pool.map(_one, work))


def _cells(rows: np.ndarray) -> str:
    return "".join(f"{f'{c.mean():.3f} [{c.min():.2f}, {c.max():.2f}]':>22}" for c in rows.T)


def reference(steps: int, seeds: int, jobs: int, settings=SETTINGS) -> str:
    """The reference table: each setting's share, waste and duration ratio over seeds."""
    work = [
        (Workload(seed=seed, steps=steps, **REFERENCE), setting)
        for setting in settings
        for seed in range(seeds)
    ]
    results = _run(work, jobs)
    lines = [
        "reference workload: C=64, 8 tasks x 8 rollouts, lognormal mean 10 s sigma 1, one call "
        f"each, T=10 s, {steps} steps, seeds 0..{seeds - 1}; mean [min, max]",
        f"{'setting':<30}{'of bound':>22}{'wasted':>22}{'slot waste':>22}{'admitted/mean':>22}"
        f"{'window allows':>22}{'slot wait s':>22}",
    ]
    for setting in settings:
        # Share, wasted (rollout-seconds), slot waste (slot-seconds), ratio, allowed, wait.
        rows = np.array(
            [(r[1], r[2], r[7], r[3], r[5], r[6]) for r in results if r[0] == setting.name]
        )
        lines.append(f"{setting.name:<30}{_cells(rows)}")
    return "\n".join(lines)


def workloads(
    steps: int, seeds: int, jobs: int, names=tuple(WORKLOADS), fixed=AT_LAG_5, autos=AUTOS
) -> str:
    """Auto against the best fixed setting within its budget, on each workload.

    Each row is one workload and one auto: auto's goodput (samples per second, mean over
    seeds) and slot waste (mean, and its worst seed), whether it held its budget (every seed
    within one point of it, in slot-seconds), the best fixed setting whose mean slot waste is
    within the same budget, its goodput and slot waste, and auto's goodput over that one's:
    the ratio of the means, and in brackets the least and greatest of the seeds' own ratios
    (each seed's auto over the same setting on that seed), how far one seed strays (`none
    fits` where no fixed setting is within the budget)."""
    settings = (*fixed, *autos)
    work = [
        (Workload(seed=seed, steps=steps, **WORKLOADS[name]), setting)
        for name in names
        for setting in settings
        for seed in range(seeds)
    ]
    results = iter(_run(work, jobs))
    lines = [
        f"max_lag 5, {steps} steps, seeds 0..{seeds - 1}: auto (ahead {autos[0].ahead}, "
        f"carry-over) against "
        f"the best of {len(fixed)} fixed settings within its budget; goodput in samples/s and "
        f"slot waste, means over seeds (slot waste's worst seed in brackets)",
        f"{'workload':<11}{'budget':>7}{'auto':>8}{'slot waste':>17}{'holds':>7}"
        f"  {'best fixed within budget':<28}{'goodput':>8}{'slot waste':>11}{'auto/best':>20}",
    ]
    for name in names:
        # Per setting: goodput and slot waste, mean over seeds, and slot waste's worst seed;
        # and each seed's goodput.
        figures, goodputs = [], []
        for _ in settings:
            rows = np.array([next(results)[1:] for _ in range(seeds)])
            figures.append((rows[:, 3].mean(), rows[:, 6].mean(), rows[:, 6].max()))
            goodputs.append(rows[:, 3])
        for index, (auto, (goodput, slot, worst)) in enumerate(
            zip(autos, figures[len(fixed) :], strict=True)
        ):
            budget = auto.waste_budget
            holds = "yes" if worst <= budget + 0.01 else "no"
            kept = [
                (g, v, s.name, i)
                for i, (s, (g, v, _)) in enumerate(zip(fixed, figures[: len(fixed)], strict=True))
                if v <= budget
            ]
            row = f"{name:<11}{budget:>7}{goodput:>8.2f}{f'{slot:.1%} [{worst:.1%}]':>17}{holds:>7}"
            if kept:
                g, v, best, i = max(kept)
                ratios = goodputs[len(fixed) + index] / goodputs[i]
                spread = f"{goodput / g:.3f} [{ratios.min():.2f}, {ratios.max():.2f}]"
                row += f"  {best:<28}{g:>8.2f}{v:>11.1%}{spread:>20}"
            else:
                row += f"  {'none fits':<28}"
            lines.append(row)
    return "\n".join(lines)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--reference" in args or "--workloads" in args:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--reference", action="store_true")
        parser.add_argument("--workloads", action="store_true")
        parser.add_argument("--steps", type=int, default=300)
        parser.add_argument("--seeds", type=int, default=None)
        parser.add_argument("--jobs", type=int, default=2)
        parser.add_argument("--auto-ahead", type=int, default=1)
        options = parser.parse_args(args)
        for name in ("steps", "seeds", "jobs", "auto_ahead"):
            value = getattr(options, name)
            if value is not None and value < 1:
                parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if options.reference:
            print(reference(options.steps, options.seeds or 10, options.jobs))
        if options.workloads:
            autos = _autos(options.auto_ahead)
            print(workloads(options.steps, options.seeds or 10, options.jobs, autos=autos))
        sys.exit(0)
    if "-h" in args or "--help" in args:  # this script's own modes, then dew simulate's options
        print(__doc__[: __doc__.index("Targets")])
    code = main(["simulate", *args])
    if "--smoke" in args:
        print(reference(steps=4, seeds=1, jobs=1, settings=SETTINGS[0:6:2]))
        print(
            workloads(  # two jobs, so that the pool of processes runs too
                steps=4, seeds=1, jobs=2, names=("bimodal",), fixed=AT_LAG_5[4:6], autos=AUTOS[:1]
            )
        )
    sys.exit(code)
