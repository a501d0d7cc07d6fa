"""Every benchmark runs its smoke version and prints figures: benchmarks may not rot."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

BENCHMARKS = sorted((pathlib.Path(__file__).parent.parent / "benchmarks").glob("*.py"))


def test_there_are_benchmarks():
    assert {b.stem for b in BENCHMARKS} >= {
        "pack",
        "logprobs",
        "scheduler_overhead",
        "long_tail",
        "engine",
        "gateway",
    }


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmark_smoke_run_prints_figures(script):
    done = subprocess.run(
        [sys.executable, str(script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"\d+\.\d+", done.stdout), done.stdout
