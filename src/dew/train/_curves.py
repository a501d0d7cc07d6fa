"""`curves.png`: a run's metrics log drawn as eight panels over the step axis.

Drawn with matplotlib's object API (a `Figure` of its own, never pyplot's global state), so it
works in a headless process and in a notebook alike: `curves_figure` returns the figure for a
notebook to show, `write_curves` writes it as a PNG beside the metrics.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dew.train._checkpoint import _write_atomically

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Steps averaged into the smoothed reward: a tenth of the run, at least 1 and at most 50.
SMOOTHING = (1, 50)


def _series(lines: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    """float64[steps]: key's value in each line, NaN where a line lacks it or holds null."""
    values = [line.get(key) for line in lines]
    return np.array([math.nan if v is None else float(v) for v in values], np.float64)


def smoothed(values: np.ndarray, window: int) -> np.ndarray:
    """The trailing mean of the last `window` finite values at each step (NaN before any).

    Args:
        values: float64[steps], NaN where a step has no value.
        window: steps averaged, >= 1.

    Returns:
        float64[steps].

    Raises:
        ValueError: for a window below 1.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = np.full(len(values), math.nan)
    for i in range(len(values)):
        recent = values[max(0, i - window + 1) : i + 1]
        recent = recent[np.isfinite(recent)]
        if recent.size:
            out[i] = recent.mean()
    return out


def curves_figure(
    lines: Sequence[Mapping[str, Any]],
    evaluations: Sequence[Mapping[str, Any]] = (),
) -> Figure:
    """Draw a run's metrics lines (one per step, as `metrics.jsonl` holds them).

    Eight panels over the step axis: the mean reward per step and its trailing mean; the loss;
    the behaviour–proximal KL, split where the record has it into the engine's own mismatch
    (tokens sampled at the trainer's version) and staleness (older tokens), on a scale that
    shows both; the lag in whole updates; the trainer's wait share (seconds waited on the
    scheduler over the step's seconds); the packed rows' fill with the groups cut per step;
    the selection bias (the admitted rollouts' mean length over that of everything their batch
    started, in tokens, turns and seconds: below 1, the cut favoured short rollouts); and the
    groups whose rewards were all equal, those trained on among them. A panel whose keys no
    line holds says so. With evaluations, the reward panel also marks the held-out reward at
    each one, greedy and mean@k, and pass@k, the share of held-out tasks a sampled reply solved.

    Args:
        lines: the metrics lines, each with `step` and any of `reward/mean`, `loss`,
            `kl/behavior_proximal`, `mismatch/engine`, `staleness/kl`, `lag`, `waited`,
            `seconds/step`, `fill`, `cut`, `bias/<tokens|turns|seconds>/ratio_mean`,
            `groups/uniform`, `groups/uniform_trained`.
        evaluations: the held-out evaluations (`eval.jsonl`'s lines), each with `updates`,
            `greedy` and, where it sampled, `mean@k` and `pass@k`.

    Returns:
        The figure, 12 x 12 inches.

    Raises:
        ValueError: when a line has no `step`.
    """
    for index, line in enumerate(lines):
        if "step" not in line:
            raise ValueError(f"metrics line {index} has no 'step': {sorted(line)}")
    steps = _series(lines, "step")
    # Imported here: matplotlib takes half a second, which every `dew` command would pay.
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 12), layout="constrained")
    axes = figure.subplots(4, 2, sharex=True)
    reward = _series(lines, "reward/mean")
    window = min(max(len(lines) // 10, SMOOTHING[0]), SMOOTHING[1])
    _panel(axes[0, 0], steps, reward, "reward", "mean reward", alpha=0.35, label="per step")
    if np.isfinite(reward).any():
        axes[0, 0].plot(steps, smoothed(reward, window), label=f"mean of {window} steps")
    if evaluations:
        at = _series(evaluations, "updates")
        held_out = _series(evaluations, "greedy")
        axes[0, 0].plot(at, held_out, "o-", color="tab:green", label="held-out, greedy")
        for prefix, style, color in (("mean@", "s--", "tab:olive"), ("pass@", "^:", "tab:cyan")):
            sampled = next((key for key in evaluations[0] if key.startswith(prefix)), None)
            if sampled is not None:
                axes[0, 0].plot(
                    at,
                    _series(evaluations, sampled),
                    style,
                    color=color,
                    label=f"held-out, {sampled}",
                )
    if np.isfinite(reward).any() or evaluations:
        axes[0, 0].legend(loc="best", fontsize="small")
    _panel(axes[0, 1], steps, _series(lines, "loss"), "loss", "clipped surrogate")
    _series_panel(
        axes[1, 0],
        steps,
        lines,
        {
            "mismatch/engine": "engine (current version)",
            "staleness/kl": "staleness (older versions)",
            "kl/behavior_proximal": "all trained tokens",
        },
        "KL(behaviour ‖ proximal)",
        "nats per token",
    )
    # The engine's own mismatch is float noise beside staleness: a linear scale near 0 and a
    # log scale above shows both.
    axes[1, 0].set_yscale("symlog", linthresh=1e-9)
    _panel(axes[1, 1], steps, _series(lines, "lag"), "lag", "updates", drawstyle="steps-mid")
    axes[1, 1].yaxis.set_major_locator(_whole_numbers())
    wait = _series(lines, "waited") / _series(lines, "seconds/step")
    _panel(axes[2, 0], steps, wait, "trainer's wait share", "waited / step time")
    axes[2, 0].set_ylim(0, 1.05)
    _rows_panel(axes[2, 1], steps, _series(lines, "fill"), _series(lines, "cut"))
    bias = {f"bias/{kind}/ratio_mean": kind for kind in ("tokens", "turns", "seconds")}
    title, ylabel = "selection bias", "admitted / started mean length"
    if _series_panel(axes[3, 0], steps, lines, bias, title, ylabel):
        axes[3, 0].axhline(1.0, color="grey", linewidth=0.8)
    uniform = {
        "groups/uniform": "rewards all equal",
        "groups/uniform_trained": "trained on (advantage 0)",
    }
    _series_panel(axes[3, 1], steps, lines, uniform, "uniform groups", "groups per step")
    axes[3, 1].yaxis.set_major_locator(_whole_numbers())
    for ax in axes[-1]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(_whole_numbers())
    return figure


def _panel(ax, steps: np.ndarray, values: np.ndarray, title: str, ylabel: str, **style) -> None:
    """One series against the steps, or a note where it has no value at all."""
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if np.isfinite(values).any():
        ax.plot(steps, values, **style)
    else:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center")


def _series_panel(
    ax, steps: np.ndarray, lines, keys: Mapping[str, str], title: str, ylabel: str
) -> bool:
    """The series of `keys` (key -> legend label) that some line holds, or a note where none
    does; return whether any was drawn."""
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    drawn = False
    for key, label in keys.items():
        values = _series(lines, key)
        if np.isfinite(values).any():
            ax.plot(steps, values, label=label)
            drawn = True
    if drawn:
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center")
    return drawn


def _rows_panel(ax, steps: np.ndarray, fill: np.ndarray, cut: np.ndarray) -> None:
    """Row fill (share of cells, left axis) and groups cut (bars, right axis)."""
    _panel(ax, steps, fill, "packed rows", "fill (share of cells)", color="tab:green")
    ax.yaxis.label.set_color("tab:green")
    ax.set_ylim(0, 1.05)
    cuts = ax.twinx()
    cuts.bar(steps, np.nan_to_num(cut), color="tab:red", alpha=0.5, width=0.8)
    cuts.set_ylabel("groups cut", color="tab:red")
    cuts.yaxis.set_major_locator(_whole_numbers())
    cuts.set_ylim(0, max(1.0, float(np.nanmax(cut, initial=0.0))) * 1.1)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of a metrics log, in order.

    Raises:
        ValueError: naming the file and line of a line that is not a JSON object.
    """
    lines = []
    with open(path, encoding="utf-8") as log:
        for number, text in enumerate(log, start=1):
            try:
                line = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON: {error}") from None
            if not isinstance(line, dict):
                raise ValueError(f"{path}:{number}: a JSON {type(line).__name__}, not an object")
            lines.append(line)
    return lines


def write_curves(
    metrics: str | os.PathLike,
    path: str | os.PathLike,
    *,
    evaluations: str | os.PathLike | None = None,
) -> None:
    """Draw a metrics log's curves (see `curves_figure`) into a PNG at `path`, atomically,
    with the held-out rewards of an `evaluations` log (`eval.jsonl`) where that file exists."""
    evaluated = evaluations is not None and Path(evaluations).exists()
    figure = curves_figure(read_metrics(metrics), read_metrics(evaluations) if evaluated else ())
    _write_atomically(Path(path), lambda file: figure.savefig(file, format="png", dpi=100))


def _whole_numbers():
    """A tick locator that puts ticks on whole numbers only."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)
