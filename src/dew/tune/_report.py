"""What `dew tune` makes of its rows: which settings are within the limits (`feasible`), the
Pareto front of goodput and mean lag among them (`front`), the best goodput (`best`), the
printed table and the drawn front (`table`, `plot`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from dew.simulate import percent
from dew.tune._grid import Row


def feasible(row: Row, *, max_waste: float | None = None, max_bias: float | None = None) -> bool:
    """Whether a row is within the waste and selection-bias limits (None: no limit)."""
    return (max_waste is None or row.wasted <= max_waste) and (
        max_bias is None or row.bias <= max_bias
    )


def front(
    rows: Sequence[Row], *, max_waste: float | None = None, max_bias: float | None = None
) -> list[Row]:
    """The Pareto front over (goodput, higher better; mean lag, lower better) among the rows
    within the limits, best goodput first.

    A row is on it when no feasible row has at least its goodput and at most its mean lag,
    and is better in one of them. Ties in both keep every tied row.
    """
    kept = [r for r in rows if feasible(r, max_waste=max_waste, max_bias=max_bias)]
    on = [
        r
        for r in kept
        if not any(
            o.goodput >= r.goodput
            and o.lag_mean <= r.lag_mean
            and (o.goodput > r.goodput or o.lag_mean < r.lag_mean)
            for o in kept
        )
    ]
    return sorted(on, key=lambda r: (-r.goodput, r.lag_mean))


def best(
    rows: Sequence[Row], *, max_waste: float | None = None, max_bias: float | None = None
) -> Row | None:
    """The feasible row of the highest goodput (ties: lower mean lag, then grid order)."""
    kept = [r for r in rows if feasible(r, max_waste=max_waste, max_bias=max_bias)]
    return min(kept, key=lambda r: (-r.goodput, r.lag_mean), default=None)


def table(
    rows: Sequence[Row], *, max_waste: float | None = None, max_bias: float | None = None
) -> str:
    """Every row's figures, the front's rows starred and the infeasible ones marked '-'.

    Columns: goodput (admitted samples per second, mean over seeds, ± its spread), its share of
    the capacity bound, the trainer's idle share, mean and max lag, the wasted share of
    rollout-seconds, of slot-seconds (`slot waste`) and wasted rollout-seconds per second, and
    selection (the admitted
    rollouts' mean duration over the population's; 1 is unbiased).
    """
    on = {id(r) for r in front(rows, max_waste=max_waste, max_bias=max_bias)}
    width = max(len("setting"), *(len(r.setting.name) for r in rows)) + 2
    lines = [
        f"  {'setting':<{width}}{'goodput/s':>16}{'of bound':>10}{'idle':>7}{'lag mean':>10}"
        f"{'lag max':>9}{'wasted':>8}{'slot waste':>12}{'wasted s/s':>12}{'selection':>11}"
    ]
    for r in rows:
        mark = (
            "*"
            if id(r) in on
            else (" " if feasible(r, max_waste=max_waste, max_bias=max_bias) else "-")
        )
        goodput = f"{r.goodput:.2f} ±{r.goodput_spread:.2f}"
        lines.append(
            f"{mark} {r.setting.name:<{width}}{goodput:>16}{percent(r.share):>10}{r.idle:>7.1%}"
            f"{r.lag_mean:>10.2f}{r.lag_max:>9d}{r.wasted:>8.1%}{percent(r.slot_wasted):>12}"
            f"{r.wasted_seconds:>12.3g}"
            f"{r.selection:>11.3f}"
        )
    limits = [f"wasted <= {max_waste:.1%}"] if max_waste is not None else []
    limits += [f"|1 - selection| <= {max_bias:g}"] if max_bias is not None else []
    chosen = best(rows, max_waste=max_waste, max_bias=max_bias)
    lines.append(
        "* on the Pareto front of goodput and mean lag"
        + (f" within {' and '.join(limits)}; - outside the limits" if limits else "")
    )
    lines.append(
        f"best goodput: {chosen.setting.name} ({chosen.goodput:.2f}/s)"
        if chosen
        else "no setting is within the limits"
    )
    return "\n".join(lines)


def plot(
    rows: Sequence[Row],
    path: str | os.PathLike,
    *,
    max_waste: float | None = None,
    max_bias: float | None = None,
) -> None:
    """Draw goodput against mean lag, one point per setting, the front joined, into a PNG.

    Raises:
        ModuleNotFoundError: without matplotlib (the `plot` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    on = front(rows, max_waste=max_waste, max_bias=max_bias)
    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    try:
        for r in rows:
            ok = feasible(r, max_waste=max_waste, max_bias=max_bias)
            axes.scatter(r.lag_mean, r.goodput, color="tab:blue" if ok else "lightgray", zorder=2)
            axes.annotate(r.setting.name, (r.lag_mean, r.goodput), fontsize=7, alpha=0.8)
        ordered = sorted(on, key=lambda r: r.lag_mean)
        axes.plot(
            [r.lag_mean for r in ordered],
            [r.goodput for r in ordered],
            color="tab:orange",
            marker="o",
            label="Pareto front",
            zorder=3,
        )
        axes.set_xlabel("mean lag (updates)")
        axes.set_ylabel("goodput (samples/s)")
        axes.legend()
        figure.tight_layout()
        figure.savefig(os.fspath(path), dpi=120)
    finally:
        pyplot.close(figure)
