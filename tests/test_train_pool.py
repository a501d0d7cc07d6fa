"""`dew train` on a pool of real `jax.distributed` processes on the loopback interface.

Each test starts `dew train --processes N` as a user would, and reads the run folder it leaves:
one metrics stream, one checkpoint, a log per process. Every wait is bounded (a pool still
running past its bound is killed and fails the test); nothing is timed. The processes share the
session's persistent compilation cache, so a resumed pool need not compile again.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import attrs
import numpy as np
import pytest

from dew.cli import main
from dew.envs.tasks import CopyDigits
from dew.train import COMMIT, TrainConfig

DEW_TRAIN = [sys.executable, "-m", "dew", "train"]
SMALL = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
SMALL += ["--batch-size", "4", "--groups", "2", "--tasks", "32"]
# Seconds a pool may take before the test kills it and fails.
BOUND = 400


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    """The environment of the module's `dew train` processes. They inherit the session's
    persistent compilation cache (tests/conftest.py), so a resumed process compiles nothing the
    run before it compiled."""
    assert "JAX_COMPILATION_CACHE_DIR" in os.environ
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(sys.path)}


def dew_train(run, *options: str) -> list[str]:
    return [*DEW_TRAIN, "--run", str(run), *options]


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def metrics_lines(run) -> list[dict]:
    return jsonl(run / "metrics.jsonl")


def logs(run) -> dict[int, str]:
    return {
        int(path.stem.rpartition("-")[2]): path.read_text()
        for path in sorted((run / "logs").glob("process-*.log"))
    }


@pytest.mark.slow
def test_a_pool_of_processes_trains_the_default_task_with_a_rising_reward(tmp_path, env):
    run, steps, processes = tmp_path / "run", 40, 2
    # The default run, cut short and synchronous, on two processes (four groups each). Each
    # process draws its own sampling keys, so a pool's run is not one process's: this one rises
    # from 0.004 to 0.125 over the first and last ten steps, the same in every run. (With
    # `ahead` 1 the versions rollouts are sampled at depend on the threads' timing, and so does
    # the reward's rise; see test_train.py's learning test.) Adam at 1e-3 rather than the
    # default 3e-4 makes the rise show within 40 steps (the default's shows later). Two
    # processes on CI's two cores: four took three times as long, and test_parallel.py runs its
    # pools of four. Without XLA's optimisation passes (the session's setting, not the
    # `xla_optimizations` fixture): each process compiles its own programs, and the passes cost
    # it more than its 40 steps gain (42.0 and 41.5 CPU-s against 46.8 and 45.6), to the same
    # rewards step for step.
    argv = ["--processes", str(processes), "--steps", str(steps), "--ahead", "0"]
    done = subprocess.run(
        dew_train(run, *argv, "--learning-rate", "1e-3"),
        capture_output=True,
        text=True,
        timeout=BOUND,
        env=env,
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


@pytest.mark.slow
def test_ctrl_c_stops_the_pool_after_one_step_with_its_checkpoint(tmp_path, env):
    """A pool of two trains an agent harness through the gateway, each step the pool's global
    batch of the agent's sessions, then a terminal's Ctrl-C stops it after a step. The Ctrl-C
    reaches the launcher alone (each process has a session of its own); it passes the interrupt
    on, and the processes agree after each step whether any was interrupted, so every one stops
    after the same step, whose checkpoint process 0 writes. (One pool for both: a pool's start
    is most of either's cost.)"""
    run = tmp_path / "run"
    options = ["--harness", "lookup", "--processes", "2", "--steps", "400"]
    launcher = subprocess.Popen(
        dew_train(run, *SMALL, *options, "--checkpoint-every", "1000"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    metrics = run / "metrics.jsonl"
    try:
        bound = time.monotonic() + BOUND
        while launcher.poll() is None and time.monotonic() < bound:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=BOUND)
    finally:
        launcher.kill()
    assert launcher.returncode == 130, out + err + str(logs(run))
    assert (
        err
        == "dew: interrupted: the pool stops after its step in progress (Ctrl-C again: at once)\n"
    )
    lines = metrics_lines(run)
    stopped = len(lines)
    assert 2 <= stopped < 400
    assert [line["step"] for line in lines] == list(range(stopped))
    for line in lines:
        # The pool's global batch, two groups a process, every rollout the agent's session
        # scored by the lookup verifier.
        assert line["groups"] == 4 and line["status/completed"] == 1.0
        assert {"reward/lookup", "reward/answer"} <= set(line) and line["tokens/trained"] > 0
    assert sorted(logs(run)) == [0, 1]
    said = f"dew train: stopped after step {stopped}/400, its checkpoint saved"
    assert said in out and all(said in text for text in logs(run).values())
    commit = json.loads((run / "checkpoints" / COMMIT).read_text())
    assert (commit["updates"], commit["position"]) == (stopped, stopped)
    assert commit["metadata"]["metrics_bytes"] == metrics.stat().st_size


@attrs.frozen
class Killed:
    """A pool of two whose process 1 was killed mid-run, then resumed as a pool of two."""

    run: pathlib.Path
    pid: int  # process 1's, killed
    status: int  # the launcher's
    err: str  # the launcher's report
    commit: dict  # the checkpoint the kill left
    before: bytes  # metrics.jsonl as the kill left it
    resumed: subprocess.CompletedProcess


# The killed run: SMALL, 8 steps, checkpointed every 2.
KILLED = [*SMALL, "--steps", "8", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, env) -> Killed:
    """kill -9 of process 1 once the run has a checkpoint, then `--resume` of the same pool."""
    run = tmp_path_factory.mktemp("killed") / "run"
    launcher = subprocess.Popen(
        dew_train(run, *KILLED, "--processes", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    commit = run / "checkpoints" / COMMIT
    try:
        bound = time.monotonic() + BOUND
        while not commit.exists() and launcher.poll() is None and time.monotonic() < bound:
            time.sleep(0.05)
        pid = int(re.search(r"\(pid (\d+)\)", logs(run)[1]).group(1))
        os.kill(pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    record = json.loads(commit.read_text())
    before = (run / "metrics.jsonl").read_bytes()
    resumed = subprocess.run(
        dew_train(run, *KILLED, "--processes", "2", "--resume"),
        capture_output=True,
        text=True,
        timeout=BOUND,
        env=env,
    )
    return Killed(run, pid, launcher.returncode, err.decode(), record, before, resumed)


@pytest.mark.slow
def test_a_killed_process_stops_the_pool_by_name_and_the_pool_resumes_exactly(killed):
    """kill -9 of process 1 mid-run: process 0 stops with a line naming it, the launcher exits
    with the killed process's status; `--resume` then continues from the last checkpoint, every
    data position trained once."""
    run, steps = killed.run, 8
    assert killed.status == 128 + signal.SIGKILL, killed.err
    assert "dew: process 1 failed first (killed by SIGKILL)" in killed.err
    # The resumed pool's logs follow the killed run's.
    said = logs(run)[0]
    assert said.count("process 0 of 2 (pid ") == 2
    assert (
        f"process 0 of 2 stops with the pool: process 1 died (its pid {killed.pid} is gone)"
        in (said.split("resuming at step")[0])
    )
    killed_at = killed.commit["updates"]
    assert 2 <= killed_at < steps and killed_at % 2 == 0
    assert killed.commit["position"] == killed_at
    kept = killed.commit["metadata"]["metrics_bytes"]

    resumed = killed.resumed
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + str(logs(run))
    assert f"resuming at step {killed_at}, data position {killed_at}" in resumed.stdout
    assert (run / "metrics.jsonl").read_bytes()[:kept] == killed.before[:kept]
    lines = metrics_lines(run)
    assert [line["step"] for line in lines] == list(range(steps))
    assert [line["position"] for line in lines] == list(range(steps))
    # Process 0 logs samples of its own rows: each step's, once, though the kill left some of
    # a step past the checkpoint.
    samples = [sample["step"] for sample in jsonl(run / "samples.jsonl")]
    assert samples == sorted(samples) and all(samples.count(s) == 2 for s in range(steps))
    final = json.loads((run / "checkpoints" / COMMIT).read_text())
    assert (final["updates"], final["position"]) == (steps, steps)


@pytest.mark.slow
def test_a_pools_run_resumes_on_one_process_at_the_exact_data_position(killed, tmp_path, env):
    """A run checkpointed by a pool of two resumes on a single process: it continues at the
    checkpoint's step and data position, reading every row of each global batch itself."""
    run, before, after = tmp_path / "run", 8, 10
    shutil.copytree(killed.run, run)
    resumed = subprocess.run(
        dew_train(run, *SMALL, "--steps", str(after), "--checkpoint-every", "2", "--resume"),
        capture_output=True,
        text=True,
        timeout=BOUND,
        env=env,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming at step {before}, data position {before}" in resumed.stdout
    lines = metrics_lines(run)
    assert [line["step"] for line in lines] == list(range(after))
    assert [line["position"] for line in lines] == list(range(after))
    assert all(line["groups"] == 4 for line in lines)
    # The tasks each step trained: the pool's process 0 logged its half of each global batch,
    # the lone process every task of it.
    config = TrainConfig.from_json(json.loads((run / "config.json").read_text()))
    dataset = CopyDigits().dataset(
        config.tasks, config.batch_size, shuffle_seed=config.seed, epochs=2
    )
    batches = [[str(i) for i in batch["task_id"]] for batch in dataset.stream()][:after]
    trained: dict[int, list[str]] = {}
    for sample in jsonl(run / "samples.jsonl"):
        trained.setdefault(sample["step"], []).append(sample["task"])
    assert sorted(trained) == list(range(after))
    for step, tasks in trained.items():
        rows = batches[step][:2] if step < before else batches[step]
        assert sorted(tasks) == sorted(rows), step
    final = json.loads((run / "checkpoints" / COMMIT).read_text())
    assert (final["updates"], final["position"]) == (after, after)
    assert final["metadata"]["processes"] == 1


@pytest.mark.parametrize(
    ("argv", "culprit"),
    [
        (["--processes", "2", "--process-id", "0"], "--processes starts a pool of its own"),
        (["--coordinator", "127.0.0.1:1234"], "takes --coordinator, --num-processes and"),
        (["--processes", "0"], "argument --processes: must be an int within [1, 1024], got '0'"),
        (["--deadline", "0"], "--deadline must be a finite number of seconds > 0, got 0.0"),
        (
            ["--processes", "3", "--batch-size", "4"],
            "batch_size 4 must split evenly over the 3 processes",
        ),
        (
            ["--processes", "2", "--batch-size", "4", "--admit", "3"],
            "admit 3 must split evenly over the 2 processes",
        ),
    ],
)
def test_the_pool_options_name_what_is_wrong(tmp_path, capsys, argv, culprit):
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--run", str(tmp_path / "run"), *argv])
    assert stopped.value.code == 2
    assert culprit in capsys.readouterr().err
