"""Draw the concepts page's figures from dew's own simulator: `python docs/figures/concepts.py`.

Each figure is the table `dew simulate` prints at its defaults (docs/concepts.md, "The long
tail"), drawn: the same `dew.simulate.long_tail` over the same default workload, so the picture
and the console table beside it are one run's. The PNGs are checked in beside this script (the
docs build runs no simulation); rerun it after a change to the simulator or its defaults.
`--smoke` draws them from `Workload.smoke()` in about a second (tests/test_docs.py runs it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from matplotlib import pyplot  # noqa: E402
from matplotlib.ticker import PercentFormatter  # noqa: E402

from dew.simulate import Outcome, Workload, describe, long_tail  # noqa: E402

HERE = Path(__file__).parent
FIGURES = ("long_tail_goodput.png", "long_tail_cost.png")
"""The files this script writes, each referenced by docs/concepts.md."""

# PNG metadata left out: the same outcomes draw the same bytes, so a rerun changes no file.
SAVE = {"dpi": 110, "metadata": {"Software": None}}


def goodput_figure(outcomes: list[Outcome], workload: Workload, path: Path) -> None:
    """Goodput per setting as bars, each split into what the bound allows and what it missed,
    the trainer's idle share written beside it."""
    names = [o.setting.name for o in outcomes]
    figure, axes = pyplot.subplots(figsize=(8, 3.8))
    try:
        rows = range(len(outcomes))
        axes.barh(rows, [o.bound for o in outcomes], color="0.88", label="capacity bound")
        axes.barh(rows, [o.goodput for o in outcomes], color="tab:blue", label="goodput")
        for row, outcome in zip(rows, outcomes, strict=True):
            axes.annotate(
                f"{outcome.goodput:.2f}/s, trainer idle {outcome.idle:.0%}",
                (outcome.goodput, row),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        axes.set_yticks(list(rows), names, fontsize=8)
        axes.invert_yaxis()
        axes.set_xlabel("admitted samples per simulated second")
        axes.set_title(f"dew simulate: {describe(workload).split(',')[1].strip()}", fontsize=9)
        axes.set_xlim(right=max(o.bound for o in outcomes) * 1.45)  # room for the labels
        axes.legend(fontsize=8, loc="upper right")
        figure.tight_layout()
        figure.savefig(path, **SAVE)
    finally:
        pyplot.close(figure)


def cost_figure(outcomes: list[Outcome], path: Path) -> None:
    """What each setting pays for its goodput: the wasted share of rollout-seconds against the
    selection bias (admitted rollouts' mean model time over the population's), bubble size the
    mean lag."""
    figure, axes = pyplot.subplots(figsize=(8, 4))
    try:
        # Settings that cut nothing land on one point (no waste, no bias): one label for them.
        points: dict[tuple[float, float], list[str]] = {}
        for outcome in outcomes:
            lag = sum(outcome.lags) / len(outcome.lags)
            point = (round(outcome.wasted, 3), round(outcome.selection, 3))
            points.setdefault(point, []).append(f"{outcome.setting.name} (lag {lag:.1f})")
            axes.scatter(
                outcome.wasted, outcome.selection, s=40 + 60 * lag, alpha=0.5, color="tab:orange"
            )
        # Labels alternately above and below their points, left to right: neighbours at
        # similar bias would otherwise write over each other.
        for order, ((wasted, selection), names) in enumerate(sorted(points.items())):
            axes.annotate(
                "\n".join(names),
                (wasted, selection),
                xytext=(8, (6 if order % 2 else -10) - 4 * (len(names) - 1)),
                textcoords="offset points",
                fontsize=8,
            )
        axes.axhline(1.0, color="0.3", lw=0.6)
        axes.set_xlabel("wasted share of rollout-seconds")
        axes.set_ylabel("admitted / population mean duration")
        axes.xaxis.set_major_formatter(PercentFormatter(1.0))
        axes.set_title("1 = unbiased; below 1 the cut trains on short rollouts", fontsize=9)
        axes.set_xlim(-0.03, max(o.wasted for o in outcomes) * 1.6 + 0.05)
        axes.margins(y=0.2)
        figure.tight_layout()
        figure.savefig(path, **SAVE)
    finally:
        pyplot.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="folder (default: this one)")
    parser.add_argument("--smoke", action="store_true", help="a tiny workload, for tests")
    args = parser.parse_args(argv)
    if not args.out.is_dir():
        parser.error(f"argument --out: {args.out} is not a folder")
    workload = Workload.smoke() if args.smoke else Workload()
    outcomes = long_tail(workload)
    goodput_figure(outcomes, workload, args.out / FIGURES[0])
    cost_figure(outcomes, args.out / FIGURES[1])
    for name in FIGURES:
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
