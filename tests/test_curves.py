"""curves.png: a run's metrics drawn with matplotlib, panel by panel."""

from __future__ import annotations

import json
import math

import matplotlib.image
import numpy as np
import pytest

from dew.train import curves_figure, write_curves
from dew.train._curves import smoothed


def lines(steps: int = 30) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "step": step,
            "reward/mean": float(rng.uniform()),
            "loss": float(rng.normal()),
            "kl/behavior_proximal": float(rng.uniform(0, 0.1)),
            "lag": int(step > 0),
            "waited": 0.25,
            "seconds/step": 1.0,
            "fill": 0.75,
            "cut": int(step % 7 == 0),
        }
        for step in range(steps)
    ]


def panels(figure) -> dict:
    return {ax.get_title(): ax for ax in figure.axes if ax.get_title()}


def test_eight_panels_with_labelled_axes():
    figure = curves_figure(lines())
    titled = panels(figure)
    assert list(titled) == [
        "reward",
        "loss",
        "KL(behaviour ‖ proximal)",
        "lag",
        "trainer's wait share",
        "packed rows",
        "selection bias",
        "uniform groups",
    ]
    for title, ax in titled.items():
        assert ax.get_ylabel(), title
    assert all(
        ax.get_xlabel() == "step" for ax in (titled["selection bias"], titled["uniform groups"])
    )


def test_the_held_out_evaluations_are_drawn_greedy_mean_and_pass_at_k():
    """Issue 44 item 7: curves.png's reward panel marks each evaluation's pass@k beside its
    greedy and mean@k reward."""
    evaluations = [
        {"updates": updates, "greedy": 0.1 * updates, "mean@4": 0.05 * updates, "pass@4": 0.5}
        for updates in (0, 10, 20)
    ]
    reward = panels(curves_figure(lines(30), evaluations))["reward"]
    drawn = {line.get_label(): line for line in reward.lines}
    for key in ("greedy", "mean@4", "pass@4"):
        line = drawn[f"held-out, {key}"]
        np.testing.assert_allclose(line.get_xdata(), [0, 10, 20])
        np.testing.assert_allclose(line.get_ydata(), [e[key] for e in evaluations])


def test_reward_is_drawn_raw_and_as_its_trailing_mean():
    data = lines(30)
    reward = panels(curves_figure(data))["reward"]
    raw, mean = reward.get_lines()
    values = np.array([line["reward/mean"] for line in data])
    np.testing.assert_allclose(raw.get_ydata(), values)
    window = 3  # a tenth of 30 steps
    expected = [values[max(0, i - window + 1) : i + 1].mean() for i in range(30)]
    np.testing.assert_allclose(mean.get_ydata(), expected)
    assert mean.get_label() == "mean of 3 steps"


def test_lag_ticks_are_whole_updates_and_wait_is_a_share():
    titled = panels(curves_figure(lines()))
    ticks = titled["lag"].get_yticks()
    assert np.array_equal(ticks, np.round(ticks))
    np.testing.assert_allclose(titled["trainer's wait share"].get_lines()[0].get_ydata(), 0.25)


def test_cuts_are_bars_on_their_own_axis():
    figure = curves_figure(lines(30))
    twin = [ax for ax in figure.axes if ax.get_ylabel() == "groups cut"]
    assert len(twin) == 1
    heights = [bar.get_height() for bar in twin[0].patches]
    assert heights == [float(step % 7 == 0) for step in range(30)]


def test_a_metric_no_line_holds_says_so():
    data = [{"step": s, "reward/mean": 0.5} for s in range(5)]
    titled = panels(curves_figure(data))
    assert [t.get_text() for t in titled["loss"].texts] == ["not logged"]
    assert not titled["reward"].texts


def test_a_line_without_a_step_is_named():
    with pytest.raises(ValueError, match="metrics line 1 has no 'step'"):
        curves_figure([{"step": 0}, {"loss": 1.0}])


def test_smoothed_skips_missing_values():
    values = np.array([1.0, math.nan, 3.0, 5.0])
    np.testing.assert_allclose(smoothed(values, 2), [1.0, 1.0, 3.0, 4.0])
    assert np.isnan(smoothed(np.array([math.nan]), 3)).all()
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        smoothed(values, 0)


def test_write_curves_writes_a_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines()))
    write_curves(metrics, tmp_path / "curves.png")
    image = matplotlib.image.imread(tmp_path / "curves.png")
    assert image.shape[:2] == (1200, 1200)
    assert image.std() > 0  # not a blank canvas
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]


def test_a_broken_metrics_line_is_named(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: a JSON list, not an object"):
        write_curves(metrics, tmp_path / "curves.png")
    metrics.write_text('{"step": 0}\n{oops\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not JSON"):
        write_curves(metrics, tmp_path / "curves.png")
    assert not (tmp_path / "curves.png").exists()


def test_the_mismatch_split_the_selection_bias_and_the_uniform_groups_are_drawn():
    data = [
        {
            "step": s,
            "mismatch/engine": 1e-13,
            "staleness/kl": 0.01 * s,
            "bias/tokens/ratio_mean": 0.8,
            "bias/seconds/ratio_mean": 0.6,
            "groups/uniform": 5,
            "groups/uniform_trained": 0,
        }
        for s in range(10)
    ]
    titled = panels(curves_figure(data))
    kl = {line.get_label(): line.get_ydata() for line in titled["KL(behaviour ‖ proximal)"].lines}
    assert set(kl) == {"engine (current version)", "staleness (older versions)"}
    np.testing.assert_allclose(kl["staleness (older versions)"], [0.01 * s for s in range(10)])
    bias = {line.get_label(): line.get_ydata() for line in titled["selection bias"].lines}
    assert set(bias) >= {"tokens", "seconds"} and "turns" not in bias
    np.testing.assert_allclose(bias["seconds"], 0.6)
    uniform = {line.get_label(): line.get_ydata() for line in titled["uniform groups"].lines}
    np.testing.assert_allclose(uniform["rewards all equal"], 5)
    np.testing.assert_allclose(uniform["trained on (advantage 0)"], 0)
