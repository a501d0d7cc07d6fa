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
        # seconds a call waited for a slot
    python benchmarks/long_tail.py --workloads [--steps 300] [--seeds 3] [--jobs 2]
        # auto against the best fixed setting at max_lag 5 on the reference workload and on
        # sigma 0.5, sigma 1.5 and T = 3 x mean, auto told nothing of which: each workload's
        # fixed settings, auto at budgets 0.15 and 0.25, and each auto's goodput over the
        # best fixed one's
    python benchmarks/long_tail.py --smoke    # each, tiny and fast

Targets (issue 23): carry-over at max_lag 5 >= 0.90 of the bound at <= 15 % waste and a duration
ratio >= 0.90; at max_lag 8 >= 0.95, <= 7 %, >= 0.95; at max_lag 3 above 0.75 at <= 23 % waste;
auto within 5 % of the best setting's goodput on each workload.

Figures (300 steps, seeds 0..9; share of bound / wasted / admitted over population mean
duration, means; [min, max] in docs/concepts.md, "The reference workload"):
    ahead=3 oversample=1          0.730 / 21.3 % / 0.719
    carry lag=3 ahead=1 admit=3   0.802 / 20.8 % / 0.803     no hedge 0.742 / 30.8 % / 0.834
    carry lag=5 ahead=2 admit=4   0.932 / 10.4 % / 0.877     no hedge 0.879 / 16.4 % / 0.891
    carry lag=8 ahead=3 admit=4   0.969 /  3.9 % / 0.941     no hedge 0.951 /  6.2 % / 0.944
    auto (budget 0.15) lag 3, 5, 8: 0.678 / 15.0 %, 0.958 / 12.0 %, 0.973 / 4.0 %
    carry lag=3 ahead=1 admit=5   0.678 / 13.6 %  (the best fixed setting within 15 % there)
Share and waste targets are met at every lag; the duration ratio misses at 5 and 8, where the
staleness window alone allows about 0.893 and 0.950 at those runs' pace (the `window allows`
column; docs/concepts.md, "The bound the staleness window puts on the duration ratio").
Workloads (seeds 0..3), auto's goodput over the best fixed one's: reference 0.991, sigma 0.5
0.995, T = 3 x mean 0.999; sigma 1.5 0.727 at budget 0.15, spending 18 % (1.23 of admit 7's,
the one fixed setting within 15 % there; its stragglers alone cost about 15 % at that pace),
and 0.982 at budget 0.25.
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
)

# The workloads auto must do well on without being told which: the reference, a lighter and a
# heavier tail, and a trainer three times slower than a mean rollout.
WORKLOADS = {
    "reference": REFERENCE,
    "sigma=0.5": REFERENCE | dict(duration_sigma=0.5),
    "sigma=1.5": REFERENCE | dict(duration_sigma=1.5),
    "T=3xmean": REFERENCE | dict(step_time=30.0),
}
# The fixed settings at max_lag 5 auto is measured against on each workload, and auto itself.
AT_LAG_5 = (
    Setting("ahead=3 oversample=1 lag=5", ahead=3, max_lag=5, oversample=1),
    Setting("carry ahead=2 admit=2", ahead=2, max_lag=5, admit=2, carry_over=True),
    Setting("carry ahead=2 admit=4", ahead=2, max_lag=5, admit=4, carry_over=True),
    Setting("carry ahead=2 admit=6", ahead=2, max_lag=5, admit=6, carry_over=True),
    # The one of them that wastes under 15 % on sigma 1.5.
    Setting("carry ahead=2 admit=7", ahead=2, max_lag=5, admit=7, carry_over=True),
)
# Auto at the reference table's budget, and at one every fixed setting above but admit 7
# meets on each workload (on sigma 1.5 the others waste 18 % or more).
AUTOS = (
    Setting("auto ahead=2", ahead=2, max_lag=5, admit="auto", carry_over=True, **BUDGET),
    Setting(
        "auto ahead=2 budget=.25",
        ahead=2,
        max_lag=5,
        admit="auto",
        carry_over=True,
        waste_budget=0.25,
    ),
)


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
    """Auto beside the fixed settings at max_lag 5 on each workload: goodput (samples per
    second, mean over seeds), waste, and each auto's goodput over the best fixed setting's,
    and over the best of those whose waste is within that auto's budget."""
    settings = (*fixed, *autos)
    work = [
        (Workload(seed=seed, steps=steps, **WORKLOADS[name]), setting)
        for name in names
        for setting in settings
        for seed in range(seeds)
    ]
    results = iter(_run(work, jobs))
    lines = [
        f"max_lag 5, {steps} steps, seeds 0..{seeds - 1}: goodput (samples/s) and wasted share "
        f"(of rollout-seconds, and of slot-seconds), "
        f"means over seeds; each auto's goodput over the best fixed setting's, and over the "
        f"best of those wasting no more than its budget",
        f"{'workload':<12}"
        + "".join(f"{s.name:>28}" for s in settings)
        + "".join(f"{f'/best ({s.waste_budget})':>14}" for s in autos)
        + "".join(f"{f'/within ({s.waste_budget})':>16}" for s in autos),
    ]
    for name in names:
        figures = []
        for _ in settings:
            rows = np.array([next(results)[1:] for _ in range(seeds)])
            figures.append((rows[:, 3].mean(), rows[:, 1].mean(), rows[:, 6].mean()))
        best = max(goodput for goodput, _, _ in figures[: len(fixed)])
        cells = "".join(f"{f'{g:.2f} ({w:.0%}, slot {v:.0%})':>28}" for g, w, v in figures)
        ratios = "".join(f"{g / best:>14.3f}" for g, _, _ in figures[len(fixed) :])
        within = ""
        for auto, (goodput, _, _) in zip(autos, figures[len(fixed) :], strict=True):
            kept = [g for g, w, _ in figures[: len(fixed)] if w <= auto.waste_budget]
            within += f"{goodput / max(kept):>16.3f}" if kept else f"{'none':>16}"
        lines.append(f"{name:<12}{cells}{ratios}{within}")
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
        options = parser.parse_args(args)
        if options.reference:
            print(reference(options.steps, options.seeds or 10, options.jobs))
        if options.workloads:
            print(workloads(options.steps, options.seeds or 3, options.jobs))
        sys.exit(0)
    if "-h" in args or "--help" in args:  # this script's own modes, then dew simulate's options
        print(__doc__[: __doc__.index("Targets")])
    code = main(["simulate", *args])
    if "--smoke" in args:
        print(reference(steps=4, seeds=1, jobs=1, settings=SETTINGS[0:6:2]))
        print(
            workloads(  # two jobs, so that the pool of processes runs too
                steps=4, seeds=1, jobs=2, names=("sigma=1.5",), fixed=AT_LAG_5[1:2], autos=AUTOS[:1]
            )
        )
    sys.exit(code)
