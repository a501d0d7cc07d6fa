"""Every benchmark runs its smoke version and prints figures: benchmarks may not rot. Those
that start servers or processes run in tests/test_benchmarks_heavy.py."""

from __future__ import annotations

import runpy
import sys

import pytest

from _benchmarks import BENCHMARKS, HEAVY, load_benchmark, run_smoke, run_smoke_here

# Run as `python benchmarks/NAME.py --smoke`, in a process of its own: one of each way a light
# script starts (`main()` under `if __name__ == "__main__"`: pack; argparse and `trio.run` in
# that block: gateway_large; a `sys.exit` there, after a pool of spawned processes: long_tail).
# The rest run their `__main__` in this process (`run_smoke_here`); the heavy ones all in one of
# their own.
AS_PROCESS = {"gateway_large", "long_tail", "pack"}


def test_there_are_benchmarks():
    names = {b.stem for b in BENCHMARKS}
    assert names >= {"pack", "logprobs", "scheduler_overhead", "long_tail", "engine", "gateway"}
    assert HEAVY <= names, HEAVY - names
    assert AS_PROCESS <= names - HEAVY, AS_PROCESS - (names - HEAVY)


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", [b for b in BENCHMARKS if b.stem not in HEAVY], ids=lambda p: p.stem
)
def test_benchmark_smoke_run_prints_figures(script, monkeypatch, capsys):
    if script.stem in AS_PROCESS:
        run_smoke(script)
    else:
        run_smoke_here(script, monkeypatch, capsys)


def test_the_long_tail_reference_table_shows_slot_waste_as_dew_simulate_measures_it():
    """Issue 46 item 2: benchmarks/long_tail.py --reference has a slot waste column beside the
    rollout waste, each the very figure `dew.simulate` measures for the run (4 steps, seed 0)."""
    from dew.simulate import Workload, simulate

    long_tail = load_benchmark("long_tail")
    setting = long_tail.SETTINGS[0]
    header, row = long_tail.reference(steps=4, seeds=1, jobs=1, settings=(setting,)).splitlines()[
        1:
    ]
    columns = header.split("  ")
    assert [c.strip() for c in columns if c.strip()][1:4] == ["of bound", "wasted", "slot waste"]
    cells = row[30:]
    means = [float(cells[i : i + 22].split()[0]) for i in range(0, len(cells), 22)]
    outcome = simulate(Workload(seed=0, steps=4, **long_tail.REFERENCE), setting)
    assert means[1:3] == [round(outcome.wasted, 3), round(outcome.slot_wasted, 3)]
    assert outcome.slot_wasted != outcome.wasted  # queueing counted apart: the columns differ


@pytest.mark.medium
def test_the_long_tail_workloads_weigh_auto_against_the_best_fixed_setting_within_its_budget():
    """Issue 46 item 3: benchmarks/long_tail.py --workloads runs the six workloads (the bimodal
    mix 80 % short, 20 % ten times as long, of mean 10 s) and sets each auto beside the best
    fixed setting whose slot waste is within auto's budget, or says none fits, with the least
    and greatest of the seeds' own ratios beside the ratio of the means (4 steps, seeds 0 and 1:
    each figure the one `dew.simulate` measures)."""
    import numpy as np

    from dew.simulate import Workload, simulate

    long_tail = load_benchmark("long_tail")
    assert list(long_tail.WORKLOADS) == [
        "reference",
        "sigma=0.5",
        "sigma=1.5",
        "sigma=2.0",
        "T=3xmean",
        "bimodal",
    ]
    pool = Workload(**long_tail.WORKLOADS["bimodal"])
    assert abs(pool.population_mean - 10.0) < 0.3
    seconds = [r.duration for r in pool.observed]
    short, long = seconds[: len(seconds) * 8 // 10], seconds[len(seconds) * 8 // 10 :]
    assert 9 < (sum(long) / len(long)) / (sum(short) / len(short)) < 11
    auto = long_tail.AUTOS[0]
    assert (auto.ahead, auto.max_lag, auto.waste_budget) == (1, 5, 0.15)
    fixed = long_tail.AT_LAG_5[4:6]
    lines = long_tail.workloads(
        steps=4, seeds=2, jobs=1, names=("bimodal",), fixed=fixed, autos=(auto,)
    )
    (row,) = lines.splitlines()[2:]
    bimodal = long_tail.WORKLOADS["bimodal"]
    outcomes = [
        [simulate(Workload(seed=seed, steps=4, **bimodal), s) for seed in (0, 1)]
        for s in (*fixed, auto)
    ]
    # [setting (the fixed ones, then auto), seed, (goodput, slot waste)]
    runs = np.array([[(o.goodput, o.slot_wasted) for o in seeds] for seeds in outcomes])
    means = runs.mean(axis=1)
    within = [i for i in range(2) if means[i, 1] <= 0.15]
    assert row.split()[2] == f"{means[2, 0]:.2f}"
    assert ("yes" if runs[2, :, 1].max() <= 0.16 else "no") in row.split()
    if within:
        best = max(within, key=lambda i: means[i, 0])
        assert fixed[best].name in row
        ratios = runs[2, :, 0] / runs[best, :, 0]
        assert row.split()[-3:] == [
            f"{means[2, 0] / means[best, 0]:.3f}",
            f"[{ratios.min():.2f},",
            f"{ratios.max():.2f}]",
        ]
    else:
        assert "none fits" in row


@pytest.mark.parametrize("option", ["--steps=-1", "--seeds=0", "--jobs=0"])
def test_the_long_tail_tables_refuse_a_count_below_one_in_one_line(option, monkeypatch, capsys):
    """The script run as `python long_tail.py --workloads OPTION` runs it, but in this process
    (runpy, as `__main__` with that argv): a process of its own added only the library's
    import, 4-5 s a case."""
    script = next(path for path in BENCHMARKS if path.stem == "long_tail")
    monkeypatch.setattr(sys, "argv", [str(script), "--workloads", option])
    with pytest.raises(SystemExit) as refused:
        runpy.run_path(str(script), run_name="__main__")
    err = capsys.readouterr().err
    name, value = option.split("=")
    assert refused.value.code == 2, err
    assert err.splitlines()[-1] == f"long_tail.py: error: {name} must be at least 1, got {value}"


def test_the_learning_summary_counts_a_step_whose_groups_all_scored_alike(tmp_path):
    """benchmarks/learning.py's row of a run one of whose steps trained no group (every group
    uniform, left out by `--filter-uniform`: its metrics line has no `reward/mean` or
    `length/mean`, as a SmolLM2 sums run's steps 0, 2 and 7 had). The summary raised KeyError
    after the run's 30 steps; the step counts its seconds and no tokens."""
    import json

    learning = load_benchmark("learning")
    run = tmp_path / "run"
    run.mkdir()
    trained = {"groups": 1, "seconds/step": 30.0, "reward/mean": 0.25, "length/mean": 2.5}
    untrained = {"groups": 0, "seconds/step": 10.0}
    (run / "metrics.jsonl").write_text(f"{json.dumps(untrained)}\n{json.dumps(trained)}\n")
    evaluations = [
        {"updates": 0, "greedy": 0.125, "mean@2": 0.05, "distinct_correct": 4},
        {"updates": 2, "greedy": 0.5, "mean@2": 0.4, "distinct_correct": 9},
    ]
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evaluations))
    row = learning.summary(run, {"wall": 60.0, "peak_gib": 6.2})
    assert row["steps"] == 2 and row["s/step"] == 20.0
    assert row["tokens/s"] == 2.5 * learning.RECIPE["groups"] / 40.0
    assert row["reward"] == [None, 0.25]
    assert row["greedy"] == (0.125, 0.5) and row["distinct_correct"] == (4, 9)


def test_the_readmes_real_model_command_trains_the_learning_benchmarks_sums_recipe():
    """README's "Train a real model" command is benchmarks/learning.py's sums run (`RECIPE` and
    `TASKS["arithmetic"]` at the script's 30 steps, evaluated every 10), so that the figures of
    the one stand beside the other's tables. They parted on --tasks (the benchmark's 512, the
    README's dew default 1000), which moves the held-out tasks too (the ids after the training
    ones; 5 of seed 0's 64 held-out sums kept their answer): the base model's held-out greedy
    read 0.125 in the README and 0.047 in the benchmark's vLLM table, both on dew's engine.
    What a run logs and how often it saves (`samples`, `checkpoint_every`) may differ: neither
    changes what it learns or how it is evaluated."""
    import argparse

    import attrs

    from dew import train
    from test_real_model import real_model_command

    learning = load_benchmark("learning")
    parser = argparse.ArgumentParser()
    train.configure_cli(parser)
    args = parser.parse_args(real_model_command()[2:])
    given = {field.name: getattr(args, field.name) for field in attrs.fields(train.TrainConfig)}
    readme = train.TrainConfig(
        **{name: value for name, value in given.items() if value is not None}
    )
    script = {"steps": 30, "eval_every": 10}
    benchmark = train.TrainConfig(**(learning.RECIPE | learning.TASKS["arithmetic"] | script))
    kept_apart = {"samples", "checkpoint_every"}
    differ = {
        field.name: (getattr(readme, field.name), getattr(benchmark, field.name))
        for field in attrs.fields(train.TrainConfig)
        if field.name not in kept_apart
        and getattr(readme, field.name) != getattr(benchmark, field.name)
    }
    assert differ == {}, f"README's command against the benchmark's recipe: {differ}"
