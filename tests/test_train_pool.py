"""`dew train` on a pool of real `jax.distributed` processes on the loopback interface.

Each test starts `dew train --processes N` as a user would, and reads the run folder it leaves:
one metrics stream, one checkpoint, a log per process. Every wait is bounded (a pool still
running past its bound is killed and fails the test); nothing is timed. The processes share a
persistent compilation cache, so a resumed pool need not compile again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dew.cli import main
from dew.train import COMMIT

DEW_TRAIN = [sys.executable, "-m", "dew", "train"]
SMALL = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
SMALL += ["--batch-size", "4", "--groups", "2", "--tasks", "32"]
# Seconds a pool may take before the test kills it and fails.
BOUND = 400


def environment(tmp_path) -> dict[str, str]:
    cache = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    return {**os.environ, **cache}


def dew_train(run, *options: str) -> list[str]:
    return [*DEW_TRAIN, "--run", str(run), *options]


def metrics_lines(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def logs(run) -> dict[int, str]:
    return {
        int(path.stem.rpartition("-")[2]): path.read_text()
        for path in sorted((run / "logs").glob("process-*.log"))
    }


def test_a_pool_of_processes_trains_the_default_task_with_a_rising_reward(tmp_path):
    run, steps, processes = tmp_path / "run", 40, 2
    # The default run, cut short. Each process draws its own sampling keys, so a pool's run is
    # not one process's: under seed 1 this one takes off within 40 steps (seed 0 takes longer).
    done = subprocess.run(
        dew_train(run, "--processes", str(processes), "--steps", str(steps), "--seed", "1"),
        capture_output=True,
        text=True,
        timeout=BOUND,
        env=environment(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr + str(logs(run))
    lines = metrics_lines(run)  # one stream for the pool, written by process 0
    assert [line["step"] for line in lines] == list(range(steps))
    # Every step trained the whole global batch: each process its share of the groups.
    assert all(line["groups"] == 8 for line in lines)
    rewards = [line["reward/mean"] for line in lines]
    start, end = np.mean(rewards[:10]), np.mean(rewards[-10:])
    assert end > start + 0.1, (start, end)
    per_process = logs(run)
    assert sorted(per_process) == list(range(processes))
    for index, text in per_process.items():
        assert f"process {index} of {processes} (pid " in text
        assert f"trained {steps} steps" in text
    assert f"trained {steps} steps" in done.stdout  # process 0 is the console's
    commit = json.loads((run / "checkpoints" / COMMIT).read_text())
    assert (commit["updates"], commit["position"]) == (steps, steps)
    assert commit["metadata"]["processes"] == processes
    assert (run / "curves.png").exists()


def test_a_killed_process_stops_the_pool_by_name_and_the_pool_resumes_exactly(tmp_path):
    """kill -9 of process 1 mid-run: process 0 stops with a line naming it, the launcher exits
    with the killed process's status; `--resume` then continues from the last checkpoint, every
    data position trained once."""
    run, steps = tmp_path / "run", 12
    options = [*SMALL, "--steps", str(steps), "--checkpoint-every", "4", "--processes", "2"]
    env = environment(tmp_path)
    launcher = subprocess.Popen(
        dew_train(run, *options), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    commit = run / "checkpoints" / COMMIT
    try:
        bound = time.monotonic() + BOUND
        while not commit.exists() and launcher.poll() is None and time.monotonic() < bound:
            time.sleep(0.05)
        pid = int(re.search(r"\(pid (\d+)\)", logs(run)[1]).group(1))
        os.kill(pid, signal.SIGKILL)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    out, err = out.decode(), err.decode()
    assert launcher.returncode == 128 + signal.SIGKILL, out + err
    assert "dew: process 1 failed first (killed by SIGKILL)" in err
    said = logs(run)[0]
    assert f"process 0 of 2 stops with the pool: process 1 died (its pid {pid} is gone)" in said
    record = json.loads(commit.read_text())
    killed_at = record["updates"]
    assert 4 <= killed_at < steps and killed_at % 4 == 0 and record["position"] == killed_at
    kept = record["metadata"]["metrics_bytes"]
    before = (run / "metrics.jsonl").read_bytes()[:kept]

    resumed = subprocess.run(
        dew_train(run, *options, "--resume"),
        capture_output=True,
        text=True,
        timeout=BOUND,
        env=env,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + str(logs(run))
    assert f"resuming at step {killed_at}, data position {killed_at}" in resumed.stdout
    assert (run / "metrics.jsonl").read_bytes()[:kept] == before
    lines = metrics_lines(run)
    assert [line["step"] for line in lines] == list(range(steps))
    assert [line["position"] for line in lines] == list(range(steps))
    final = json.loads(commit.read_text())
    assert (final["updates"], final["position"]) == (steps, steps)


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--processes", "2", "--process-id", "0"], "--processes starts a pool of its own"),
        (["--coordinator", "127.0.0.1:1234"], "takes --coordinator, --num-processes and"),
        (["--processes", "0"], "--processes must be an int >= 1, got 0"),
        (["--deadline", "0"], "--deadline must be a finite number of seconds > 0, got 0.0"),
        (
            ["--processes", "3", "--batch-size", "4"],
            "batch_size 4 must split evenly over the 3 processes",
        ),
    ],
)
def test_the_pool_options_name_what_is_wrong(tmp_path, capsys, argv, culprit):
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--run", str(tmp_path / "run"), *argv])
    assert stopped.value.code == 2
    assert culprit in capsys.readouterr().err
