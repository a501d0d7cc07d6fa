"""The table of a long-tail simulation: a line on the workload and a row per setting."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dew.simulate._workload import Outcome, Workload


def describe(workload: Workload) -> str:
    """One line on a workload: the engine, the rollouts, the batch, the trainer and the run."""
    engine = "unbounded slots" if workload.slots is None else f"C={workload.slots} slots"
    if workload.observed:
        rollouts = (
            f"{len(workload.observed)} observed rollouts resampled, mean "
            f"{workload.population_mean:.3g}s"
        )
    else:
        low, high = workload.calls
        calls = f"{low}" if low == high else f"{low}-{high}"
        rollouts = (
            f"lognormal rollouts mean {workload.duration_mean:g}s sigma "
            f"{workload.duration_sigma:g}, {calls} call{'s' if high > 1 else ''} each"
        )
    warmup = f" (the first {workload.warmup} not measured)" if workload.warmup else ""
    shared = workload.contention
    cpu = (
        f", sharing a CPU (trainer +{shared.trainer:.0%}, engine +{shared.engine:.0%} while "
        "both run)"
        if shared is not None
        else ""
    )
    return (
        f"{engine}, {rollouts}, {workload.tasks} tasks x {workload.groups} rollouts per step, "
        f"T={workload.step_time:.4g}s{cpu}, {workload.steps} steps{warmup}, seed {workload.seed}"
    )


def percent(share: float) -> str:
    """A share as a table shows it: "nan" where it is undefined, never a made-up 0.0%."""
    return f"{share:.1%}" if math.isfinite(share) else "nan"


def report(workload: Workload, outcomes: Sequence[Outcome]) -> str:
    """The table of a simulation's outcomes, one row per setting, under a line on the workload.

    Columns: goodput (admitted samples per simulated second), its share of the capacity bound,
    the trainer's idle share, the mean and max over steps of a step's lag (its oldest admitted
    call's), the wasted share of rollout-seconds and of slot-seconds (Outcome.slot_wasted), the
    admitted rollouts' mean duration over
    the population mean (selection bias; see Outcome), and their mean seconds over those of
    everything their batches started (the same bias as a trainer's record measures it: see
    Outcome.length_ratio), and the mean seconds an engine call waited for a slot. A last line
    gives the goodput of `ahead=1` over `sync` where both were run (undefined, saying why,
    where sync admitted nothing).
    """
    lines = [
        describe(workload),
        f"{'setting':<26}{'goodput/s':>10}{'of bound':>10}{'idle':>7}"
        f"{'lag mean':>10}{'lag max':>9}{'wasted':>8}{'slot waste':>12}{'admitted/mean':>15}"
        f"{'admitted/started':>18}{'slot wait':>11}",
    ]
    for o in outcomes:
        lines.append(
            f"{o.setting.name:<26}{o.goodput:>10.2f}{percent(o.share):>10}{o.idle:>7.1%}"
            f"{np.mean(o.lags):>10.2f}{max(o.lags):>9d}{o.wasted:>8.1%}{percent(o.slot_wasted):>12}"
            f"{o.selection:>15.2f}{o.length_ratio:>18.2f}{o.slot_wait:>10.2f}s"
        )
    by_name = {o.setting.name: o for o in outcomes}
    if "sync" in by_name and "ahead=1" in by_name:
        sync = by_name["sync"]
        if sync.goodput > 0:
            ratio = by_name["ahead=1"].goodput / sync.goodput
            lines.append(f"ahead=1 goodput / sync goodput: {ratio:.2f}x")
        else:
            lines.append(
                "ahead=1 goodput / sync goodput: undefined: sync admitted no sample in its "
                f"{len(sync.lags)} measured steps"
            )
    return "\n".join(lines)
