"""Processes, long runs and waits, as a hostile user meets them (issue 48, items 7, 8, 9, 15,
16 and 23): a pool interrupted while it starts, a mesh a single process cannot make, simulate's
runaway inputs and its report, a wait that says what it waits on, and fit's wall-clock bound.

The pool tests start `dew train --processes` as a user would, every wait bounded (a pool still
running past its bound is killed and fails the test); nothing is timed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import attrs
import numpy as np
import optax
import psutil
import pytest
import trio
import trio.testing

from _hf_folders import chat_checkpoint
from dew import cli, models, simulate
from dew.data import ArrayDataset, Task
from dew.envs import Score
from dew.envs.environment import EnvironmentSource
from dew.envs.simulated import SimulatedConfig, SimulatedEngine, SimulatedSource
from dew.objectives.rl.scheduler import RolloutScheduler
from dew.objectives.rl.sessions import Call
from dew.serve.tokenizer import BYTES
from dew.simulate import BehaviorObjective
from dew.train import COMMIT, fit

DEW_TRAIN = [sys.executable, "-m", "dew", "train"]
SMALL = ["--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32"]
DEVICES_2 = "--xla_force_host_platform_device_count=2"
SMALL += ["--batch-size", "4", "--groups", "2", "--tasks", "32"]
# Seconds a pool may take before the test kills it and fails.
BOUND = 300
# fit's model: the bytes' vocabulary, small enough to compile in seconds.
TINY = models.TransformerConfig(
    vocab=BYTES.vocab_size, d_model=16, heads=2, layers=1, d_ff=32, max_len=64
)
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


@pytest.mark.slow
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


@pytest.mark.slow
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
        env={**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {DEVICES_2}"},
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


@attrs.define(eq=False)
class Answering:
    """An engine that answers every call at once with 'a' and the end of the turn, under the
    version last loaded: the environment, not the engine, is what the wait test holds up."""

    version: int = 0

    def load(self, variables, version: int) -> None:
        self.version = version

    async def generate(self, prompt, *, max_tokens, stop=(), **sampling) -> Call:
        completion = np.array([*BYTES.encode("a"), BYTES.eos_id], np.int32)
        return Call(
            np.asarray(prompt, np.int32),
            completion,
            np.full(len(completion), -0.5, np.float32),
            version=self.version,
        )


@attrs.define(eq=False)
class Blocking:
    """An environment whose step blocks its worker thread until `release` is set, first
    counting itself into `stepping` (on the trio side)."""

    release: threading.Event
    stepping: Stepping

    def reset(self, task: Task) -> str:
        return "go"

    def step(self, action: str):
        trio.from_thread.run_sync(self.stepping.enter, trio_token=self.stepping.token)
        self.release.wait()
        return None, True


@attrs.define(eq=False)
class Stepping:
    """How many environment steps have begun; `all` is set once `expected` have."""

    expected: int
    token: trio.lowlevel.TrioToken = attrs.Factory(trio.lowlevel.current_trio_token)
    begun: int = 0
    all: trio.Event = attrs.Factory(trio.Event)

    def enter(self) -> None:
        self.begun += 1
        if self.begun == self.expected:
            self.all.set()


@pytest.fixture
def release():
    """A threading.Event set at the test's end, so the thread a step blocked finishes."""
    event = threading.Event()
    yield event
    event.set()


async def test_a_long_wait_on_a_blocking_environment_step_names_the_step(
    mock_clock, caplog, release
):
    """Items 9 and 23 (build point 8): a blocking environment `step()` held the trainer's first
    batch, and the long-wait line blamed it on the engine's compilation whatever was slow.
    The line now names what the rollouts in flight wait on: here the environment's step, and
    no compilation. The clock jumps once both rollouts are inside their step (the autojump
    clock would jump while a worker thread makes the environment, too)."""
    engine = Answering()
    stepping = Stepping(expected=2)
    source = EnvironmentSource(
        engine,
        lambda: Blocking(release, stepping),
        lambda env, episode: Score(1.0),
        max_turns=2,
        max_tokens=4,
        max_context=128,
    )
    sched = RolloutScheduler(
        BehaviorObjective(), source, engine, width=128, rows=2, groups=2, ahead=0, max_lag=0
    )
    caplog.set_level(logging.WARNING, logger="dew.objectives.rl.scheduler")
    async with sched, trio.open_nursery() as nursery:
        batches = ArrayDataset({"task_id": np.arange(1)}, batch_size=1)
        nursery.start_soon(sched.step, next(sched.tasks(batches).stream(0)), None, 0)
        await stepping.all.wait()
        for _ in range(2):
            mock_clock.jump(60)
            await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    said = [record.getMessage() for record in caplog.records]
    assert said == [
        f"the trainer has waited {seconds}s for its first batch (0 of 2 rollouts finished), "
        "its rollouts in flight waiting: 2 on the environment's step; status() says more"
        for seconds in (60, 120)
    ]


async def test_a_trainer_that_keeps_its_batch_long_is_named_as_what_the_run_waits_on(
    autojump_clock, caplog
):
    """Item 23 (build point 8): the long-wait lines told the engine and the environment apart
    but never the trainer: a step that trains for minutes (its first update compiling, a
    checkpoint, an evaluation) left the rollouts ahead waiting without a word. From delivery to
    its next hand-over the trainer's time is now logged at long_wait and each doubling, as the
    trainer's, and no more once it hands over."""
    engine = SimulatedEngine(slots=None)
    source = SimulatedSource(engine, SimulatedConfig(duration_mean=1.0, duration_sigma=0.0))
    sched = RolloutScheduler(
        BehaviorObjective(), source, engine, width=512, rows=2, groups=2, ahead=1, max_lag=1
    )
    caplog.set_level(logging.WARNING, logger="dew.objectives.rl.scheduler")
    async with sched:
        batches = ArrayDataset({"task_id": np.arange(3)}, batch_size=1)
        stream = sched.tasks(batches).stream(0)
        first, second = next(stream), next(stream)
        await sched.step(first, None, 0)
        await trio.sleep(130)  # the trainer's first step
        await sched.step(second, None, 1)
        await trio.sleep(30)  # a step within long_wait: nothing said
        await sched.step(next(stream), None, 2)
    said = [record.getMessage() for record in caplog.records]
    assert said == [
        f"the trainer has spent {seconds}s on the batch of updates 0 since it was delivered "
        "(its update, logs and checkpoint; the first update compiles): the scheduler waits on "
        "the trainer, its rollouts in flight waiting: none"
        for seconds in (60, 120)
    ]


@pytest.mark.slow
def test_fit_stops_at_the_step_boundary_past_its_wall_clock(tmp_path, caplog):
    """Item 9 (build point 8): `fit` had no wall-clock bound. With `wall_clock`, a run stops
    cleanly after the step during which the bound passed (here 1 µs, which the first step
    outlasts), saying so, with that step's line."""
    tasks = [Task(f"{digit}") for digit in range(4)]
    lines = []
    caplog.set_level(logging.WARNING, logger="dew.train")
    trainer = fit(
        tasks,
        lambda task, reply: Score(float(reply.strip() == task.name)),
        prompt=lambda task: f"say {task.name}",
        max_tokens=2,
        model=models.Transformer(TINY),
        optimizer=optax.sgd(1e-2),  # Adam's step count meets strict dtype promotion
        steps=5,
        batch_size=2,
        groups=2,
        run=tmp_path / "run",
        on_step=lines.append,
        wall_clock=1e-6,
    )
    assert trainer.updates == 1 and [line["updates"] for line in lines] == [1]
    assert [record.getMessage() for record in caplog.records] == [
        "stopped after step 1/5: its wall_clock of 1e-06s has passed"
    ]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1


@pytest.mark.parametrize("bound", [0, -1.0, math.inf, math.nan, "60"])
def test_fit_refuses_a_wall_clock_that_is_not_seconds(bound):
    """Item 9: a wall_clock that is not a finite number of seconds > 0 is refused naming it,
    before anything runs."""
    with pytest.raises(ValueError, match="wall_clock"):
        fit([Task("1")], lambda task, reply: Score(0.0), prompt=str, max_tokens=1,
            batch_size=1, wall_clock=bound)  # fmt: skip
