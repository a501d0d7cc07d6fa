"""Every benchmark runs its smoke version and prints figures: benchmarks may not rot. Those
that start servers or processes run in tests/test_benchmarks_heavy.py."""

from __future__ import annotations

import pytest

from _benchmarks import BENCHMARKS, HEAVY, run_smoke


def test_there_are_benchmarks():
    names = {b.stem for b in BENCHMARKS}
    assert names >= {"pack", "logprobs", "scheduler_overhead", "long_tail", "engine", "gateway"}
    assert HEAVY <= names, HEAVY - names


@pytest.mark.slow
@pytest.mark.parametrize(
    "script", [b for b in BENCHMARKS if b.stem not in HEAVY], ids=lambda p: p.stem
)
def test_benchmark_smoke_run_prints_figures(script):
    run_smoke(script)


def test_the_long_tail_reference_table_shows_slot_waste_as_dew_simulate_measures_it():
    """Issue 46 item 2: benchmarks/long_tail.py --reference has a slot waste column beside the
    rollout waste, each the very figure `dew.simulate` measures for the run (4 steps, seed 0)."""
    import importlib.util

    from dew.simulate import Workload, simulate

    (script,) = [b for b in BENCHMARKS if b.stem == "long_tail"]
    spec = importlib.util.spec_from_file_location("long_tail_benchmark", script)
    long_tail = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(long_tail)
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
