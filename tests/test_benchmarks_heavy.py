"""The smoke runs of the benchmarks that start vLLM servers, a pool of processes or a device
mesh (tests/_benchmarks.py's HEAVY)."""

from __future__ import annotations

import pytest

from _benchmarks import BENCHMARKS, HEAVY, HEAVY_AS_PROCESS, run_smoke, run_smoke_here


@pytest.mark.slow
@pytest.mark.parametrize("script", [b for b in BENCHMARKS if b.stem in HEAVY], ids=lambda p: p.stem)
def test_benchmark_smoke_run_prints_figures(script, monkeypatch, capsys):
    if script.stem in HEAVY_AS_PROCESS:
        run_smoke(script)
    else:
        run_smoke_here(script, monkeypatch, capsys)
