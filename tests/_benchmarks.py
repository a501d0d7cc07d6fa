"""Smoke runs of the scripts under benchmarks/, shared by the two files that run them."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import runpy
import subprocess
import sys
import types

import jax

BENCHMARKS = sorted((pathlib.Path(__file__).parent.parent / "benchmarks").glob("*.py"))

# Those that start vLLM servers, a pool of processes or a device mesh, or train one model in JAX
# and in torch, or several `dew train` processes: minutes between them, so they have a test file
# of their own, which xdist's file-by-file scheduling runs beside the rest.
HEAVY = {
    "checkpoints",
    "engines",
    "gpu",
    "learning",
    "lora",
    "options",
    "parallel",
    "sharded_checkpoints",
    "train_step_torch",
    "vllm_start",
}
# Those of HEAVY that need a process of their own: a pool of processes (its signal handling) and
# a device count forced in XLA_FLAGS before jax is imported. The rest run their `__main__` in
# the test's process (`run_smoke_here`), starting their servers and processes as before.
HEAVY_AS_PROCESS = {"parallel", "sharded_checkpoints"}


def load_benchmark(name: str) -> types.ModuleType:
    """The script `benchmarks/NAME.py` as a module (its tables, recipes and helpers), not run."""
    (script,) = [b for b in BENCHMARKS if b.stem == name]
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_smoke(script: pathlib.Path) -> None:
    """Run `script --smoke`: it exits 0 and prints at least one figure."""
    done = subprocess.run(
        [sys.executable, str(script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"\d+\.\d+", done.stdout), done.stdout


def run_smoke_here(script: pathlib.Path, monkeypatch, capsys) -> None:
    """Run `script --smoke` as `python script --smoke` runs it, but in this process: runpy runs
    it as `__main__` with that argv, its folder first on `sys.path` and JAX's default
    promotion, as in its own process (conftest's strict promotion is the tests'; optax's Adam
    needs the default). It returns or exits 0 and prints at least one figure. A process of its
    own added its interpreter's start and the imports (jax, the library) each time; the
    processes the script starts run as before."""
    monkeypatch.setattr(sys, "argv", [str(script), "--smoke"])
    monkeypatch.syspath_prepend(str(script.parent))
    try:
        with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit:
        assert exit.code in (0, None), f"{script.name} --smoke exited {exit.code!r}"
    out = capsys.readouterr().out
    assert re.search(r"\d+\.\d+", out), out
