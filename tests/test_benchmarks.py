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
