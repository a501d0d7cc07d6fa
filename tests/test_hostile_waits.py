"""Processes, long runs and waits, as a hostile user meets them (issue 48, items 7, 8, 9, 15,
16 and 23): a pool interrupted while it starts, a mesh a single process cannot make, simulate's
runaway inputs and its report, a wait that says what it waits on, and fit's wall-clock bound.

The pool tests start `dew train --processes` as a user would, every wait bounded (a pool still
running past its bound is killed and fails the test); nothing is timed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from _hf_folders import chat_checkpoint
from dew import cli, simulate
from dew.train import COMMIT

DEW_TRAIN = [sys.executable, "-m", "dew", "train"]
SMALL = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
SMALL += ["--batch-size", "4", "--groups", "2", "--tasks", "32"]
# Seconds a pool may take before the test kills it and fails.
BOUND = 300
# A `--model` checkpoint small enough to split over two CPU devices.
CHECKPOINT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    """The environment of the module's `dew train` processes, with the session's persistent
    compilation cache (tests/conftest.py)."""
    assert "JAX_COMPILATION_CACHE_DIR" in os.environ
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(sys.path)}


def pool_processes(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The `dew train` processes the launcher has started so far (not its watchdog)."""
    children = psutil.Process(launcher.pid).children()
    found = []
    for child in children:
        try:
            if "--process-id" in child.cmdline():
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_pool_signalled_while_it_starts_stops_at_its_first_step(tmp_path, env, signum):
    """Item 7 (and build point 6): a pool signalled while its processes still start (importing
    jax) stops at its first step boundary, every process alike, with that step's checkpoint. A
    SIGINT delivered during the processes' start-up was swallowed by jax's garbage-collection
    hook (the pool then trained all its steps), or ended one process while the other waited
    for it in jax.distributed.initialize."""
    run = tmp_path / "run"
    launcher = subprocess.Popen(
        [*DEW_TRAIN, "--run", str(run), *SMALL, "--processes", "2", "--steps", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        bound = time.monotonic() + BOUND
        while len(pool_processes(launcher)) < 2 and time.monotonic() < bound:
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.01)
        launcher.send_signal(signum)
        out, err = launcher.communicate(timeout=BOUND)
    finally:
        launcher.kill()
    logs = [(run / "logs" / f"process-{index}.log").read_text() for index in range(2)]
    assert launcher.returncode == 130, out + err + str(logs)
    assert err == (
        "dew: interrupted: the pool stops after its step in progress (Ctrl-C again: at once)\n"
    )
    said = "dew train: stopped after step 1/300, its checkpoint saved"
    assert all(said in log for log in logs), logs
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    commit = json.loads((run / "checkpoints" / COMMIT).read_text())
    assert (commit["updates"], commit["position"]) == (1, 1)


def test_a_pool_of_one_process_trains_on_a_mesh_of_its_devices(tmp_path, env):
    """Item 15: `--processes 1 --mesh 1x1x2` trains, its process splitting the checkpoint over
    its two devices. Its one process checked the mesh against its devices before it joined the
    pool, which started JAX's backend: `jax.distributed.initialize() must be called before any
    JAX calls`, a traceback."""
    folder = chat_checkpoint(tmp_path / "checkpoint", CHECKPOINT)
    run = tmp_path / "run"
    command = [*DEW_TRAIN, "--model", str(folder), "--run", str(run), "--batch-size", "2"]
    command += ["--groups", "2", "--tasks", "8", "--steps", "1"]
    finished = subprocess.run(
        [*command, "--processes", "1", "--mesh", "1x1x2"],
        env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    log = (run / "logs" / "process-0.log").read_text()
    assert finished.returncode == 0, finished.stdout + finished.stderr + log
    assert "Traceback" not in log
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize(
    "options",
    [
        # 100,000 rollouts a setting (the bound on steps x tasks x groups) of 64 calls each.
        ["--steps", "1000", "--tasks", "25", "--groups", "4", "--calls", "64"],
        # 98,304 rollouts a setting in groups of 4096, the costliest size.
        ["--steps", "1", "--tasks", "24", "--groups", "4096", "--calls", "1"],
    ],
    ids=["calls", "groups"],
)
def test_dew_simulate_refuses_a_table_of_hours_before_it_starts(monkeypatch, capsys, options):
    """Item 8: `dew simulate` with every option within its bounds ran 874 CPU-seconds without
    a line; many engine calls a rollout, or groups of thousands, multiply a rollout's cost.
    It now refuses a table estimated past ten CPU-minutes before simulating anything, naming
    the options and the estimate."""

    def tripwire(*args, **kwargs):
        raise AssertionError("dew simulate started simulating")

    monkeypatch.setattr(simulate, "long_tail", tripwire)
    with pytest.raises(SystemExit) as exit:
        cli.main(["simulate", *options])
    assert exit.value.code == 2
    said = capsys.readouterr().err
    assert re.search(r"would simulate for about \d+ CPU-minutes, more than 10: lower", said)
    assert all(option in said for option in ("--steps", "--tasks", "--groups", "--calls"))


def test_dew_simulate_says_what_it_will_take_and_each_setting_as_it_ends(capsys):
    """Item 8: a table within the bound says first about how long it takes, then each setting
    as it ends, on standard error (the table stays alone on standard out)."""
    assert cli.main(["simulate", "--smoke"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    names = [setting.name for setting in simulate.settings(simulate.Workload.smoke())]
    assert re.fullmatch(rf"dew simulate: {len(names)} settings, about \d+ CPU-seconds", lines[0])
    assert lines[1:] == [
        f"dew simulate: {name} simulated ({index}/{len(names)})"
        for index, name in enumerate(names, 1)
    ]
    assert captured.out.startswith(simulate.describe(simulate.Workload.smoke()))


def test_dew_simulate_reports_a_sync_run_that_admitted_nothing(capsys):
    """Item 16: a workload whose sync setting admits no sample (one task of one rollout of 64
    calls, one step) crashed at the report's last line with ZeroDivisionError, after all the
    work; the ratio is now undefined, saying why."""
    options = ["--steps", "1", "--tasks", "1", "--groups", "1", "--calls", "64"]
    assert cli.main(["simulate", *options]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (
        "ahead=1 goodput / sync goodput: undefined: sync admitted no sample in its 1 measured steps"
    )
